"""Sequential heads and the confidence head of the DSpark drafter.

DSpark paper sec. 3.1 (semi-autoregressive generation): the parallel backbone gives base logits
``U_k`` for every predicting slot k of a block; a light sequential head adds a prefix-dependent bias
``B_k`` slot by slot, and the draft distribution is an explicit softmax

    q_k(v | x_0, x_<k) = softmax(U_k + B_k)(v)          (then divided by the temperature)

so rejection sampling against the target stays lossless. Every head here writes the bias as
``B_k = W2 u_k`` with a rank-r feature ``u_k`` (``markov_w2`` is ``nn.Linear(r, V_draft)``):

- vanilla Markov: ``u_k = W1[x_{k-1}]``, i.e. ``B = W2 W1[x_{k-1}]`` (DSpark sec. 3.1, transition bias);
- gated Markov: ``u_k = sigmoid(W_g [h_k ; W1[x_{k-1}]] + b_g) * W1[x_{k-1}]`` (DSpark sec. 3.1 variant);
- RNN: a state ``s_k`` over the block (DSpark sec. 3.1, RNN head; ``s_0 = 0``):
  ``z_k = [s_{k-1} ; W1[x_{k-1}] ; h_k]``, ``g_k = sigmoid(W_g z_k + b_g)``,
  ``s_k = g_k * s_{k-1} + (1 - g_k) * tanh(W_c z_k + b_c)``, ``u_k = tanh(W_o z_k + b_o)``.

- control (the ablation that isolates the sequential effect, not a paper head): the same ``W1`` and
  ``W2`` fed the anchor token and a learned per-slot vector instead of the previous token,
  ``u_k = W1[x_0] + e_k`` (``slot_embed`` ``[gamma, r]``): equal capacity, no dependence on ``x_{k-1}``.

``x_{k-1}`` for the first predicting slot is the anchor token; ``W1`` embeds target-vocabulary ids
(``[V, r]``), ``W2`` maps to the draft vocabulary (``V_draft <= V``), as vLLM's ``DSparkMarkovHead``.
Training uses teacher forcing (true previous tokens); inference samples slot by slot.

Confidence head (DSpark sec. 3.2.1): ``c_k = sigmoid(w^T [h_k ; W1[x_{k-1}]] + b)`` (``[h_k]`` alone
without a Markov head); the module returns the logit.
"""
from __future__ import annotations

import torch
from torch import nn

from training.spec_sampling import temperature_probs, truncation_mask

__all__ = ["MarkovHead", "GatedMarkovHead", "RNNHead", "ControlHead", "ConfidenceHead", "HEAD_TYPES",
           "build_sequential_head", "sample_sequential"]


