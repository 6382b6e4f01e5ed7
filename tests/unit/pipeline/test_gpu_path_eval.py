"""GPU-path fixes of calibrate and evaluate (issue #35, findings 3 and 4), held in place on the CPU.

- the block-level evaluation builds its [blocks, gamma, V] distributions ``chunk_blocks`` blocks at a
  time: the same outcomes as the pre-#35 unchunked code (``bench/bench_eval_memory.py`` keeps it
  verbatim), a peak memory bounded by the chunk;
- the drafter for evaluation holds a tied ``lm_head`` once, in the model's dtype, on its device;
- the decoding loop's prefill keeps only the last position's logits, and samples from generators on
  the target's device;
- calibrate and evaluate run in a Ray task that asks for the configured GPUs.

There is no second device here: the ``meta`` device stands in for CUDA where a move is checked, and a
recording stand-in for ``torch.Generator`` / ``ray.remote`` where the real one needs hardware."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from paths import REPO

pytestmark = pytest.mark.gpu_path

_spec = importlib.util.spec_from_file_location("bench_eval_memory",
                                               REPO / "bench" / "bench_eval_memory.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

V_SMALL = 3000
DRAFTERS = {  # name -> bench.random_drafter keywords: Markov + confidence, DFlash (no head), control, reduced vocab
    "dspark": dict(block_size=5),
    "dflash": dict(block_size=4, markov_rank=0, confidence_head=False),
    "control": dict(block_size=5, head_type="control"),
    "reduced": dict(block_size=5, draft_vocab_size=700),
}


def _drafters(vocab: int, names=DRAFTERS) -> dict:
    return {n: bench.random_drafter(vocab, seed=i, **DRAFTERS[n]) for i, n in enumerate(names)}


def _assert_same(old_tally, new_tally, old_rec, new_rec):
    assert old_tally.keys() == new_tally.keys() and len(old_tally.keys()) == 2 * len(DRAFTERS)
    for name, T in old_tally.keys():
        for f in ("tau", "reached", "accepted"):  # the outcomes: exactly equal
            assert torch.equal(old_tally.values(name, T, f), new_tally.values(name, T, f)), (name, T, f)
        for f in ("tau_expected", "target_entropy"):  # float statistics: BLAS may round differently by row count
            torch.testing.assert_close(new_tally.values(name, T, f), old_tally.values(name, T, f), rtol=1e-5, atol=1e-5)
    assert old_rec.keys() == new_rec.keys() == {(n, T) for n in ("dspark", "control", "reduced") for T in (0.0, 1.0)}
    for key, rec in old_rec.items():
        for f in ("accepted", "verified", "group", "z"):
            assert torch.equal(torch.cat(rec[f]), torch.cat(new_rec[key][f])), (key, f)
        torch.testing.assert_close(torch.cat(new_rec[key]["max_q"]), torch.cat(rec["max_q"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_blocks", [4, 10_000])
def test_chunked_block_evaluation_gives_the_unchunked_outcomes(chunk_blocks):
    """Every drafter kind (Markov + confidence head, DFlash, control, reduced draft vocabulary) at
    T = 0 and 1 over two batches: the same taus, per-slot counts and records as the pre-#35 code
    (teacher-forced, as that code was; the sequential drafting is compared in
    tests/unit/training/test_block_eval.py)."""
    from training.block_runner import evaluate_blocks

    drafters = _drafters(V_SMALL)
    batches = [bench.random_samples(V_SMALL, lengths=(40, 31), seed=0), bench.random_samples(V_SMALL, lengths=(36,), seed=1)]
    kw = dict(temperatures=[0.0, 1.0], num_anchors=9, seed=5)
    old_rec, new_rec = {}, {}
    old = bench.legacy_evaluate_blocks(drafters, batches, records=old_rec, **kw)
    new = evaluate_blocks(drafters, batches, records=new_rec, chunk_blocks=chunk_blocks, sequential=False, **kw)
    _assert_same(old, new, old_rec, new_rec)
    tau = new.values("dspark", 1.0, "tau")
    assert tau.numel() == 27 and 1.2 < float(tau.mean()) < 6  # non-trivial outcomes: blocks accept drafts


_PEAK_SCRIPT = """
import importlib.util, sys
sys.path.insert(0, {root!r})
spec = importlib.util.spec_from_file_location("b", {bench!r}); b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
from training.block_runner import evaluate_blocks
vocab, blocks = 50_000, {blocks}
drafters = {{"dspark": b.random_drafter(vocab)}}
samples = b.random_samples(vocab, lengths={lengths})
tally, peak, _ = b.peak_rss(evaluate_blocks, drafters, [samples], temperatures=[0.0, 1.0],
                            num_anchors=blocks // 2, seed=3, records={{}}, chunk_blocks=4)
print(tally.values("dspark", 1.0, "tau").numel(), peak)
"""


def test_block_evaluation_peak_memory_is_bounded_by_the_chunk_not_the_batch():
    """512 blocks of gamma 7 at V = 50,000: one unchunked [blocks, gamma, V] float32 tensor is 717 MB
    and the pre-#35 code holds several; with 4 blocks per chunk the peak stays under an eighth of one
    (measured 45 MiB). The resident-set high-water mark is per process, so it is read in a fresh
    interpreter: in the suite's own process, threads left by earlier tests (Ray's among them)
    allocate during the call and land in the same mark."""
    import subprocess
    import sys

    root = REPO
    vocab, blocks = 50_000, 512
    script = _PEAK_SCRIPT.format(root=str(root), bench=str(root / "bench" / "bench_eval_memory.py"),
                                 blocks=blocks, lengths=(300, 300))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    evaluated, peak = out.stdout.split()[-2:]
    one_dense = blocks * 7 * vocab * 4 / 2 ** 20
    assert int(evaluated) == blocks
    assert float(peak) < one_dense / 8, f"peak {float(peak):.0f} MiB, one dense [blocks, gamma, V] tensor {one_dense:.0f} MiB"


def test_eval_drafter_holds_a_tied_lm_head_once_in_the_models_dtype_on_its_device():
    from training.block_runner import eval_drafter

    for kind, kw in (("full", {}), ("reduced", {"draft_vocab_size": 700})):
        model = bench.random_drafter(V_SMALL, **kw)
        head = model.target_lm_head_weight
        assert head is not model.embed_tokens.weight and torch.equal(head, model.embed_tokens.weight)
        rope = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
        out = eval_drafter(model, "cpu", torch.bfloat16)
        # the RoPE frequencies stay float32, as the bf16 engine trained them and vLLM serves them
        assert rope and all(torch.equal(model.get_buffer(n), b) for n, b in rope.items()), kind
        assert out is model and not model.training
        assert model.target_lm_head_weight is model.embed_tokens.weight, kind  # one copy, not two
        assert model.embed_tokens.weight.dtype == model.fc.weight.dtype == torch.bfloat16
        sizes = {p.data_ptr() for p in model.parameters() if p.shape == (V_SMALL, 64)}
        assert len(sizes) == 1, kind
        eval_drafter(model, torch.device("meta"))
        assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
    untied = bench.random_drafter(V_SMALL)
    with torch.no_grad():
        untied.lm_head.weight[0, 0] += 1
    eval_drafter(untied, "cpu")
    assert untied.lm_head.weight is not untied.embed_tokens.weight  # different values are kept apart


def test_block_level_draft_logits_of_a_bf16_drafter_sum_their_terms_in_float32():
    """The block-level q adds the Markov bias to the backbone's logits in float32, as training
    (``losses._draft_logits``) and the decoding loop (``heads.sample_sequential``) do: a bf16 sum
    would round once more (up to 0.06 of a logit at |z| ~ 20) and tie more argmaxes at T = 0."""
    from types import SimpleNamespace

    import training.block_runner as br

    model = br.eval_drafter(bench.random_drafter(V_SMALL), "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    slots = SimpleNamespace(hidden=(torch.randn(5, 64, generator=g) * 30).bfloat16(),
                            bias_features=(torch.randn(5, 8, generator=g) * 30).bfloat16(),
                            target_hidden=torch.randn(5, 64, generator=g).bfloat16())
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_(0, 1, generator=g)
    q, _ = br.slot_logits(model, slots, torch.arange(5))
    want = (slots.hidden @ model.lm_head.weight.t()).float() + (slots.bias_features @ model.markov_head.markov_w2.weight.t()).float()
    assert q.dtype == torch.float32 and torch.equal(q, want)


def test_block_evaluation_runs_a_bf16_drafter_without_a_float32_lm_head_copy(monkeypatch):
    """A bf16 drafter: the target logits upcast the lm_head a vocabulary chunk at a time (exact:
    bf16 products are exact in float32), and the outcomes match the float32 drafter's closely."""
    import training.block_runner as br

    x = torch.randn(6, 64).bfloat16()
    w = torch.randn(V_SMALL, 64).bfloat16()
    monkeypatch.setattr(br, "TARGET_VOCAB_CHUNK", 1024)
    got = br._fp32_logits(x, w, torch.empty(6, V_SMALL))
    torch.testing.assert_close(got, x.float() @ w.float().t(), rtol=1e-6, atol=1e-5)
    samples = bench.random_samples(V_SMALL, lengths=(40,))
    f32 = br.evaluate_blocks({"d": bench.random_drafter(V_SMALL)}, [samples], temperatures=[0.0], num_anchors=12)
    bf16 = br.evaluate_blocks({"d": br.eval_drafter(bench.random_drafter(V_SMALL), "cpu", torch.bfloat16)}, [samples],
                              temperatures=[0.0], num_anchors=12)
    a, b = f32.values("d", 0.0, "tau"), bf16.values("d", 0.0, "tau")
    assert a.numel() == b.numel() == 12 and float((a == b).double().mean()) >= 0.75


