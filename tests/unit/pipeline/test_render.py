"""Rendering with the target's chat template and the loss mask (assistant content + end of turn)."""
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from pipeline.chats.ingest import Chat, RowError, iter_chats
from pipeline.config import RenderConfig, SystemPromptPolicy
from pipeline.embedded.tokenizer import build_tokenizer
from pipeline.chats.render import render_chat, render_prompt

RC = RenderConfig()


@pytest.fixture(scope="module")
def tok():
    src = Path(sysconfig.get_paths()["stdlib"]) / "json"
    texts = [p.read_text() for p in sorted(src.glob("*.py"))]
    return build_tokenizer(texts * 2 + ["word " * 50], vocab_size=600)


def _render(tok, msgs, **kw):
    return render_chat(tok, msgs, kw.pop("cfg", RC), max_length=kw.pop("max_length", 4096),
                       min_loss_tokens=kw.pop("min_loss_tokens", 1))


def _supervised_text(tok, r):
    return tok.decode(r.input_ids[r.loss_mask == 1].tolist())


def test_single_turn_mask_is_answer_plus_eot(tok):
    msgs = [{"role": "user", "content": "Write add."}, {"role": "assistant", "content": "def add(a, b):\n    return a + b"}]
    r = _render(tok, msgs)
    assert r.input_ids.dtype == np.int32 and r.loss_mask.dtype == np.uint8
    assert tok.decode(r.input_ids.tolist()) == tok.apply_chat_template(msgs, tokenize=False)
    assert _supervised_text(tok, r) == "def add(a, b):\n    return a + b<|im_end|>"
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    sup_ids = r.input_ids[r.loss_mask == 1]
    assert sup_ids[-1] == eot and r.loss_mask[-1] == 0  # the trailing "\n" is markup
    # the mask is a single contiguous span
    assert np.all(np.diff(np.flatnonzero(r.loss_mask)) == 1)


def test_multi_turn_supervises_only_answers(tok):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Define x."},
            {"role": "assistant", "content": "x = 1"}, {"role": "user", "content": "Now double it."},
            {"role": "assistant", "content": "x = 2 * x"}]
    r = _render(tok, msgs)
    spans = np.split(np.flatnonzero(r.loss_mask), np.flatnonzero(np.diff(np.flatnonzero(r.loss_mask)) > 1) + 1)
    texts = [tok.decode(r.input_ids[s].tolist()) for s in spans]
    assert texts == ["x = 1<|im_end|>", "x = 2 * x<|im_end|>"]


def test_pad_equal_eos_keeps_final_eos_supervised(tok):
    import copy
    t2 = copy.deepcopy(tok)
    t2.pad_token = t2.eos_token
    assert t2.pad_token_id == t2.eos_token_id
    r = _render(t2, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}])
    eot = t2.eos_token_id
    last_eot = np.flatnonzero(r.input_ids == eot)[-1]
    assert r.loss_mask[last_eot] == 1
    assert _supervised_text(t2, r) == "answer<|im_end|>"


def test_literal_special_text_in_answer_stays_content(tok):
    content = "The marker is <|im_end|> and nothing else."
    r = _render(tok, [{"role": "user", "content": "Print the end marker."}, {"role": "assistant", "content": content}])
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    sup = r.input_ids[r.loss_mask == 1]
    assert list(sup).count(eot) == 1 and sup[-1] == eot  # only the real end of turn is special
    assert _supervised_text(tok, r) == content + "<|im_end|>"


def test_truncation_and_min_loss_tokens(tok):
    msgs = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "short answer"}]
    full = _render(tok, msgs)
    with pytest.raises(RowError) as e:
        _render(tok, msgs, max_length=len(full.input_ids) - full.num_supervised - 2)
    assert e.value.reason == "no_supervised_tokens"
    with pytest.raises(RowError) as e:
        _render(tok, msgs, min_loss_tokens=full.num_supervised + 1)
    assert e.value.reason == "too_few_loss_tokens"
    cut = _render(tok, msgs, max_length=len(full.input_ids) - 2)  # drops the trailing "\n" and the eot
    assert cut.num_supervised == full.num_supervised - 1 and len(cut.input_ids) == len(full.input_ids) - 2


def test_system_policies_and_thinking_prompt(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    drop = _render(tok, msgs, cfg=RenderConfig(system_prompt=SystemPromptPolicy.drop))
    assert tok.decode(drop.input_ids.tolist()).startswith("<|im_start|>user\nq")
    default = _render(tok, msgs[1:], cfg=RenderConfig(system_prompt=SystemPromptPolicy.default,
                                                      default_system_prompt="D"))
    assert tok.decode(default.input_ids.tolist()).startswith("<|im_start|>system\nD<|im_end|>")
    ids = render_prompt(tok, msgs[1:2], RenderConfig(enable_thinking=False))
    assert tok.decode(ids) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_template_that_rewrites_content_is_aligned(tok):
    import copy
    t2 = copy.deepcopy(tok)
    t2.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
                        "<|im_end|>\n{% endfor %}")
    r = _render(t2, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\n  answer  \n"}])
    assert _supervised_text(t2, r) == "answer<|im_end|>"


def test_input_cases_render(tok, input_cases):
    """Every kept row of the input cases renders with its answers (and only them) supervised."""
    rows = [r for r in iter_chats(str(input_cases / "chats" / "openai.jsonl"), 0) if isinstance(r, Chat)]
    by_id = {r.row_id: r for r in rows}
    o2 = _render(tok, by_id["o2"].messages)
    assert "You answer in one line." in tok.decode(o2.input_ids.tolist())
    assert _supervised_text(tok, o2) == "7<|im_end|>"
    o13 = by_id["o13"].messages[1]["content"]
    r13 = _render(tok, by_id["o13"].messages)
    assert _supervised_text(tok, r13) == o13 + "<|im_end|>"  # CJK, ZWJ emoji, RTL, combining marks
    o14 = _render(tok, by_id["o14"].messages)
    assert tok.decode(o14.input_ids.tolist()).count("<|im_start|>user") == 2
    o20 = _render(tok, by_id["o20"].messages)
    assert _supervised_text(tok, o20) == "Hello.<|im_end|>" and "Bye." not in tok.decode(o20.input_ids.tolist())
    o19 = by_id["o19"].messages
    with pytest.raises(RowError) as e:
        _render(tok, o19, max_length=64)
    assert e.value.reason == "no_supervised_tokens"
    assert _render(tok, by_id["o1"].messages).content_hash == _render(tok, by_id["o16"].messages).content_hash
