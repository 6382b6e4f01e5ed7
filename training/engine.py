"""Optimizer engines behind one small interface: DeepSpeed ZeRO (stages 1-3; AdamW, or DeepSpeed's
Muon for the backbone's hidden matrices with AdamW for the rest) or plain PyTorch DDP with AdamW
(``zero_stage=0``, the cross-check). Only the drafter's trainable parameters reach the optimizer:
the frozen ``embed_tokens`` / ``lm_head`` carry no optimizer state.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

log = logging.getLogger("training.engine")

MUON_MOMENTUM = 0.95
"""Muon's momentum (its authors' value, and DeepSpeed's default)."""

STALE_BUILD_LOCK_S = 600.0
"""Age (seconds) past which a DeepSpeed op's build lock is stale: the op builds in about 30 s."""


def clear_stale_build_locks(root: str | None = None, max_age_s: float = STALE_BUILD_LOCK_S) -> list[str]:
    """Remove the build locks of DeepSpeed's JIT-built ops older than ``max_age_s`` seconds.

    torch's C++-extension loader takes ``<extensions root>/<op>/lock`` before it builds or even
    loads an op, and waits while that file exists; a build killed mid-way (a worker of a killed job)
    leaves it behind, and every later DeepSpeed CPU init (which loads ``deepspeed_shm_comm``) would
    wait on it forever. The lock is created once per build and never touched, so its age is the
    build's age.

    Args:
        root: the extensions root (default: ``$TORCH_EXTENSIONS_DIR``, else torch's default root
            and its per-accelerator folders).

    Returns:
        The lock files removed (each also logged as a warning).
    """
    from torch.utils.cpp_extension import get_default_build_root

    roots = [Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())]
    if root is None and "TORCH_EXTENSIONS_DIR" not in os.environ:
        roots += [p for p in roots[0].glob("py*") if p.is_dir()]
    removed = []
    for lock in (lk for r in roots for lk in r.glob("deepspeed*/lock")):
        try:
            if time.time() - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                removed.append(str(lock))
                log.warning("removed a stale DeepSpeed op build lock (%s, older than %.0f s): a build was "
                            "killed mid-way; the op is rebuilt", lock, max_age_s)
        except FileNotFoundError:  # another worker removed it, or its build just finished
            continue
    return removed


def lr_lambda(total_steps: int, warmup_ratio: float):
    """Multiplier of the peak lr at optimizer step s (0-based): linear warmup over
    ``W = ceil(warmup_ratio * total_steps)`` steps, ``(s + 1) / (W + 1)``, then cosine to 0,
    ``0.5 (1 + cos(pi (s - W) / (total - W)))``, whose first step (s = W) is the peak lr."""
    warm = math.ceil(warmup_ratio * total_steps)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(total_steps - warm, 1)))

    return f