def test_block_slots_hands_the_batch_and_blocks_to_the_drafters_device():
    from training.block_runner import block_slots
    from training.blocks import collate_samples, sample_anchors

    model = bench.random_drafter(V_SMALL).to("meta")
    seen = {}

    def forward(batch, blocks):
        seen.update({f"{k}": v.device.type for k, v in vars(batch).items() if torch.is_tensor(v)})
        seen.update({f"blocks.{k}": v.device.type for k, v in vars(blocks).items() if torch.is_tensor(v)})
        return "slots"

    model.forward = forward
    batch = collate_samples(bench.random_samples(V_SMALL, lengths=(40,)))
    anchors, keep = sample_anchors(batch.loss_mask, 4, torch.Generator().manual_seed(0))  # CPU: same anchors anywhere
    assert block_slots(model, batch, anchors, keep) == "slots"
    assert len(seen) >= 10 and set(seen.values()) == {"meta"}, seen


def test_prefill_keeps_only_the_last_logits_and_decodes_the_same_tokens(tiny_qwen3, monkeypatch):
    """The prompt's prefill asks the model for the last position's logits only (``logits_to_keep=1``:
    [1, V], not [prompt, V]); the tokens out are those of the full-logits prefill."""
    from pipeline.config import DrafterSpec, RunConfig, SequentialHead
    from pipeline.drafters import drafter_config
    from pipeline.inference import speculate
    from pipeline.target_model.prefill import LayerTap
    from training.drafter import Drafter

    cfg = RunConfig()
    spec = DrafterSpec(num_layers=1, block_size=4, mask_token_id=5, head=SequentialHead.markov, markov_rank=8)
    torch.manual_seed(1)
    drafter = Drafter(drafter_config(spec, cfg), tiny_qwen3.config, tiny_qwen3.model.embed_tokens.weight,
                      tiny_qwen3.lm_head.weight).eval()
    tap = LayerTap(tiny_qwen3, cfg.target.target_layer_ids)
    prompt = [7, 8, 9, 10, 300, 41, 12, 99, 4]
    kw = dict(max_new_tokens=24, temperature=1.0, stop_ids=set())

    def decode():
        return (speculate.plain_decode(tiny_qwen3, prompt, generator=torch.Generator().manual_seed(0), **kw).tokens,
                speculate.speculative_decode(tiny_qwen3, drafter, prompt, tap=tap,
                                             generator=torch.Generator().manual_seed(0), **kw).tokens)

    shapes = []
    real = speculate.Target.forward

    def recording(self, ids, *a, **k):
        logits, feats = real(self, ids, *a, **k)
        shapes.append((len(ids), tuple(logits.shape)))
        return logits, feats

    monkeypatch.setattr(speculate.Target, "forward", recording)
    new = decode()
    assert shapes[0] == (len(prompt), (1, 512))  # the prefill: one row of logits
    monkeypatch.setattr(speculate.Target, "forward", lambda self, ids, last_only=False: real(self, ids))
    assert decode() == new and len(new[0]) == len(new[1]) == 24


