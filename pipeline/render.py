"""Render chats with the target's own chat template, tokenize, and build the loss mask.

How supervision is located (never by token value: pad may equal eos):
1. The chat is rendered once with every message's content replaced by a sentinel; the sentinels
   split the rendered text into template markup and content slots.
2. The real render (full, final: templates that rewrite earlier turns are covered) is aligned with
   those pieces; content text is what the template actually emitted for that message.
3. Markup is tokenized with special tokens parsed; content with ``split_special_tokens=True``, so a
   literal ``<|im_end|>`` written inside an answer stays text, as it would if the target generated it.
4. The loss mask covers exactly each assistant turn's content tokens plus the first token of the
   markup that follows it (the template's end-of-turn token).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pipeline.chats import RowError
from pipeline.config import RenderConfig, SystemPromptPolicy

_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True)
class RenderedChat:
    """A tokenized chat. ``input_ids`` int32 [T], ``loss_mask`` uint8 [T] (1 = supervised)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    content_hash: str  # blake2b-128 hex of (input_ids, loss_mask): identical renders hash equal

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


def apply_render_policy(messages: Sequence[dict[str, str]], cfg: RenderConfig) -> list[dict[str, str]]:
    """Apply the system prompt policy (keep / drop / default) to a normalised chat."""
    msgs = [dict(m) for m in messages]
    if cfg.system_prompt == SystemPromptPolicy.drop:
        msgs = [m for m in msgs if m["role"] != "system"]
    elif cfg.system_prompt == SystemPromptPolicy.default and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": cfg.default_system_prompt})
    return msgs


def render_options(cfg: RenderConfig) -> dict[str, Any]:
    """The render options as recorded in cache fingerprints and summaries."""
    return {"system_prompt": cfg.system_prompt.value, "default_system_prompt": cfg.default_system_prompt,
            "enable_thinking": cfg.enable_thinking}


def _template(tokenizer, messages, add_generation_prompt: bool, cfg: RenderConfig) -> str:
    kwargs = {} if cfg.enable_thinking is None else {"enable_thinking": cfg.enable_thinking}
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # jinja raises TemplateError and arbitrary errors from template code
        raise RowError("template_error", str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _pieces(tokenizer, messages, add_generation_prompt: bool, cfg: RenderConfig) -> list[tuple[str, int]]:
    """Split the real render into ``(text, message index)`` pieces; index -1 marks template markup."""
    masked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    skeleton = _template(tokenizer, masked, add_generation_prompt, cfg)
    parts = _SENTINEL_RE.split(skeleton)  # markup, idx, markup, idx, ..., markup
    markup, order = parts[0::2], [int(i) for i in parts[1::2]]
    if sorted(order) != sorted(set(order)):
        raise RowError("template_rewrites_content", "the template repeats a message")
    real = _template(tokenizer, messages, add_generation_prompt, cfg)
    contents = [messages[i]["content"] for i in order]
    if "".join(m + c for m, c in zip(markup, contents)) + markup[-1] != real:
        # the template rewrote some content (e.g. strips it): recover what it emitted
        pattern = "(.*?)".join(re.escape(m) for m in markup)
        match = re.fullmatch(pattern, real, flags=re.DOTALL)
        if match is None:
            raise RowError("template_rewrites_content", "markup of the real render differs")
        contents = list(match.groups())
    pieces: list[tuple[str, int]] = []
    for m, i, c in zip(markup, order, contents):
        pieces += [(m, -1), (c, i)]
    pieces.append((markup[-1], -1))
    return [(t, i) for t, i in pieces if t]


def _encode(tokenizer, text: str, is_content: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=is_content)["input_ids"]


def _with_one_bos(tokenizer, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """Exactly one BOS when the tokenizer uses one (whether or not the template wrote it)."""
    bos = tokenizer.bos_token_id
    if bos is None or _encode(tokenizer, "a", False) == tokenizer("a")["input_ids"]:
        return ids, mask  # the tokenizer adds nothing: no BOS convention (e.g. Qwen)
    while len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids, mask = ids[1:], mask[1:]
    if not ids or ids[0] != bos:
        ids, mask = [bos, *ids], [0, *mask]
    return ids, mask


def tokenize_pieces(tokenizer, pieces: list[tuple[str, int]], supervised: set[int]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask for rendered pieces; messages in ``supervised`` are masked in,
    each with the first token of the markup that follows it (end of turn)."""
    ids: list[int] = []
    mask: list[int] = []
    eot_pending = False
    for text, idx in pieces:
        toks = _encode(tokenizer, text, idx >= 0)
        sup = idx in supervised
        m = [1 if sup else 0] * len(toks)
        if idx < 0 and eot_pending and toks:
            m[0] = 1
        eot_pending = sup
        ids += toks
        mask += m
    return _with_one_bos(tokenizer, ids, mask)


def render_chat(tokenizer, messages: Sequence[dict[str, str]], cfg: RenderConfig, *,
                max_length: int, min_loss_tokens: int) -> RenderedChat:
    """Render a normalised chat for the cache: tokens, loss mask and content hash.

    Trailing turns after the last assistant turn are dropped (nothing there is supervised). The
    sample is truncated to ``max_length`` tokens; rows left with no supervised token, or fewer
    than ``min_loss_tokens``, raise before any target compute.

    Returns:
        RenderedChat with ``input_ids`` int32 [T <= max_length] and ``loss_mask`` uint8 [T].

    Raises:
        RowError: ``template_error``, ``template_rewrites_content``, ``no_answer``,
            ``no_supervised_tokens`` or ``too_few_loss_tokens``.
    """
    msgs = apply_render_policy(messages, cfg)
    answers = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not answers:
        raise RowError("no_answer")
    msgs = msgs[: answers[-1] + 1]
    pieces = _pieces(tokenizer, msgs, False, cfg)
    ids, mask = tokenize_pieces(tokenizer, pieces, set(answers))
    ids, mask = ids[:max_length], mask[:max_length]
    n_sup = sum(mask)
    if n_sup == 0:
        raise RowError("no_supervised_tokens", f"max_length={max_length}")
    if n_sup < min_loss_tokens:
        raise RowError("too_few_loss_tokens", f"{n_sup} < data.min_loss_tokens={min_loss_tokens}")
    input_ids = np.asarray(ids, dtype=np.int32)
    loss_mask = np.asarray(mask, dtype=np.uint8)
    digest = hashlib.blake2b(input_ids.tobytes() + loss_mask.tobytes(), digest_size=16).hexdigest()
    return RenderedChat(input_ids, loss_mask, digest)


def render_prompt(tokenizer, messages: Sequence[dict[str, str]], cfg: RenderConfig) -> list[int]:
    """Token ids of ``messages`` followed by the template's generation prompt (generate, evaluate).

    Raises:
        RowError: ``template_error`` or ``template_rewrites_content``.
    """
    msgs = apply_render_policy(messages, cfg)
    ids, _ = tokenize_pieces(tokenizer, _pieces(tokenizer, msgs, True, cfg), set())
    return ids
