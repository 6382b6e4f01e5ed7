"""Train and evaluate the embedded tiny target: a small Qwen3ForCausalLM on stdlib source and chats.

Training runs a fixed number of optimizer steps (never a wall-clock budget) from a fixed seed, so a
build is a deterministic function of its ``TargetSpec`` and data on a given machine and torch build.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.optimization import get_cosine_schedule_with_warmup

IGNORE = -100


@dataclass(frozen=True)
class TargetSpec:
    """Shape and training recipe of the tiny target.

    Sizes are in tokens (``seq_len``, ``eval_tokens``) or rows (``batch_size``); ``lr`` is AdamW's
    peak learning rate, reached after ``warmup_steps`` of linear warmup, then cosine decay to 0 at
    ``steps``.

    ``threads`` is passed to ``torch.set_num_threads`` during training; ``bf16_autocast`` runs the
    training forward pass under CPU bf16 autocast (weights and optimizer state stay fp32). It is off
    by default: on a CPU without native bf16 (AVX2 only) autocast made a training step 13x slower
    (2.34 vs 0.18 s for 4 x 256 tokens), and a build must not depend on which CPU it ran on.
    ``attn_implementation`` is the attention kernel used here for training and evaluation; it is
    not saved with the model.
    """

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 2400
    lr: float = 3e-3
    warmup_steps: int = 120
    weight_decay: float = 0.1
    seed: int = 0
    eval_tokens: int = 131072
    threads: int = 2
    bf16_autocast: bool = False
    attn_implementation: str = "eager"


def qwen3_config(spec: TargetSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """The ``Qwen3Config`` for ``spec``, with vocab size and special ids taken from ``tokenizer``.

    ``eos_token_id`` is ``<|im_end|>`` (end of turn, as in Qwen3 instruct); there is no BOS.
    """
    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, torch_dtype="float32")


def render_training_chat(tokenizer: PreTrainedTokenizerFast, messages: list[dict],
                         thinking_off_prompt: bool) -> str:
    """One chat as training text, through the tokenizer's own chat template.

    ``thinking_off_prompt=False`` renders the whole conversation (plain ChatML turns);
    ``True`` renders the prompt as a non-thinking generation prompt (``enable_thinking=False``:
    ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``) followed by the answer and
    ``<|im_end|>\\n``, which is what the target sees when it answers in non-thinking mode.
    """
    if not thinking_off_prompt:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
    return f"{prompt}{messages[-1]['content']}{tokenizer.eos_token}\n"


def pack_windows(texts: Sequence[str], tokenizer: PreTrainedTokenizerFast, seq_len: int,
                 max_tokens: int | None = None) -> torch.Tensor:
    """Tokenize ``texts``, join them with ``<|endoftext|>`` and cut into windows.

    Special tokens in ``texts`` (from rendered chats) are parsed as special tokens.

    Returns:
        int64 tensor [N, seq_len]; the remainder shorter than one window is dropped, and at most
        ``max_tokens`` tokens (rounded down to whole windows) are kept when given.

    Raises:
        ValueError: if the texts hold fewer than ``seq_len`` tokens.
    """
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(tokenizer.pad_token_id)
    n = len(ids) // seq_len if max_tokens is None else min(len(ids), max_tokens) // seq_len
    if n == 0:
        raise ValueError(f"only {len(ids)} tokens for windows of {seq_len}: give more text or "
                         "lower seq_len")
    return torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)


def chat_eval_batch(tokenizer: PreTrainedTokenizerFast, rows: Sequence[dict],
                    thinking_off_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and labels for scoring the final assistant answer of each row.

    Labels keep the answer tokens and its closing ``<|im_end|>`` and are ``-100`` elsewhere
    (prompt, trailing newline, padding). Padding sits after the text, so causal attention needs no
    mask.

    Returns:
        (input_ids int64 [B, T], labels int64 [B, T]) with T the longest rendered row; rows are
        sorted by length so that ``evaluate`` batches carry little padding.
    """
    seqs, labels = [], []
    for row in sorted(rows, key=lambda r: sum(len(m["content"]) for m in r["messages"])):
        messages = row["messages"]
        text = render_training_chat(tokenizer, messages, thinking_off_prompt)
        start = text.rindex(messages[-1]["content"] + tokenizer.eos_token)
        end = start + len(messages[-1]["content"]) + len(tokenizer.eos_token)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        seqs.append(enc["input_ids"])
        labels.append([t if start <= a < end else IGNORE
                       for t, (a, _) in zip(enc["input_ids"], enc["offset_mapping"])])
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    return (torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=torch.long),
            torch.tensor([lab + [IGNORE] * (width - len(lab)) for lab in labels], dtype=torch.long))


