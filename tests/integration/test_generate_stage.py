"""Generate stage on S3, Ray and subprocesses: commit protocol, resume, kill-and-rerun, chaining (multi-turn
regeneration and the error file: tests/unit/pipeline/test_generate.py)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.chats.ingest import iter_chats
from pipeline.stages.generate import (ShardCommitConflictError, committed_records, generate_shard, generate_url,
                                      generated_files, plan, settings, write_shard)
from pipeline.run import DEFAULT_CONFIG

from genfakes import FakeEngine, _cfg
from paths import REPO


@pytest.mark.integration
def test_commit_protocol_on_s3(tiny_tokenizer, tiny_target_dir, input_cases, s3_url):
    url = str(input_cases / "chats" / "sharegpt.jsonl")
    cfg = _cfg(tiny_target_dir, s3_url, [url], "generate.rows_per_shard=4")
    want, out = settings(cfg, tiny_target_dir), generate_url(cfg)
    for i, span in plan(cfg):
        write_shard(out, i, span, generate_shard(span, FakeEngine(tiny_tokenizer), cfg), want, "s3-test")
    files = generated_files(cfg)
    assert files == [f"{s3_url}/generate/shards/shard-000000.jsonl", f"{s3_url}/generate/shards/shard-000001.jsonl"]
    assert [c.row_id for f in files for c in iter_chats(f, 0)] == ["s1", "s2", "s3", "s6"]
    assert sorted(committed_records(out)) == [0, 1]
    span = plan(cfg)[1][1]
    with pytest.raises(ShardCommitConflictError, match="another writer"):
        write_shard(out, 1, span, generate_shard(span, FakeEngine(tiny_tokenizer), cfg), want, "late")


@pytest.mark.integration
def test_stage_resume_and_cache_chaining(ray_local, tiny_target_dir, input_cases, tmp_path):
    from pipeline.stages.cache import input_files, run_cache
    from pipeline.stages.generate import run_generate

    files = [input_cases / "chats" / "openai.jsonl", input_cases / "chats" / "sharegpt.jsonl"]
    cfg = _cfg(tiny_target_dir, tmp_path / "run", files, "generate.rows_per_shard=8", "generate.enabled=true",
               "data.min_loss_tokens=1", "cache.num_workers=1")
    s = run_generate(cfg)
    assert (s["shards_planned"], s["shards_written"], s["shards_already_committed"]) == (4, 4, 0)
    assert s["rows_in"] == 26 and s["rows_kept"] == 14  # 10 of openai.jsonl (o19 too long) + s1 s2 s3 s6
    assert s["rows_failed"] == {"bad_type": 1, "empty_answer": 2, "empty_conversation": 1, "invalid_json": 1,
                                "invalid_utf8": 1, "no_user_turn": 2, "not_a_chat": 1, "prompt_too_long": 1,
                                "unknown_role": 2}
    assert s["turns_generated"] == 17 == sum(s["finish_reasons"].values())  # 12 openai (o2, o4 too) + 5 sharegpt
    assert 17 <= s["new_tokens"] <= 17 * 8
    assert s["tokens_per_s"] > 0 and s["engine"] == "hf" and s["sampling"]["top_k"] == 20
    errors = [json.loads(line) for p in sorted((tmp_path / "run/generate/errors").glob("*.jsonl"))
              for line in p.read_text().splitlines()]
    assert len(errors) == 12 and {(e["id"], e["line"]) for e in errors} >= {("o5", 5), ("s5", 5), ("o19", 20)}
    again = run_generate(cfg)
    assert again["shards_written"] == 0 and again["shards_already_committed"] == 4
    assert again["tokens_per_s"] is None and again["rows_kept"] == 14
    assert input_files(cfg) == generated_files(cfg)
    c = run_cache(cfg)
    assert c["samples"] == 14 and c["skipped_rows"] == {}


def _write_prompts(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            turns = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
            if i % 3:  # two of three rows have answers to regenerate; every other one a second turn
                turns.append({"role": "assistant", "content": f"old answer {i}"})
            if i % 3 == 2:
                turns += [{"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": "old"}]
            f.write(json.dumps({"id": f"p{i}", "messages": turns}) + "\n")
        f.write('{"id": "broken", "messages": [\n')


def _shard_rows(run_dir: Path) -> list:
    return [json.loads(line) for p in sorted((run_dir / "generate" / "shards").glob("*.jsonl"))
            for line in p.read_text().splitlines()]


@pytest.mark.integration
def test_kill_and_rerun_ends_with_the_rows_of_an_uninterrupted_run(ray_local, tiny_target_dir, tmp_path):
    """SIGKILL the CLI after the first commit; the rerun ends with exactly the uninterrupted rows and text
    (the uninterrupted run in this process, on the session's Ray: the same stage code)."""
    from pipeline.run import load_config
    from pipeline.stages.generate import run_generate

    data = tmp_path / "prompts.jsonl"
    _write_prompts(data, 47)  # 48 lines: 24 shards of 2
    args = ["+stage=generate", str(DEFAULT_CONFIG), f"target.path={tiny_target_dir}", f"data.train_files=[{data}]",
            "generate.rows_per_shard=2", "generate.max_new_tokens=32", "generate.batch_size=2", "ray.num_cpus=2"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}

    def cli(run_dir):
        log = (tmp_path / f"{run_dir.name}.log").open("a")
        return subprocess.Popen([sys.executable, "-m", "pipeline.run", *args, f"run_dir={run_dir}"], cwd=REPO,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    killed = tmp_path / "killed"
    p = cli(killed)
    commits = killed / "generate" / "commits"
    deadline = time.time() + 240
    while time.time() < deadline and not list(commits.glob("*.json")) and p.poll() is None:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    n_before = len(list(commits.glob("*.json")))
    assert 1 <= n_before < 24, (tmp_path / "killed.log").read_text()[-3000:]  # the kill lands mid-run
    assert cli(killed).wait(timeout=300) == 0
    full = tmp_path / "full"
    run_generate(load_config(DEFAULT_CONFIG, [*args[2:], f"run_dir={full}"]))
    a, b = _shard_rows(killed), _shard_rows(full)
    assert len(a) == 47 and a == b  # same rows, same order, same text
    assert [r["row"] for r in a] == list(range(47)) and a[2]["messages"][1]["content"] != "old answer 2"
    errors = [json.loads(line) for line in (killed / "generate/errors/shard-000023.jsonl").read_text().splitlines()]
    assert [(e["line"], e["reason"]) for e in errors] == [(48, "invalid_json")]
    summary = json.loads((killed / "generate" / "summary.json").read_text())
    assert summary["shards_already_committed"] >= n_before and summary["rows_kept"] == 47
    assert summary["shards_written"] + summary["shards_already_committed"] == 24