class MarkovHead(nn.Module):
    """Vanilla Markov head: ``B(x_{k-1}, .) = W2 W1[x_{k-1}]`` (DSpark sec. 3.1).

    Args:
        vocab_size: target vocabulary V (rows of ``markov_w1``).
        draft_vocab_size: draft vocabulary V_draft (rows of ``markov_w2.weight``).
        rank: r >= 1. hidden_size: backbone width H (unused here, used by the subclasses).
    Parameters (vLLM names): ``markov_w1.weight`` [V, r], ``markov_w2.weight`` [V_draft, r].
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, slots: int = 0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"markov rank must be >= 1 for a sequential head, got {rank}")
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """``W1[x]``: [...] int64 target ids -> [..., r] (also the confidence head's extra input)."""
        return self.markov_w1(prev_ids)

    def step(self, state: torch.Tensor | None, prev_ids: torch.Tensor, hidden: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: ``(u_k [..., r], next state)`` from ``x_{k-1}`` [...] and ``h_k`` [..., H]."""
        return self.embed(prev_ids), None

    def features(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced ``u`` for whole blocks: prev_ids [..., S], hidden [..., S, H] -> [..., S, r]."""
        return self.step(None, prev_ids, hidden)[0]

    def bias(self, u: torch.Tensor) -> torch.Tensor:
        """``B = W2 u``: [..., r] -> [..., V_draft] logits bias."""
        return self.markov_w2(u)


class GatedMarkovHead(MarkovHead):
    """Gated Markov head: ``u_k = sigmoid(W_g [h_k ; W1[x_{k-1}]] + b_g) * W1[x_{k-1}]`` (DSpark sec. 3.1).

    Extra parameters: ``gate_proj`` ``nn.Linear(H + r, r)``.
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, slots: int = 0):
        super().__init__(vocab_size, draft_vocab_size, rank, hidden_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, state, prev_ids, hidden):
        """``u_k = g_k * W1[x_{k-1}]``, ``g_k = sigmoid(W_g [h_k ; W1[x_{k-1}]] + b_g)``; no state."""
        e = self.embed(prev_ids)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e.to(hidden.dtype)], dim=-1)))
        return gate.to(e.dtype) * e, None


class RNNHead(MarkovHead):
    """RNN head with a state ``s_k`` carried over the block (DSpark sec. 3.1; equations in the module doc).

    Extra parameters: ``rnn_proj`` ``nn.Linear(2r + H, 3r)`` producing ``[gate ; candidate ; output]``.
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, slots: int = 0):
        super().__init__(vocab_size, draft_vocab_size, rank, hidden_size)
        self.rnn_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, state, prev_ids, hidden):
        """``(u_k, s_k)`` from ``s_{k-1}`` [..., r] (None = zeros), ``x_{k-1}`` [...] and ``h_k`` [..., H]."""
        e = self.embed(prev_ids).to(hidden.dtype)
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.rank)
        g, c, o = self.rnn_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        return torch.tanh(o), g * state + (1 - g) * torch.tanh(c)

    def features(self, prev_ids, hidden):
        """Teacher-forced ``u`` [..., S, r], unrolling the state over the S slots from ``s_0 = 0``."""
        state, out = None, []
        for k in range(prev_ids.shape[-1]):
            u, state = self.step(state, prev_ids[..., k], hidden[..., k, :])
            out.append(u)
        return torch.stack(out, dim=-2)


class ControlHead(MarkovHead):
    """Control head: ``u_k = W1[x_0] + e_k`` from the anchor ``x_0`` and a learned slot vector ``e_k``.

    The capacity of the Markov head (the same ``markov_w1`` [V, r] and ``markov_w2`` [V_draft, r],
    plus ``slot_embed`` [gamma, r]) without its input: the previous token. DSpark / control
    measures the sequential effect; control / DFlash measures what the extra parameters alone give.
    Every tensor carries the slot dimension last among the leading ones (``prev_ids`` [..., S]).
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, slots: int = 0):
        super().__init__(vocab_size, draft_vocab_size, rank, hidden_size)
        if slots < 1:
            raise ValueError(f"the control head needs the block size (slots >= 1), got {slots}")
        self.slot_embed = nn.Embedding(slots, rank)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """``W1[x_0] + e_k`` for every slot: prev_ids [..., S] (slot 0 holds the anchor) -> [..., S, r]."""
        S = prev_ids.shape[-1]
        return self.markov_w1(prev_ids[..., :1]) + self.slot_embed.weight[:S]

    def step(self, state, prev_ids, hidden):
        """``(u_k, (x_0, k + 1))``: the state carries the anchor ids [...] and the slot index."""
        anchor, k = (prev_ids, 0) if state is None else state
        return self.markov_w1(anchor) + self.slot_embed.weight[k], (anchor, k + 1)

    def features(self, prev_ids, hidden):
        """Teacher-forced ``u`` [..., S, r] (only the anchor in ``prev_ids[..., 0]`` is read)."""
        return self.embed(prev_ids)


class ConfidenceHead(nn.Module):
    """Confidence head: one linear layer, logit of ``c_k`` (DSpark sec. 3.2.1).

    Args:
        input_dim: H + r with a Markov head (input ``[h_k ; W1[x_{k-1}]]``), H without.
    Parameters (vLLM names): ``proj.weight`` [1, input_dim], ``proj.bias`` [1].
    """

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden: torch.Tensor, prev_embed: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., H], prev_embed [..., r] or None -> confidence logits [...] (float32)."""
        x = hidden if prev_embed is None else torch.cat([hidden, prev_embed.to(hidden.dtype)], dim=-1)
        return self.proj(x).squeeze(-1).float()


HEAD_TYPES = {"markov": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead, "control": ControlHead}


