"""The embedded default target and data: tokenizer, chat template, stdlib chats, build and cache."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import threading
import time
from pathlib import Path

import jinja2
import pytest
import torch

from pipeline.embedded import build as build_mod
from pipeline.embedded.build import (BuildSpec, EmbeddedSpecMismatch, build_embedded,
                                     ensure_embedded, resolve_embedded)
from pipeline.embedded.stdlib_chats import (StdlibModule, build_stdlib_chats, extract_chats,
                                            is_heldout, module_name, read_stdlib)
from pipeline.embedded.target import (TargetSpec, chat_eval_batch, evaluate, new_model,
                                      pack_windows, train)
from pipeline.embedded.tokenizer import SPECIAL_TOKENS, build_tokenizer

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Box:\n    def get(self, key):\n        return self.items[key]\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog. 0123456789 assistant user system\n",
] * 20


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, vocab_size=320)


def test_special_tokens_are_single_low_ids(tok):
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == [0, 1, 2, 3, 4, 5]
    assert len(tok) == 320
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|endoftext|>", "<|im_end|>", None)
    assert tok.convert_tokens_to_ids("<|mask|>") < len(tok)
    for special, i in zip(SPECIAL_TOKENS, ids):
        assert tok(f"x{special}y", add_special_tokens=False)["input_ids"][1:-1] == [i]


def test_tokenizer_is_deterministic_and_round_trips(tok):
    again = build_tokenizer(CORPUS, vocab_size=320)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    text = "    def f(x):\n\treturn x  # café ✓\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    with pytest.raises(ValueError, match="at least 262"):
        build_tokenizer(CORPUS, vocab_size=100)


def test_chat_template_renders_chatml_exactly(tok):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 3 and ids[0] == 1 and ids[-2] == 2
    with pytest.raises(jinja2.TemplateError, match="unsupported chat role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_generation_prompt_and_enable_thinking(tok):
    chat = [{"role": "user", "content": "Hi"}]
    base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == base
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=True) == base
    off = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert off == base + "<think>\n\n</think>\n\n"
    ids = tok(off, add_special_tokens=False)["input_ids"]
    assert ids.count(3) == 1 and ids.count(4) == 1
    assert tok.decode(ids[ids.index(3):]) == "<think>\n\n</think>\n\n"


def test_literal_special_text_is_not_special_when_split(tok):
    text = "print('<|im_end|>')"
    plain = tok(text, add_special_tokens=False)["input_ids"]
    split = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert 2 in plain
    assert not set(split) & set(range(6))
    assert tok.decode(split) == text


SOURCE = '''\
"""Module doc."""


def add(a, b=1):
    """Add two numbers.

    Returns a + b.
    """
    # plain sum
    return a + b


def undocumented(x):
    return x


class Box:
    """A box."""

    def get(self, key,
            default=None):
        """Return the item."""
        if key in self.items:
            text = """
x"""
            return self.items[key]
        return default

    def only_doc(self):
        """Nothing else."""

    def inline(self): "doc"; return 1
'''


def test_extract_chats_exact_prompt_and_answer():
    rows = extract_chats(SOURCE, "pkg.mod")
    assert [r["id"] for r in rows] == ["pkg.mod:add:4", "pkg.mod:Box.get:20"]
    add, get = (r["messages"] for r in rows)
    assert add == [
        {"role": "user", "content": 'In module `pkg.mod`, write the function:\n```python\n'
                                    'def add(a, b=1):\n    """Add two numbers.\n\n'
                                    '    Returns a + b.\n    """\n```'},
        {"role": "assistant", "content": "# plain sum\nreturn a + b"}]
    assert get[0]["content"] == ('In module `pkg.mod`, class `Box`, write the method:\n```python\n'
                                 'def get(self, key,\n        default=None):\n'
                                 '    """Return the item."""\n```')
    assert get[1]["content"] == ('if key in self.items:\n    text = """\nx"""\n'
                                 '    return self.items[key]\nreturn default')
    assert [r["id"] for r in extract_chats(SOURCE, "m", max_body_lines=2)] == ["m:add:4"]
    assert [r["id"] for r in extract_chats(SOURCE, "m", max_body_chars=20)] == []
    assert extract_chats("def broken(:\n", "m") == []
    form_feed = extract_chats('def f():\n    """D."""\n    # a\x0cb\n    return 1\n', "m")
    assert form_feed[0]["messages"][1]["content"] == "# a\x0cb\nreturn 1"


