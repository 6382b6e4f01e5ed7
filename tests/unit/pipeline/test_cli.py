"""CLI: positional YAML rewriting, overrides, Hydra flags and -m, one-line config errors, fail-fast target."""
import time
from pathlib import Path

import pytest

from pipeline.config import Stage, to_run_config
from pipeline.errors import ConfigError
from pipeline.run import DEFAULT_CONFIG, load_config, rewrite_argv
from clirun import REPO, plans, run_cli



def test_rewrite_positional_yaml():
    argv = rewrite_argv(["+stage=cache", "conf/qwen3_4b.yaml", "train.lr=0.1", "--cfg", "job"])
    i = argv.index("--config-path")
    assert argv[i + 1] == str(REPO / "conf") and argv[argv.index("--config-name") + 1] == "qwen3_4b"
    assert "+stage=cache" in argv and "++train.lr=0.1" in argv and "--cfg" in argv
    assert "hydra.run.dir=." in argv and "hydra.output_subdir=null" in argv
    default = rewrite_argv(["+stage=cache"])
    assert default[default.index("--config-path") + 1] == str(DEFAULT_CONFIG.parent)
    assert rewrite_argv(["--config-name", "x", "hydra.run.dir=/tmp/y"]).count("hydra.run.dir=.") == 0
    with pytest.raises(ConfigError, match="one YAML file"):
        rewrite_argv(["a.yaml", "b.yaml"])
    with pytest.raises(ConfigError, match="no such file"):
        rewrite_argv(["missing.yaml"])


def test_compose_loader_types_and_overrides():
    cfg = load_config(REPO / "conf" / "qwen3_4b.yaml", ["+stage=train", "train.lr=0.001"])
    assert cfg.stage == Stage.train and cfg.train.lr == 0.001
    assert cfg.target.target_layer_ids == [1, 9, 17, 25, 33]
    d = cfg.train.drafters["dspark"]
    assert (d.num_layers, d.block_size, d.mask_token_id, d.markov_rank) == (5, 7, 151669, 256)
    assert (cfg.train.num_anchors, cfg.train.decay_lambda, cfg.train.warmup_ratio) == (512, 4.0, 0.04)
    assert (cfg.data.max_length, cfg.data.min_loss_tokens) == (4096, 14)
    tiny = load_config(DEFAULT_CONFIG)
    assert set(tiny.train.drafters) == {"dflash", "dspark", "eagle3"}
    assert tiny.train.drafters["dflash"].markov_rank == 0


