"""Shared fixtures: a tiny random-weight Qwen3 target, a real S3-compatible server, a local Ray.

The S3 server is moto's standalone server started as a subprocess on 127.0.0.1 and stopped by its
PID; credentials and the endpoint reach every client (s3fs, boto3, Ray workers) through the
standard AWS environment variables, exactly as they would on a real cluster.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from paths import REPO  # tests/support, on pytest's pythonpath (pyproject.toml)
from pipeline.cluster import free_port

SHARED = REPO.parent / "shared"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "dspark-torch-extensions"))


CASES = REPO / "tests" / "fixtures" / "cases"


# The integration modules that take longest, longest first (seconds measured serially on the 2-core VM,
# docs/testing.md "Where the suite's time goes"). `make test` runs the suite on two pytest-xdist workers,
# one module at a time each (--dist loadfile), in collection order: started first, the long modules
# run beside each other and the short ones fill in at the end, instead of one long module running
# alone after the rest are done.
LONGEST_FIRST = ("test_cluster_faults", "test_features_train", "test_rehearsal_quick", "test_user_cluster",
                 "test_train_stage", "test_storage_faults", "test_all", "test_cache_stage", "test_docs_commands")


def pytest_collection_modifyitems(config, items):
    """Reorder the collected tests: the modules of :data:`LONGEST_FIRST` in its order, then the other
    integration modules, then the unit tests (each module's tests keep their order)."""
    def rank(item) -> tuple[int, int]:
        module = item.path.stem
        if module in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(module)
        return (1 if "integration" in item.path.parts else 2), 0

    items.sort(key=rank)  # stable: the collection order within a rank


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "shared: reads ../shared (the team's reference material, absent from a user's clone); "
                   "skipped when ../shared is missing")


@pytest.fixture(scope="session")
def input_cases() -> Path:
    """The project's own chat input cases (``tests/fixtures/cases``; see its README.md)."""
    if not (CASES / "chats").is_dir():
        pytest.fail(f"input cases not found at {CASES}: the repository checkout is incomplete")
    return CASES


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the repository; skips the test when it is absent (a user's clone)."""
    if not SHARED.is_dir():
        pytest.skip(f"needs ../shared ({SHARED}), absent from a user's clone: the project's own "
                    "fixtures under tests/fixtures cover the behaviour")
    return SHARED


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 behind a fault-injecting proxy (``tests/support/faultproxy.py``, no
    faults unless a test sets them); yields ``{"endpoint": proxy url, "bucket": name, "proxy":
    FaultProxy}``.

    Sets AWS_ENDPOINT_URL (the proxy) / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION
    for the session so that s3fs, boto3, Ray workers and child processes find it with no extra options.
    """
    from faultproxy import FaultProxy

    port = free_port()
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    proxy = FaultProxy(f"http://127.0.0.1:{port}")
    endpoint = proxy.endpoint
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.2)
        import boto3

        bucket = "dspark-test"
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield {"endpoint": endpoint, "bucket": bucket, "proxy": proxy}
    finally:
        proxy.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_url(s3_server) -> str:
    """A fresh, empty ``s3://bucket/prefix`` for one test."""
    return f"s3://{s3_server['bucket']}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_qwen3():
    """A random-weight Qwen3ForCausalLM (4 layers, hidden 64, vocab 512), fp32, eval mode."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    return model


@pytest.fixture(scope="session")
def ray_local(s3_server):
    """One local Ray instance for the whole test session (``ray.init`` costs seconds).

    Started after the S3 server so that its workers inherit the AWS_* environment, as the workers
    of a real cluster node inherit that node's credentials.
    """
    import ray

    tmp = Path("/tmp") / f"rt{os.getpid()}"
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp), log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokenizer (vocab 512, ChatML template) trained on a few stdlib modules."""
    import sysconfig

    from pipeline.embedded.tokenizer import build_tokenizer

    src = Path(sysconfig.get_paths()["stdlib"]) / "json"
    texts = [p.read_text() for p in sorted(src.glob("*.py"))]
    return build_tokenizer(texts * 2 + ["word " * 50], vocab_size=512)


@pytest.fixture(scope="session")
def local_target(tmp_path_factory, tiny_qwen3) -> str:
    """A target folder holding only the tiny Qwen3's config.json: enough for dry runs (layer ids are
    checked on it), not for a forward pass."""
    d = tmp_path_factory.mktemp("config_only_target")
    tiny_qwen3.config.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_qwen3, tiny_tokenizer) -> str:
    """A local target folder (random tiny Qwen3 + tokenizer), loadable with local_files_only."""
    d = tmp_path_factory.mktemp("tiny_target")
    tiny_qwen3.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return str(d)


