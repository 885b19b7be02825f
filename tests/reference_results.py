"""Results that a refactor must not move: the final weights of two short, fixed runs.

    python tests/reference_results.py            # run both, compare with reference_results.json
    python tests/reference_results.py --record   # run both, write reference_results.json
    python tests/reference_results.py --same-here  # run both; if they match, list this machine too

Each run is `gymflow run PRESET --set seed=7 --set schedule.total_env_steps=20000
--set schedule.target_return=null` in a temporary folder; its final checkpoint's
`policy.safetensors` and `learner.safetensors` are hashed straight from the files (no gymflow
import, so the check outlives any reorganisation of the code). Float results depend on the CPU's
instruction set, so the file lists the machines on which these results were taken or found again
(VMs of one kind show different flags: the tests check wherever the list names the machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REFERENCE = Path(__file__).with_name("reference_results.json")
PRESETS = ("cartpole-ppo", "cartpole-dqn")
OVERRIDES = ("seed=7", "schedule.total_env_steps=20000", "schedule.target_return=null")
BLOBS = ("policy.safetensors", "learner.safetensors")


def machine() -> str:
    """The CPU model and its vector instruction sets: what float results depend on."""
    flags: set[str] = set()
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            if name.strip() == "flags":
                flags = {flag for flag in value.split() if flag.startswith(("avx", "fma", "sse", "amx"))}
                break
    return f"{platform.machine()} {model} [{' '.join(sorted(flags))}]"


def final_weights(preset: str) -> dict[str, str]:
    """sha256 of the final checkpoint's blobs after one fixed run of `preset`."""
    gymflow = Path(sys.executable).with_name("gymflow")
    with tempfile.TemporaryDirectory() as folder:
        settings = [*OVERRIDES, f"storage.root={folder}/data", f"tracking.tracking_uri=sqlite:///{folder}/mlflow.db"]
        command = [str(gymflow), "run", preset, "--quiet", *(arg for s in settings for arg in ("--set", s))]
        subprocess.run(command, cwd=folder, check=True, stdout=subprocess.DEVNULL, env={**os.environ})
        (run,) = Path(folder, "data", "runs").iterdir()
        checkpoints = run / "checkpoints"
        version = json.loads((checkpoints / "latest").read_text())["version"]
        final = checkpoints / f"v{version:06d}"
        return {"version": version} | {name: hashlib.sha256((final / name).read_bytes()).hexdigest() for name in BLOBS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write reference_results.json instead of checking")
    parser.add_argument("--same-here", action="store_true",
                        help="where both results match, add this machine to those the tests check on")
    args = parser.parse_args()
    results = {preset: final_weights(preset) for preset in PRESETS}
    if args.record:
        write_reference([machine()], results)
        print(f"recorded {REFERENCE}")
        return 0
    reference = json.loads(REFERENCE.read_text())
    if machine() not in reference["machines"]:
        print(f"warning: recorded on {reference['machines']}, checking on {machine()}")
    failed = False
    for preset, result in results.items():
        same = result == reference["results"][preset]
        failed |= not same
        print(f"{preset:14} {'same' if same else 'DIFFERENT'}  {json.dumps(result)}")
    if args.same_here and not failed and machine() not in reference["machines"]:
        write_reference([*reference["machines"], machine()], reference["results"])
        print(f"added this machine to {REFERENCE}")
    return 1 if failed else 0


def write_reference(machines: list[str], results: dict[str, dict[str, str]]) -> None:
    REFERENCE.write_text(json.dumps({"machines": machines, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
