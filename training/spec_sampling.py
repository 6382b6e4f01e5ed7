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

Sampling settings (:class:`Sampling`): temperature, top-k and top-p are applied to the target's
and to the drafter's logits alike, in vLLM's order (vLLM v1 ``Sampler.sample``: temperature, then
``apply_top_k_top_p`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``: top-k, then top-p on what
top-k kept, then softmax, i.e. renormalised). Verification against the truncated target ``p`` stays
lossless for any draft distribution ``q`` the draft was sampled from (Leviathan et al. 2023, Thm.
3.5 holds for any ``q``); truncating ``q`` the same way only raises acceptance.

Why two speculative-sampling modules: this is the verify rule over tensors and the one
sampling-distribution function (the block-level evaluation and the drafter's sampler use it too);
:mod:`pipeline.inference.speculate` is the loop around an HF target.
"""
from __future__ import annotations

import math

import torch

__all__ = ["Sampling", "truncation_mask", "temperature_probs", "verify_batch", "verify_block"]


class Sampling(float):
    """A sampling setting: its float value is the temperature T; ``top_p`` and ``top_k`` truncate.

    A float so that every function taking a temperature takes a setting unchanged (``T > 0``,
    ``1 / T`` and the drafter's sampler work as before); equal to (and hashing as) the plain float
    when it does not truncate (``top_p == 1`` and ``top_k == 0``), so ``Sampling(1.0)`` and ``1.0``
    are the same dict key, while ``Sampling(0.7, 0.8, 20)`` differs from ``0.7``. Formats as the
    temperature followed by the truncation (``f"{s:g}"`` -> ``"0.7,p0.8,k20"``), which names its
    tables, keys (``"T=0.7,p0.8,k20"``) and files.

    Args:
        temperature: T >= 0, finite (0 = greedy: top-p / top-k change nothing there).
        top_p: nucleus mass in (0, 1]; 1 disables it. top_k: tokens kept, >= 0; 0 disables it.
    Raises:
        ValueError: a value out of range (the message names it and its range).
    """

    def __new__(cls, temperature: float, top_p: float = 1.0, top_k: int = 0):
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
        self = super().__new__(cls, float(temperature))
        self.top_p, self.top_k = float(top_p), int(top_k)
        return self

    @classmethod
    def of(cls, value: "float | Sampling") -> "Sampling":
        """``value`` as a :class:`Sampling` (a plain float: that temperature, no truncation)."""
        return value if isinstance(value, Sampling) else cls(value)

    @property
    def temperature(self) -> float:
        return float(self)

    @property
    def truncates(self) -> bool:
        """Whether top-p or top-k removes tokens (at T > 0)."""
        return self.top_p < 1 or self.top_k > 0

    def _key(self) -> tuple:
        return (float(self), self.top_p, self.top_k)

    def __eq__(self, other) -> bool:
        if isinstance(other, Sampling):
            return self._key() == other._key()
        return not self.truncates and float(self) == other

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(float(self)) if not self.truncates else hash(self._key())

    def __format__(self, spec: str) -> str:
        t = format(float(self), spec)
        return t + (f",p{self.top_p:g},k{self.top_k}" if self.truncates else "")

    def __repr__(self) -> str:
        return f"Sampling(temperature={float(self)!r}, top_p={self.top_p!r}, top_k={self.top_k!r})"

    def __getnewargs__(self) -> tuple:
        return self._key()

    def to_dict(self) -> dict:
        """``{"temperature", "top_p", "top_k"}`` (JSON-able)."""
        return {"temperature": float(self), "top_p": self.top_p, "top_k": self.top_k}


def truncation_mask(scaled_logits: torch.Tensor, setting: "float | Sampling") -> torch.Tensor | None:
    """Tokens kept by top-k then top-p, as vLLM v1's ``apply_top_k_top_p`` keeps them.

    Top-k keeps the k largest logits; top-p then keeps, of those, the smallest set of the largest
    probabilities (``softmax`` over the top-k survivors) whose mass reaches ``top_p``: a token is kept
    iff the mass of the tokens ranked strictly above it is < top_p (the most likely token always
    stays). Ties at the k-th value are broken by the kernel's order (``topk``; ``sort`` without top-k),
    as in vLLM. With top-k only the k largest are ranked (``topk``, O(V log k) per row, not a full sort:
    at the serving setting's k = 20 the train step's confidence labels spent a third of the demo's step
    sorting whole rows).

    Args:
        scaled_logits: [..., V] float logits already divided by the temperature.
        setting: a :class:`Sampling` (or a float: no truncation).
    Returns:
        bool [..., V] True where kept, or None when ``setting`` does not truncate.
    """
    s = Sampling.of(setting)
    if not s.truncates:
        return None
    V = scaled_logits.shape[-1]
    if 0 < s.top_k < V:
        ranked, order = scaled_logits.topk(s.top_k, dim=-1, sorted=True)
    else:
        ranked, order = scaled_logits.sort(dim=-1, descending=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if s.top_p < 1:
        probs = torch.softmax(ranked, dim=-1)
        keep = (probs.cumsum(-1) - probs) < s.top_p
    return torch.zeros(scaled_logits.shape, dtype=torch.bool, device=scaled_logits.device).scatter(-1, order, keep)


def temperature_probs(logits: torch.Tensor, T: "float | Sampling") -> torch.Tensor:
    """Sampling distribution at setting T: ``softmax(logits / T)`` restricted to the tokens that
    top-k then top-p keep (:func:`truncation_mask`) and renormalised, vLLM's order (module doc);
    T = 0 means greedy.

    Args:
        logits: [..., V] float logits. T: temperature >= 0 (unitless), or a :class:`Sampling`.
    Returns:
        probabilities [..., V] on ``logits``' device, float32 (float64 if ``logits`` is float64),
        zero outside the kept tokens; for ``T == 0`` the one-hot of ``argmax`` (first index on
        ties), which makes speculative sampling exact greedy decoding. The one function for target
        and draft distributions alike.
    Raises:
        ValueError: ``T < 0`` or not finite.
    """
    if not (T >= 0 and T < float("inf")):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {T}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if T == 0:
        hot = torch.zeros(logits.shape, dtype=dtype, device=logits.device)
        return hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scaled = logits.to(dtype) / float(T)
    keep = truncation_mask(scaled, T)
    return torch.softmax(scaled if keep is None else scaled.masked_fill(~keep, float("-inf")), dim=-1)


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
