"""Serving a policy: its ONNX graph in ONNX Runtime against gymflow's pyfunc model, both loaded by
MLflow as `mlflow models serve` loads them, for a CartPole MLP (cartpole-ppo) and an Atari CNN
(breakout-ppo, 4 stacked 84x84 frames).

    .venv/bin/python benchmarks/serving.py                 # 3 rounds of 2 s a side
    .venv/bin/python benchmarks/serving.py --rounds 5 --seconds 4

For each policy (its network's initial weights: the time does not depend on them), predictions per
second with one observation a request and with a batch of 256, the sides alternating round by
round (this VM drifts by tens of percent within minutes), each figure the median over rounds, each
ratio the median of the rounds' own; then each model's folder size and the installed size of what
serving it needs (the model's pip requirements and everything they require, as installed here).
The last line:

    ONNX Runtime / pyfunc, predictions per second: R (CartPole, 1), R (CartPole, 256), R (Atari, 1), R (Atari, 256)
    pyfunc logging decisions / pyfunc, predictions per second: R (CartPole, 1), ...

The third side is the pyfunc model serving as a deployment that logs every decision sets it
(epsilon-greedy exploration, each decision written to a folder by the log's own thread).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

POLICIES = {"CartPole": "cartpole-ppo", "Atari": "breakout-ppo"}
EXPLORATION = {"CartPole": "epsilon=0.1", "Atari": "epsilon=0.05"}
BATCHES = (1, 256)


def saved_models(preset: str, folder: Path) -> dict[str, str]:
    """The pyfunc model and the ONNX one of `preset`'s policy, saved under `folder`."""
    import mlflow
    import onnx

    from gymflow.agents.export import onnx_policy
    from gymflow.presets.validate import resolve_experiment
    from gymflow.tasks.tracking.models import save_policy_model
    from gymflow.testing.policies import untrained_policy_model

    experiment = resolve_experiment(preset)
    folder.mkdir(parents=True)
    algorithm, config = experiment.algorithm, experiment.preset.agent
    model = untrained_policy_model(preset)
    weights = model.policy
    save_policy_model(model, str(folder / "pyfunc"))
    graph = onnx_policy(algorithm, config, experiment.observation_space, experiment.action_space, weights)
    mlflow.onnx.save_model(onnx.load_from_string(graph), str(folder / "onnx"), save_as_external_data=False,
                           onnx_execution_providers=["CPUExecutionProvider"])
    return {"pyfunc": str(folder / "pyfunc"), "onnx": str(folder / "onnx")}


def predictions_per_second(model, observations: np.ndarray, onnx: bool, seconds: float) -> float:
    request = {"observations": observations} if onnx else observations
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        model.predict(request)
        done += len(observations)
    return done / (time.perf_counter() - started)


def installed_megabytes(requirements_file: Path) -> float:
    """The installed size here of the requirements and all they require, in MB."""
    wanted = [re.split(r"[<>=!~\[; ]", line.strip())[0] for line in requirements_file.read_text().splitlines()
              if line.strip() and not line.startswith(("-", "#"))]
    seen: set[str] = set()
    while wanted:
        name = wanted.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        wanted += [re.split(r"[<>=!~\[; (]", requirement)[0] for requirement in distribution.requires or []
                   if "extra ==" not in requirement]
    return sum(_size(metadata.distribution(name)) for name in seen) / 1e6


def _size(distribution: metadata.Distribution) -> int:
    return sum(os.path.getsize(path) for file in distribution.files or []
               if os.path.isfile(path := str(distribution.locate_file(file))))


def _folder_megabytes(folder: str) -> float:
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file()) / 1e6


def main() -> None:
    import mlflow
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.rounds} rounds of {args.seconds:g} s a side, torch and ONNX Runtime on their defaults, "
          f"{os.cpu_count()} cores")
    ratios, logging_ratios = [], []
    with tempfile.TemporaryDirectory() as folder:
        for name, preset in POLICIES.items():
            paths = saved_models(preset, Path(folder, name))
            models = {side: mlflow.pyfunc.load_model(path) for side, path in paths.items()}
            models["logging"] = mlflow.pyfunc.load_model(paths["pyfunc"], model_config={  # every decision logged
                "decision_log": str(Path(folder, name, "decisions")), "exploration": EXPLORATION[name]})
            shape = models["pyfunc"].metadata.signature.inputs.inputs[0].shape[1:]
            dtype = np.uint8 if len(shape) == 3 else np.float32
            for batch in BATCHES:
                observations = np.random.default_rng(0).integers(0, 255, (batch, *shape)).astype(dtype)
                figures: dict[str, list[float]] = {side: [] for side in models}
                for _ in range(args.rounds):
                    for side, model in models.items():
                        figures[side].append(predictions_per_second(model, observations, side == "onnx", args.seconds))
                ratio = statistics.median(o / p for o, p in zip(figures["onnx"], figures["pyfunc"], strict=True))
                logged = statistics.median(o / p for o, p in zip(figures["logging"], figures["pyfunc"], strict=True))
                ratios.append((name, batch, ratio))
                logging_ratios.append((name, batch, logged))
                print(f"{name:9s} batch {batch:3d}  pyfunc {statistics.median(figures['pyfunc']):10,.0f}/s  "
                      f"ONNX Runtime {statistics.median(figures['onnx']):10,.0f}/s  ratio {ratio:.2f}  "
                      f"pyfunc logging decisions {statistics.median(figures['logging']):10,.0f}/s  ratio {logged:.2f}")
            for side, path in paths.items():
                print(f"{name:9s} {side:6s} model {_folder_megabytes(path):7.2f} MB, what serving it installs "
                      f"{installed_megabytes(Path(path, 'requirements.txt')):8.0f} MB")
    print("ONNX Runtime / pyfunc, predictions per second: "
          + ", ".join(f"{ratio:.2f} ({name}, {batch})" for name, batch, ratio in ratios))
    print("pyfunc logging decisions / pyfunc, predictions per second: "
          + ", ".join(f"{ratio:.2f} ({name}, {batch})" for name, batch, ratio in logging_ratios))


if __name__ == "__main__":
    main()
