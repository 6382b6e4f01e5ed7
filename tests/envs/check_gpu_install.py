"""Check that the GPU install resolves: ``pip install -c constraints-gpu.txt -e '.[gpu]'`` (CUDA torch,
vLLM and the pipeline in one environment, docs/cluster.md), replayed as a dry run against PyPI in a
throwaway virtual environment. Nothing is installed and no GPU is needed; it needs PyPI.

    python3 tests/envs/check_gpu_install.py [--constraints constraints-gpu.txt] [--extras gpu]   (make check-gpu-install)

The dry run (``pip install --dry-run --ignore-installed --report``) resolves from the wheels' metadata:
PEP 658 metadata files where the index serves them, else HTTP range reads of each wheel's metadata
(``--use-feature=fast-deps``; ``--no-fast-deps`` downloads every wheel whole instead, about 4.5 GB for
this set). It then asserts that the resolution succeeded, that torch is a CUDA build (torch requires the
CUDA wheels and they are in the resolved set), that torch, vllm, deepspeed, ray and transformers
resolved to the versions pinned in the constraints file, and that every resolved package is pinned there
(else the file is stale). Prints a table of the tested versions and the times; exits 1 with the reason
when a check fails, 2 when this machine cannot run the check (not Linux x86_64 / Python 3.11).

Stdlib only, no project imports: it runs with the system ``python3`` before anything is installed.
The project's ``pyproject.toml`` is copied into the temporary directory and resolved from there
(``--in-tree`` resolves ``.`` itself), so the check writes nothing into the working tree.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEY_PACKAGES = ("torch", "vllm", "deepspeed", "ray", "transformers")
PROJECT = "dspark-pipeline"
# pip settings kept from the caller's environment: where and how to reach the index (a site's mirror,
# proxy, certificates). Everything else pip reads from the environment or its config files (local
# find-links such as a CPU torch wheel, extra indexes, global constraints) is dropped, so the dry run sees
# what a GPU node installing from the index sees.
KEEP_PIP_ENV = ("PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST", "PIP_PROXY",
                "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES", "PIP_DISABLE_PIP_VERSION_CHECK")


class CheckFailed(Exception):
    """A check of the resolved set failed; the message says which and why."""


def canon(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_constraints(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints file (comments and blank lines skipped)."""
    pins = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        if not m:
            raise CheckFailed(f"{path.name}:{n}: not a `name==version` pin: {raw!r}")
        pins[canon(m.group(1))] = m.group(2)
    return pins


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in KEEP_PIP_ENV}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf: neither the user's nor a machine's (/etc/xdg/pip)
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise CheckFailed(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{out[-3000:]}") from None


def downloaded_mb(pip_output: str) -> tuple[int, float]:
    """Whole files pip downloaded (its ``Downloading name (size)`` lines): count and MB."""
    unit = {"bytes": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}
    sizes = [float(n) * unit[u] for n, u in re.findall(r"Downloading \S+ \(([\d.]+) (bytes|kB|MB|GB)\)", pip_output)]
    return len(sizes), sum(sizes)


def cuda_variant(resolved: dict[str, dict]) -> str:
    """The CUDA release of the resolved set, from cuda-toolkit or the CUDA runtime wheel."""
    if "cuda-toolkit" in resolved:
        v = resolved["cuda-toolkit"]["version"]
        return f"CUDA {'.'.join(v.split('.')[:2])} (cuda-toolkit {v})"
    for name, item in sorted(resolved.items()):
        if name.startswith("nvidia-cuda-runtime"):
            m = re.search(r"-cu(\d+)$", name)
            major = m.group(1) if m else item["version"].split(".")[0]
            return f"CUDA {major} ({name} {item['version']})"
    return "CUDA ?"


def check_report(report: dict, pins: dict[str, str], constraints: str) -> list[tuple[str, str, str]]:
    """The checks on pip's ``--report``; returns the (package, pinned, resolved) rows of KEY_PACKAGES."""
    resolved = {canon(i["metadata"]["name"]): i for i in report["install"]}
    resolved = {k: {"version": v["metadata"]["version"], "item": v} for k, v in resolved.items()}
    if PROJECT not in resolved:
        raise CheckFailed(f"{PROJECT} itself is not in pip's report")
    rows, errors = [], []
    for name in KEY_PACKAGES:
        got, want = resolved.get(name, {}).get("version"), pins.get(name)
        rows.append((name, want or "-", got or "-"))
        if want is None:
            errors.append(f"{name} is not pinned in {constraints}")
        elif got is None:
            errors.append(f"{name} is not in the resolved set (is it still a dependency of .[gpu]?)")
        elif got != want:
            errors.append(f"{name} resolved to {got}, {constraints} pins {want}")
    torch = resolved.get("torch")
    if torch:
        version, meta = torch["version"], torch["item"]["metadata"]
        cuda_reqs = [r for r in meta.get("requires_dist", []) if re.match(r"(nvidia-|cuda-toolkit)", r)]
        runtime = [n for n in resolved if n.startswith("nvidia-cuda-runtime")]
        if "+" in version and not version.split("+", 1)[1].startswith("cu"):
            errors.append(f"torch {version} is a {version.split('+', 1)[1]} build, not CUDA")
        if not cuda_reqs:
            errors.append(f"torch {version}'s metadata requires no nvidia-*/cuda-toolkit package: not a CUDA build")
        if not runtime:
            errors.append("no nvidia-cuda-runtime* wheel in the resolved set: torch is not a CUDA build")
        rows.append(("cuda", "-", cuda_variant(resolved)))
    unpinned = sorted(f"{n}=={d['version']}" for n, d in resolved.items() if n != PROJECT and n not in pins)
    if unpinned:
        errors.append(f"{constraints} is stale: {len(unpinned)} resolved packages are not pinned there "
                      f"(new dependencies?): {', '.join(unpinned[:20])}")
    differ = sorted(f"{n} {d['version']} (pinned {pins[n]})" for n, d in resolved.items()
                    if n in pins and d["version"] != pins[n] and n not in KEY_PACKAGES)
    if differ:
        errors.append(f"resolved versions differ from {constraints}: {', '.join(differ[:20])}")
    if errors:
        raise CheckFailed("\n".join(f"- {e}" for e in errors))
    extra = sorted(set(pins) - set(resolved))
    if extra:
        print(f"note: {len(extra)} pins of {constraints} are not in the resolved set: {', '.join(extra[:10])}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--constraints", default=str(REPO / "constraints-gpu.txt"))
    ap.add_argument("--extras", default="gpu", help="the project's extras to resolve (default: gpu)")
    ap.add_argument("--python", default=sys.executable, help="Python 3.11 to build the throwaway venv from")
    ap.add_argument("--no-fast-deps", action="store_true",
                    help="no HTTP range reads: pip downloads each wheel whose index serves no PEP 658 metadata")
    ap.add_argument("--in-tree", action="store_true",
                    help="resolve '.' itself (setuptools then rewrites dspark_pipeline.egg-info in the tree)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds for the dry run (default 1200)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (venv, report.json, pip.log)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    constraints = Path(args.constraints).resolve()

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        print(f"check_gpu_install: {constraints.name} is resolved for Linux x86_64; this is "
              f"{platform.system()} {platform.machine()}", file=sys.stderr)
        return 2
    probe = subprocess.run([args.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != "3.11":
        print(f"check_gpu_install: {constraints.name} is resolved for Python 3.11; {args.python} is "
              f"{probe.stdout.strip() or probe.stderr.strip()} (pass --python python3.11)", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="dspark-gpu-install-"))
    env = pip_env()
    try:
        pins = read_constraints(constraints)
        venv = tmp / "venv"
        t = time.perf_counter()
        r = run([args.python, "-m", "venv", str(venv)], env, 300)
        if r.returncode != 0:
            raise CheckFailed(f"python -m venv failed:\n{r.stderr[-2000:]}")
        py = str(venv / "bin" / "python")
        r = run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], env, 300)
        if r.returncode != 0:
            raise CheckFailed(f"upgrading pip in the throwaway venv failed (is the index reachable?):\n"
                              f"{(r.stdout + r.stderr)[-3000:]}")
        pip_version = run([py, "-m", "pip", "--version"], env, 60).stdout.split()[1]
        venv_s = time.perf_counter() - t

        if args.in_tree:
            source, cwd = f".[{args.extras}]", REPO
        else:  # the metadata is pyproject.toml's: resolve a copy, leave the tree (and its egg-info) alone
            src = tmp / "src"
            src.mkdir()
            for name in ("pyproject.toml", "setup.py", "setup.cfg"):
                if (REPO / name).is_file():
                    shutil.copy2(REPO / name, src / name)
            source, cwd = f"{src}[{args.extras}]", tmp
        report_path = tmp / "report.json"
        cmd = [py, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
               "--report", str(report_path), "-c", str(constraints), source]
        if not args.no_fast_deps:
            cmd.insert(4, "--use-feature=fast-deps")
        index = env.get("PIP_INDEX_URL", "https://pypi.org/simple")
        print(f"resolving .[{args.extras}] with {constraints.name} against {index} (pip {pip_version}, "
              f"{'whole wheels' if args.no_fast_deps else 'metadata only'}) ...", flush=True)
        t = time.perf_counter()
        r = run(cmd, env, args.timeout, cwd=cwd)
        resolve_s = time.perf_counter() - t
        (tmp / "pip.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            raise CheckFailed(f"pip could not resolve the GPU install (exit {r.returncode}):\n"
                              f"  {' '.join(cmd)}\n{(r.stdout + r.stderr)[-4000:]}")
        report = json.loads(report_path.read_text())
        rows = check_report(report, pins, constraints.name)
        files, mb = downloaded_mb(r.stdout)
    except CheckFailed as e:
        print(f"check_gpu_install: FAILED after {time.perf_counter() - t0:.0f} s\n{e}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n| package | {constraints.name} | resolved |\n|---|---|---|")
    for name, want, got in rows:
        print(f"| {name} | {want} | {got} |")
    print(f"\nresolved {len(report['install']) - 1} packages (+ the project) for Linux x86_64, Python 3.11, each as pinned: "
          f"dry run {resolve_s:.1f} s, venv + pip {venv_s:.1f} s, total {time.perf_counter() - t0:.1f} s; "
          f"whole files downloaded: {files} ({mb:.0f} MB)")
    print("versions: " + " ".join(f"{name}=={got}" for name, _, got in rows if name in KEY_PACKAGES))
    print("check_gpu_install: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
