"""Render chats with the target's own chat template, tokenize, and build the loss mask.

The rule, for any template: an assistant turn is supervised on exactly what the template emits for
it after its generation prompt (what the target writes when serving that turn), reasoning and
reasoning markup included, plus the end-of-turn token; what the template drops (e.g. Qwen3 drops
the reasoning of turns before the last user turn) is not in the render, so it is not supervised;
nothing of a user or system turn is. How it is located (never by token value: pad may equal eos):

1. The chat is rendered once with every text replaced by a sentinel: each message's ``content``, an
   assistant turn's ``reasoning_content``, and the text between ``<think>``/``</think>`` tags written
   inline in an assistant's ``content`` (the tags stay, so a template that parses inline reasoning
   sees it). The sentinels split the render into template markup and text slots.
2. The real render (full, final: templates that rewrite earlier turns are covered) is aligned with
   those pieces; slot text is what the template actually emitted.
3. A turn's supervision starts inside the markup before its first slot, after the longest prefix of
   that turn's generation prompt (``add_generation_prompt=True`` minus ``False`` for the chat up to
   the turn) found there: Qwen3-2507's ``<|im_start|>assistant\n<think>\n`` prompt leaves the
   reasoning, ``</think>`` and the answer supervised; a template whose prompt stops at
   ``<|im_start|>assistant\n`` also supervises the ``<think>`` the target writes. It ends with the
   turn's last slot; the first token of the markup after it (the end-of-turn token) is supervised too.
4. The render is tokenized in one piece with special tokens parsed, so the ids equal the template's
   own ``apply_chat_template(..., tokenize=True)``, with one exception: a message text that contains
   a special token's text (e.g. a literal ``<|im_end|>`` in an answer) is tokenized on its own with
   ``split_special_tokens=True`` (it stays text, as it would if the target generated it). Tokens are
   supervised by their character offsets (a token overlapping a supervised span is supervised;
   needs a fast tokenizer). Added tokens that are not special (Qwen3's ``<think>``, ``</think>``)
   are parsed everywhere, as the target writes them.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pipeline.chats.ingest import RowError
from pipeline.config import RenderConfig, SystemPromptPolicy

_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_THINK_TAGS = re.compile("(<think>|</think>)")  # inline reasoning delimiters (Qwen3, QwQ, DeepSeek-R1)


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


def thinking_mode(cfg: RenderConfig) -> str:
    """One line naming the thinking mode, for results tables."""
    said = {True: "true (thinking on)", False: "false (thinking off)", None: "null (the template's default)"}
    return f"data.render.enable_thinking={said[cfg.enable_thinking]}"


def ignored_thinking_switch(tokenizer, cfg: RenderConfig) -> str | None:
    """A warning when ``cfg.enable_thinking`` is set but the template renders the same generation
    prompt with it true and false (e.g. Qwen3-4B-2507's always opens a think block); else None."""
    if cfg.enable_thinking is None:
        return None
    probe = [{"role": "user", "content": "q"}]
    try:
        on, off = (_template(tokenizer, probe, True, RenderConfig(enable_thinking=v)) for v in (True, False))
    except RowError:
        return None  # a template that cannot render a one-turn prompt says nothing here
    if on != off:
        return None
    return (f"data.render.enable_thinking={str(cfg.enable_thinking).lower()} has no effect on this target's chat "
            f"template (its generation prompt is {generation_prompt(tokenizer, probe, cfg)!r} either way)")


def _template(tokenizer, messages, add_generation_prompt: bool, cfg: RenderConfig) -> str:
    kwargs = {} if cfg.enable_thinking is None else {"enable_thinking": cfg.enable_thinking}
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # jinja raises TemplateError and arbitrary errors from template code
        raise RowError("template_error", str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _masked(messages) -> tuple[list[dict[str, str]], list[str], list[int]]:
    """The messages with their texts replaced by numbered sentinels; the texts; each slot's message."""
    texts: list[str] = []
    owner: list[int] = []

    def slot(text: str, i: int) -> str:
        texts.append(text)
        owner.append(i)
        return _SENTINEL.format(len(texts) - 1)

    masked = []
    for i, m in enumerate(messages):
        mm = dict(m)
        if m["role"] == "assistant":  # empty texts stay empty: templates test them for truth
            parts = _THINK_TAGS.split(m["content"])
            mm["content"] = "".join(p if k % 2 or not p else slot(p, i) for k, p in enumerate(parts))
            if m.get("reasoning_content"):
                mm["reasoning_content"] = slot(m["reasoning_content"], i)
        else:
            mm["content"] = slot(m["content"], i)
        masked.append(mm)
    return masked, texts, owner


def _pieces(tokenizer, messages, add_generation_prompt: bool, cfg: RenderConfig) -> list[tuple[str, int]]:
    """Split the real render into ``(text, message index)`` pieces; index -1 marks template markup."""
    masked, texts, owner = _masked(messages)
    skeleton = _template(tokenizer, masked, add_generation_prompt, cfg)
    parts = _SENTINEL_RE.split(skeleton)  # markup, slot, markup, slot, ..., markup
    markup, order = parts[0::2], [int(i) for i in parts[1::2]]
    if len(order) != len(set(order)):
        raise RowError("template_rewrites_content", "the template repeats a message")
    real = _template(tokenizer, messages, add_generation_prompt, cfg)
    contents = [texts[i] for i in order]
    if "".join(m + c for m, c in zip(markup, contents)) + markup[-1] != real:
        # the template rewrote some text (e.g. strips it): recover what it emitted
        pattern = "(.*?)".join(re.escape(m) for m in markup)
        match = re.fullmatch(pattern, real, flags=re.DOTALL)
        if match is None:
            raise RowError("template_rewrites_content", "markup of the real render differs")
        contents = list(match.groups())
    pieces: list[tuple[str, int]] = []
    for m, k, c in zip(markup, order, contents):
        pieces += [(m, -1), (c, owner[k])]
    pieces.append((markup[-1], -1))
    return pieces


def generation_prompt(tokenizer, messages, cfg: RenderConfig) -> str:
    """The text the template appends for ``add_generation_prompt=True`` after ``messages``.

    Raises:
        RowError: ``template_error``.
    """
    plain = _template(tokenizer, messages, False, cfg)
    full = _template(tokenizer, messages, True, cfg)
    n = next((k for k, (a, b) in enumerate(zip(plain, full)) if a != b), min(len(plain), len(full)))
    return full[n:]


def _header_end(markup: str, prompt: str) -> int:
    """Where a turn's text starts in the markup before its first slot: after the last occurrence of
    the longest prefix of its generation prompt; all of the markup when none occurs."""
    for k in range(len(prompt), 0, -1):
        pos = markup.rfind(prompt[:k])
        if pos >= 0:
            return pos + k
    return len(markup)


def _segments(pieces: list[tuple[str, int]], prompts: dict[int, str], specials: Sequence[str]
              ) -> list[tuple[str, bool, bool]]:
    """``(text, supervised, literal)`` segments of the render: each answer in ``prompts`` (message
    index -> its generation prompt) is supervised from its header's end to its last slot; message
    text holding a special token's text is ``literal`` (tokenized with special tokens split)."""
    sup = [False] * len(pieces)
    cut: dict[int, int] = {}  # markup piece -> header end inside it
    for i, prompt in prompts.items():
        ks = [k for k, (_, o) in enumerate(pieces) if o == i]
        if not ks:
            continue  # the template emitted nothing of this turn
        for k in range(ks[0], ks[-1] + 1):
            sup[k] = True
        cut[ks[0] - 1] = _header_end(pieces[ks[0] - 1][0], prompt)
    out = []
    for k, (text, owner) in enumerate(pieces):
        literal = owner >= 0 and any(t in text for t in specials)
        if k in cut:
            out += [(text[: cut[k]], False, False), (text[cut[k]:], True, False)]
        else:
            out.append((text, sup[k], literal))
    return [s for s in out if s[0]]


def _with_one_bos(tokenizer, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """Exactly one BOS when the tokenizer uses one (whether or not the template wrote it)."""
    bos = tokenizer.bos_token_id
    if bos is None or tokenizer("a", add_special_tokens=False)["input_ids"] == tokenizer("a")["input_ids"]:
        return ids, mask  # the tokenizer adds nothing: no BOS convention (e.g. Qwen)
    while len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids, mask = ids[1:], mask[1:]
    if not ids or ids[0] != bos:
        ids, mask = [bos, *ids], [0, *mask]
    return ids, mask


def tokenize_segments(tokenizer, segments: list[tuple[str, bool, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of ``(text, supervised, literal)`` segments.

    The text is tokenized in one piece (a fast tokenizer, special tokens parsed), cut only around
    ``literal`` segments (tokenized with ``split_special_tokens=True``). A token is supervised when
    its characters (``offset_mapping``) overlap a supervised segment; so is the first token after
    each supervised run (the end-of-turn token).
    """
    text = "".join(t for t, _, _ in segments)
    runs: list[list[int]] = []  # supervised [start, end) character ranges
    chunks: list[list] = []  # [start, end, literal]
    pos = 0
    for t, sup, literal in segments:
        end = pos + len(t)
        if sup:
            if runs and runs[-1][1] == pos:
                runs[-1][1] = end
            else:
                runs.append([pos, end])
        if chunks and not literal and not chunks[-1][2]:
            chunks[-1][1] = end
        else:
            chunks.append([pos, end, literal])
        pos = end
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for a, b, literal in chunks:
        enc = tokenizer(text[a:b], add_special_tokens=False, split_special_tokens=literal,
                        return_offsets_mapping=True)
        ids += enc["input_ids"]
        spans += [(a + s, a + e) for s, e in enc["offset_mapping"]]
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e in spans], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in runs:
        mask |= (starts < b) & (ends > a)
        after = np.flatnonzero(starts >= b)
        if len(after):
            mask[after[0]] = True
    return _with_one_bos(tokenizer, ids, mask.astype(int).tolist())


def render_chat(tokenizer, messages: Sequence[dict[str, str]], cfg: RenderConfig, *,
                max_length: int, min_loss_tokens: int) -> RenderedChat:
    """Render a normalised chat for the cache: tokens, loss mask (module docstring) and content hash.

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
    prompts = {i: generation_prompt(tokenizer, msgs[:i], cfg) for i in answers}
    segments = _segments(_pieces(tokenizer, msgs, False, cfg), prompts, tokenizer.all_special_tokens)
    ids, mask = tokenize_segments(tokenizer, segments)
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
    """Token ids of ``messages`` followed by the template's generation prompt (generate, evaluate),
    in ``cfg.enable_thinking``'s mode.

    Raises:
        RowError: ``template_error`` or ``template_rewrites_content``.
    """
    msgs = apply_render_policy(messages, cfg)
    pieces = _pieces(tokenizer, msgs, True, cfg)
    return tokenize_segments(tokenizer, _segments(pieces, {}, tokenizer.all_special_tokens))[0]
