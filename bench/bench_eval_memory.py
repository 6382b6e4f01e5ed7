"""Peak memory and time of the block-level evaluation, before and after issue #35 (finding 4).

Before: :func:`legacy_evaluate_blocks` (the pre-#35 ``training.block_runner``, kept here verbatim as
the reference) builds the unchunked ``[M, V]`` logits and dense float32 ``q`` and ``p`` of
``[blocks, gamma, V]``. After: :func:`training.block_runner.evaluate_blocks` builds them
``chunk_blocks`` blocks at a time. Both run on the same random drafter (hidden 64, one layer,
block size 7, Markov and confidence heads) over the real vocabulary (V = 151,936 by default) and the
same random cache samples, on the CPU; the peak is the process's resident-set high-water mark
above its resident set at the start of the call (``/proc/self/clear_refs`` resets it; Linux).

Run: ``.venv/bin/python bench/bench_eval_memory.py [--vocab 151936] [--blocks 16 64] [--chunk 16]``
"""
from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.block_eval import PairedTally, block_uniforms, speculative_outcomes  # noqa: E402
from training.blocks import build_blocks, collate_samples, sample_anchors  # noqa: E402

LAYER_IDS = (0, 2)


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def peak_rss(fn, *args, **kwargs):
    """``(fn(...), peak MiB above the resident set at the call, seconds)``: the resident-set
    high-water mark (``VmHWM``) is reset first by writing 5 to ``/proc/self/clear_refs`` (Linux >= 4.0).
    So that the resident set follows the live tensors, glibc's mmap threshold is fixed at 64 KiB
    (``mallopt(M_MMAP_THRESHOLD)``: a freed large block goes back to the system at once, instead of
    the threshold growing and freed blocks staying in the heap) and the heap is trimmed first.

    Raises:
        OSError: not Linux with glibc, or ``/proc/self/clear_refs`` not writable.
    """
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kb("VmRSS")
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    seconds = time.perf_counter() - t0
    return out, (_status_kb("VmHWM") - base) / 1024, seconds


def random_drafter(vocab: int, *, hidden: int = 64, block_size: int = 7, markov_rank: int = 8,
                   confidence_head: bool = True, draft_vocab_size: int | None = None, head_type: str = "markov",
                   seed: int = 0):
    """A random drafter (one layer) on a random 4-layer Qwen3 target config of ``vocab`` tokens:
    float32 ``embed_tokens`` / ``lm_head`` [vocab, hidden] (tied: the same values), eval mode."""
    from transformers import Qwen3Config

    from training.drafter import Drafter, DrafterConfig

    tc = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, hidden, generator=g) * 0.05
    d2t = None
    if draft_vocab_size is not None:
        ids = torch.randperm(vocab, generator=g)[:draft_vocab_size].sort().values
        d2t = ids - torch.arange(draft_vocab_size)
    torch.manual_seed(seed)
    cfg = DrafterConfig(target_layer_ids=LAYER_IDS, mask_token_id=vocab - 1, num_layers=1, block_size=block_size,
                        markov_rank=markov_rank, head_type=head_type, confidence_head=confidence_head,
                        draft_vocab_size=draft_vocab_size)
    model = Drafter(cfg, tc, embed.clone(), embed.clone(), d2t)
    for p in model.trainable_parameters():  # larger weights than the init: a non-trivial Markov bias
        p.data.normal_(0, 0.2, generator=g)
    return model.eval()


