"""ops tools on local caches: ls, stat, du, sample, verify checks, gc, diff, estimate, errors, output."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cache_schema import CacheSample, Fingerprint, estimate_cache_bytes, shard_overhead_bytes, open_cache
from ops.__main__ import main
from ops.estimate import shard_objects
from ops.report import human_bytes, preview, table
from ops.verify import (duplicate_problems, load_cursor, object_problems, offset_problems, problem,
                        write_cursor)
from pipeline.run import DEFAULT_CONFIG

from opscache import H, LAYERS, SMALL, build, crash, make_fp, make_sample, run
from paths import REPO


@pytest.fixture
def url(tmp_path) -> str:
    return str(tmp_path / "run" / "cache")


def test_report_helpers_format_sizes_tables_and_previews():
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 * 2**30, None)] == ["0 B", "1023 B", "1.5 KiB", "5.0 GiB", "-"]
    assert table([{"a": "x", "n": 1234}, {"a": "long", "n": None}], ["a", "n"]) == \
        "a         n\nx     1,234\nlong      -"
    assert table([], ["a"]) == "(none)"
    assert preview(list(range(12)), 3) == "0, 1, 2 (+9 more)" and preview([]) == "-"


def test_ls_shows_committed_and_uncommitted_shards(url, capsys):
    root = build(url, {0: [make_sample(0, 10), make_sample(1, 7)], 1: [make_sample(4, 12)]})
    crash(root, 2, [make_sample(8, 9)])
    code, p = run(capsys, "ls", url)
    assert code == 0 and (p["committed"], p["uncommitted"], p["samples"], p["tokens"]) == (2, 1, 3, 29)
    rows = {r["shard"]: r for r in p["shards"]}
    assert rows[0]["state"] == "committed" and rows[0]["writer"] == "w0" and rows[1]["samples"] == 1
    assert rows[2]["state"] == "uncommitted" and rows[2]["samples"] is None
    assert rows[2]["bytes"] == sum(root.shard_objects(2).values()) > 0
    assert rows[0]["bytes"] == root.record(0).total_bytes
    assert main(["ls", url]) == 0
    text = capsys.readouterr().out
    assert "s000002  uncommitted" in text and "2 committed, 1 uncommitted; 3 samples, 29 tokens" in text


def test_stat_reports_fingerprint_totals_skips_and_missing_input(url, tmp_path, capsys):
    build(url, {0: [make_sample(0, 10), make_sample(1, 7)], 2: [make_sample(8, 12)]})
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(f'{{"n": {i}}}\n' for i in range(12)))  # spans [0,4) [4,8) [8,12)
    code, p = run(capsys, "stat", url)
    assert code == 0 and p["coverage"] is None and p["schema_version"] == 1
    assert p["fingerprint"]["target_layer_ids"] == [0, 1, 2] and p["fingerprint_sha256"] == make_fp().digest()
    t = p["totals"]
    assert (t["shards"], t["samples"], t["tokens"], t["skipped_rows"]) == (2, 3, 29, {"invalid_json": 2})
    assert t["bytes_per_token"] == round(t["bytes"] / 29, 2)
    code, p = run(capsys, "stat", url, "--data", data)
    cov = p["coverage"]
    assert code == 1 and (cov["rows"], cov["rows_per_shard"], cov["planned_shards"]) == (12, 4, 3)
    assert cov["missing"] == [{"shard": 1, "source": 0, "file": str(data), "rows": [4, 8]}]
    assert cov["missing_rows"] == 4 and cov["unplanned"] == []
    code, p = run(capsys, "stat", url, "--data", data, "--rows-per-shard", "5")
    assert code == 1 and len(p["coverage"]["missing"]) == 3 and p["coverage"]["unplanned"] == [0, 2]
    assert main(["stat", url, "--data", str(data)]) == 1
    assert "missing 1 shards (4 rows)" in capsys.readouterr().out


def test_du_splits_bytes_by_array_and_shard(url, capsys):
    root = build(url, {0: [make_sample(0, 10)], 3: [make_sample(1, 30), make_sample(2, 5)]})
    code, p = run(capsys, "du", url)
    total = root.record(0).total_bytes + root.record(3).total_bytes
    assert code == 0 and p["bytes"] == total and p["tokens"] == 45
    arrays = {a["array"]: a for a in p["arrays"]}
    assert sum(a["bytes"] for a in arrays.values()) == total
    features = sum(v for r in (root.record(0), root.record(3)) for k, v in r.object_bytes.items()
                   if k.startswith("features/"))
    assert arrays["features"]["bytes"] == features and p["arrays"][0]["array"] == "features"
    assert features >= 45 * 2 * len(LAYERS) * H  # bf16 payload of 45 tokens
    assert [s["shard"] for s in p["shards"]] == [0, 3] and p["shards"][1]["tokens"] == 35


# ---- verify: the pure checks ------------------------------------------------------------------

def test_object_problems_name_missing_truncated_and_extra_objects():
    got = object_problems(5, {"a/c/0": 10, "b/c/0": 20, "zarr.json": 3}, {"a/c/0": 10, "b/c/0": 19, "x": 1})
    assert [(p["shard"], p["check"]) for p in got] == [(5, "truncated_object"), (5, "missing_object"),
                                                       (5, "extra_object")]
    assert "b/c/0 has 19 bytes, its record says 20" in got[0]["detail"]


def test_offset_problems_catch_inconsistent_offsets_per_sample(url):
    root = build(url, {0: [make_sample(0, 10), make_sample(1, 9)]})
    record = root.record(0)
    mask = np.concatenate([make_sample(0, 10).loss_mask.numpy(), make_sample(1, 9).loss_mask.numpy()])
    good_off, good_sup = np.array([0, 10, 19]), np.array([0, 7, 13])  # T_sup = loss_mask[1:].sum()
    assert offset_problems(0, good_off, good_sup, mask, record, ["a", "b"]) == []
    bad = offset_problems(0, good_off, np.array([0, 6, 13]), mask, record, ["a", "b"])
    assert [(p["sample"], p["sample_id"]) for p in bad] == [(0, "a"), (1, "b")]
    assert "6 last_hidden rows, its loss mask needs 7" in bad[0]["detail"]
    assert [p["detail"] for p in offset_problems(0, np.array([0, 10, 18]), good_sup, mask, record, ["a", "b"])] \
        == ["offsets run 0..18, expected 0..19"]


def test_duplicate_problems_name_every_place():
    results = {0: {"ids": ["x", "y"], "provenance": [[0, 1], [0, 2]]},
               3: {"ids": ["x", "z"], "provenance": [[0, 9], [0, 2]]}}
    got = duplicate_problems(results)
    assert [(p["shard"], p["sample"], p["sample_id"], p["check"]) for p in got] == [
        (0, 0, "x", "duplicate_sample_id"), (3, 0, "x", "duplicate_sample_id"),
        (0, 1, "y", "duplicate_provenance"), (3, 1, "z", "duplicate_provenance")]
    assert got[0]["detail"] == "sample id x also at shard 3 sample 0"


def test_cursor_keeps_whole_lines_only_and_only_for_its_cache(tmp_path):
    path, header = tmp_path / "c.jsonl", {"cursor_version": 1, "url": "u", "fingerprint_sha256": "f"}
    entries = [{"shard": 0, "problems": []}, {"shard": 2, "problems": [problem(2, "checksum", "x")]}]
    write_cursor(path, header, entries)
    path.write_text(path.read_text() + '{"shard": 3, "probl')  # a write torn by a kill
    assert load_cursor(path, header) == {0: entries[0], 2: entries[1]}
    assert load_cursor(path, {**header, "fingerprint_sha256": "g"}) == {}
    assert load_cursor(tmp_path / "absent.jsonl", header) == {}


def test_verify_clean_cache_passes_and_keeps_its_cursor_for_the_next_shards(url, tmp_path, capsys):
    root = build(url, {0: [make_sample(0, 10), make_sample(1, 7)], 1: [make_sample(4, 12)]})
    cursor = tmp_path / "cursor.jsonl"
    code, p = run(capsys, "verify", url, "--cursor", cursor, "--workers", "2")
    assert code == 0 and p["ok"] and p["problems"] == []
    assert (p["shards"], p["verified_now"], p["resumed"], p["samples"]) == (2, 2, 0, 3)
    assert p["bytes_read_now"] >= 29 * (4 + 1 + 2 * len(LAYERS) * H) and cursor.exists()
    root.write_shard(2, [make_sample(5, 9)], writer_id="w")  # a growing cache: only the new shard is read
    code, p = run(capsys, "verify", url, "--cursor", cursor)
    assert code == 0 and (p["shards"], p["verified_now"], p["resumed"], p["samples"]) == (3, 1, 2, 4)


def test_verify_reports_a_changed_array_and_nan_with_the_sample(url, tmp_path, capsys):
    import zarr

    root = build(url, {0: [make_sample(0, 10), make_sample(1, 7)]})
    features = zarr.open_array(root.shard_store(0, read_only=False), path="features", mode="r+",
                               config={"write_empty_chunks": True})
    features[12, 0] = 0x7FC0  # bf16 NaN bits in sample 1 (tokens 10..16)
    code, p = run(capsys, "verify", url, "--cursor", tmp_path / "c.jsonl")
    assert code == 1
    assert [(q["shard"], q["sample"], q["sample_id"], q["check"]) for q in p["problems"]] == [
        (0, None, None, "checksum"), (0, 1, "0-1", "non_finite")]
    assert main(["verify", url, "--cursor", str(tmp_path / "c.jsonl")]) == 1
    assert "2 problems in shard 0" in capsys.readouterr().out


# ---- sample -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_cache(tmp_path_factory, tiny_qwen3, tiny_target_dir):
    """A cache of two real samples: tiny-tokenizer text, features from the tiny target's prefill."""
    from transformers import AutoTokenizer

    from pipeline.target_model.prefill import TargetPrefill

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    fp = make_fp(hidden=64, tokenizer_hash=hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest())
    fp = Fingerprint(**{**fp.to_dict(), "target": {**fp.target, "prefill_dtype": "float32"}})
    url = str(tmp_path_factory.mktemp("text") / "cache")
    root = open_cache(url, fp)
    samples = []
    for row, (prompt, answer) in enumerate([("def load(path):", " return json.loads(path)"),
                                            ("class Encoder:", " pass  # encodes objects")]):
        p, a = tok.encode(prompt), tok.encode(answer)
        ids, mask = np.array(p + a, dtype=np.int32), np.array([0] * len(p) + [1] * len(a), dtype=np.uint8)
        out = TargetPrefill(tiny_qwen3, LAYERS)([ids], [mask])[0]
        samples.append(CacheSample(input_ids=torch.from_numpy(ids), loss_mask=torch.from_numpy(mask),
                                   features=out.features, last_hidden=out.last_hidden, sample_id=f"0-{row + 3}",
                                   source=0, row=row + 3, content_hash=f"{row:04x}"))
    root.write_shard(0, samples, writer_id="w", extra={"source": 0, "rows": [0, 8]})
    root.fs.pipe_file(f"{root.path}/quarantine/s000000.jsonl",
                      b'{"source": "x.jsonl", "line": 2, "row": 1, "reason": "invalid_json", "detail": "bad"}\n')
    return url, samples, tok


