"""Checkpoint bytes before / after issue #35.7 (frozen target weights out of the checkpoint,
``drafter.safetensors`` in the training dtype, one download per node on resume).

Two parts, printed side by side:

1. The real job (``conf/qwen3_4b.yaml`` on Qwen3-4B's published config), from parameter counts of the
   drafter built on the ``meta`` device (no memory): DeepSpeed ZeRO-2 in bf16 with AdamW stores, per
   trainable parameter, 2 bytes of bf16 weights in the model states and 12 in the optimizer states
   (fp32 master, ``exp_avg``, ``exp_avg_sq``); before the fix the model states also held the frozen
   ``embed_tokens`` and ``lm_head`` (2 x V x H bf16: the tied Qwen3-4B embedding, copied twice) and
   ``drafter.safetensors`` held the trainable weights in fp32.
2. Measured: one bf16 ZeRO-2 engine at the real vocabulary, layer count and Markov rank but hidden
   size 256 (to fit 4 GiB), saved the old way and the new way, file bytes against the same formulas.

Run: ``DS_ACCELERATOR=cpu .venv/bin/python bench/bench_checkpoint.py`` (single process, ~1.5 GiB).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from common import REPO

import torch

GB = 1e9
SHAPES = REPO / "pipeline" / "target_model" / "shapes" / "qwen3_4b.json"


def _drafter(target_config, spec, device: str):
    """The real job's drafter on ``target_config`` (frozen embedding passed twice: the loop's two fp32 copies)."""
    from training.drafter import Drafter

    V, H = target_config.vocab_size, target_config.hidden_size
    with torch.device(device):
        embed = torch.randn(V, H) * 0.02 if device != "meta" else torch.empty(V, H)
        return Drafter(spec, target_config, embed, embed.clone())


def _counts(model) -> tuple[int, int]:
    """(trainable, frozen) parameter counts; frozen counts each stored copy."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(v.numel() for k, v in model.state_dict().items() if k.startswith(("embed_tokens.", "lm_head.")))
    return trainable, frozen


def predicted(trainable: int, frozen: int, ranks: int = 8) -> dict[str, dict[str, float]]:
    """Bytes of one checkpoint (all ranks together) and of a resume's download per node of ``ranks``."""
    before = {"model_states": 2 * (trainable + frozen), "optimizer": 12 * trainable, "drafter": 4 * trainable}
    after = {"model_states": 2 * trainable, "optimizer": 12 * trainable, "drafter": 2 * trainable}
    for d in (before, after):
        d["total"] = sum(d.values())
    before["resume_download_per_node"] = ranks * (before["model_states"] + before["optimizer"])
    after["resume_download_per_node"] = after["model_states"] + after["optimizer"]
    return {"before": before, "after": after}


def real_shape() -> dict:
    from omegaconf import OmegaConf  # noqa: F401  (load_config's dependency, imported for a clear error)
    from transformers import Qwen3Config

    from pipeline.drafters import drafter_config
    from pipeline.run import load_config

    cfg = load_config(REPO / "conf" / "qwen3_4b.yaml")
    spec = drafter_config(cfg.train.drafters["dspark"], cfg)
    tc = Qwen3Config(**json.loads(SHAPES.read_text()))
    trainable, frozen = _counts(_drafter(tc, spec, "meta"))
    return {"trainable": trainable, "frozen": frozen, **predicted(trainable, frozen, cfg.train.num_workers)}


def _engine(model):
    from training.engine import make_engine

    return make_engine(model, 2, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.0, total_steps=10, warmup_ratio=0.04,
                       bf16=True, micro_batch=1, accumulation=1, grad_clip=1.0)


def _sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def measured(hidden: int = 256) -> dict:
    """Save one bf16 ZeRO-2 engine the old way (frozen weights kept, fp32 drafter.safetensors) and the new
    way; returns file bytes and the formulas' predictions."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    from pipeline.drafters import drafter_config
    from pipeline.run import load_config
    from training.loop import FROZEN_PREFIXES

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29731"}.items():
        os.environ.setdefault(k, v)
    cfg = load_config(REPO / "conf" / "qwen3_4b.yaml")
    spec = drafter_config(cfg.train.drafters["dspark"], cfg)
    shape = json.loads(SHAPES.read_text())
    shape.update(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64)
    torch.manual_seed(0)
    model = _drafter(Qwen3Config(**shape), spec, "cpu")
    trainable, frozen = _counts(model)
    engine = _engine(model)
    loss = sum((p.float() ** 2).mean() for p in model.parameters() if p.requires_grad)
    engine.backward(loss)
    engine.step()  # creates the optimizer states
    weights = {k: v.detach() for k, v in engine.consolidated_state().items() if not k.startswith(FROZEN_PREFIXES)}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in ("before", "after"):
            folder = Path(tmp) / way
            if way == "before":
                engine.engine.save_checkpoint(str(folder), tag="t")
                save_file({k: v.float().contiguous() for k, v in weights.items()}, str(folder / "drafter.safetensors"))
            else:
                engine.save(str(folder), "t")
                save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "drafter.safetensors"))
            files = _sizes(folder)
            out[way] = {"model_states": files["mp_rank_00_model_states.pt"],
                        "optimizer": sum(n for f, n in files.items() if f.endswith("optim_states.pt")),
                        "drafter": files["drafter.safetensors"]}
            out[way]["total"] = sum(out[way].values())
    return {"hidden": hidden, "trainable": trainable, "frozen": frozen, "measured": out,
            "predicted": predicted(trainable, frozen, 1)}


def main() -> None:
    real = real_shape()
    print(f"real job (conf/qwen3_4b.yaml, Qwen3-4B): {real['trainable']:,} trainable parameters, "
          f"{real['frozen']:,} frozen values stored before (2 x 151,936 x 2560)")
    print(f"{'file':<28}{'before GB':>12}{'after GB':>12}{'after/before':>14}")
    for k in ("model_states", "optimizer", "drafter", "total", "resume_download_per_node"):
        b, a = real["before"][k], real["after"][k]
        print(f"{k:<28}{b / GB:>12.3f}{a / GB:>12.3f}{a / b:>14.3f}")
    m = measured()
    print(f"\nmeasured: bf16 ZeRO-2 engine at hidden {m['hidden']} (real vocabulary, layers, Markov rank), "
          f"{m['trainable']:,} trainable, {m['frozen']:,} frozen")
    print(f"{'file':<16}{'before MB':>11}{'predicted':>11}{'after MB':>11}{'predicted':>11}{'after/before':>14}")
    for k in ("model_states", "optimizer", "drafter", "total"):
        b, a = m["measured"]["before"][k], m["measured"]["after"][k]
        pb, pa = m["predicted"]["before"][k], m["predicted"]["after"][k]
        print(f"{k:<16}{b / 1e6:>11.2f}{pb / 1e6:>11.2f}{a / 1e6:>11.2f}{pa / 1e6:>11.2f}{a / b:>14.3f}")


if __name__ == "__main__":
    main()
