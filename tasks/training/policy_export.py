"""`gymflow export-policy`: a run's policy as an ONNX file a team copies anywhere, made from the run's
storage (its preset and published policy) as delivery makes the `policy-onnx` model."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from gymflow.errors import GymflowError, InvalidPreset
from gymflow.tasks.storage.checkpoints import POLICY_BLOB, latest_policy_version, read_policy, versions_on
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage
from gymflow.tasks.storage.records import has_run_record, read_run_record, read_stored_preset


@dataclass(frozen=True)
class ExportedPolicy:
    version: int
    chosen: str  # how the version was chosen, in words
    path: str
    size: int  # bytes


def export_policy(storage: Storage, run_id: str, version: int | None, to: str, policy_name: str | None = None
                  ) -> ExportedPolicy:
    """Write version `version` of the run's policy (None: the one the run delivered, per its MLflow
    run, else its newest) to the file `to` as an ONNX graph (`policy_name`: one of its agent groups'
    separate policies); a GymflowError in one line where it cannot be, with nothing written."""
    from gymflow.agents.algorithms import algorithm_of
    from gymflow.agents.export import CannotExport, onnx_policy
    from gymflow.envs.make import env_spaces
    from gymflow.presets.load import validate_preset_data

    if not has_run_record(storage, run_id):
        raise InvalidPreset("run_id", f"no run {run_id!r} under {storage.url('runs')}")
    preset = validate_preset_data(read_stored_preset(storage, run_id))
    layout = RunLayout(run_id)
    version, chosen = _chosen_version(storage, run_id, version)
    if version not in versions_on(storage, layout.policies):
        raise InvalidPreset("--version", f"run {run_id} keeps no policy v{version}; allowed: "
                            f"{', '.join(f'v{kept}' for kept in versions_on(storage, layout.policies))}")
    weights = read_policy(storage, layout, version, [POLICY_BLOB])[POLICY_BLOB]
    observation_space, action_space = env_spaces(preset.env.id, preset.env.kwargs,
                                                 preset.env.preprocessing().evaluation())
    try:
        graph = onnx_policy(algorithm_of(preset.agent), preset.agent, observation_space, action_space, weights,
                            policy_name)
    except CannotExport as why:
        field = "--policy" if policy_name is not None or "one graph a policy" in str(why) else "--format"
        raise GymflowError(field, f"v{version} of run {run_id} cannot be an ONNX graph: {why}") from None
    _write_whole(to, graph)
    return ExportedPolicy(version, chosen, to, len(graph))


def _chosen_version(storage: Storage, run_id: str, version: int | None) -> tuple[int, str]:
    if version is not None:
        return version, "as asked"
    delivered = _delivered_version(storage, run_id)
    if delivered is not None:
        return delivered, "the version the run delivered"
    return latest_policy_version(storage, RunLayout(run_id)), "the newest (no delivery recorded in its MLflow run)"


def _delivered_version(storage: Storage, run_id: str) -> int | None:
    """The version the run's MLflow run says it delivered; None where it has not (or cannot be read)."""
    from mlflow.tracking import MlflowClient

    from gymflow.tasks.training.resume import stored_tracking_uri

    try:
        record = read_run_record(storage, run_id)
        tags = MlflowClient(stored_tracking_uri(storage, run_id)).get_run(record.mlflow_run_id).data.tags
    except Exception:  # an MLflow store out of reach, a password not given: the newest version stands in, said so
        return None
    delivered = tags.get("gymflow.delivered_version")
    return int(delivered) if delivered is not None else None


def _write_whole(path: str, data: bytes) -> None:
    """`data` at `path`, or nothing there: written beside it and renamed into place."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".gymflow-", suffix=".onnx", delete=False) as handle:
        handle.write(data)
    os.replace(handle.name, path)
