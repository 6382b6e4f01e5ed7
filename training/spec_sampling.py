"""Standard (lossless) speculative sampling verification, with an optional truncated verify length.

Leviathan et al. 2023 (Algorithm 1) / Chen et al. 2023 (Algorithm 2): draft token ``d_k ~ q_k`` is
accepted with probability ``min(1, p_k(d_k) / q_k(d_k))``, left to right; at the first rejection the
emitted token is drawn from ``norm(max(p_k - q_k, 0))`` and the block ends; if every verified draft is
accepted, a bonus token is drawn from the next target distribution. Each emitted token is then
distributed exactly as the target's ``p`` given the emitted prefix.

Truncation (DSpark confidence-scheduled verification): only the first ``l <= gamma`` drafts are
verified; the bonus after ``l`` acceptances comes from ``p_l``. This stays lossless as long as ``l`` is
decided from information available before the drafts at positions ``>= l`` are inspected (the
scheduler's survival ``a_{r,j}`` for ``j <= l``), never from the drafted values being verified.

Indexing (0-based in code): ``q[k]`` is the draft distribution of slot k, ``p[k]`` is the target
distribution of the token after the prefix ``d[:k]`` (so ``p[0]`` is the target's next-token
distribution at the anchor and ``p[gamma]`` the bonus distribution after a full accept).

Why two speculative-sampling modules: this is the verify rule over tensors and the one
temperature function (the block-level evaluation uses it too); :mod:`pipeline.inference.speculate` is the loop around an HF target.
"""
from __future__ import annotations

import torch

__all__ = ["temperature_probs", "verify_batch", "verify_block"]


def temperature_probs(logits: torch.Tensor, T: float) -> torch.Tensor:
    """Sampling distribution at temperature T: ``softmax(logits / T)``; T = 0 means greedy.

    Args:
        logits: [..., V] float logits. T: temperature >= 0 (unitless).
    Returns:
        probabilities [..., V] on ``logits``' device, float32 (float64 if ``logits`` is float64); for
        ``T == 0`` the one-hot of ``argmax`` (first index on ties), which makes speculative sampling
        exact greedy decoding. The one function for target and draft distributions alike.
    Raises:
        ValueError: ``T < 0`` or not finite.
    """
    if not (T >= 0 and T < float("inf")):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {T}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if T == 0:
        hot = torch.zeros(logits.shape, dtype=dtype, device=logits.device)
        return hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.softmax(logits.to(dtype) / T, dim=-1)


def _check(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, verify_len: torch.Tensor
           ) -> None:
    """Raise ValueError on inconsistent shapes, lengths or a draft token with q = 0."""
    if draft.ndim != 2 or q.ndim != 3 or p.ndim != 3:
        raise ValueError(f"expected draft [N, gamma], q [N, gamma, V], p [N, gamma+1, V]; got "
                         f"{tuple(draft.shape)}, {tuple(q.shape)}, {tuple(p.shape)}")
    n, gamma = draft.shape
    if q.shape[:2] != (n, gamma) or p.shape != (n, gamma + 1, q.shape[2]):
        raise ValueError(f"shape mismatch: draft {tuple(draft.shape)}, q {tuple(q.shape)}, "
                         f"p {tuple(p.shape)}; p needs gamma+1 rows (the last one is the bonus)")
    if verify_len.shape != (n,) or (verify_len < 0).any() or (verify_len > gamma).any():
        raise ValueError(f"verify_len must be [N] ints in [0, gamma={gamma}], got {verify_len.tolist()}")
    if draft.dtype not in (torch.int32, torch.int64) or (draft < 0).any() or (draft >= q.shape[2]).any():
        raise ValueError("draft tokens must be integer ids in [0, V)")
    if gamma and (q.gather(2, draft.long().unsqueeze(2)) <= 0).any():
        raise ValueError("a draft token has q_k(d_k) = 0, so it was not sampled from q: pass the exact "
                         "per-slot draft distribution that produced the draft")