@torch.no_grad()
def evaluate(model: Qwen3ForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             batch_size: int = 16) -> dict[str, float]:
    """Next-token loss and top-1 accuracy of ``model`` over labelled positions.

    Args:
        input_ids: int64 [N, T] token windows.
        labels: int64 [N, T], ``-100`` where not scored; default ``input_ids`` (score every
            position after the first of each window). Position t's logits are scored against
            ``labels[:, t + 1]``.
        batch_size: rows per forward pass; each batch is cut after its last scored column.

    Returns:
        ``{"loss": mean cross-entropy in nats per token, "top1": fraction of scored tokens whose
        argmax prediction is right, "tokens": number of scored tokens}``.
    """
    labels = input_ids if labels is None else labels
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(input_ids), batch_size):
        scored = (labels[i:i + batch_size] != IGNORE).any(0).nonzero()
        width = int(scored.max()) + 1 if len(scored) else 0
        if width < 2:
            continue
        logits = model(input_ids=input_ids[i:i + batch_size, :width]).logits[:, :-1].float()
        target = labels[i:i + batch_size, 1:width]
        keep = target != IGNORE
        loss_sum += F.cross_entropy(logits[keep], target[keep], reduction="sum").item()
        correct += (logits[keep].argmax(-1) == target[keep]).sum().item()
        count += int(keep.sum())
    return {"loss": loss_sum / max(count, 1), "top1": correct / max(count, 1), "tokens": count}


def _batches(data: torch.Tensor, rows: int, steps: int, gen: torch.Generator):
    """Yield ``steps`` batches of ``rows`` rows of ``data``, epoch by epoch in seeded order."""
    per_epoch = len(data) // rows
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(len(data), generator=gen)
        k = step % per_epoch
        yield data[order[k * rows:(k + 1) * rows]]


def train(model: Qwen3ForCausalLM, windows: torch.Tensor, spec: TargetSpec,
          on_step: Callable[[int, float], None] | None = None) -> dict[str, float]:
    """Train ``model`` in place for ``spec.steps`` AdamW steps on random batches of ``windows``.

    Batches are drawn epoch by epoch from a permutation seeded with ``spec.seed``; the loss is the
    mean next-token cross-entropy over every position of a window (nats per token).

    Args:
        windows: int64 [N, seq_len] packed token windows (``pack_windows``).
        on_step: called as ``on_step(step, loss)`` after each step (progress display).

    Returns:
        ``{"seconds": wall time, "steps_per_s", "tokens_per_s", "final_loss": mean loss of the last
        50 steps}``.

    Raises:
        ValueError: if there are fewer windows than ``spec.batch_size``.
    """
    if len(windows) < spec.batch_size:
        raise ValueError(f"{len(windows)} windows < batch_size={spec.batch_size}: give more text "
                         "or a smaller batch_size")
    gen = torch.Generator().manual_seed(spec.seed)
    batches = _batches(windows, spec.batch_size, spec.steps, gen)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; not norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = get_cosine_schedule_with_warmup(opt, spec.warmup_steps, spec.steps)
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    try:
        for step, batch in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16_autocast):
                loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(step + 1, losses[-1])
    finally:
        torch.set_num_threads(old_threads)
    seconds = time.perf_counter() - start
    tail = losses[-50:]
    return {"seconds": seconds, "steps_per_s": spec.steps / seconds,
            "tokens_per_s": spec.steps * spec.batch_size * windows.shape[1] / seconds,
            "final_loss": sum(tail) / len(tail) if tail else math.nan}


def new_model(spec: TargetSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    """A freshly initialised fp32 ``Qwen3ForCausalLM`` for ``spec`` (seeded with ``spec.seed``)."""
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(qwen3_config(spec, tokenizer))
    model.set_attn_implementation(spec.attn_implementation)
    return model
