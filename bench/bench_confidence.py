"""Why the confidence head ranks decoding rounds worse than max-q, and what fixes it (issue #36 items 2, 3).

One trained run (``--run-dir``, e.g. conf/tiny.yaml trained into /tmp/d2-base) and one drafter. The
head is a linear layer on detached features (``confidence_grad_to_backbone=false``, the default), so
every head variant below is the same logistic model refitted here on the drafter's frozen features:
the candidates are compared on the **same decoding rounds** (paired), which a retrain per variant
could not give. Per sampling setting s (``--settings``, "T[,top_p,top_k]"):

1. head training data: teacher-forced blocks of ``--train-samples`` training-split cache samples (the
   anchors of training), per supervised slot the features ``h_k``, ``W1[x_{k-1}]``, the draft
   distribution's statistics (``logit max q``, entropy, one-hot position) and the labels ``c*`` at
   T = 1 and at s (:func:`training.losses.confidence_labels`);
2. on-policy data (``--rollout-prompts`` training prompts): the drafter's own decoding rounds at s on
   the cache's prompts, labels the realised conditional acceptance ``1[accepted >= k]`` where slot k
   was reached;
3. judged on the decoding rounds at s of ``--prompts`` held-out prompts (``data.eval_files``): even
   prompts fit every calibrator (STS, Platt for max-q), odd prompts report AUC and equal-mass ECE of
   the survival ``a_k = prod_{i<=k} c_i`` per position k (:func:`pipeline.inference.realised.metrics`).

Candidates (rows): ``trained`` (the trained head), ``calibrate refit`` (the head calibrate's on-policy
refit put in place, :mod:`training.confidence_refit`, if it adopted one), ``refit c*(T=1)`` (the same head refitted here:
the check that a refit reproduces training), ``matched c*(s)`` (temperature-matched labels),
``+stats`` (the free inputs: max q, entropy, position), ``on-policy`` (rollout labels), max-q
(Platt), and item 3: the trained head with the global temperature vLLM gets folded in, fitted on
teacher-forced ``c*`` (the old calibrate) or on realised acceptance at s of held-out cache blocks
(the new default, :func:`pipeline.stages.calibrate.realised_confidence`).

Usage: ``python bench/bench_confidence.py --run-dir /tmp/d2-base [--settings 0 0.7,0.8,20 1]``
(prints one table per setting and writes ``--out`` JSON; a few minutes on 2 cores, < 2 GiB).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.drafters import load_trained_drafter
from pipeline.inference.realised import Outcomes, fit_estimators, conditional, metrics
from pipeline.inference.speculate import device_generator, speculative_decode
from pipeline.run import load_config
from pipeline.stages.calibrate import (collect_confidence, heldout_batches, realised_confidence, select_heldout)
from pipeline.stages.evaluate import eval_prompts
from pipeline.target_model.loader import load_target, resolve_target_path
from pipeline.target_model.prefill import LayerTap
from training.blocks import collate_samples
from training.confidence_refit import fit_logistic, reached_rows
from training.losses import LossConfig, confidence_labels, position_weights
from training.spec_sampling import Sampling
from training.sts import fit_global_temperature, fit_temperatures


def parse_setting(text: str) -> Sampling:
    parts = text.split(",")
    return Sampling(float(parts[0]), float(parts[1]) if len(parts) > 1 else 1.0, int(parts[2]) if len(parts) > 2 else 0)


def slot_stats(model, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(W1[x_{k-1}], draft logits at T = 1, [logit max q, entropy])`` of slots ``h`` [..., H], ``prev`` [...]."""
    e = model.markov_head.embed(prev)
    z = h @ model.lm_head.weight.t() + model.markov_head.bias(model.markov_head.step(None, prev, h)[0])
    logp = torch.log_softmax(z.float(), -1)
    mq = logp.max(-1).values.exp().clamp(1e-6, 1 - 1e-6)
    ent = -(logp.exp() * logp).sum(-1)
    return e, z, torch.stack([torch.logit(mq), ent], -1)


def features(h, e, stats, slot, gamma: int, kind: str) -> torch.Tensor:
    """Head input: ``[h ; W1[x]]`` (kind "base") or with ``[logit max q, entropy, onehot(k)]`` ("stats")."""
    x = [h.float(), e.float()]
    if kind == "stats":
        x += [stats.float(), F.one_hot(slot, gamma).float()]
    return torch.cat(x, -1)


