"""Hydra configs: ``tiny.yaml`` (the embedded default) and ``qwen3_4b.yaml`` (the public recipe)."""
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent
