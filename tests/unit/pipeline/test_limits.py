"""GPU-path review at the Qwen3-4B shape: bounds on calibrate's compute and on checkpoint storage.

- ``calibrate.max_samples``: calibrate runs the drafter over at most that many held-out samples, the
  first ones in the held-out shards' stored order (:func:`pipeline.stages.calibrate.select_heldout`),
  and reports ``samples_used`` / ``samples_available``.
- ``train.keep_checkpoints``: after each commit rank 0 deletes the committed checkpoints older than
  the newest N (:func:`training.checkpoint.prune_checkpoints`), commit record first.

The imports of the new names are inside the tests, so that each test fails on its own without them. Both end to
end on the tiny target: tests/integration/test_calibrate_stage.py.
"""
from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest
import torch

from pipeline.config import to_run_config
from pipeline.errors import ConfigError
from storage import filesystem, join
from training.checkpoint import commit, latest_checkpoint, read_parts, step_name, write_part

from checkpointdirs import _folders
from paths import REPO

pytestmark = pytest.mark.gpu_path


def _run_config(**sections):
    return to_run_config({"train": {"drafters": {"dspark": {}}}, **sections})


# ---------------------------------------------------------------- calibrate.max_samples


COUNTS = {0: 7, 1: 5, 2: 4, 3: 6}  # shards 2 and 3 held out: 10 samples
HELDOUT = (2, 3)


@pytest.mark.parametrize("cap, shards, used", [
    (1, (2,), 1),
    (3, (2,), 3),
    (4, (2,), 4),          # exactly shard 2: shard 3 is not read at all
    (6, (2, 3), 6),
    (10, (2, 3), 10),      # exactly all
    (256, (2, 3), 10),     # above what there is: all of them
    (None, (2, 3), 10),    # unset: all of them, as before the cap
])
def test_select_heldout_takes_the_first_samples_in_stored_order(cap, shards, used):
    from pipeline.stages.calibrate import HeldoutSelection, select_heldout

    sel = select_heldout(COUNTS, HELDOUT, cap)
    assert sel == HeldoutSelection(shards=shards, samples_used=used, samples_available=10)
    assert select_heldout(COUNTS, HELDOUT, cap) == sel  # deterministic: a rerun chooses the same


def test_select_heldout_refuses_a_cap_below_one():
    from pipeline.stages.calibrate import select_heldout

    with pytest.raises(ConfigError, match=r"calibrate.max_samples: must be >= 1 .*got 0"):
        select_heldout(COUNTS, HELDOUT, 0)


class _Reader:
    """A cache reader's ``iter_samples`` over fake shards (``COUNTS``), logging every sample read."""

    def __init__(self, counts):
        self.counts, self.read = counts, []

    def iter_samples(self, shards):
        for s in shards:
            for k in range(self.counts[s]):
                self.read.append((s, k))
                yield SimpleNamespace(input_ids=torch.tensor([s, k]), loss_mask=torch.ones(2), features=None,
                                      last_hidden=None, sample_id=f"{s}/{k}")


@pytest.mark.parametrize("cap, sizes", [(6, [4, 2]), (3, [3]), (None, [4, 4, 2]), (99, [4, 4, 2])])
def test_heldout_batches_read_only_the_selected_samples(cap, sizes):
    from pipeline.stages.calibrate import heldout_batches, select_heldout

    reader = _Reader(COUNTS)
    batches = list(heldout_batches(reader, select_heldout(COUNTS, HELDOUT, cap), micro_batch=4))
    expected = [(2, k) for k in range(4)] + [(3, k) for k in range(6)]
    expected = expected[:cap] if cap is not None else expected
    assert [len(b) for b in batches] == sizes
    assert [m["sample_id"] for b in batches for m in b] == [f"{s}/{k}" for s, k in expected]
    assert reader.read == expected  # not one sample past the cap is read from the cache


def test_calibrate_max_samples_config_key_validates():
    assert _run_config().calibrate.max_samples is None  # default: every held-out sample, as before
    assert _run_config(calibrate={"max_samples": 256}).calibrate.max_samples == 256
    for bad in (0, -3):
        with pytest.raises(ConfigError, match=rf"calibrate.max_samples: must be >= 1 .*\(got {bad}\)"):
            _run_config(calibrate={"max_samples": bad})
    with pytest.raises(ConfigError, match="calibrate.max_samples"):
        _run_config(calibrate={"max_samples": "many"})


def test_run_calibrate_feeds_the_drafter_only_the_capped_samples(tmp_path, monkeypatch):
    """The stage's wiring, without a cache or a trained drafter: the samples that reach the forward
    pass (``collect_confidence``) are the first ``calibrate.max_samples`` held-out ones, and the
    summary and ``report.json`` say how many were used of how many."""
    import cache_schema
    import pipeline.drafters
    import pipeline.stages.calibrate as cal
    import pipeline.stages.train
    import pipeline.target_model.loader

    reader = _Reader(COUNTS)
    reader.records = {s: SimpleNamespace(num_samples=n) for s, n in COUNTS.items()}
    monkeypatch.setattr(cache_schema, "CacheReader", lambda url, fp: reader)
    monkeypatch.setattr(pipeline.target_model.loader, "resolve_target_path", lambda path: "/no/target")
    monkeypatch.setattr(pipeline.stages.train, "expected_fingerprint", lambda cfg, target_dir: None)
    monkeypatch.setattr(pipeline.drafters, "load_trained_drafter", lambda cfg, name, target_dir: None)
    seen = []

    def forward(model, batches, loss_cfg, *, seed):
        g = torch.Generator().manual_seed(0)
        batch_ids = []
        for i, samples in enumerate(batches):
            seen.extend(m["sample_id"] for m in samples)
            batch_ids += [i] * 20
        n = len(batch_ids)
        return cal.ConfidenceSet(torch.randn(n, 3, generator=g), torch.rand(n, 3, generator=g),
                                 torch.ones(n, 3, dtype=torch.bool), torch.tensor(batch_ids))

    monkeypatch.setattr(cal, "collect_confidence", forward)
    import training.block_runner
    monkeypatch.setattr(training.block_runner, "eval_drafter", lambda model, device, dtype=None: model)
    cfg = to_run_config({"run_dir": str(tmp_path / "run"), "train": {"drafters": {"dspark": {"confidence_calibration": "expected"}}, "heldout_shards": 2,
                                                                     "micro_batch_samples": 2},
                         "calibrate": {"max_samples": 5, "bins": 4, "refit_prompts": 0,
                                       "gate_prompts": 0}})  # no target here
    summary = cal.run_calibrate(cfg)
    assert seen == ["2/0", "2/1", "2/2", "2/3", "3/0"]
    assert reader.read == [(2, 0), (2, 1), (2, 2), (2, 3), (3, 0)]
    assert summary["heldout_shards"] == [2, 3]
    assert (summary["samples_used"], summary["samples_available"]) == (5, 10)
    d = summary["drafters"]["dspark"]
    assert (d["samples_used"], d["samples_available"]) == (5, 10) and d["num_blocks"] == 60  # 3 batches x 20
    report = json.loads((tmp_path / "run" / "calibrate" / "dspark" / "report.json").read_text())
    assert (report["samples_used"], report["samples_available"]) == (5, 10)


# ---------------------------------------------------------------- train.keep_checkpoints


STEPS = [100, 200, 300, 400, 500]


@pytest.fixture(params=["local", "memory"])
def train_url(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "train")
        return
    url = f"memory://limits-{uuid.uuid4().hex}/train"
    yield url
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path.rsplit("/", 1)[0], recursive=True)


def _write(train_url: str, step: int) -> str:
    """A checkpoint folder laid out as ``training.loop._save`` writes it (one rank), not committed."""
    ckpt = join(train_url, "checkpoints", step_name(step))
    fs, path = filesystem(join(ckpt, "engine", "mp_rank_00_model_states.pt"))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, b"x" * 16)
    write_part(ckpt, 0, {"mp_rank_00_model_states.pt": 16})
    _, weights = filesystem(join(ckpt, "drafter.safetensors"))
    fs.pipe_file(weights, b"w" * 8)
    return ckpt


def _committed(train_url: str, step: int) -> str:
    ckpt = _write(train_url, step)
    commit(train_url, step, {"world_size": 1, "step": step, "epoch": 0, "micro": step})
    return ckpt


def _objects(ckpt: str) -> list[str]:
    fs, path = filesystem(ckpt)
    fs.invalidate_cache(path)
    return sorted(fs.find(path)) if fs.exists(path) else []


def test_prune_keeps_the_two_newest_committed_checkpoints(train_url):
    from training.checkpoint import prune_checkpoints

    ckpts = [_committed(train_url, s) for s in STEPS]
    deleted = prune_checkpoints(train_url, 2)
    assert deleted == ckpts[:3]                              # oldest first
    assert _folders(train_url) == {"step-000400": True, "step-000500": True}
    assert all(_objects(c) == [] for c in ckpts[:3])         # every object of a pruned checkpoint is gone
    assert len(_objects(ckpts[3])) == len(_objects(ckpts[4])) == 4  # engine file, part, weights, record
    found = latest_checkpoint(train_url)
    assert found is not None and found[0] == ckpts[4] and found[1]["step"] == 500
    assert read_parts(ckpts[3], 1) == {0: {"mp_rank_00_model_states.pt": 16}}  # the kept ones are whole
    assert prune_checkpoints(train_url, 2) == []             # idempotent
    _committed(train_url, 600)                               # the next commit drops the next oldest
    assert prune_checkpoints(train_url, 2) == [ckpts[3]]
    assert _folders(train_url) == {"step-000500": True, "step-000600": True}
    assert latest_checkpoint(train_url)[1]["step"] == 600


def test_prune_with_keep_none_deletes_nothing(train_url):
    from training.checkpoint import prune_checkpoints

    ckpts = [_committed(train_url, s) for s in STEPS]
    assert prune_checkpoints(train_url, None) == []
    assert _folders(train_url) == {step_name(s): True for s in STEPS}
    assert all(len(_objects(c)) == 4 for c in ckpts)
    assert latest_checkpoint(train_url)[1]["step"] == 500