def worker_device() -> torch.device:
    """The device of this worker's model: ``cuda:LOCAL_RANK`` (the launcher's local rank, 0 when
    unset) where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@contextlib.contextmanager
def muon_selection(model: torch.nn.Module):
    """Within the block, DeepSpeed's Muon tags (``param.use_muon``) follow the model's own
    ``muon_parameters()`` instead of DeepSpeed's name rule; a model without that method keeps
    DeepSpeed's rule.

    DeepSpeed (``deepspeed.set_optimizer_flags``, run inside ``deepspeed.initialize``) gives Muon
    every parameter of two or more dimensions whose name lacks ``embed`` / ``lm_head``: in the
    drafter that is also the Markov embedding ``markov_w1`` [V, r], the Markov output
    ``markov_w2`` [V_draft, r] and the confidence projection [1, H + r]. Muon is meant for the
    hidden matrices only; embeddings and output heads take AdamW (Jordan et al. 2024, "Muon: an
    optimizer for hidden layers"). DeepSpeed splits its Muon and AdamW groups by these tags.
    """
    select = getattr(model, "muon_parameters", None)
    if select is None:
        yield
        return
    import deepspeed
    from deepspeed.runtime.config import MUON_OPTIMIZER

    chosen = {id(p) for p in select()}
    deepspeed_flags = deepspeed.set_optimizer_flags

    def flags(config_class, module):
        deepspeed_flags(config_class, module)
        if config_class.optimizer_name == MUON_OPTIMIZER:
            for p in module.parameters():
                p.use_muon = id(p) in chosen

    with mock.patch.object(deepspeed, "set_optimizer_flags", flags):
        yield


def deepspeed_config(*, micro_batch: int, accumulation: int, grad_clip: float, zero_stage: int, bf16: bool,
                     lr: float, betas: tuple[float, float], weight_decay: float,
                     muon_lr: float | None = None) -> dict:
    """The DeepSpeed config dict of :class:`DeepSpeedEngine` (pure: no DeepSpeed import).

    With ``bf16`` the gradients are accumulated over micro-steps in fp32
    (``"data_types": {"grad_accum_dtype": "fp32"}``): without it DeepSpeed accumulates them in the
    model's bf16 (ZeRO-2 / ZeRO-3 add each micro-step's reduced bf16 gradient into a bf16 buffer,
    8 bits of mantissa over ``accumulation`` additions). DeepSpeed then keeps fp32 gradient
    partitions under ZeRO-2 / ZeRO-3 and, at ZeRO-1, wraps the optimizer in its ``BF16_Optimizer``
    (ZeRO-1 partitioning with fp32 accumulation; its Muon requires fp32 accumulation). The
    per-micro-step gradient reduction still communicates in bf16 (``communication_data_type``
    defaults to the model dtype). In fp32 training there is no ``data_types`` entry: nothing changes.

    Args:
        micro_batch: samples per micro-step and rank. accumulation: micro-steps per optimizer step.
        grad_clip: global gradient-norm clip (ignored with Muon: 0). zero_stage: 1-3. bf16: bf16
            parameters and compute. lr, betas, weight_decay: AdamW's (with Muon, its non-matrix half).
        muon_lr: None = client AdamW (no ``optimizer`` entry); else DeepSpeed's Muon at this lr.
    Returns:
        the config dict passed to ``deepspeed.initialize``.
    """
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": grad_clip, "zero_optimization": {"stage": zero_stage},
              "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
              "zero_allow_untested_optimizer": True}
    if bf16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if muon_lr is not None:
        # DeepSpeed orthogonalises the Muon matrices' updates before its norm and clip, so a clip
        # would scale the updates, not the gradients: Muon's updates are normalised already.
        config["gradient_clipping"] = 0.0
        # torch's AdamW for the non-matrix half: DeepSpeed's CPU Adam kernel keeps beta^t as a running
        # float product but recomputes it with pow() after a restart, so a resumed run drifted from
        # an uninterrupted one by 1 ulp at some steps; torch derives it from the saved step count.
        config["optimizer"] = {"type": "Muon", "params": {
            "muon_lr": muon_lr, "adam_lr": lr, "betas": list(betas), "momentum": MUON_MOMENTUM,
            "weight_decay": weight_decay, "torch_adam": True}}
    return config


class DeepSpeedEngine:
    """DeepSpeed ZeRO with a client ``torch.optim.AdamW`` (no DeepSpeed op build on CPU), or with
    DeepSpeed's own Muon (``muon_lr`` set): Newton-Schulz-orthogonalised momentum (Jordan et al.
    2024, "Muon: an optimizer for hidden layers") for the model's ``muon_parameters()`` (the
    drafter: its backbone's hidden matrices, :meth:`training.drafter.Drafter.muon_parameters`;
    a model without the method: DeepSpeed's rule, 2-D and not named ``embed`` / ``lm_head``,
    :func:`muon_selection`), and ``torch.optim.AdamW`` (DeepSpeed's ``torch_adam``: a resumed run
    stays bitwise equal) at ``lr`` for the rest (embeddings, heads, norms); both follow
    :func:`lr_lambda`. With Muon ``grad_clip`` is not applied (DeepSpeed orthogonalises before its
    clip, which would scale the updates), and on CPU the worker process runs the Newton-Schulz
    iterations eagerly (``torch._dynamo`` off). The DeepSpeed config is :func:`deepspeed_config`'s
    (bf16: fp32 gradient accumulation)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 total_steps: int, warmup_ratio: float, zero_stage: int, bf16: bool, micro_batch: int,
                 accumulation: int, grad_clip: float, muon_lr: float | None = None):
        import deepspeed

        clear_stale_build_locks()
        config = deepspeed_config(micro_batch=micro_batch, accumulation=accumulation, grad_clip=grad_clip,
                                  zero_stage=zero_stage, bf16=bf16, lr=lr, betas=betas, weight_decay=weight_decay,
                                  muon_lr=muon_lr)
        schedule = lr_lambda(total_steps, warmup_ratio)
        if muon_lr is None:
            opt = torch.optim.AdamW(model.trainable_parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        else:
            opt = None
            if not torch.cuda.is_available():
                # DeepSpeed torch.compile's its Newton-Schulz kernels: on CPU that is minutes of C++
                # builds per new matrix shape for what are microseconds of eager matmuls here.
                torch._dynamo.config.disable = True
            sched = lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)  # noqa: E731
        with muon_selection(model):
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=opt, lr_scheduler=sched, config=config,
                model_parameters=model.trainable_parameters())
        self.module = self.engine.module
        self.stage = zero_stage

    def __call__(self, *args):
        return self.engine(*args)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scaled by 1 / accumulation inside DeepSpeed

    def step(self) -> None:
        self.engine.step()  # steps the optimizer and scheduler at accumulation boundaries only

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[-1]  # AdamW's (with Muon, the non-matrix half)

    def save(self, local_dir: str, tag: str) -> None:
        """Collective: every rank writes its own files under ``local_dir``, without the frozen
        ``embed_tokens`` / ``lm_head`` (rebuilt from the target when the drafter is built)."""
        self.engine.save_checkpoint(local_dir, tag=tag, exclude_frozen_parameters=True)

    def load(self, local_dir: str, tag: str) -> None:
        """Load checkpoint ``tag`` (every rank's optimizer files under ``local_dir``); the frozen
        weights it lacks keep the target's values the drafter was built with."""
        path, _ = self.engine.load_checkpoint(local_dir, tag=tag, load_module_strict=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint {tag} under {local_dir}")

    def consolidated_state(self) -> dict[str, torch.Tensor]:
        """Full trainable state on rank 0 (collective under ZeRO-3)."""
        if self.stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.module.state_dict()
        return state or {}


class DDPEngine:
    """Plain PyTorch DDP with manual accumulation, clipping, AdamW and the same lr schedule. A model
    on the CPU moves to :func:`worker_device` (``cuda:LOCAL_RANK`` with CUDA) before DDP wraps it;
    one already placed elsewhere stays there."""

    def __init__(self, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 total_steps: int, warmup_ratio: float, accumulation: int, grad_clip: float, **_):
        from training.data import module_device

        self.device = module_device(model)
        if self.device.type == "cpu":
            self.device = worker_device()
        self.module = model.to(self.device)
        ids = None
        if self.device.type == "cuda":  # NCCL works on the current device: make it this rank's
            torch.cuda.set_device(self.device)
            ids = [self.device.index]
        self.ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids) if dist.is_initialized() else model
        self.optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=lr, betas=betas,
                                           weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(total_steps, warmup_ratio))
        self.accumulation, self.grad_clip, self._micro = accumulation, grad_clip, 0

    def __call__(self, *args):
        return self.ddp(*args)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accumulation).backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro % self.accumulation:
            return
        torch.nn.utils.clip_grad_norm_(self.module.trainable_parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, local_dir: str, tag: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            out = Path(local_dir) / tag
            out.mkdir(parents=True, exist_ok=True)
            model = {k: v for k, v in self.module.state_dict().items() if k not in _frozen_names(self.module)}
            torch.save({"model": model, "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "micro": self._micro}, out / "ddp_state.pt")

    def load(self, local_dir: str, tag: str) -> None:
        state = torch.load(Path(local_dir) / tag / "ddp_state.pt", map_location=self.device, weights_only=False)
        missing, unexpected = self.module.load_state_dict(state["model"], strict=False)
        if set(missing) - _frozen_names(self.module) or unexpected:
            raise RuntimeError(f"{local_dir}/{tag}: the checkpoint does not fit the drafter (missing "
                               f"{sorted(set(missing) - _frozen_names(self.module))}, unexpected {unexpected})")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._micro = state["micro"]

    def consolidated_state(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()


def _frozen_names(module: torch.nn.Module) -> set[str]:
    """State-dict names of the module's frozen parameters (the target's ``embed_tokens`` / ``lm_head``)."""
    return {n for n, p in module.named_parameters() if not p.requires_grad}


def make_engine(model: torch.nn.Module, zero_stage: int, **kw):
    """DeepSpeed ZeRO for stages 1-3, plain DDP for stage 0."""
    return DeepSpeedEngine(model, zero_stage=zero_stage, **kw) if zero_stage > 0 else DDPEngine(model, **kw)