def test_sample_shows_text_span_norms_and_target_top_tokens(text_cache, tiny_qwen3, tiny_target_dir, capsys):
    url, samples, tok = text_cache
    code, p = run(capsys, "sample", url, "1", "--target", tiny_target_dir, "--top-k", "3")
    want = samples[1]
    assert code == 0 and (p["shard"], p["position"], p["sample_id"], p["row"]) == (0, 1, "0-4", 4)
    assert p["tokenizer_matches_cache"] is True
    sup = [s for s in p["segments"] if s["supervised"]]
    assert len(sup) == 1 and sup[0]["ids"] == want.input_ids[want.loss_mask == 1].tolist()
    assert sup[0]["text"] == tok.decode(sup[0]["ids"])
    norms = want.features.float().reshape(want.num_tokens, 3, 64).norm(dim=-1).mean(0)
    assert [n["layer"] for n in p["norms"]] == ["0", "1", "2", "last_hidden"]
    assert [round(n["mean_norm"], 3) for n in p["norms"][:3]] == [round(float(x), 3) for x in norms]
    first = int(torch.nonzero(want.loss_mask[1:]).flatten()[0])
    assert [t["position"] for t in p["top_tokens"]] == [first, first + 1, first + 2]
    with torch.no_grad():
        logits = tiny_qwen3(input_ids=want.input_ids.long()[None]).logits[0, first]
    top = p["top_tokens"][0]["top"]
    assert [t["id"] for t in top] == logits.topk(3).indices.tolist()
    assert top[0]["prob"] >= top[1]["prob"] >= top[2]["prob"]
    assert p["last_hidden_max_abs_diff"] < 0.05  # the cached bf16 state is the target's own
    assert main(["sample", url, "1", "--target", tiny_target_dir, "--positions", "2"]) == 0
    out = capsys.readouterr().out
    assert f"<<{sup[0]['text']}>>" in out and "position 2 (next" in out


