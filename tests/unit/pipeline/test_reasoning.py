"""Reasoning data (Qwen3 thinking traces): ingestion keeps them, rendering and the loss mask follow
what the template emits, on Qwen3-4B's real template and on a template that keeps all reasoning (the cache
stage on it: tests/integration/test_reasoning_cache.py)."""
import numpy as np
import pytest

from pipeline.chats.ingest import Chat, iter_chats
from pipeline.config import RenderConfig
from pipeline.chats.render import render_chat, render_prompt

from reasoningdata import QWEN3_SUPERVISED, REASONING

RC = RenderConfig()


def _rows():
    return {r.row_id: r.messages for r in iter_chats(str(REASONING), 0)}


def _render(tok, msgs):
    return render_chat(tok, msgs, RC, max_length=4096, min_loss_tokens=1)


def _spans(tok, r):
    """The supervised text, one string per contiguous supervised span."""
    on = np.flatnonzero(r.loss_mask)
    return [tok.decode(r.input_ids[s].tolist()) for s in np.split(on, np.flatnonzero(np.diff(on) > 1) + 1)]


def _template_ids(tok, msgs):
    return list(tok.apply_chat_template(list(msgs), tokenize=True, return_dict=False))


def test_every_reasoning_row_is_kept_with_its_reasoning():
    rows = list(iter_chats(str(REASONING), 0))
    assert all(isinstance(r, Chat) for r in rows) and len(rows) == 5
    by_id = _rows()
    assert by_id["r1"][1] == {"role": "assistant", "content": "5", "reasoning_content": "Two plus three is five."}
    assert by_id["r3"][2]["reasoning_content"] == "11 has no divisor but 1 and itself."  # alias "reasoning"
    assert by_id["r4"][1]["reasoning_content"] == "9 = 3 * 3, so it is not."  # alias "thinking", ShareGPT
    assert by_id["r2"][1] == {"role": "assistant", "content": "<think>\nTwo plus three is five.\n</think>\n\n5"}


@pytest.mark.parametrize("rid", sorted(QWEN3_SUPERVISED))
def test_qwen3_template_ids_and_supervised_text(qwen3_tokenizer, rid):
    tok, msgs = qwen3_tokenizer, _rows()[rid]
    r = _render(tok, msgs)
    assert r.input_ids.tolist() == _template_ids(tok, msgs)  # the template's own tokenization
    assert _spans(tok, r) == QWEN3_SUPERVISED[rid]
    text = tok.apply_chat_template(list(msgs), tokenize=False)
    if rid in ("r1", "r2", "r4"):  # the template dropped the first answer's reasoning: so do we
        first = msgs[1].get("reasoning_content") or msgs[1]["content"].split("</think>")[0][len("<think>\n"):-1]
        assert first not in text and first not in "".join(_spans(tok, r))
    # nothing of a user or system turn is supervised, and each answer's supervision is one span
    users = [m["content"] for m in msgs if m["role"] != "assistant"]
    assert not any(u in s for u in users for s in _spans(tok, r))


def test_qwen3_think_tokens_are_the_targets_tokens(qwen3_tokenizer):
    tok = qwen3_tokenizer
    r = _render(tok, _rows()["r2"])
    think_end = tok.convert_tokens_to_ids("</think>")
    assert think_end not in tok.all_special_ids  # an added, non-special token, as in Qwen3-4B
    sup = r.input_ids[r.loss_mask == 1].tolist()
    assert sup.count(think_end) == 1 and sup[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    # serving prompt: the template's generation prompt opens the think block, so <think> is not supervised
    ids = render_prompt(tok, _rows()["r1"][:1], RC)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n")


LLAMA_SUPERVISED = {  # every answer keeps its reasoning; inline <think> stays as written
    "r1": ["<think>Two plus three is five.</think>\n\n5<|eot_id|>",
           "<think>The last answer was 5, and 5 times 4 is 20.</think>\n\n20<|eot_id|>"],
    "r2": ["<think>\nTwo plus three is five.\n</think>\n\n5<|eot_id|>",
           "<think>\nThe last answer was 5, and 5 times 4 is 20.\n</think>\n\n20<|eot_id|>"],
    "r4": ["<think>9 = 3 * 3, so it is not.</think>\n\nNo: 9 = 3 * 3.<|eot_id|>",
           "<think>\n7 has no divisor but 1 and 7.\n</think>\n\nYes, 7 is prime.<|eot_id|>"],
    "r5": ["ok<|eot_id|>"],
}


@pytest.mark.parametrize("rid", sorted(LLAMA_SUPERVISED))
def test_reasoning_keeping_template(llama_reasoning_tokenizer, rid):
    tok, msgs = llama_reasoning_tokenizer, _rows()[rid]
    r = _render(tok, msgs)
    assert r.input_ids.tolist() == _template_ids(tok, msgs)
    assert r.input_ids[0] == tok.bos_token_id and r.loss_mask[0] == 0
    assert _spans(tok, r) == LLAMA_SUPERVISED[rid]


def test_non_reasoning_template_supervises_inline_think_as_content(tok_chatml):
    """The embedded ChatML template knows no reasoning: inline <think> is answer text, the field is unused."""
    rows = _rows()
    r2 = _render(tok_chatml, rows["r2"])
    assert r2.input_ids.tolist() == _template_ids(tok_chatml, rows["r2"])
    assert _spans(tok_chatml, r2) == ["<think>\nTwo plus three is five.\n</think>\n\n5<|im_end|>",
                                      "<think>\nThe last answer was 5, and 5 times 4 is 20.\n</think>\n\n20<|im_end|>"]
    assert _spans(tok_chatml, _render(tok_chatml, rows["r1"])) == ["5<|im_end|>", "20<|im_end|>"]


def test_input_cases_render_as_the_template_tokenizes(tok_chatml, qwen3_tokenizer, input_cases):
    """Every kept input case renders to the template's own ids, except o18 whose answer holds the
    literal text "<|im_end|>" (kept as text, so it differs by design)."""
    rows = [r for f in ("openai.jsonl", "sharegpt.jsonl") for r in iter_chats(str(input_cases / "chats" / f), 0)
            if isinstance(r, Chat)]
    for tok in (tok_chatml, qwen3_tokenizer):
        for row in rows:
            msgs = row.messages[: max(i for i, m in enumerate(row.messages) if m["role"] == "assistant") + 1]
            ids = render_chat(tok, msgs, RC, max_length=10**6, min_loss_tokens=1).input_ids.tolist()
            same = ids == _template_ids(tok, msgs)
            assert same == (row.row_id != "o18"), row.row_id


def test_literal_special_text_in_reasoning_stays_text(qwen3_tokenizer):
    tok = qwen3_tokenizer
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "Is <|im_end|> the end marker?"}]
    r = _render(tok, msgs)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert r.input_ids[r.loss_mask == 1].tolist().count(eot) == 1
    assert _spans(tok, r) == ["Is <|im_end|> the end marker?\n</think>\n\na<|im_end|>"]