def verify_batch(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator,
                 verify_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling verification of N independent blocks (Leviathan et al. 2023, Alg. 1).

    For block n, drafts ``k < l_n`` are tested left to right with ``u_k < p[k, d_k] / q[k, d_k]``,
    ``u_k ~ U[0, 1)``; at the first rejection j the block emits ``d[:j]`` plus one token from
    ``norm(max(p[j] - q[j], 0))``; if all ``l_n`` are accepted it emits ``d[:l_n]`` plus a bonus from
    ``p[l_n]``. Greedy decoding is the special case of one-hot ``p`` and ``q``.

    Args:
        draft: int64/int32 [N, gamma] draft token ids, ``draft[n, k] ~ q[n, k]``.
        q: float [N, gamma, V] exact draft distributions (rows sum to 1).
        p: float [N, gamma + 1, V] target distributions (temperature already applied).
        generator: torch.Generator on ``q``'s device for the uniforms and the resample / bonus draws.
        verify_len: int [N] in [0, gamma], drafts to verify per block; None = gamma for all.
    Returns:
        ``(emitted, n_accepted)``: emitted int64 [N, gamma + 1], the first ``n_accepted[n] + 1``
        entries valid and the rest -1; n_accepted int64 [N], accepted drafts (<= verify_len), so the
        acceptance length tau (bonus included) is ``n_accepted + 1``.
    Raises:
        ValueError: inconsistent shapes, ``verify_len`` out of range, token ids out of range, or a
            draft token with ``q = 0``.
    """
    n, gamma = draft.shape[:2] if draft.ndim == 2 else (0, 0)
    dev = q.device  # the uniforms and draws come from ``generator``, which must be on this device
    verify_len = (torch.full((n,), gamma, dtype=torch.long, device=dev) if verify_len is None
                  else torch.as_tensor(verify_len, dtype=torch.long, device=dev))
    _check(draft, q, p, verify_len)
    d = draft.long()
    ar = torch.arange(n, device=dev)
    p_d = p[:, :gamma].gather(2, d.unsqueeze(2)).squeeze(2).double()
    q_d = q.gather(2, d.unsqueeze(2)).squeeze(2).double()
    u = torch.rand(n, gamma, generator=generator, dtype=torch.float64, device=dev)
    slot = torch.arange(gamma, device=dev)
    accept = (u * q_d < p_d) & (slot < verify_len.unsqueeze(1))
    n_acc = torch.cumprod(accept.long(), dim=1).sum(1)
    rejected = n_acc < verify_len
    p_j = p[ar, n_acc].double()
    q_j = q[ar, torch.clamp(n_acc, max=max(gamma - 1, 0))].double() if gamma else torch.zeros_like(p_j)
    residual = torch.clamp(p_j - q_j, min=0.0)
    # A rejection implies p_j(d_j) < q_j(d_j), hence sum(residual) > 0 mathematically; the fallback to
    # p_j only guards floating-point underflow.
    dist = torch.where(rejected.unsqueeze(1) & (residual.sum(1, keepdim=True) > 0), residual, p_j)
    last = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    emitted = torch.where(slot < n_acc.unsqueeze(1), d, torch.full_like(d, -1))
    emitted = torch.cat([emitted, torch.full((n, 1), -1, dtype=torch.long, device=dev)], dim=1)
    emitted[ar, n_acc] = last
    return emitted, n_acc


def verify_block(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator,
                 verify_len: int | None = None) -> tuple[torch.Tensor, int]:
    """Speculative sampling verification of one block (see :func:`verify_batch`).

    Args:
        draft: int [gamma] draft ids; q: float [gamma, V]; p: float [gamma + 1, V];
        generator: torch.Generator; verify_len: drafts to verify, 0..gamma (None = gamma).
    Returns:
        ``(tokens, n_accepted)``: tokens int64 [n_accepted + 1] (accepted drafts, then the resampled
        or bonus token); n_accepted in [0, verify_len].
    Raises:
        ValueError: as :func:`verify_batch`.
    """
    lens = None if verify_len is None else torch.tensor([verify_len], dtype=torch.long)
    emitted, n_acc = verify_batch(draft.unsqueeze(0), q.unsqueeze(0), p.unsqueeze(0), generator, lens)
    k = int(n_acc[0])
    return emitted[0, : k + 1], k