def test_decoding_samples_from_a_generator_on_the_targets_device(monkeypatch):
    from pipeline.inference import speculate
    from pipeline.stages.evaluate import _decode_all

    made = []

    class Recorder:
        def __init__(self, device=None):
            made.append(torch.device(device))

        def manual_seed(self, seed):
            made.append(seed)
            return self

    monkeypatch.setattr(speculate.torch, "Generator", Recorder)
    seen = []
    out = _decode_all(lambda prompt, generator, **kw: seen.append(generator) or speculate.Decoded(list(prompt)),
                      [("a", [1]), ("b", [2])], 7, device=torch.device("cuda", 0), temperature=0.0)
    assert made == [torch.device("cuda", 0), 7] and len(seen) == 2 and seen[0] is seen[1]
    assert {k: [d.tokens for d in v] for k, v in out.items()} == {"a": [[1]], "b": [[2]]}


def test_stage_tasks_ask_ray_for_the_configured_gpus(monkeypatch, tmp_path):
    """``calibrate.gpus`` / ``evaluate.gpus`` > 0: one Ray task with those ``num_gpus`` and ``num_cpus``
    (the remote function's options) and two retries of a lost node or worker, its result returned with
    its attempt count; 0: in the driver, no Ray at all."""
    import ray

    import pipeline.cluster
    from pipeline.config import RunConfig
    from pipeline.errors import ConfigError
    from pipeline.run import load_config
    from pipeline.stages.calibrate import run_task, task_faults, task_options

    real_remote, made, inits = ray.remote, [], []

    def remote(**options):
        def wrap(fn):
            rf = real_remote(**options)(fn)
            made.append(rf._default_options)
            return type("RF", (), {"remote": lambda self, *a: ("ref", fn(*a))})()
        return wrap

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", lambda ref: ref[1])
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "n1"})())
    monkeypatch.setattr(pipeline.cluster, "init_ray", lambda cfg: inits.append(cfg))
    cfg = RunConfig(run_dir=str(tmp_path))
    result, faults = run_task(cfg, lambda a, b: a + b, 2, 3, gpus=1, cpus=4, name="evaluate")
    assert result == 5 and faults == {"task_attempts": 1, "nodes": 1, "retry_seconds": 0}
    assert len(list((tmp_path / "evaluate" / "attempts").rglob("*.json"))) == 1
    assert made[0]["num_gpus"] == 1 and made[0]["num_cpus"] == 4 and made[0]["max_retries"] == 2 and inits == [cfg.ray]
    assert run_task(cfg, lambda a: a * 2, 21, gpus=0, cpus=1, name="calibrate") == (42, None) and len(made) == 1
    with pytest.raises(ConfigError, match="evaluate.gpus"):
        task_options(-1, 1, "evaluate")
    assert task_faults([{"started_at": 10.0, "node": "a"}, {"started_at": 31.5, "node": "b"}]) == \
        {"task_attempts": 2, "nodes": 2, "retry_seconds": 21.5}
    real = load_config(str(REPO / "conf" / "qwen3_4b.yaml"), [])
    assert real.calibrate.gpus == real.evaluate.gpus == 1
    assert RunConfig().calibrate.gpus == RunConfig().evaluate.gpus == 0  # CPU configs run in the driver, as before