def _small_bpe(corpus: list[str], added: list[tuple[str, bool]], template: str, **special):
    """A byte-level BPE (Qwen's pre-tokenizer split, ~400 tokens) trained on ``corpus``, with
    ``added`` tokens ``(text, special)`` in order and ``template`` as its chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.embedded.tokenizer import QWEN_SPLIT_PATTERN

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
        show_progress=False))
    for text, is_special in added:
        t = AddedToken(text, special=is_special, normalized=False)
        (tok.add_special_tokens if is_special else tok.add_tokens)([t])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, clean_up_tokenization_spaces=False,
                                   **special)


_CORPUS = ["What is 2 + 3? Two plus three is five. The last answer was 5, and 5 times 4 is 20. " * 3,
           "Name a prime above 10. 11 has no divisor but 1 and itself. Is 9 prime? No, it is not. " * 3,
           "assistant user system think step by step\n\n" * 3]


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """A small tokenizer with Qwen3-4B's real special tokens (same texts, order and ``special``
    flags: ``<think>`` is a plain added token) and its real chat template, from
    ``tests/fixtures/qwen3_4b/tokenizer_config.json`` (see the README there)."""
    import json

    conf = json.loads((REPO / "tests" / "fixtures" / "qwen3_4b" / "tokenizer_config.json").read_text())
    added = [(t["content"], t["special"]) for _, t in sorted(conf["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))]
    return _small_bpe(_CORPUS, added, conf["chat_template"], eos_token=conf["eos_token"],
                      pad_token=conf["pad_token"], extra_special_tokens=conf["additional_special_tokens"])


@pytest.fixture(scope="session")
def llama_reasoning_tokenizer():
    """A small Llama-3-style tokenizer with the reasoning-keeping template of
    ``tests/fixtures/templates/llama3_reasoning.jinja``."""
    template = (REPO / "tests" / "fixtures" / "templates" / "llama3_reasoning.jinja").read_text()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return _small_bpe(_CORPUS, [(t, True) for t in specials] + [("<think>", False), ("</think>", False)], template,
                      bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>",
                      extra_special_tokens=specials[2:4])


@pytest.fixture(scope="session")
def tok_chatml(tiny_tokenizer):
    """The embedded target's tokenizer (ChatML template without reasoning handling)."""
    return tiny_tokenizer


@pytest.fixture(scope="session")
def cache_samples_of(tiny_qwen3):
    """``make(layer_ids, seed)``: two cache samples (T = 40, 30) of ``tiny_qwen3`` per the cache contract: bf16
    features of ``layer_ids``, the final hidden state where the next token is supervised (from position 6
    and 12), random token ids drawn with ``seed``."""
    import torch

    def make(layer_ids, seed):
        out = []
        g = torch.Generator().manual_seed(seed)
        for T, sup_from in ((40, 6), (30, 12)):
            ids = torch.randint(0, 500, (T,), generator=g)
            with torch.no_grad():
                hs = tiny_qwen3(ids[None], output_hidden_states=True).hidden_states
            lm = torch.zeros(T, dtype=torch.uint8)
            lm[sup_from:] = 1
            out.append(dict(input_ids=ids.int(), loss_mask=lm,
                            features=torch.cat([hs[i + 1][0] for i in layer_ids], -1).bfloat16(),
                            last_hidden=hs[-1][0][:-1][lm[1:].bool()].bfloat16(), sample_id=f"s-{T}"))
        return out
    return make


@pytest.fixture(scope="session")
def drafter_samples(cache_samples_of):
    """Two cache samples of ``tiny_qwen3`` with the features of layers 0 and 2 (:func:`cache_samples_of`)."""
    return cache_samples_of((0, 2), 0)


@pytest.fixture(scope="module")
def rehearsal():
    """``bench/rehearsal.py`` loaded as the module ``rehearsal`` (tests/unit/bench/test_rehearsal.py,
    tests/integration/test_rehearsal_quick.py)."""
    spec = importlib.util.spec_from_file_location("rehearsal", REPO / "bench" / "rehearsal.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["rehearsal"] = module
    spec.loader.exec_module(module)
    return module