def build_sequential_head(head_type: str, *, vocab_size: int, draft_vocab_size: int, rank: int,
                          hidden_size: int, slots: int = 0) -> MarkovHead | None:
    """The sequential head for a config; ``rank == 0`` means none (plain DFlash). ``slots``: the
    predicting slots per block (gamma), used by the control head's slot vectors only.

    Raises:
        ValueError: unknown ``head_type`` (choose from ``HEAD_TYPES``) or ``rank < 0``.
    """
    if rank < 0:
        raise ValueError(f"markov_rank must be >= 0 (0 = DFlash, no sequential head), got {rank}")
    if head_type not in HEAD_TYPES:
        raise ValueError(f"unknown head_type {head_type!r}; choose one of {sorted(HEAD_TYPES)}")
    if rank == 0:
        return None
    return HEAD_TYPES[head_type](vocab_size, draft_vocab_size, rank, hidden_size, slots)


def sample_sequential(base_logits: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                      head: MarkovHead | None, temperature: float, generator: torch.Generator | None,
                      draft_to_target: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft one block slot by slot and return the exact per-slot draft distributions.

    For slot k: ``q_k = softmax((U_k + W2 u_k(x_<k)) / T)`` (DSpark sec. 3.1) and ``x_k ~ q_k``, then
    ``x_k`` feeds slot k+1. Without a head the slots are independent (DFlash): ``q_k = softmax(U_k/T)``.
    Sampling uses the Gumbel-max trick (Gumbel 1954; Maddison et al. 2014): ``x_k = argmax(l_k / T
    - log E_k)`` with ``E_k ~ Exp(1)`` i.i.d. is an exact draw from ``softmax(l_k / T)``; the noise is
    drawn for the whole block at once, so each sequential step is a few kernels (embedding, bias
    matmul, add, argmax), and ``q`` is one batched softmax after the loop. ``T = 0`` is the argmax.

    Args:
        base_logits: [B, S, V_draft] backbone logits of the predicting slots.
        hidden: [B, S, H] backbone output (after the final norm) of the same slots.
        anchor_ids: [B] int64 anchor tokens (target ids), the ``x_{k-1}`` of slot 0.
        head: a sequential head or None. temperature: T >= 0, or a
            :class:`training.spec_sampling.Sampling` whose top-k / top-p truncate each ``q_k`` as vLLM
            does (the Gumbel-max then runs over the kept tokens, an exact draw from the truncated
            ``q_k``). generator: on the logits' device.
        draft_to_target: [V_draft] int64 target id of each draft id, or None (same vocabulary).
    Returns:
        tokens [B, S] int64 target ids, q [B, S, V_draft] float32 (rows sum to 1),
        prev_ids [B, S] int64 the ``x_{k-1}`` each slot was conditioned on.
    Raises:
        ValueError: T negative or not finite.
    """
    if not (0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    scale = 1.0 if temperature == 0 else 1.0 / temperature
    score = base_logits.float() * scale
    if temperature > 0:
        noise = torch.empty_like(score).exponential_(generator=generator)
        score = score - noise.log()
    truncate = temperature > 0 and getattr(temperature, "truncates", False)  # top-k / top-p (Sampling)
    if head is None:
        keep = truncation_mask(base_logits.float() * scale, temperature) if truncate else None
        idx = (score if keep is None else score.masked_fill(~keep, float("-inf"))).argmax(-1)
        tokens = idx if draft_to_target is None else draft_to_target[idx]
        prev = torch.cat([anchor_ids.long().view(-1, 1), tokens[:, :-1]], dim=1)
        return tokens, temperature_probs(base_logits, temperature), prev
    x, state, tokens, prevs, biases = anchor_ids.long(), None, [], [], []
    for k in range(base_logits.shape[1]):
        u, state = head.step(state, x, hidden[:, k])
        bias = head.bias(u).float()
        logits_k = torch.add(score[:, k], bias, alpha=scale)
        if truncate:  # the kept set of q_k, from the noiseless logits: Gumbel-max over it draws from q_k
            keep = truncation_mask(torch.add(base_logits[:, k].float(), bias) * scale, temperature)
            logits_k = logits_k.masked_fill(~keep, float("-inf"))
        idx = logits_k.argmax(-1)
        prevs.append(x)
        biases.append(bias)
        x = idx if draft_to_target is None else draft_to_target[idx]
        tokens.append(x)
    q = temperature_probs(base_logits.float() + torch.stack(biases, 1), temperature)
    return torch.stack(tokens, 1), q, torch.stack(prevs, 1)