@torch.no_grad()
def cache_slots(model, reader, shards, n_samples: int, micro: int, seed: int, settings) -> dict:
    """Teacher-forced supervised slots of the first ``n_samples`` samples of ``shards``: features and labels."""
    from training.data import as_mapping
    import itertools

    out = {k: [] for k in ("h", "e", "stats", "slot", "labels")}
    samples = itertools.islice(reader.iter_samples(shards), n_samples)
    i = 0
    while batch := [as_mapping(s) for s in itertools.islice(samples, micro)]:
        b = collate_samples(batch)
        blocks = model.make_blocks(b, torch.Generator().manual_seed(seed + i))
        slots = model(b, blocks)
        bi, ni, ki = blocks.valid.nonzero(as_tuple=True)
        prev = blocks.prev_ids[bi, ni, ki]
        e, _, st = slot_stats(model, slots.hidden, prev)
        lab = {f"{s:g}": confidence_labels(
            slots.hidden, slots.bias_features, slots.target_hidden, lm_head=model.lm_head.weight,
            markov_w2=model.markov_head.markov_w2.weight, target_lm_head=model.target_lm_head_weight,
            draft_to_target=model.draft_to_target, sampling=s, chunk_size=512) for s in settings}
        for k, v in (("h", slots.hidden), ("e", e), ("stats", st), ("slot", slots.slot), ("labels", lab)):
            out[k].append(v)
        i += 1
    return {"h": torch.cat(out["h"]), "e": torch.cat(out["e"]), "stats": torch.cat(out["stats"]),
            "slot": torch.cat(out["slot"]), "labels": {k: torch.cat([d[k] for d in out["labels"]]) for k in out["labels"][0]}}


def decode_rounds(model, drafter, tap, prompts, setting, *, max_new_tokens: int, stop: set, seed: int) -> dict:
    """Decoding rounds at ``setting`` with the head's inputs captured per round (a spy on ``_confidence``)."""
    seen = []
    orig = drafter._confidence

    def spy(h, prev):
        seen.append((h[0].clone(), prev[0].clone()))
        return orig(h, prev)

    drafter._confidence = spy
    gen = device_generator("cpu", seed)
    rows = []
    try:
        for p, (_, ids) in enumerate(prompts):
            start = len(seen)
            d = speculative_decode(model, drafter, ids, tap=tap, max_new_tokens=max_new_tokens, temperature=setting,
                                   stop_ids=stop, generator=gen)
            for r, (h, prev) in zip(d.rounds, seen[start:]):
                rows.append((p, r, h, prev))
    finally:
        del drafter._confidence
    h = torch.stack([x[2] for x in rows])
    prev = torch.stack([x[3] for x in rows])
    with torch.no_grad():
        e, _, st = slot_stats(drafter, h, prev)
    g = h.shape[1]
    return {"h": h, "e": e, "stats": st, "slot": torch.arange(g).expand(len(rows), g),
            "z": torch.tensor([x[1].confidence_logits for x in rows], dtype=torch.float64),
            "max_q": torch.tensor([x[1].max_q for x in rows], dtype=torch.float64),
            "accepted": torch.tensor([x[1].accepted for x in rows]), "verified": torch.tensor([x[1].verified for x in rows]),
            "group": torch.tensor([x[0] for x in rows])}


def fit_scorer(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, l2: float = 1e-4):
    """The head's logistic model fitted on ``x`` (soft labels ``y``, row weights ``w``): a scorer."""
    wt, b = fit_logistic(x, y, l2, w)
    return lambda xn: xn.double() @ wt + b


def rollout_training_rows(r: dict, kind: str):
    """On-policy head data from decoding rounds (:func:`training.confidence_refit.reached_rows`)."""
    g = r["h"].shape[1]
    x = features(r["h"], r["e"], r["stats"], r["slot"], g, kind)
    x, y, _, _ = reached_rows(x, r["accepted"], r["verified"])
    return x, y


def outcomes(r: dict, z: torch.Tensor) -> Outcomes:
    return Outcomes(z.double(), r["max_q"], r["accepted"], r["verified"], r["group"])