@pytest.mark.parametrize("path, name", [
    ("json/decoder.py", "json.decoder"), ("json/__init__.py", "json"), ("os.py", "os"),
    ("test/test_os.py", None), ("idlelib/idle_test/htest.py", None),
    ("lib2to3/tests/data/bom.py", None), ("site-packages/pip/x.py", None),
    ("encodings/cp1252.py", None), ("_sysconfigdata__linux_x86_64-linux-gnu.py", None),
    ("config-3.11-x86_64-linux-gnu/python-config.py", None)])
def test_module_name(path, name):
    assert module_name(Path(path)) == name


def test_split_is_by_module_deterministic_and_capped(tmp_path):
    # Stable hash: these memberships must never change (they define every cached build's split).
    assert [is_heldout(m) for m in ("json", "json.decoder", "inspect", "os")] == [
        True, False, True, False]
    with pytest.raises(ValueError, match="must be in"):
        is_heldout("json", 0.0)
    modules = [StdlibModule(f"pkg{i}.mod", f'def f{i}(x):\n    """Doc {i}."""\n    return x\n\n'
                                           f'def g{i}(y):\n    """Doc."""\n    return -y\n')
               for i in range(60)]
    counts = build_stdlib_chats(tmp_path / "a", modules, heldout_fraction=0.2, max_train=1000)
    train = [json.loads(x) for x in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (tmp_path / "a" / "heldout.jsonl").read_text().splitlines()]
    train_mods = {r["id"].split(":")[0] for r in train}
    held_mods = {r["id"].split(":")[0] for r in held}
    assert not train_mods & held_mods
    assert held_mods == {m.name for m in modules if is_heldout(m.name, 0.2)}
    assert counts == {"train_modules": len(train_mods), "heldout_modules": len(held_mods),
                      "train": 2 * len(train_mods), "heldout": 2 * len(held_mods)}
    assert 0 < len(held_mods) < 30
    ids = [r["id"] for r in train]
    assert ids == sorted(ids, key=lambda i: hashlib.sha256(i.encode()).digest())
    build_stdlib_chats(tmp_path / "b", modules, heldout_fraction=0.2, max_train=5)
    capped = (tmp_path / "b" / "train.jsonl").read_text().splitlines()
    assert capped == (tmp_path / "a" / "train.jsonl").read_text().splitlines()[:5]


def test_real_stdlib_is_read_and_split():
    modules = read_stdlib()
    names = [m.name for m in modules]
    assert names == sorted(names) and "json.decoder" in names and "os" in names
    assert not [n for n in names if n.startswith(("test.", "encodings")) or ".tests" in n]
    assert len(modules) > 300


def test_pack_windows_and_evaluate_masks(tok, tiny_qwen3):
    windows = pack_windows(["ab", "cd"], tok, seq_len=2)
    flat = tok("ab", add_special_tokens=False)["input_ids"] + [0]
    flat += tok("cd", add_special_tokens=False)["input_ids"] + [0]
    assert windows.tolist() == [flat[i:i + 2] for i in range(0, len(flat) // 2 * 2, 2)]
    rows = [{"messages": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "return a + b"}]}]
    ids, labels = chat_eval_batch(tok, rows)
    kept = [t for t in labels[0].tolist() if t != -100]
    assert kept == tok("return a + b<|im_end|>", add_special_tokens=False)["input_ids"]
    result = evaluate(tiny_qwen3, ids, labels)
    assert result["tokens"] == len(kept)
    logits = tiny_qwen3(input_ids=ids).logits[0, :-1]
    keep = labels[0, 1:] != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], labels[0, 1:][keep]).item()
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


