"""The CLIs do what the docs say: Hydra flags anywhere, sweeps leave no multirun/ folder, ops tools take
the config as pipeline.run does, estimate before generate, target download hints, input files checked
up front, a useful --help, one dtype spelling with aliases."""
import json

import pytest

from ops.__main__ import main as ops_main
from pipeline.config import to_dict
from pipeline.errors import ConfigError, TargetNotFoundError
from pipeline.run import DEFAULT_CONFIG, load_config, rewrite_argv
from pipeline.target_model.loader import resolve_target_path
from clirun import REPO, plans, run_cli



# ---- 1. Hydra flags before or after the YAML and the overrides -----------------------------------

def test_hydra_flag_after_overrides_prints_the_config():
    r = run_cli("+stage=all", "conf/tiny.yaml", "train.epochs=3", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "epochs: 3" in r.stdout and "stage: all" in r.stdout


def test_rewrite_puts_flags_with_their_values_before_every_override():
    from pipeline.run import split_argv

    argv = rewrite_argv(["train.lr=0.1", "--cfg", "job", "conf/tiny.yaml", "-p", "train", "train.epochs=2",
                         "--info", "defaults", "--resolve", "-m", "train.seed=1,2"])
    assert argv[:4] == ["--config-path", str(REPO / "conf"), "--config-name", "tiny"]
    assert argv[4:12] == ["--cfg", "job", "-p", "train", "--info", "defaults", "--resolve", "-m"]
    assert argv[12:15] == ["++train.lr=0.1", "++train.epochs=2", "++train.seed=1,2"]
    assert all("=" in o and not o.startswith("-") for o in argv[12:]) and "hydra.run.dir=." in argv[12:]
    assert split_argv(["--info", "a=1"]) == ([], ["--info"], ["a=1"])  # --info's value is optional


# ---- 2. sweeps write under runs/, never a multirun/ folder where the command ran ----------------

def test_sweep_leaves_no_multirun_folder(local_target, tmp_path):
    r = run_cli("-m", DEFAULT_CONFIG, f"target.path={local_target}", "dry_run=true", "train.lr=1e-3,2e-3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [p["config"]["train"]["lr"] for p in plans(r.stdout)] == [1e-3, 2e-3]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()
    assert list((tmp_path / "runs" / "multirun").glob("*/multirun.yaml"))
    assert "multirun/" in (REPO / ".gitignore").read_text().split()


# ---- 3 and 4. ops estimate: positional config, and before the generate stage has run ------------

def _estimate(capsys, *argv) -> dict:
    assert ops_main(["estimate", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def case_overrides(tiny_target_dir, input_cases, tmp_path_factory):
    files = f"[{input_cases}/chats/openai.jsonl,{input_cases}/chats/sharegpt.jsonl]"
    run_dir = tmp_path_factory.mktemp("run")
    return [f"target.path={tiny_target_dir}", f"data.train_files={files}", "cache.rows_per_shard=4",
            "data.min_loss_tokens=1", f"run_dir={run_dir}"]


def test_ops_estimate_takes_the_config_positionally_or_by_flag(case_overrides, capsys):
    positional = _estimate(capsys, DEFAULT_CONFIG, *case_overrides, "generate.enabled=false")
    flag = _estimate(capsys, "--config", DEFAULT_CONFIG, *case_overrides, "generate.enabled=false")
    assert positional == flag and (positional["shards"], positional["samples"]) == (8, 13)
    assert positional["note"] is None
    assert ops_main(["estimate", *case_overrides]) == 2 and "give the run's config file" in capsys.readouterr().err


def test_ops_estimate_before_generate_sizes_the_input_answers(case_overrides, capsys):
    cached = _estimate(capsys, "--config", DEFAULT_CONFIG, *case_overrides, "generate.enabled=false")
    before = _estimate(capsys, "--config", DEFAULT_CONFIG, *case_overrides, "generate.enabled=true")
    assert before["note"].startswith("generate has not run yet (0 of 2 generate shards committed): these figures "
                                     "are of the input chats' own assistant answers")
    assert {k: v for k, v in before.items() if k != "note"} == {k: v for k, v in cached.items() if k != "note"}
    # generate.max_rows keeps its first span (rows 0-7 of openai.jsonl): the estimate covers those rows only
    part = _estimate(capsys, "--config", DEFAULT_CONFIG, *case_overrides, "generate.rows_per_shard=8",
                     "generate.max_rows=8")
    assert (part["shards"], part["rows"]) == (2, 8)
    assert ops_main(["estimate", "--config", str(DEFAULT_CONFIG), *case_overrides]) == 0
    assert capsys.readouterr().out.startswith("note: generate has not run yet")


# ---- 5. the missing-target message names the right download command -----------------------------

def test_missing_hub_target_suggests_hf_download_into_a_local_folder():
    with pytest.raises(TargetNotFoundError) as e:
        resolve_target_path("dspark-test/NoSuchModel-4B")
    msg = str(e.value)
    assert "`hf download dspark-test/NoSuchModel-4B --local-dir /models/NoSuchModel-4B`" in msg
    assert "target.path=/models/NoSuchModel-4B" in msg and "huggingface-cli" not in msg


def test_missing_local_target_says_the_folder_is_missing(tmp_path):
    path = str(tmp_path / "models" / "Qwen3-4B")
    with pytest.raises(TargetNotFoundError) as e:
        resolve_target_path(path)
    msg = str(e.value)
    assert msg.startswith(f"target.path={path!r}: the folder does not exist")
    assert f"`hf download <hub id> --local-dir {path}`" in msg and "huggingface-cli" not in msg


# ---- 6. input files are checked before any stage (dry runs too), for the stages that read them ---

def test_dry_run_refuses_a_missing_train_file(local_target, tmp_path):
    r = run_cli("+stage=all", DEFAULT_CONFIG, f"target.path={local_target}", "dry_run=true",
             "data.train_files=[missing.jsonl]", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"error: config error: data.train_files: {tmp_path}/missing.jsonl does not exist; "
                                "fix the path (JSONL or Parquet files) or remove it from data.train_files")


def test_each_stage_checks_only_the_files_it_reads(tmp_path):
    import fsspec

    from pipeline.run import check_inputs, input_keys

    fsspec.filesystem("memory").pipe("/dspark-test/chats.jsonl", b"{}\n")
    train = "data.train_files=[memory://dspark-test/chats.jsonl,embedded:stdlib/train.jsonl]"
    cfg = load_config(DEFAULT_CONFIG, [train, f"data.eval_files=[{tmp_path}/gone.jsonl]", "~evaluate.prompt_sets"])
    assert input_keys(cfg, ["cache", "train", "calibrate", "export"]) == ["data.train_files"]
    assert input_keys(cfg, ["train", "calibrate", "export"]) == []
    cfg.train.features = type(cfg.train.features)("online")
    assert input_keys(cfg, ["train"]) == ["data.train_files"]
    check_inputs(cfg, ["generate", "cache", "train", "calibrate", "export"])  # evaluate's file is not needed
    with pytest.raises(ConfigError, match=f"data.eval_files: {tmp_path}/gone.jsonl does not exist"):
        check_inputs(cfg, ["evaluate"])
    cfg.data.train_files = ["memory://dspark-test/other.jsonl"]
    with pytest.raises(ConfigError, match="data.train_files: memory://dspark-test/other.jsonl does not exist"):
        check_inputs(cfg, ["cache"])
    cfg.data.train_files = ["embedded:stdlib/nope.jsonl"]
    with pytest.raises(ConfigError, match="unknown embedded data 'embedded:stdlib/nope.jsonl'"):
        check_inputs(cfg, ["generate"])


# ---- 7. --help ---------------------------------------------------------------------------------

def test_help_names_the_stages_configs_and_keys():
    for args in (["--help"], ["conf/tiny.yaml", "train.lr=1", "-h"]):
        r = run_cli(*args)
        assert r.returncode == 0, r.stderr
        assert "Configuration groups" not in r.stdout and r.stdout.startswith("usage: python -m pipeline.run")
        for word in ("generate", "cache", "train", "calibrate", "export", "evaluate", "conf/tiny.yaml",
                     "conf/qwen3_4b.yaml", "run_dir=", "target.path=", "data.train_files=", "train.epochs=",
                     "dry_run=true"):
            assert word in r.stdout, word


# ---- 8. one dtype spelling, aliases accepted ------------------------------------------------------

def test_dtype_aliases_give_equal_configs_in_the_canonical_spelling():
    import torch

    from pipeline.config import TargetDtype, canonical_dtype, torch_dtype

    short = load_config(DEFAULT_CONFIG, ["target.dtype=bf16", "train.precision=bf16", "cache.feature_dtype=bf16"])
    long = load_config(DEFAULT_CONFIG, ["target.dtype=bfloat16", "train.precision=bfloat16",
                                        "cache.feature_dtype=bfloat16"])
    assert short == long
    d = to_dict(long)
    assert (d["target"]["dtype"], d["train"]["precision"], d["cache"]["feature_dtype"]) == ("bf16", "bf16", "bf16")
    assert load_config(DEFAULT_CONFIG, ["target.dtype=float32"]).target.dtype is TargetDtype.fp32
    assert to_dict(load_config(REPO / "conf" / "qwen3_4b.yaml"))["target"]["dtype"] == "bf16"
    # what consumers get is unchanged: torch's name for the target (vLLM, the fingerprint), bf16 for DeepSpeed
    assert (long.target.dtype == "bfloat16", long.train.precision == "bf16", long.cache.feature_dtype.value) == \
        (True, True, "bf16")
    assert f"{long.target.dtype}" == "bf16" and json.dumps(long.target.dtype) == '"bfloat16"'
    assert canonical_dtype("float32") == "fp32" and canonical_dtype(long.target.dtype) == "bf16"
    assert (torch_dtype(long.target.dtype), torch_dtype("fp32"), torch_dtype("fp8_e4m3")) == \
        (torch.bfloat16, torch.float32, torch.float8_e4m3fn)


@pytest.mark.parametrize("override,accepted", [
    ("target.dtype=fp16", "expected one of [bf16, fp32, bfloat16, float32]"),
    ("train.precision=half", "expected one of [bf16, fp32, bfloat16, float32]"),
    ("cache.feature_dtype=fp32", "expected one of [bf16, fp8_e4m3, bfloat16]"),
])
def test_bad_dtype_names_the_accepted_spellings(override, accepted):
    from pipeline.config import canonical_dtype

    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [override])
    key, value = override.split("=")
    assert str(e.value) == f"config error: {key}: Invalid value '{value}', {accepted}"
    with pytest.raises(ConfigError, match="use one of bf16, bfloat16, fp32, float32, fp8_e4m3"):
        canonical_dtype("half")


def test_cache_fingerprint_records_the_prefill_dtype_as_before(tiny_target_dir):
    """Existing caches keep their fingerprint: target.prefill_dtype stays torch's name."""
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.stages.cache import target_fingerprint

    for spelling, recorded in (("fp32", "float32"), ("bfloat16", "bfloat16"), ("bf16", "bfloat16")):
        cfg = load_config(DEFAULT_CONFIG, [f"target.dtype={spelling}", f"target.path={tiny_target_dir}"])
        fp = target_fingerprint(cfg, AutoTokenizer.from_pretrained(tiny_target_dir), tiny_target_dir,
                                AutoConfig.from_pretrained(tiny_target_dir))
        assert json.loads(fp.to_json())["target"]["prefill_dtype"] == recorded