def random_samples(vocab: int, *, hidden: int = 64, lengths=(96, 80), supervised_from: int = 4, seed: int = 0):
    """Cache samples (``training.data.as_mapping`` fields) of random bf16 features and final hidden
    states, supervised from ``supervised_from`` on."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in lengths:
        lm = torch.zeros(T, dtype=torch.uint8)
        lm[supervised_from:] = 1
        out.append(dict(input_ids=torch.randint(0, vocab - 1, (T,), generator=g).int(), loss_mask=lm,
                        features=torch.randn(T, len(LAYER_IDS) * hidden, generator=g).bfloat16(),
                        last_hidden=(3 * torch.randn(int(lm[1:].sum()), hidden, generator=g)).bfloat16(),
                        sample_id=f"r-{T}"))
    return out


# -- the pre-#35 implementation, verbatim (the reference of the exactness tests) ---------------------------

@torch.no_grad()
def legacy_block_logits(model, batch, anchors, keep):
    cfg = model.config
    blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block_size=cfg.block_size,
                          sample_from_anchor=cfg.sample_from_anchor, mask_token_id=cfg.mask_token_id)
    slots = model(batch, blocks)
    logits = slots.hidden @ model.lm_head.weight.t()
    if slots.bias_features is not None:
        logits = logits + slots.bias_features @ model.markov_head.markov_w2.weight.t()
    V = model.target_lm_head_weight.shape[0]
    if model.draft_to_target is not None:
        full = logits.new_full((logits.shape[0], V), float("-inf"))
        logits = full.index_copy_(1, model.draft_to_target, logits)
    target = slots.target_hidden.float() @ model.target_lm_head_weight.float().t()
    n_blocks, gamma = slots.num_blocks, cfg.block_size
    q = torch.zeros(n_blocks, gamma, V)
    p = torch.zeros(n_blocks, gamma, V)
    valid = torch.zeros(n_blocks, gamma, dtype=torch.bool)
    q[slots.block, slots.slot] = logits.float()
    p[slots.block, slots.slot] = target
    valid[slots.block, slots.slot] = True
    conf = None
    if slots.confidence_logits is not None:
        conf = torch.zeros(n_blocks, gamma)
        conf[slots.block, slots.slot] = slots.confidence_logits.float()
    return q, p, valid, conf


@torch.no_grad()
def legacy_evaluate_blocks(drafters, batches, *, temperatures, num_anchors, seed=104729, tally=None, records=None):
    tally = PairedTally() if tally is None else tally
    max_gamma = max(m.config.block_size for m in drafters.values())
    for model in drafters.values():
        model.eval()
    for i, samples in enumerate(batches):
        batch = collate_samples(samples)
        anchors, keep = sample_anchors(batch.loss_mask, num_anchors, torch.Generator().manual_seed(seed + i))
        kept = keep.flatten()
        u_draw, u_accept = block_uniforms(seed, i, int(kept.sum()), max_gamma)
        for name, model in drafters.items():
            q, p, valid, conf = legacy_block_logits(model, batch, anchors, keep)
            q, p, valid = q[kept], p[kept], valid[kept]
            g = model.config.block_size
            for T in temperatures:
                out = speculative_outcomes(q, p, valid, u_draw[:, :g], u_accept[:, :g], T)
                tally.add(name, T, out)
                if records is not None and conf is not None:
                    rec = records.setdefault((name, float(T)), {k: [] for k in ("z", "max_q", "accepted",
                                                                                "verified", "group")})
                    rec["z"].append(conf[kept])
                    rec["max_q"].append(torch.softmax(q / (T if T > 0 else 1.0), dim=-1).amax(-1))
                    rec["accepted"].append(out["accepted"].cpu())
                    rec["verified"].append(valid.sum(-1))
                    rec["group"].append(torch.full((int(kept.sum()),), i, dtype=torch.long))
    return tally


def main(argv=None) -> None:
    from training.block_runner import evaluate_blocks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 64], help="blocks per batch (2 samples)")
    ap.add_argument("--chunk", type=int, default=16, help="chunk_blocks of the new path")
    ap.add_argument("--repeats", type=int, default=2, help="runs per cell; the best time and the largest peak")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    drafter = {"dspark": random_drafter(args.vocab)}
    print(f"block-level evaluation, V={args.vocab}, gamma=7, T in (0, 1), records on; CPU, 1 thread "
          "(shared machine: times are noisy)")
    print("| blocks | old peak MiB | new peak MiB | peak ratio old/new | old s | new s | time ratio old/new |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.blocks:
        samples = random_samples(args.vocab)
        kw = dict(temperatures=[0.0, 1.0], num_anchors=n // 2, seed=3)
        cells = {}
        for label, fn in (("old", lambda: legacy_evaluate_blocks(drafter, [samples], records={}, **kw)),
                          ("new", lambda: evaluate_blocks(drafter, [samples], records={}, chunk_blocks=args.chunk,
                                                          **kw))):
            runs = [peak_rss(fn) for _ in range(args.repeats)]
            cells[label] = (max(r[1] for r in runs), min(r[2] for r in runs), runs[0][0])
        old_tau = cells["old"][2].values("dspark", 1.0, "tau")
        assert torch.equal(old_tau, cells["new"][2].values("dspark", 1.0, "tau")), "old and new taus differ"
        (mo, to, _), (mn, tn, _) = cells["old"], cells["new"]
        print(f"| {old_tau.numel()} | {mo:.0f} | {mn:.0f} | {mo / mn:.1f} | {to:.2f} | {tn:.2f} | {to / tn:.2f} |")


if __name__ == "__main__":
    main()