def test_sample_by_source_row_and_errors(text_cache, capsys):
    url = text_cache[0]
    code, p = run(capsys, "sample", url, "--row", "0:3")
    assert code == 0 and (p["index"], p["sample_id"]) == (0, "0-3") and p["top_tokens"] is None
    assert main(["sample", url, "--row", "0:1"]) == 2
    err = capsys.readouterr().err
    assert "source 0 row 1" in err and "skipped: invalid_json (bad)" in err
    assert main(["sample", url, "7"]) == 2 and "outside [0, 2)" in capsys.readouterr().err
    assert main(["sample", url]) == 2 and "give a sample INDEX or --row" in capsys.readouterr().err
    assert main(["sample", url, "0", "--positions", "1"]) == 2 and "needs --target" in capsys.readouterr().err


def test_sample_refuses_a_target_of_another_hidden_size(url, tiny_target_dir, capsys):
    build(url, {0: [make_sample(0, 10)]})  # hidden 16; the tiny target has 64
    assert main(["sample", url, "0", "--target", tiny_target_dir]) == 2
    assert "has hidden size 64, the cache's target has 16" in capsys.readouterr().err


# ---- gc, diff, estimate -----------------------------------------------------------------------

def test_gc_lists_then_deletes_only_uncommitted_objects(url, capsys):
    root = build(url, {0: [make_sample(0, 10)]})
    crash(root, 1, [make_sample(1, 9)])
    root.fs.pipe_file(f"{root.path}/quarantine/s000001.jsonl", b"{}\n")
    kept = dict(root.shard_objects(0))
    code, p = run(capsys, "gc", url, "--min-age", "3600")
    assert code == 0 and p["shards"][0]["action"].startswith("kept: written")
    code, p = run(capsys, "gc", url, "--min-age", "0")
    assert code == 1 and [r["shard"] for r in p["shards"]] == [1] and p["deleted"] == 0
    assert p["objects"] == len(root.shard_objects(1)) + 1 and root.shard_objects(1)
    code, p = run(capsys, "gc", url, "--min-age", "0", "--yes")
    assert code == 0 and p["deleted"] == 1 and root.shard_objects(1) == {}
    assert not root.fs.exists(f"{root.path}/quarantine/s000001.jsonl")
    assert root.shard_objects(0) == kept and root.committed_shards() == [0]
    assert run(capsys, "gc", url, "--min-age", "0") == (0, {"url": root.url, "shards": [], "objects": 0,
                                                             "bytes": 0, "deleted": 0})