def test_the_target_gets_its_kv_cache_under_the_keyword_its_forward_takes(tiny_qwen3):
    """transformers 5.20 (the GPU set) takes the KV cache as ``past_key_values``, 5.24 (the CPU set) as
    ``cache``; under the other name the model ignores it and builds its own, so the caller's stays
    empty (``profile_sps``'s ``cache.crop`` then raised on the GPU set). The SPS profile and the
    decoding loop's target both pass it under the name ``forward`` takes."""
    from pipeline.inference.sps import profile_sps
    from pipeline.inference.speculate import Target, cache_keyword

    class GpuSetSignature(torch.nn.Module):  # transformers 5.20's keyword, over the tiny target
        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, model.config

        @property
        def device(self):
            return self.model.device

        def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
            return self.model(input_ids=input_ids, cache=past_key_values, use_cache=use_cache,
                              logits_to_keep=logits_to_keep)

    old = GpuSetSignature(tiny_qwen3)
    assert cache_keyword(old) == "past_key_values" and cache_keyword(tiny_qwen3) == "cache"
    curve = profile_sps(old, (1, 4), context=16, repeats=1)
    assert list(curve.batch_tokens) == [1, 4] and (curve.steps_per_s > 0).all()
    target = Target(old)
    target.forward([1, 2, 3])
    assert target.cache.get_seq_length() == 3