def judge(r: dict, z: torch.Tensor, fixed_T: float | None = None) -> dict:
    """AUC / equal-mass ECE per position on odd prompts: raw, STS (fitted on even prompts' rounds),
    a fixed global temperature when given, and max-q (Platt, even prompts)."""
    data = outcomes(r, z)
    fit, rep = data.split()
    est = fit_estimators(fit)
    out = {}
    for name in ("raw", "STS", "max-q"):
        out[name] = metrics(conditional(est[name], rep), rep)
    if fixed_T is not None:
        out["fixed T"] = metrics(conditional({"T": [fixed_T] * data.gamma}, rep), rep)
    return out


def summary(m: list[dict]) -> tuple[list, list, float, float]:
    auc = [p["auc"] for p in m]
    ece = [p["ece_mass"] for p in m]
    ok_a = [a for a in auc if a is not None]
    ok_e = [e for e in ece if e is not None]
    return auc, ece, float(np.mean(ok_a)) if ok_a else math.nan, float(np.mean(ok_e)) if ok_e else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="conf/tiny.yaml")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--settings", nargs="+", default=["0", "0.7,0.8,20", "1"])
    ap.add_argument("--train-samples", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rollout-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--heldout-samples", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--set", nargs="*", default=[], help="config overrides of the run (key=value)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = load_config(args.config, [f"run_dir={args.run_dir}", f"evaluate.num_prompts={args.prompts}", *args.set])
    from cache_schema import CacheReader
    from pipeline.stages.cache import cache_url
    from pipeline.stages.train import expected_fingerprint
    from training.data import split_shards

    target_dir = resolve_target_path(cfg.target.path)
    drafter = load_trained_drafter(cfg, args.drafter, target_dir).eval()
    refitted = load_trained_drafter(cfg, args.drafter, target_dir, calibrated=True).confidence_head
    model, tok, _ = load_target(cfg.target, "cpu")
    tap = LayerTap(model, cfg.target.target_layer_ids)
    stop = {tok.eos_token_id, *np.atleast_1d(model.generation_config.eos_token_id or []).tolist()} - {None}
    reader = CacheReader(cache_url(cfg), expected_fingerprint(cfg, target_dir))
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards,
                         cfg.train.validation_shards)
    settings = [parse_setting(s) for s in args.settings]
    gamma = drafter.config.block_size
    train = cache_slots(drafter, reader, split.train, args.train_samples, cfg.train.micro_batch_samples,
                        cfg.train.seed, [Sampling(1.0), *settings])
    w_train = position_weights(train["slot"], cfg.train.decay_lambda)
    heldout_prompts = eval_prompts(cfg, tok)
    cfg_train = load_config(args.config, [f"run_dir={args.run_dir}", f"evaluate.num_prompts={args.rollout_prompts}",
                                          f"data.eval_files={list(cfg.data.train_files)}", *args.set])
    train_prompts = eval_prompts(cfg_train, tok) if args.rollout_prompts else []
    sel = select_heldout(split.counts, split.heldout, args.heldout_samples)
    loss_cfg = LossConfig()
    expected_set = collect_confidence(drafter, heldout_batches(reader, sel, cfg.train.micro_batch_samples), loss_cfg,
                                      seed=cfg.train.seed)
    T_expected = fit_global_temperature(expected_set.z, expected_set.y, expected_set.valid, n_bins=cfg.calibrate.bins)
    print(f"data: {train['h'].shape[0]} teacher-forced training slots, {len(heldout_prompts)} held-out prompts, "
          f"{len(train_prompts)} rollout prompts; global T on c* (old calibrate) {T_expected:.3f}", flush=True)
    results = {}
    for s in settings:
        key = f"{s:g}"
        lab_key = key
        rounds = decode_rounds(model, drafter, tap, heldout_prompts, s, max_new_tokens=args.max_new_tokens,
                               stop=stop, seed=cfg.evaluate.seed)
        roll = decode_rounds(model, drafter, tap, train_prompts, s, max_new_tokens=args.max_new_tokens, stop=stop,
                             seed=cfg.evaluate.seed + 1) if train_prompts else None
        real_set, _ = realised_confidence(drafter, heldout_batches(reader, sel, cfg.train.micro_batch_samples),
                                          sampling=s, num_anchors=drafter.config.num_anchors, seed=cfg.train.seed)
        T_real = fit_global_temperature(real_set.z, real_set.y, real_set.valid, n_bins=cfg.calibrate.bins)
        sts_real = fit_temperatures(real_set.z, real_set.y, real_set.valid, n_bins=cfg.calibrate.bins)
        sts_exp = fit_temperatures(expected_set.z, expected_set.y, expected_set.valid, n_bins=cfg.calibrate.bins)
        cands: dict[str, torch.Tensor] = {"trained": rounds["z"]}
        with torch.no_grad():  # the head calibrate refitted on held-out prompts (the trained one if it kept that)
            cands["calibrate refit"] = refitted(features(rounds["h"], rounds["e"], None, None, gamma, "base"), None).double()
        for kind in ("base", "stats"):
            xt = features(train["h"], train["e"], train["stats"], train["slot"], gamma, kind)
            xr = features(rounds["h"], rounds["e"], rounds["stats"], rounds["slot"], gamma, kind)
            tag = "" if kind == "base" else " +stats"
            cands[f"refit c*(T=1){tag}"] = fit_scorer(xt, train["labels"]["1"], w_train)(xr)
            if lab_key != "1":
                cands[f"matched c*({key}){tag}"] = fit_scorer(xt, train["labels"][lab_key], w_train)(xr)
            for other in train["labels"]:
                if other not in ("1", lab_key):   # labels of another setting: one head served at several
                    cands[f"cross c*({other}){tag}"] = fit_scorer(xt, train["labels"][other], w_train)(xr)
            if roll is not None:
                xo, yo = rollout_training_rows(roll, kind)
                cands[f"on-policy{tag}"] = fit_scorer(xo, yo, torch.ones_like(yo))(xr)
        table = {}
        for name, z in cands.items():
            table[name] = judge(rounds, z)
        data = outcomes(rounds, rounds["z"])
        rep = data.split()[1]
        table["trained"]["export T on c* (old)"] = metrics(conditional({"T": [T_expected] * gamma}, rep), rep)
        table["trained"]["export T realised (new)"] = metrics(conditional({"T": [T_real] * gamma}, rep), rep)
        table["trained"]["STS on c* (old)"] = metrics(conditional({"T": sts_exp.tolist()}, rep), rep)
        table["trained"]["STS realised (new)"] = metrics(conditional({"T": sts_real.tolist()}, rep), rep)
        results[key] = {"rounds": data.num_blocks, "report_rounds": rep.num_blocks, "rollout_rounds": 0 if roll is None else roll["h"].shape[0],
                        "global_T_expected": T_expected, "global_T_realised": T_real, "table": table}
        maxq_auc, maxq_ece, maxq_ma, maxq_me = summary(table["trained"]["max-q"])
        print(f"\n== setting {key}: {data.num_blocks} decoding rounds of held-out prompts, {rep.num_blocks} reported "
              f"(odd prompts); calibrators fitted on even prompts; tau {float((data.accepted + 1).double().mean()):.3f}")
        print(f"{'estimator':44s} | " + " | ".join(f"k={k + 1} AUC/ECE" for k in range(gamma))
              + " | mean AUC | mean ECE | AUC - max-q (mean)")
        print(f"{'max-q (Platt)':44s} | " + " | ".join(f"{_f(a)}/{_f(e)}" for a, e in zip(maxq_auc, maxq_ece))
              + f" | {maxq_ma:.3f} | {maxq_me:.3f} | 0")
        for name, per in table.items():
            for cal, m in per.items():
                if cal == "max-q":
                    continue
                auc, ece, ma, me = summary(m)
                print(f"{(name + ' / ' + cal)[:44]:44s} | " + " | ".join(f"{_f(a)}/{_f(e)}" for a, e in zip(auc, ece))
                      + f" | {ma:.3f} | {me:.3f} | {ma - maxq_ma:+.3f}")
        print(f"global T folded into the export: on c* {T_expected:.3f}, on realised acceptance at {key} {T_real:.3f}",
              flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s (machine shared; figures are deterministic given the run)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
