"""What a compat check found: ``ok:`` / ``FAIL:`` lines, ``row:`` JSON lines for the README table
(``tests/envs/compat/table.py``), and the closing ``N passed, M failed`` with the exit status. Shared by
the check scripts, each run by its tool's own interpreter (``python tests/envs/compat/check_<tool>.py OUT``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


class Findings:
    """Checks and table rows of one compat script, written to ``OUT/rows-<script>.json`` at the end."""

    def __init__(self, out: Path, script: str):
        self.out, self.script, self.results, self.rows = out, Path(script).stem, [], []

    def row(self, cells: dict) -> None:
        print("row: " + json.dumps(cells))
        self.rows.append(cells)

    def report(self, ok: bool, what: str) -> bool:
        print(f"{'ok' if ok else 'FAIL'}: {what}", flush=True)
        self.results.append(ok)
        return ok

    def finish(self) -> None:
        """Write the rows, print the tally and exit (1 on any failure)."""
        (self.out / f"rows-{self.script}.json").write_text(json.dumps(self.rows, indent=1))
        passed = sum(self.results)
        print(f"{passed} passed, {len(self.results) - passed} failed")
        sys.exit(0 if all(self.results) else 1)
