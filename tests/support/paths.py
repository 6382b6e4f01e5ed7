"""The repository's root, for tests that read its files or run its scripts (``tests/support`` is on
pytest's ``pythonpath``: ``from paths import REPO``)."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