def test_prune_of_fewer_checkpoints_than_kept_or_none_deletes_nothing(train_url):
    from training.checkpoint import prune_checkpoints

    assert prune_checkpoints(train_url, 2) == []             # no checkpoints folder yet
    _committed(train_url, 100)
    _committed(train_url, 200)
    assert prune_checkpoints(train_url, 2) == []
    assert _folders(train_url) == {"step-000100": True, "step-000200": True}


def test_a_folder_without_its_commit_record_is_not_a_kept_checkpoint(train_url):
    """Kept: the two newest *committed* checkpoints (300, 500), not the uncommitted 400 between them
    nor the 600 being written; both stay untouched while they are newer than the oldest kept one."""
    from training.checkpoint import prune_checkpoints

    ckpts = {s: _committed(train_url, s) for s in (100, 200, 300, 500)}
    half = _write(train_url, 400)                            # never committed (a crash mid-write)
    writing = _write(train_url, 600)                         # being written: its parts are up, no record yet
    before = _objects(writing)
    deleted = prune_checkpoints(train_url, 2)
    assert deleted == [ckpts[100], ckpts[200]]
    assert _folders(train_url) == {"step-000300": True, "step-000400": False, "step-000500": True,
                                   "step-000600": False}
    assert len(_objects(half)) == 3 and _objects(writing) == before
    assert latest_checkpoint(train_url)[1]["step"] == 500
    commit(train_url, 600, {"world_size": 1, "step": 600})  # the write completes: it commits as usual
    assert prune_checkpoints(train_url, 2) == [ckpts[300], half]  # 400 is now older than every kept one
    assert _folders(train_url) == {"step-000500": True, "step-000600": True}
    assert latest_checkpoint(train_url)[1]["step"] == 600


def test_a_prune_cut_short_leaves_only_an_uncommitted_folder(train_url, monkeypatch):
    """The commit record of an old checkpoint goes first: a crash before its objects are deleted
    leaves a folder nothing reads, and the next prune removes it."""
    from training.checkpoint import prune_checkpoints

    ckpts = [_committed(train_url, s) for s in STEPS]
    fs, _ = filesystem(train_url)

    def crash(*args, **kwargs):
        raise OSError("killed mid-prune")

    with monkeypatch.context() as m:
        m.setattr(fs, "rm", crash)                            # the folder's objects are deleted by fs.rm
        with pytest.raises(OSError, match="killed mid-prune"):
            prune_checkpoints(train_url, 2)
    assert _folders(train_url) == {"step-000100": False, "step-000200": True, "step-000300": True,
                                   "step-000400": True, "step-000500": True}
    assert len(_objects(ckpts[0])) == 3                      # objects left, commit record gone
    assert latest_checkpoint(train_url)[1]["step"] == 500    # resume is unaffected
    assert prune_checkpoints(train_url, 2) == ckpts[:3]
    assert _folders(train_url) == {"step-000400": True, "step-000500": True}


def test_prune_never_deletes_the_checkpoint_latest_names(train_url):
    """A run resumed from an earlier checkpoint (``latest`` edited back to it) keeps that one."""
    from training.checkpoint import prune_checkpoints

    ckpts = [_committed(train_url, s) for s in STEPS]
    fs, latest = filesystem(join(train_url, "latest"))
    fs.pipe_file(latest, b"step-000200")
    assert prune_checkpoints(train_url, 2) == [ckpts[0], ckpts[2]]
    assert _folders(train_url) == {"step-000200": True, "step-000400": True, "step-000500": True}
    assert latest_checkpoint(train_url)[1]["step"] == 200


@pytest.mark.parametrize("bad", [0, -1])
def test_prune_refuses_keep_below_one(tmp_path, bad):
    from training.checkpoint import prune_checkpoints

    _committed(str(tmp_path), 100)
    with pytest.raises(ValueError, match=r"train.keep_checkpoints"):
        prune_checkpoints(str(tmp_path), bad)
    assert _folders(str(tmp_path)) == {"step-000100": True}


def test_keep_checkpoints_config_key_validates_and_reaches_the_train_job():
    from pipeline.stages.train import train_job

    cfg = _run_config()
    assert cfg.train.keep_checkpoints is None                # default: keep every checkpoint, as before
    assert train_job(cfg, "dspark", "{}", "/no/target").keep_checkpoints is None
    cfg = _run_config(train={"drafters": {"dspark": {}}, "keep_checkpoints": 2})
    assert train_job(cfg, "dspark", "{}", "/no/target").keep_checkpoints == 2
    for bad in (0, -2):
        with pytest.raises(ConfigError, match=rf"train.keep_checkpoints: must be >= 1.*\(got {bad}\)"):
            _run_config(train={"drafters": {"dspark": {}}, "keep_checkpoints": bad})


def test_the_qwen3_4b_recipe_caps_calibrate_and_keeps_two_checkpoints():
    from omegaconf import OmegaConf

    cfg = to_run_config(OmegaConf.load(REPO / "conf" / "qwen3_4b.yaml"))
    assert cfg.calibrate.max_samples == 256
    assert cfg.train.keep_checkpoints == 2
