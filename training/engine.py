"""Optimizer engines behind one small interface: DeepSpeed ZeRO (stages 1-3) or plain PyTorch DDP
(``zero_stage=0``, the cross-check). Only the drafter's trainable parameters reach the optimizer:
the frozen ``embed_tokens`` / ``lm_head`` carry no optimizer state.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist


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


class DeepSpeedEngine:
    """DeepSpeed ZeRO with a client ``torch.optim.AdamW`` (no DeepSpeed op build on CPU)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 total_steps: int, warmup_ratio: float, zero_stage: int, bf16: bool, micro_batch: int,
                 accumulation: int, grad_clip: float):
        import deepspeed

        opt = torch.optim.AdamW(model.trainable_parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, warmup_ratio))
        config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
                  "gradient_clipping": grad_clip, "zero_optimization": {"stage": zero_stage},
                  "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
                  "zero_allow_untested_optimizer": True}
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
        return self.scheduler.get_last_lr()[0]

    def save(self, local_dir: str, tag: str) -> None:
        """Collective: every rank writes its own files under ``local_dir``."""
        self.engine.save_checkpoint(local_dir, tag=tag)

    def load(self, local_dir: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(local_dir, tag=tag)
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
    """Plain PyTorch DDP with manual accumulation, clipping, AdamW and the same lr schedule."""

    def __init__(self, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 total_steps: int, warmup_ratio: float, accumulation: int, grad_clip: float, **_):
        self.module = model
        self.ddp = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
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
            torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "micro": self._micro}, out / "ddp_state.pt")

    def load(self, local_dir: str, tag: str) -> None:
        state = torch.load(Path(local_dir) / tag / "ddp_state.pt", weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._micro = state["micro"]

    def consolidated_state(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()


def make_engine(model: torch.nn.Module, zero_stage: int, **kw):
    """DeepSpeed ZeRO for stages 1-3, plain DDP for stage 0."""
    return DeepSpeedEngine(model, zero_stage=zero_stage, **kw) if zero_stage > 0 else DDPEngine(model, **kw)
