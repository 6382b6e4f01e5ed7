"""Generate stage: multi-turn regeneration, error file, commit protocol (on S3, resume, kill-and-rerun and
chaining: tests/integration/test_generate_stage.py)."""
import json

import pytest

from pipeline.chats.ingest import Chat, iter_chats, plan_spans
from pipeline.config import RenderConfig
from pipeline.target_model.engines import Generation, HFEngine, SamplingSpec, batch_seed, decode_answer, stop_token_ids
from pipeline.errors import PipelineError
from pipeline.stages.generate import (GenerateSettingsMismatchError, ShardCommitConflictError, answer_slots,
                               check_records, committed_records, generate_shard, generate_url, generated_files,
                               plan, regenerate, request_seed, settings, write_shard)
from pipeline.chats.render import render_prompt

from genfakes import FakeEngine, _cfg


def _chat(row, *turns):
    roles = ["user", "assistant"] * 4
    return Chat(tuple({"role": r, "content": c} for r, c in zip(roles, turns)), 0, row, "mem.jsonl", f"c{row}")


def test_answer_slots_and_seeds():
    u, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}
    s = {"role": "system", "content": "s"}
    assert answer_slots([u, a]) == [1]
    assert answer_slots([s, u, a, u, a]) == [2, 4]
    assert answer_slots([u]) == [1]  # a prompt: its answer is appended
    assert answer_slots([u, a, u]) == [1, 3]
    assert answer_slots([u, s]) == [2] and answer_slots([u, a, s]) == [1]
    assert request_seed(0, 0, 5, 1) == request_seed(0, 0, 5, 1) != request_seed(0, 0, 5, 2)
    assert 0 <= request_seed(7, 3, 2, 0) < 2**31
    assert batch_seed([1, 2]) != batch_seed([2, 1])


def test_turn_two_is_conditioned_on_regenerated_turn_one(tiny_tokenizer, tmp_path):
    cfg = _cfg("unused", tmp_path, ["unused.jsonl"])
    eng = FakeEngine(tiny_tokenizer)
    chats = [_chat(0, "Define x.", "x = 1", "Now double it.", "x = 2 * x"), _chat(1, "Only one.", "old")]
    res = regenerate(chats, eng, cfg)
    # round 1 generates both first answers (shorter prompt first), round 2 the second answer of chat 0
    assert len(eng.prompts) == 3
    turn2 = eng.prompts[2]
    first = res.rows[0]["messages"][1]["content"]
    assert first.startswith("NEW") and first in turn2 and "x = 1" not in turn2
    expect = render_prompt(tiny_tokenizer, [{"role": "user", "content": "Define x."},
                                            {"role": "assistant", "content": first},
                                            {"role": "user", "content": "Now double it."}], RenderConfig())
    assert tiny_tokenizer.decode(expect) == turn2
    assert [m["content"] for m in res.rows[0]["messages"]] == ["Define x.", first, "Now double it.", "NEW3"]
    assert res.rows[0]["finish_reasons"] == [("stop" if first == "NEW1" else "length"), "stop"]
    assert res.rows[1]["id"] == "c1" and res.rows[1]["row"] == 1 and res.rows[1]["source"] == "mem.jsonl"
    assert res.rows[0]["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 8,
                                       "seed": 0, "engine": "hf"}
    assert res.stats["turns_generated"] == 3 and res.stats["new_tokens"] == 9 and res.errors == []