def test_diff_reports_missing_changed_and_extra_samples(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    build(a, {0: [make_sample(0, 10), make_sample(1, 7)], 1: [make_sample(2, 5)]})
    changed = make_sample(1, 7)
    changed.content_hash = "beef"
    build(b, {0: [make_sample(0, 10), changed], 2: [make_sample(3, 5)]})
    code, p = run(capsys, "diff", a, b)
    assert code == 1 and not p["identical"]
    assert (p["only_in_a"], p["only_in_b"], p["content_differs"]) == (["0-2"], ["0-3"], ["0-1"])
    assert (p["shards_only_in_a"], p["shards_only_in_b"], p["shard_data_differs"]) == ([1], [2], [])
    assert p["differences"] == ["only_in_a", "only_in_b", "content_differs", "shards_only_in_a", "shards_only_in_b"]
    assert run(capsys, "diff", a, a)[0] == 0


def test_shard_object_count_matches_a_written_shard(url):
    root = open_cache(url, make_fp(), storage=SMALL)
    counts = []
    for i, samples in enumerate([[make_sample(0, 40), make_sample(1, 33)], []]):
        record = root.write_shard(i, samples, writer_id="w")
        counts.append(shard_objects(record.num_samples, record.num_tokens, record.num_hidden_rows,
                                    feature_width=3 * H, hidden_size=H, feature_dtype="bf16", storage=SMALL))
        assert counts[i] == len(root.shard_objects(i)) + 1  # + the commit record
    assert counts[1] == 12  # group, record, 8 array metadata, offsets and sup_offsets (one row each)


def test_estimate_renders_the_input_cases_like_the_cache_stage(tiny_target_dir, input_cases, capsys):
    files = f"[{input_cases}/chats/openai.jsonl,{input_cases}/chats/sharegpt.jsonl]"
    code, p = run(capsys, "estimate", "--config", DEFAULT_CONFIG, f"target.path={tiny_target_dir}",
                  f"data.train_files={files}", "generate.enabled=false", "cache.rows_per_shard=4",
                  "data.min_loss_tokens=1", "run_dir=/tmp/x", "cache.storage_budget_bytes=1000", "train.epochs=5")
    assert (p["shards"], p["rows"], p["samples"]) == (8, 27, 13)  # as tests/integration/test_cache_stage.py counts
    assert sum(p["skipped_rows"].values()) == 13 and p["skipped_rows"]["unknown_role"] == 2
    est = estimate_cache_bytes(p["tokens"], hidden_size=64, num_target_layers=3, num_samples=13,
                               supervised_fraction=p["hidden_rows"] / p["tokens"])
    overhead = shard_overhead_bytes(hidden_size=64, target_layer_ids=(0, 1, 2))
    assert p["bytes"] == est.total_bytes + 8 * overhead and p["tokens"] > 13 * 10
    # fingerprint + summary; 6 shards with skipped rows have a quarantine file; 6 shards with samples hold a
    # group zarr.json, a commit record and 8 arrays of (zarr.json + one object); 2 shards whose rows were
    # all skipped (rows 4-11 of openai.jsonl) hold data objects only for offsets and sup_offsets
    assert p["objects"] == 2 + 6 + 6 * (2 + 8 * 2) + 2 * (2 + 8 + 2)
    r = p["requests"]  # the request bill: every object one PUT; reads per epoch, times epochs and drafters
    assert r["put_cache"] == p["objects"] and (r["epochs"], r["drafters"]) == (5, 3)
    assert r["get_per_run"] > 3 * 5 * r["get_per_epoch"] > 0
    assert code == 1 and p["over_budget"] and p["cache"] == "/tmp/x/cache"


# ---- errors -----------------------------------------------------------------------------------

def test_usage_errors_are_one_line_with_exit_2(tmp_path, capsys):
    assert main(["ls", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no cache at" in err and "fingerprint.json" in err
    assert main(["du", "nosuchproto://bucket/x"]) == 2
    assert "cannot open nosuchproto://bucket/x" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["verify"])
    assert exc.value.code == 2


def test_python_dash_m_ops_runs_as_a_module(url):
    build(url, {0: [make_sample(0, 10)]})
    out = subprocess.run([sys.executable, "-m", "ops", "du", url, "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["tokens"] == 10


def test_corrupt_shard_metadata_is_a_damaged_shard_not_a_traceback(url, capsys):
    build(url, {0: [make_sample(0, 5, row=0)], 1: [make_sample(1, 6, row=4)]})
    (Path(url) / "shards" / "s000001" / "zarr.json").write_text("{garbage")
    assert main(["sample", url, "--row", "0:4"]) == 1
    err = capsys.readouterr().err
    assert "shard 1: its zarr metadata is unreadable (JSONDecodeError" in err and "commits/s000001.json" in err
    code, p = run(capsys, "verify", url)
    assert code == 1 and {q["shard"] for q in p["problems"]} == {1}


def test_request_cost_model_counts_objects_index_and_chunk_reads():
    from ops.estimate import (LIST_PAGE, OPEN_PER_SHARD, WRITE_EXTRA_PER_SHARD, request_costs,
                              sample_read_requests)

    # a 2 MiB-chunk bf16 sample of 4096 tokens, W = 5 * 2560: features span 4096 * 25,600 bytes = 50 chunks
    per = sample_read_requests(4096, 4096, feature_width=5 * 2560, hidden_size=2560, feature_dtype="bf16",
                               chunk_bytes=2**21)
    spans = [4 * 4096, 4096, 4096 * 25600, 4096 * 5120]
    assert per == pytest.approx(sum(1 + b / 2**21 for b in spans))
    assert 4 + 60 < per < 4 + 61
    fp8 = sample_read_requests(10, 10, feature_width=8, hidden_size=8, feature_dtype="fp8_e4m3", chunk_bytes=2**21)
    assert fp8 == pytest.approx(5, rel=1e-3)  # one more array: feature_scale
    c = request_costs(shards=2500, samples=10000, tokens=40000, hidden_rows=30000, objects=50000, feature_width=8,
                      hidden_size=8, feature_dtype="bf16", chunk_bytes=2**21, epochs=3, drafters=2, workers=4)
    epoch = 2500 * OPEN_PER_SHARD + 10000 * c["get_per_sample"]
    assert c["put_cache"] == 50000 and c["other_cache"] == 2500 * WRITE_EXTRA_PER_SHARD
    assert c["get_per_epoch"] == pytest.approx(epoch, abs=30)
    assert c["get_per_run"] == pytest.approx(2 * (3 * epoch + 4 * (1 + 2500 // LIST_PAGE + 1 + 2500)), abs=30)
    assert c["usd_cache"] == pytest.approx((50000 * 0.005 + 2500 * WRITE_EXTRA_PER_SHARD * 0.0004) / 1000, abs=1e-4)