def test_relative_paths_become_absolute(tmp_path, monkeypatch, local_target):
    """Ray Train workers run in their own directory: a relative run_dir must reach them absolute."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t").symlink_to(local_target)
    cfg = load_config(DEFAULT_CONFIG, ["run_dir=runs/x", "data.train_files=[a.jsonl,s3://b/c.jsonl]",
                                       "data.eval_files=['~/e.jsonl']", "evaluate.sps_table=sps.json", "target.path=t"])
    assert cfg.run_dir == str(tmp_path / "runs" / "x")
    assert cfg.data.train_files == [str(tmp_path / "a.jsonl"), "s3://b/c.jsonl"]
    assert cfg.data.eval_files == [str(Path.home() / "e.jsonl")]
    assert cfg.evaluate.sps_table == str(tmp_path / "sps.json") and cfg.target.path == str(tmp_path / "t")
    hub = load_config(REPO / "conf" / "qwen3_4b.yaml", ["run_dir=s3://bucket/run"])
    assert hub.target.path == "Qwen/Qwen3-4B" and hub.run_dir == "s3://bucket/run"
    assert load_config(DEFAULT_CONFIG).target.path == "embedded:tiny"


@pytest.mark.parametrize("override,msg", [
    ("train.lrr=3", "train.lrr: Key 'lrr' not in 'TrainConfig'"),
    ("train.lr=-1", "train.lr: must be > 0"),
    ("cache.feature_dtype=fp16", "cache.feature_dtype: Invalid value 'fp16'"),
    ("target.target_layer_ids=[3,1]", "target.target_layer_ids: must be strictly ascending"),
    ("train.drafters.dspark.markov_rank=0", "train.drafters.dspark.markov_rank: must be > 0 exactly when head != none"),
    ("generate.top_p=0", "generate.top_p: must be in (0, 1]"),
    ("generate.rows_per_shard=0", "generate.rows_per_shard: must be >= 1"),
    ("train.cpus_per_worker=0", "train.cpus_per_worker: must be >= 1"),
    ("cache.shard_delay_s=-1", "cache.shard_delay_s: must be >= 0 seconds"),
])
def test_bad_config_is_one_line(override, msg):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [override])
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_cli_one_line_error_exit_2():
    r = run_cli("conf/tiny.yaml", "train.lrr=3")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: config error: train.lrr: Key 'lrr' not in 'TrainConfig'"


def test_qwen3_4b_offline_fails_fast_without_traceback():
    t0 = time.time()
    r = run_cli("+stage=cache", "conf/qwen3_4b.yaml")
    assert time.time() - t0 < 30
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert "target.path='Qwen/Qwen3-4B'" in r.stderr and "never downloads" in r.stderr
    assert "`hf download Qwen/Qwen3-4B --local-dir /models/Qwen3-4B`" in r.stderr
    assert "target.path=/models/Qwen3-4B" in r.stderr


def test_cli_matches_compose_loader_and_hydra_flags(local_target, tmp_path, monkeypatch):
    args = ["+stage=all", "conf/tiny.yaml", f"target.path={local_target}", "train.lr=0.5", "dry_run=true"]
    r = run_cli(*args, cwd=tmp_path)  # any working directory; the YAML path is absolute after rewriting
    assert r.returncode == 2 and "no such file" in r.stderr  # relative to cwd, as a user expects
    r = run_cli(*[a if a != "conf/tiny.yaml" else str(DEFAULT_CONFIG) for a in args], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    [plan] = plans(r.stdout)
    monkeypatch.chdir(tmp_path)  # run_dir runs/tiny is relative to the directory of the command
    via_loader = load_config(DEFAULT_CONFIG, ["+stage=all", f"target.path={local_target}", "train.lr=0.5",
                                              "dry_run=true"])
    assert to_run_config(plan["config"]) == via_loader
    assert not (tmp_path / "outputs").exists() and not (tmp_path / ".hydra").exists()
    r = run_cli("conf/tiny.yaml", "--cfg", "job", "train.lr=0.25")  # a plain Hydra flag still works
    assert r.returncode == 0 and "lr: 0.25" in r.stdout


def test_cli_multirun(local_target, tmp_path):
    r = run_cli("-m", str(DEFAULT_CONFIG), f"target.path={local_target}", "dry_run=true", "train.lr=0.1,0.2",
             f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [p["config"]["train"]["lr"] for p in plans(r.stdout)] == [0.1, 0.2]


def test_dry_run_refuses_layer_ids_the_target_lacks(local_target):
    """A 4-layer target has features at layers -1..2: [0, 3] is refused in a dry run, naming the key."""
    r = run_cli("+stage=train", str(DEFAULT_CONFIG), f"target.path={local_target}", "target.target_layer_ids=[0,3]",
             "~train.drafters.eagle3", "dry_run=true")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: config error: target.target_layer_ids: [0, 3] must lie in [-1, 2]"), r.stderr


def test_product_error_inside_ray_wrapping_is_found():
    """A cache-shard error raised in a Ray actor reaches the driver as RayTaskError (the cause as
    ``.cause``), then chained by Ray Data: the CLI reports the innermost product error's message."""
    from ray.exceptions import RayTaskError

    from cache_schema.errors import ShardAlreadyCommittedError
    from pipeline.run import user_error

    inner = ShardAlreadyCommittedError("shard 3 of s3://b/c was committed by another writer")
    wrapped = RayTaskError("write_shard", "Traceback ... 42 lines", inner).as_instanceof_cause()
    assert isinstance(wrapped, ShardAlreadyCommittedError)  # Ray's dual class: str() is the traceback
    try:
        try:
            raise wrapped
        except Exception as e:
            raise RuntimeError("Ray Data: a task failed") from e
    except RuntimeError as outer:
        assert user_error(outer) is inner
        assert str(user_error(outer)) == "shard 3 of s3://b/c was committed by another writer"
    assert user_error(RuntimeError("not ours")) is None
    assert user_error(ConfigError("bad key")).args == ("bad key",)
