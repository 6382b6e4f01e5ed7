"""Lossless speculative decoding with a frozen HF target and a trained drafter (batch size 1).

Each round: the drafter drafts a block after the anchor (the last emitted token); the target runs
once over ``[anchor, d_1..d_l]`` on its KV cache; standard speculative sampling (Leviathan et al.
2023, :mod:`training.spec_sampling`) accepts a prefix and emits one more token (the resample or the
bonus). The target's hidden states at the accepted positions become the drafter's next context,
and the KV cache is cropped back to them. The emitted tokens follow the target's distribution at
the sampling setting exactly (temperature, then top-k, then top-p, renormalised, as vLLM: a
:class:`training.spec_sampling.Sampling`, or a plain temperature; greedy at T = 0), whatever the
drafter and the verified length ``l``, as long as ``l`` is chosen before verification (the threshold
policy below only reads confidences). The drafter samples from its own distribution truncated the
same way (:func:`training.heads.sample_sequential`).

Why two speculative-sampling modules: the verify rule over tensors is :mod:`training.spec_sampling`
(with the temperature function the block-level evaluation uses); this module is the decoding loop around the target's KV cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from pipeline.target_model.prefill import LayerTap
from training.spec_sampling import temperature_probs, verify_block

# verified length policy: (confidence logits [gamma] or None, gamma) -> l in [0, gamma]
VerifyPolicy = Callable[[torch.Tensor | None, int], int]


def full_block(_conf: torch.Tensor | None, gamma: int) -> int:
    """Verify the whole block (the fixed-gamma policy)."""
    return gamma


def threshold_policy(threshold: float, temperatures: Sequence[float] | None) -> VerifyPolicy:
    """Truncate the block at the first position whose calibrated confidence
    ``c_k = sigmoid(z_k / T_k)`` falls below ``threshold`` (DSpark sec. 3.3, static thresholding)."""
    def policy(conf: torch.Tensor | None, gamma: int) -> int:
        if conf is None:
            return gamma
        t = torch.ones(gamma) if temperatures is None else torch.as_tensor(temperatures[:gamma], dtype=torch.float32)
        below = (torch.sigmoid(conf.float().cpu() / t) < threshold).nonzero()
        return int(below[0]) if len(below) else gamma
    return policy


@dataclass
class Round:
    """One speculation round: drafted ``gamma``, verified ``verified``, accepted ``accepted``
    (emitted = accepted + 1), the drafter's confidence logits, the seconds spent and the largest draft
    probability per slot (``DraftResult.max_q``); the confidence head's inputs [gamma, D] only when
    :func:`speculative_decode` was asked to keep them (``DraftResult.confidence_input``)."""

    gamma: int
    verified: int
    accepted: int
    confidence_logits: list[float] | None
    draft_s: float
    verify_s: float
    max_q: list[float] | None = None
    confidence_input: torch.Tensor | None = None


@dataclass
class Decoded:
    """A decoded continuation: new token ids and the rounds (empty for plain decoding)."""

    tokens: list[int]
    rounds: list[Round] = field(default_factory=list)
    seconds: float = 0.0


def cache_keyword(model) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` in transformers 5.24 (the CPU
    set), ``past_key_values`` before (5.20, the GPU set that vLLM 0.33 admits). Passed under the other
    name, the cache is ignored (the model builds its own) and a caller's cache stays empty."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Target:
    """The frozen target with a KV cache and a tap on its layers (one sequence)."""

    def __init__(self, model, tap: LayerTap | None = None):
        from transformers import DynamicCache

        self.model, self.tap = model, tap
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self._cache_kw = cache_keyword(model)

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``ids`` at positions ``length..``; returns logits [n, V] float32 (``last_only``: [1, V],
        the last position's, the only one a prompt's prefill needs: the model's ``logits_to_keep=1``
        applies ``lm_head`` to that position alone instead of materialising [n, V], 2.5 GB in float32
        at n = 4,096 and V = 151,936) and the tapped features [n, L*H]."""
        x = torch.as_tensor([list(ids)], dtype=torch.long, device=self.model.device)
        keep = {"logits_to_keep": 1} if last_only else {}
        out = self.model(input_ids=x, use_cache=True, **{self._cache_kw: self.cache}, **keep)
        self.length += len(ids)
        feats = None if self.tap is None else self.tap.features()[0].float()
        return out.logits[0].float(), feats

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of the KV cache."""
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5: a negative count of tokens to drop
        self.length = length


def _sample(p: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def device_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` (where the decoding loop samples: the target's), seeded
    with ``seed``: ``multinomial`` and ``rand`` on CUDA tensors need a CUDA generator."""
    return torch.Generator(device=device).manual_seed(seed)


def plain_decode(model, prompt: Sequence[int], *, max_new_tokens: int, temperature: float,
                 stop_ids: set[int], generator: torch.Generator) -> Decoded:
    """Autoregressive target decoding with a KV cache (the baseline of the same run), sampling at
    ``temperature``: T >= 0 or a :class:`training.spec_sampling.Sampling` (top-p / top-k applied)."""
    t0 = time.perf_counter()
    target = Target(model)
    logits, _ = target.forward(prompt, last_only=True)
    out: list[int] = []
    while len(out) < max_new_tokens:
        tok = _sample(temperature_probs(logits[-1:], temperature)[0], generator)
        out.append(tok)
        if tok in stop_ids:
            break
        logits, _ = target.forward([tok])
    return Decoded(out, seconds=time.perf_counter() - t0)


def speculative_decode(model, drafter, prompt: Sequence[int], *, tap: LayerTap,
                       max_new_tokens: int, temperature: float, stop_ids: set[int], generator: torch.Generator,
                       policy: VerifyPolicy = full_block, keep_confidence_inputs: bool = False) -> Decoded:
    """Speculative decoding of one prompt (see module docstring).

    Args:
        model: HF causal LM target (eval). drafter: :class:`training.drafter.Drafter` (eval).
        tap: a :class:`LayerTap` on ``model`` at the drafter's target layer ids (made once per model).
        prompt: token ids of the rendered prompt (with the generation prompt).
        temperature: the sampling setting of both target and drafter: T >= 0, or a
            :class:`training.spec_sampling.Sampling` (T, top-p, top-k). stop_ids: end-of-turn / eos ids.
        policy: verified length from the confidences (fixed gamma by default).
        keep_confidence_inputs: keep each round's confidence-head inputs (``Round.confidence_input``, on
            the CPU: gamma x D values per round), for the on-policy refit of the head.

    Returns:
        :class:`Decoded` with at most ``max_new_tokens`` tokens and one :class:`Round` per round.
    """
    t_start = time.perf_counter()
    target = Target(model, tap)
    logits, feats = target.forward(prompt, last_only=True)
    anchor = _sample(temperature_probs(logits[-1:], temperature)[0], generator)
    ctx = drafter.encode_context(feats.to(drafter.fc.weight.dtype), tokens=prompt[1:])
    out, rounds = [anchor], []
    while anchor not in stop_ids and len(out) < max_new_tokens:
        t0 = time.perf_counter()
        draft = drafter.draft_block(ctx, anchor, temperature, generator)
        if draft.tokens.is_cuda:  # the kernels launched, not done: without the wait the draft's GPU time is verify_s
            torch.cuda.synchronize(draft.tokens.device)
        t1 = time.perf_counter()
        gamma = len(draft.tokens)
        n_verify = policy(draft.confidence_logits, gamma)
        d = draft.tokens[:n_verify].tolist()
        base = target.length
        logits, feats = target.forward([anchor, *d])
        p = temperature_probs(logits, temperature)
        emitted, accepted = verify_block(draft.tokens[:n_verify], draft.q[:n_verify].float(), p, generator)
        emitted = emitted.tolist() if torch.is_tensor(emitted) else list(emitted)
        accepted = int(accepted)
        target.crop(base + 1 + accepted)  # anchor and accepted drafts stay in the cache
        ctx = drafter.encode_context(feats[: 1 + accepted].to(drafter.fc.weight.dtype), ctx, tokens=d[:accepted])
        conf = None if draft.confidence_logits is None else draft.confidence_logits.float().tolist()
        max_q = None if draft.max_q is None else draft.max_q.float().tolist()
        head_in = draft.confidence_input.cpu() if keep_confidence_inputs and draft.confidence_input is not None else None
        rounds.append(Round(gamma, n_verify, accepted, conf, t1 - t0, time.perf_counter() - t1, max_q, head_in))
        for tok in emitted:
            out.append(tok)
            if tok in stop_ids or len(out) >= max_new_tokens:
                break
        anchor = out[-1]
    return Decoded(out[:max_new_tokens], rounds, time.perf_counter() - t_start)