def test_train_draws_seeded_batches_and_learns(tok):
    spec = TargetSpec(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=32,
                      intermediate_size=32, seq_len=8, batch_size=2, steps=6, warmup_steps=1,
                      lr=1e-2)
    windows = torch.arange(6 * 8).view(6, 8) % 40 + 6
    seen, losses, models = [], [], []
    for _ in range(2):
        model = new_model(spec, tok)
        batches = []
        model.register_forward_pre_hook(lambda m, a, kw: batches.append(kw["input_ids"].clone()),
                                        with_kwargs=True)
        stats = train(model, windows, spec, on_step=lambda step, loss: losses.append(loss))
        seen.append(torch.stack(batches))
        models.append(model)
    assert seen[0].shape == (6, 2, 8)
    assert torch.equal(seen[0], seen[1])  # same seed, same batches
    # Each epoch (3 steps of 2 rows) visits all 6 windows once.
    assert sorted(seen[0][:3].reshape(6, 8).tolist()) == sorted(windows.tolist())
    assert losses[5] < losses[0] and stats["final_loss"] == pytest.approx(sum(losses[6:]) / 6)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="smaller batch_size"):
        train(models[0], windows[:1], spec)


FOLDER = f"embedded-v1-py{sys.version_info.major}.{sys.version_info.minor}"
QUICK = BuildSpec(vocab_size=400, max_train_chats=60, max_heldout_chats=20, module_stride=12,
                  target=TargetSpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                    head_dim=16, intermediate_size=64, seq_len=64, batch_size=8,
                                    steps=40, lr=1e-2, warmup_steps=5, eval_tokens=4096))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A quick embedded build (seconds): returns (home, EmbeddedPaths)."""
    home = tmp_path_factory.mktemp("dspark")
    return home, ensure_embedded(home, QUICK)


def test_quick_build_is_loadable(quick):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    home, paths = quick
    assert paths.home == (home / FOLDER).resolve()
    model = AutoModelForCausalLM.from_pretrained(paths.target_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(paths.target_dir, local_files_only=True)
    config = json.loads((paths.target_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"].startswith("{%- for message in messages %}")
    assert (paths.target_dir / "model.safetensors").is_file()
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tokenizer) == 400
    assert model.config.eos_token_id == tokenizer.eos_token_id == 2
    assert tokenizer.convert_tokens_to_ids("<|mask|>") == 5
    metrics = json.loads(paths.metrics.read_text())
    assert metrics["steps"] == 40 and metrics["params"] == model.num_parameters()
    for key in ("heldout_source", "heldout_chat", "heldout_chat_no_think"):
        assert metrics[key]["tokens"] > 0 and 0.0 <= metrics[key]["top1"] <= 1.0
        assert metrics[key]["loss"] < math.log(400)  # trained: better than uniform
    train = [json.loads(x) for x in paths.train_chats.read_text().splitlines()]
    held = [json.loads(x) for x in paths.heldout_chats.read_text().splitlines()]
    assert len(train) == 60 and 0 < len(held) <= 20
    assert not {r["id"].split(":")[0] for r in train} & {r["id"].split(":")[0] for r in held}
    prompt = tokenizer.apply_chat_template(held[0]["messages"][:1], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_quick_build_is_reused_and_guarded(quick):
    home, paths = quick
    mtime = paths.metrics.stat().st_mtime_ns
    start = time.perf_counter()
    assert ensure_embedded(home, QUICK) == paths
    assert time.perf_counter() - start < 1.0 and paths.metrics.stat().st_mtime_ns == mtime
    with pytest.raises(EmbeddedSpecMismatch, match="vocab_size.*delete that folder"):
        ensure_embedded(home, dataclasses.replace(QUICK, vocab_size=512))
    assert resolve_embedded("embedded:tiny", home, QUICK) == str(paths.target_dir)
    assert resolve_embedded("embedded:stdlib/train.jsonl", home, QUICK) == str(paths.train_chats)
    assert resolve_embedded("embedded:stdlib/heldout.jsonl", home, QUICK) == str(
        paths.heldout_chats)


def test_quick_build_is_reproducible(quick, tmp_path):
    _, paths = quick
    build_embedded(tmp_path, QUICK)
    for rel in ("stdlib/train.jsonl", "stdlib/heldout.jsonl", "target/tokenizer.json",
                "target/tokenizer_config.json", "target/model.safetensors"):
        assert (tmp_path / rel).read_bytes() == (paths.home / rel).read_bytes(), rel


def test_cli_prints_metrics(quick, monkeypatch, capsys):
    from pipeline.embedded import __main__ as cli

    home, paths = quick
    monkeypatch.setattr(cli, "ensure_embedded", lambda home, progress, train_target: paths)
    cli.main(["--home", str(home)])
    out = capsys.readouterr().out
    metrics = json.loads(paths.metrics.read_text())
    source = metrics["heldout_source"]
    assert f"loss {source['loss']:.3f} nats/token, top-1 {source['top1']:.1%}" in out
    assert str(paths.train_chats) in out and "60 rows" in out


def test_resolve_rejects_unknown_url(tmp_path):
    with pytest.raises(ValueError, match="embedded:tiny"):
        resolve_embedded("embedded:huge", tmp_path)


def test_concurrent_callers_build_once_and_failures_leave_nothing(tmp_path, monkeypatch):
    calls = []

    def fake_build(out_dir, spec, progress=False, train_target=False):
        calls.append(out_dir)
        time.sleep(0.3)
        (out_dir / "target").mkdir(parents=True)
        return {}

    monkeypatch.setattr(build_mod, "build_embedded", fake_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_embedded(tmp_path, QUICK)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [FOLDER, f"{FOLDER}.lock"]

    def failing_build(out_dir, spec, progress=False, train_target=False):
        (out_dir / "partial").mkdir(parents=True)
        raise OSError("disk full")

    other = tmp_path / "other"
    monkeypatch.setattr(build_mod, "build_embedded", failing_build)
    with pytest.raises(OSError, match="disk full"):
        ensure_embedded(other, QUICK)
    assert [p.name for p in other.iterdir()] == [f"{FOLDER}.lock"]


def test_default_build_copies_the_shipped_target(tmp_path):
    """The default spec's first use builds only the chats and copies the shipped target, whose
    recorded figures beat the 1 M-param reference (3.9 nats / 25% top-1) and which still predicts
    held-out answers as recorded (loss of 16 held-out chats within 0.3 nats of the full set's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    paths = ensure_embedded(tmp_path)
    seconds = time.perf_counter() - t0
    metrics = json.loads(paths.metrics.read_text())
    assert metrics["target"] == "shipped" and seconds < 120, seconds
    assert metrics["heldout_source"]["loss"] < 3.9 and metrics["heldout_source"]["top1"] > 0.25
    assert metrics["chats"]["train"] == 4000 and metrics["chats"]["heldout"] == 400
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (paths.target_dir / name).read_bytes() == (build_mod.SHIPPED_TARGET / name).read_bytes(), name
    assert not (paths.target_dir / "spec.json").exists()
    assert json.loads((build_mod.SHIPPED_TARGET / "spec.json").read_text()) == dataclasses.asdict(BuildSpec())
    model = AutoModelForCausalLM.from_pretrained(paths.target_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(paths.target_dir, local_files_only=True)
    rows = [json.loads(line) for line in paths.heldout_chats.read_text().splitlines()[:16]]
    loss = evaluate(model, *chat_eval_batch(tokenizer, rows))["loss"]
    assert abs(loss - metrics["heldout_chat"]["loss"]) < 0.3, (loss, metrics["heldout_chat"])
