"""What a new user waits for and keeps: `make train`'s install (gymflow alone) against `make test`'s
(every extra and the test bench), each into a new virtual environment from this checkout, the two
alternating, `--rounds` times; the install's wall time, the environment's size on disk, its
packages, and the ratios train / test. A third side, `--also SPEC`, adds any other install.

    .venv/bin/python benchmarks/install_size.py --rounds 2

pip's cache is warm after the first round (as on a machine that installed before); round 1 is
printed apart. Sizes are `du` of the whole environment (MiB and GiB). The largest packages of
each side are listed once.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = {"train (gymflow alone)": ".", "test (every extra, the bench)": ".[test]"}


def install(spec: str, folder: Path) -> tuple[float, int, int]:
    """A new venv at `folder` with `pip install -e REPO<spec>`: seconds, MiB on disk, packages."""
    python = folder / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    started = time.monotonic()
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-e", f"{REPO}{spec.lstrip('.')}"], check=True,
                   stderr=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    mib = int(subprocess.run(["du", "-sm", str(folder)], capture_output=True, text=True).stdout.split()[0])
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    return seconds, mib, len(listed.stdout.splitlines())


def largest(folder: Path, count: int = 8) -> str:
    site = next(folder.glob("lib/python*/site-packages"))
    sizes = subprocess.run(["du", "-sm", *map(str, site.iterdir())], capture_output=True, text=True).stdout
    rows = sorted((int(size), Path(path).name) for size, path in (line.split("\t") for line in sizes.splitlines()))
    return ", ".join(f"{name} {size}" for size, name in reversed(rows[-count:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--also", action="append", default=[], metavar="SPEC", help="another install, e.g. .[ui]")
    args = parser.parse_args()
    sides = SIDES | {f"also {spec}": spec for spec in args.also}
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for name, spec in (sides.items() if round_ % 2 == 0 else reversed(sides.items())):
                folder = Path(scratch, f"venv-{round_}-{len(results[name])}")
                results[name].append(install(spec, folder))
                seconds, mib, packages = results[name][-1]
                print(f"round {round_ + 1}, {name}: {seconds:.0f} s, {mib:,} MiB ({mib / 1024:.2f} GiB), "
                      f"{packages} packages", flush=True)
                if round_ == 0:
                    print(f"  largest (MiB): {largest(folder)}", flush=True)
                shutil.rmtree(folder)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    warm = {name: runs[1:] or runs for name, runs in results.items()}
    for name, runs in warm.items():
        print(f"{name}: install {statistics.median(r[0] for r in runs):.0f} s (warm cache), "
              f"{runs[0][1]:,} MiB, {runs[0][2]} packages")
    train, test = (warm[name] for name in SIDES)
    print(f"train / test: install {statistics.median(r[0] for r in train) / statistics.median(r[0] for r in test):.2f}, "
          f"size {train[0][1] / test[0][1]:.2f}")


if __name__ == "__main__":
    main()