def test_a_later_turn_that_no_longer_fits_ends_the_chat(tiny_tokenizer, tmp_path):
    first = render_prompt(tiny_tokenizer, [{"role": "user", "content": "Define x."}], RenderConfig())
    cfg = _cfg("unused", tmp_path, ["unused.jsonl"], f"data.max_length={len(first) + 1}")
    res = regenerate([_chat(0, "Define x.", "x = 1", "Now double it.", "x = 2 * x")], FakeEngine(tiny_tokenizer), cfg)
    assert [m["content"] for m in res.rows[0]["messages"]] == ["Define x.", "NEW1"]
    assert res.rows[0]["finish_reasons"] == ["stop"] and res.stats["turns_cut"] == 1 and res.errors == []
    tight = _cfg("unused", tmp_path, ["unused.jsonl"], f"data.max_length={len(first)}")
    res = regenerate([_chat(3, "Define x.", "x = 1")], FakeEngine(tiny_tokenizer), tight)
    assert res.rows == [] and [(e["row"], e["reason"]) for e in res.errors] == [(3, "prompt_too_long")]


def test_hf_engine_multi_turn_prompt_holds_the_new_answer(tiny_qwen3, tiny_tokenizer, tmp_path):
    """The real HF engine: turn 2's prompt is exactly the chat with the regenerated turn 1."""
    cfg = _cfg("unused", tmp_path, ["unused.jsonl"], "generate.max_new_tokens=6")
    hf = HFEngine(tiny_qwen3, tiny_tokenizer)
    seen = []

    class Spy:
        tokenizer = tiny_tokenizer

        def generate(self, prompts, sampling, seeds):
            seen.append([list(p) for p in prompts])
            return hf.generate(prompts, sampling, seeds)

    chats = [_chat(0, "Define x.", "x = 1", "Now double it.", "x = 2 * x")]
    res = regenerate(chats, Spy(), cfg)
    msgs = res.rows[0]["messages"]
    assert len(seen) == 2 and msgs[1]["content"] != "x = 1" and msgs[3]["content"] != "x = 2 * x"
    assert seen[1][0] == render_prompt(tiny_tokenizer, msgs[:3], RenderConfig())
    assert res.rows[0]["finish_reasons"] == ["length", "length"]  # random weights rarely stop in 6
    again = regenerate(chats, Spy(), cfg)  # same seeds, same batch: the same text
    assert again.rows == res.rows


