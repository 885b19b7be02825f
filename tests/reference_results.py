"""Results that a refactor must not move: the final weights of two short, fixed runs.

    python tests/reference_results.py            # run both, compare with this machine's kind's results
    python tests/reference_results.py --record   # run both, record them as this machine's kind's

Each run is `gymflow run PRESET --set seed=7 --set schedule.total_env_steps=20000
--set schedule.target_return=null` in a temporary folder; its final checkpoint's
`policy.safetensors` and `learner.safetensors` are hashed straight from the files (no gymflow
import, so the check outlives any reorganisation of the code). Float results depend on the CPU's
instruction set, so the file keeps them per kind: each kind's results with the machines that
gave them (VMs of one kind show different flags). `--record` on a machine whose results are a
kind's already lists it there; other results become a kind of their own. The tests check
wherever a kind names the machine.
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


def _prefect_api() -> dict[str, str]:
    """The Prefect API this process uses, if any (the tests'), for the command: no temporary API of its own."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value()} if PREFECT_API_URL.value() else {}


def final_weights(preset: str) -> dict[str, str]:
    """sha256 of the final checkpoint's blobs after one fixed run of `preset`."""
    gymflow = Path(sys.executable).with_name("gymflow")
    with tempfile.TemporaryDirectory() as folder:
        settings = [*OVERRIDES, f"storage.root={folder}/data", f"tracking.tracking_uri=sqlite:///{folder}/mlflow.db"]
        command = [str(gymflow), "run", preset, "--quiet", *(arg for s in settings for arg in ("--set", s))]
        subprocess.run(command, cwd=folder, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **_prefect_api()})
        (run,) = Path(folder, "data", "runs").iterdir()
        checkpoints = run / "checkpoints"
        version = json.loads((checkpoints / "latest").read_text())["version"]
        final = checkpoints / f"v{version:06d}"
        return {"version": version} | {name: hashlib.sha256((final / name).read_bytes()).hexdigest() for name in BLOBS}


Kind = dict  # {"machines": [machine(), ...], "results": {preset: final_weights(preset)}}


def kinds() -> list[Kind]:
    return json.loads(REFERENCE.read_text())["kinds"]


def recorded_here(recorded: list[Kind], here: str) -> dict[str, dict[str, str]] | None:
    """The results recorded for this machine's kind; None where no kind lists it."""
    return next((kind["results"] for kind in recorded if here in kind["machines"]), None)


def with_results(recorded: list[Kind], here: str, results: dict[str, dict[str, str]]) -> list[Kind]:
    """The kinds after recording `results` on machine `here`: listed with the kind that has the
    same results (or a new one), and with no other."""
    others = [{**kind, "machines": [m for m in kind["machines"] if m != here]} for kind in recorded]
    others = [kind for kind in others if kind["machines"]]
    for kind in others:
        if kind["results"] == results:
            kind["machines"].append(here)
            return others
    return [*others, {"machines": [here], "results": results}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true",
                        help="record the results as this machine's kind's (a new kind where they match none)")
    args = parser.parse_args()
    here, recorded = machine(), kinds()
    expected = recorded_here(recorded, here)
    if expected is None and not args.record:  # said before the runs, not after them
        print(f"no results recorded for {here}; `--record` records them")
        return 1
    results = {preset: final_weights(preset) for preset in PRESETS}
    if args.record:
        REFERENCE.write_text(json.dumps({"kinds": with_results(recorded, here, results)}, indent=1) + "\n")
        print(f"recorded {REFERENCE} for {here}")
        return 0
    failed = False
    for preset, result in results.items():
        same = result == expected[preset]
        failed |= not same
        print(f"{preset:14} {'same' if same else 'DIFFERENT'}  {json.dumps(result)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
