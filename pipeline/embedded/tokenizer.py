"""A small Qwen3-like byte-level BPE tokenizer with ChatML special tokens and a chat template.

Trained here with the `tokenizers` library (no hub download): Qwen2/Qwen3's pre-tokenizer regex, a
byte-level alphabet (any text round-trips), no BOS token, and Qwen3's special tokens. The chat
template follows Qwen3's ChatML layout, including its ``enable_thinking`` switch.
"""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
MASK_TOKEN = "<|mask|>"
# Ids 0..5 in this order: every special id is below any vocab size the trainer accepts.
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, THINK_START, THINK_END, MASK_TOKEN)

# Qwen2/Qwen3's pre-tokenizer split (tokenizer.json of Qwen/Qwen3-*): words, single digits,
# punctuation runs, newline runs and whitespace runs are separate pre-tokens.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as in Qwen3: one `<|im_start|>{role}\n{content}<|im_end|>\n` per turn; the generation
# prompt opens an assistant turn and, with enable_thinking=false, closes an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unsupported chat role ' + message['role']"
    " + ': use system, user or assistant') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 2048,
                    model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on ``texts``.

    Args:
        texts: training text (e.g. Python sources); iterated once.
        vocab_size: total vocabulary size in tokens, including the 256 byte symbols and the six
            special tokens (ids 0..5: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
            (eos: end of turn, as in Qwen3 instruct), ``<think>``, ``</think>``, ``<|mask|>``).
            The result has exactly this size when the text holds enough distinct merges, fewer
            otherwise.
        model_max_length: the maximum sequence length, in tokens, the tokenizer advertises.

    Returns:
        A ``PreTrainedTokenizerFast`` with no BOS token, ``padding_side="right"`` and the ChatML
        ``chat_template`` (see ``CHAT_TEMPLATE``). Save it with ``save_pretrained(dir,
        save_jinja_files=False)`` to keep the template inside ``tokenizer_config.json``.

    Raises:
        ValueError: if ``vocab_size`` is below 262 (256 bytes + 6 special tokens).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is too small: use at least {MIN_VOCAB_SIZE} "
                         "(256 byte symbols + 6 special tokens)")
    tok = Tokenizer(models.BPE())
    # no normalizer (Qwen's NFC would compose combining marks): every text round-trips byte-exactly
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token=IM_END, pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, THINK_START, THINK_END, MASK_TOKEN],
        chat_template=CHAT_TEMPLATE, model_max_length=model_max_length, padding_side="right",
        clean_up_tokenization_spaces=False)
