"""``python -m pipeline.embedded [--home DIR] [--train-target]``: build the embedded target + data, show metrics."""
from __future__ import annotations

import argparse
import json
import time

from pipeline.embedded.build import ensure_embedded


def main(argv: list[str] | None = None) -> None:
    """Build (or reuse) the embedded target and chats and print where they are and how good."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.embedded", description=__doc__)
    parser.add_argument("--home", help="cache root (default: $DSPARK_HOME or ~/.cache/dspark)")
    parser.add_argument("--train-target", action="store_true",
                        help="train the target (about 6 minutes on 2 cores) instead of copying the shipped one; "
                             "only for a home not built yet")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    paths = ensure_embedded(args.home, progress=True, train_target=args.train_target)
    m = json.loads(paths.metrics.read_text("utf-8"))
    print(f"embedded build: {paths.home} (ready in {time.perf_counter() - start:.1f} s; "
          f"built in {m['build_seconds']:.0f} s)")
    how = "shipped with the package, trained" if m.get("target") == "shipped" else "trained"
    print(f"  target      {paths.target_dir}: {m['params'] / 1e6:.2f} M params, {how} {m['steps']} steps "
          f"in {m['train_seconds']:.0f} s ({m['steps_per_s']:.2f} steps/s, "
          f"{m['tokens_per_s']} tokens/s, Python {m['python']})")
    print(f"  chats       {paths.train_chats} ({m['chats']['train']} rows, "
          f"{m['chats']['train_modules']} modules)")
    print(f"              {paths.heldout_chats} ({m['chats']['heldout']} rows, "
          f"{m['chats']['heldout_modules']} held-out modules)")
    for key, label in (("heldout_source", "held-out module source"),
                       ("heldout_chat", "held-out chat answers"),
                       ("heldout_chat_no_think", "same, enable_thinking=False prompt")):
        r = m[key]
        print(f"  {label:<36} loss {r['loss']:.3f} nats/token, top-1 {r['top1']:.1%} "
              f"({r['tokens']} tokens)")


if __name__ == "__main__":
    main()
