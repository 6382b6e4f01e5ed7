"""The README's compatibility table from the rows the checks wrote (``OUT/rows-check_*.json``).

    python3 tests/envs/compat/table.py OUT

Each cell comes from a check script's own measurement: ``loads`` (every exported tensor lands, no
missing or unexpected key, values equal), ``lossless`` (the tool's own greedy speculative decoding
gives the target's greedy tokens; ``-`` where the tool was not asked to decode), ``as trained``
(block layout, heads and vocabulary as the product trained them) and what the tool ignores.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CELL = {True: "yes", False: "no", None: "-"}


def main(out: Path) -> None:
    rows = [r for p in sorted(out.glob("rows-check_*.json")) for r in json.loads(p.read_text())]
    if not rows:
        sys.exit(f"no rows-check_*.json under {out}: run the checks first (make test-compat)")
    print("| tool | version | export format | drafter | loads | lossless | as trained | ignores / notes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tool']} | {r['version']} | {r['format']} | {r['drafter']} | {CELL[r['loads']]} | "
              f"{CELL[r['lossless']]} | {CELL[r['as_trained']]} | {r['ignores'].replace('|', '/')} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: table.py OUT")
    main(Path(sys.argv[1]))