def test_hf_engine_stop_and_length(tiny_qwen3, tiny_tokenizer):
    eng = HFEngine(tiny_qwen3, tiny_tokenizer)
    assert eng.stop_ids == [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    word = tiny_tokenizer("word", add_special_tokens=False)["input_ids"]
    stop = eng.stop_ids
    assert decode_answer(tiny_tokenizer, [*word, stop[0], *word], stop) == Generation("word", "stop", len(word) + 1)
    assert decode_answer(tiny_tokenizer, word * 2, stop) == Generation("wordword", "length", 2 * len(word))
    prompts = [render_prompt(tiny_tokenizer, [{"role": "user", "content": "hi " * k}], RenderConfig()) for k in (1, 4)]
    greedy = SamplingSpec(0.0, 1.0, 0, 5)
    both = eng.generate(prompts, greedy, [1, 2])
    alone = eng.generate(prompts[:1], greedy, [1])  # the short prompt is left-padded in the batch
    assert [g.num_tokens for g in both] == [5, 5] and both[0].text == alone[0].text
    with pytest.raises(ValueError, match="one seed per prompt"):
        eng.generate(prompts, greedy, [1])
    with pytest.raises(PipelineError, match="no eos token"):
        stop_token_ids(type("T", (), {"eos_token_id": None, "__len__": lambda s: 9})())


def test_failing_and_malformed_rows_go_to_the_error_file(tiny_tokenizer, input_cases, tmp_path):
    url = str(input_cases / "chats" / "openai.jsonl")
    cfg = _cfg("unused", tmp_path, [url])
    eng = FakeEngine(tiny_tokenizer, boom=["Name a prime"], empty=["Say hi"])
    (span,) = plan_spans(url, 0, 100)
    res = generate_shard(span, eng, cfg)
    by_line = {e["line"]: (e["id"], e["reason"]) for e in res.errors}  # unparsable rows have no id
    assert by_line == {
        2: ("o2", "generation_error"), 4: ("o4", "empty_generation"), 5: ("o5", "no_user_turn"),
        6: ("o6", "empty_answer"), 7: ("o7", "empty_answer"), 9: ("o9", "bad_type"), 10: ("o10", "unknown_role"),
        11: (None, "invalid_json"), 12: (None, "invalid_utf8"), 13: ("o12", "empty_conversation"),
        16: ("o15", "not_a_chat"), 20: ("o19", "prompt_too_long")}
    assert [e["line"] for e in res.errors] == sorted(by_line)  # input order
    assert all(e["source"] == url for e in res.errors)
    assert "RuntimeError: engine exploded" in res.errors[0]["detail"] and res.errors[0]["row"] == 1
    assert [r["id"] for r in res.rows] == ["o1", "o3", "o8", "o13", "o14", "o16", "o18", "o20"]
    assert [r["row"] for r in res.rows] == [0, 2, 7, 13, 14, 16, 18, 20]
    rows = {r["id"]: r for r in res.rows}
    assert [m["role"] for m in rows["o8"]["messages"]] == ["user", "assistant"]  # answer appended
    assert [m["role"] for m in rows["o20"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert res.stats["rows_in"] == 20 and res.stats["rows_kept"] == 8
    assert res.stats["rows_failed"]["empty_answer"] == 2 and sum(res.stats["rows_failed"].values()) == 12


def test_write_commit_read_back_and_mismatch(tiny_tokenizer, tiny_target_dir, input_cases, tmp_path):
    url = str(input_cases / "chats" / "sharegpt.jsonl")
    cfg = _cfg(tiny_target_dir, tmp_path / "run", [url], "generate.rows_per_shard=4")
    shards = plan(cfg)
    assert [(s.row_start, s.row_end) for _, s in shards] == [(0, 4), (4, 6)]
    with pytest.raises(PipelineError, match="run \\+stage=generate first or set generate.enabled=false"):
        generated_files(cfg)
    want = settings(cfg, tiny_target_dir)
    out = generate_url(cfg)
    for i, span in shards:
        rec = write_shard(out, i, span, generate_shard(span, FakeEngine(tiny_tokenizer), cfg), want, "test")
        assert rec["stats"]["rows_in"] == span.row_end - span.row_start
    files = generated_files(cfg)
    assert files == [f"{out}/shards/shard-000000.jsonl", f"{out}/shards/shard-000001.jsonl"]
    back = [c for f in files for c in iter_chats(f, 0)]
    assert [c.row_id for c in back] == ["s1", "s2", "s3", "s6"]
    assert all(m["content"].startswith("NEW") for c in back for m in c.messages if m["role"] == "assistant")
    errors = (tmp_path / "run/generate/errors/shard-000000.jsonl").read_text().splitlines()
    assert [json.loads(e)["id"] for e in errors] == ["s4"]
    with pytest.raises(ShardCommitConflictError, match="another writer"):
        write_shard(out, 0, shards[0][1], generate_shard(shards[0][1], FakeEngine(tiny_tokenizer), cfg), want, "2nd")
    hot = _cfg(tiny_target_dir, tmp_path / "run", [url], "generate.rows_per_shard=4", "generate.temperature=1.0")
    with pytest.raises(GenerateSettingsMismatchError, match=r"generate.sampling.temperature: 0.7 -> 1.0"):
        check_records(out, committed_records(out), plan(hot), settings(hot, tiny_target_dir))
    shard1 = tmp_path / "run/generate/shards/shard-000001.jsonl"
    shard1.write_bytes(shard1.read_bytes()[:-5])  # truncated behind the commit record's back
    with pytest.raises(PipelineError, match="shard-000001.jsonl is missing or not"):
        generated_files(cfg)
    moved = _cfg(tiny_target_dir, tmp_path / "run", [url], "generate.rows_per_shard=3")
    with pytest.raises(GenerateSettingsMismatchError, match=r"committed shard 0 holds rows 0-4 of input file .*chats"
                                                            r".*, but this run plans rows 0-3 .* generate.rows_per_shard"):
        generated_files(moved)