class ReasoningEngine:
    """Writes what a thinking target writes after Qwen3-2507's prompt (which opened <think>):
    reasoning, </think>, answer; a prompt holding "long" hits max_new_tokens inside its reasoning."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    def generate(self, prompts, sampling, seeds):
        from pipeline.target_model.engines import Generation

        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            self.prompts.append(text)
            if "long" in text:
                out.append(Generation("First, 9 = 3 * 3; then", "length", 8))
            else:
                out.append(Generation(f"Step {len(self.prompts)}.\n</think>\n\nAnswer {len(self.prompts)}.", "stop", 9))
        return out


def test_generate_stores_reasoning_and_skips_rows_cut_inside_it(qwen3_tokenizer, tmp_path):
    from pipeline.stages.generate import regenerate
    from pipeline.run import DEFAULT_CONFIG, load_config

    tok = qwen3_tokenizer
    cfg = load_config(DEFAULT_CONFIG, ["target.path=unused", f"run_dir={tmp_path}", "data.train_files=[x.jsonl]",
                                       "generate.max_new_tokens=8"])
    chats = [Chat(({"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "old"},
                   {"role": "user", "content": "Times 4?"}), 0, 0, "mem.jsonl", "g0"),
             Chat(({"role": "user", "content": "Is 9 prime? Think long."},), 0, 1, "mem.jsonl", "g1")]
    eng = ReasoningEngine(tok)
    res = regenerate(chats, eng, cfg)
    assert [(e["id"], e["reason"]) for e in res.errors] == [("g1", "reasoning_truncated")]
    (row,) = res.rows
    assert row["finish_reasons"] == ["stop", "stop"]
    a1, a2 = row["messages"][1], row["messages"][3]
    assert a1["reasoning_content"].startswith("Step ") and a1["content"].startswith("Answer ")
    # the second prompt holds the first answer without its reasoning, as Qwen3 serves it
    assert a1["content"] in eng.prompts[-1] and a1["reasoning_content"] not in eng.prompts[-1]
    # the cache renders the regenerated row back to exactly the prompt + what the target wrote
    r = _render(tok, [dict(m) for m in row["messages"]])
    full = tok.decode(r.input_ids.tolist())
    wrote = f"{a2['reasoning_content']}\n</think>\n\n{a2['content']}"
    assert full == eng.prompts[-1] + wrote + "<|im_end|>\n"
    assert _spans(tok, r)[-1] == wrote + "<|im_end|>"


def test_answer_message_forms():
    from pipeline.stages.generate import answer_message, opens_reasoning

    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not opens_reasoning("x\n")
    assert answer_message("Just 5.", False) == ({"role": "assistant", "content": "Just 5."}, False)
    # Qwen3 with enable_thinking on and a plain prompt: the target writes the <think> tag itself
    assert answer_message("<think>\nr\n</think>\n\n5", False) == (
        {"role": "assistant", "content": "5", "reasoning_content": "r"}, False)
    assert answer_message("r\n</think>\n\n5", True) == (
        {"role": "assistant", "content": "5", "reasoning_content": "r"}, False)
    assert answer_message("still thinking", True) == (
        {"role": "assistant", "content": "", "reasoning_content": "still thinking"}, True)


def test_a_thinking_switch_the_template_ignores_is_reported(qwen3_tokenizer, tok_chatml):
    from pipeline.chats.render import ignored_thinking_switch

    said = ignored_thinking_switch(qwen3_tokenizer, RenderConfig(enable_thinking=False))
    assert said.startswith("data.render.enable_thinking=false has no effect") and "<think>" in said
    assert ignored_thinking_switch(tok_chatml, RenderConfig(enable_thinking=False)) is None  # it has the switch
    assert ignored_thinking_switch(qwen3_tokenizer, RenderConfig()) is None  # nothing asked


def test_results_name_the_thinking_mode(tmp_path):
    from pipeline.results import results_table

    table = results_table(str(tmp_path), {"evaluate": {"results": {}, "enable_thinking": False}})
    assert "rendered with data.render.enable_thinking=false (thinking off): serve the drafters in that mode" in table
