"""Shards, checkpoints and MLflow artifacts on a real S3 API server (moto, on loopback):
end to end, under storage faults, with bad buckets and credentials, and with damaged checkpoints."""

from __future__ import annotations

import json
import stat
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client

from gymflow.flows.cli import main
from gymflow.flows.improve import improve
from gymflow.tasks.storage.checkpoints import (
    CheckpointError,
    commit_checkpoint,
    latest_version,
    read_checkpoint,
    read_newest_valid_checkpoint,
)
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.tracking.tracker import s3_artifact_environment
from gymflow.testing.faults import FaultyProxy
from tests.conftest import free_port, prefect_events, written_files
from tests.stored import check_run_storage

pytestmark = pytest.mark.e2e


def _s3_overrides(s3_server, workspace, prefix: str, endpoint: str | None = None) -> dict:
    return {
        "storage.root": f"s3://{s3_server.bucket}/{prefix}",
        "storage.options": s3_server.options(endpoint),
        "tracking.tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}",
    }


def _storage(s3_server, prefix: str) -> Storage:
    return Storage(StorageLocation(f"s3://{s3_server.bucket}/{prefix}", s3_server.options()))


def test_improve_runs_on_s3_with_mlflow_artifacts_in_the_same_bucket(prefect_api, workspace, s3_server, tiny_budget):
    prefix = f"e2e-{uuid.uuid4().hex[:6]}"
    overrides = {**tiny_budget, **_s3_overrides(s3_server, workspace, prefix),
                 "tracking.experiment": prefix, "tracking.artifact_location": f"s3://{s3_server.bucket}/{prefix}-mlflow"}
    summary = improve("cartpole-ppo", overrides)
    assert summary.storage_url.startswith(f"s3://{s3_server.bucket}/{prefix}/runs/")
    check_run_storage(_storage(s3_server, prefix), summary)
    with s3_artifact_environment(s3_server.options()):
        client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
        assert {"preset.yaml", "learning_curve.png", "checkpoint"} <= {a.path for a in client.list_artifacts(summary.mlflow_run_id)}
    artifacts = _storage(s3_server, f"{prefix}-mlflow").list("")
    assert any(key.endswith("artifacts/learning_curve.png") for key in artifacts)
    assert any(key.endswith("artifacts/checkpoint/manifest.json") for key in artifacts)
    preset_yaml = _storage(s3_server, prefix).read(RunLayout(summary.run_id).preset).decode()
    assert s3_server.secret not in preset_yaml and "secret: '***'" in preset_yaml  # credentials never stored
    assert written_files(workspace) == ["mlflow.db"]  # nothing else lands on the local disk


# default tier (one of its 25 slowest): the S3-faults drill's one test (503s, resets, lost replies)
def test_a_run_through_failing_storage_completes_with_exactly_its_shards_and_versions(prefect_api, workspace, s3_server, tiny_budget):
    prefix = f"faults-{uuid.uuid4().hex[:6]}"
    with FaultyProxy(s3_server.endpoint, fault_rate=0.15, seed=1) as proxy:
        overrides = {**tiny_budget, **_s3_overrides(s3_server, workspace, prefix, endpoint=proxy.url)}
        summary = improve("cartpole-ppo", overrides)
    assert set(proxy.faults) == {"503", "reset", "lost-reply"}, proxy.faults  # every kind happened
    assert sum(proxy.faults.values()) >= 10
    check_run_storage(_storage(s3_server, prefix), summary)
    assert summary.versions_committed == 6 and summary.env_steps == 640


@pytest.mark.parametrize(
    ("case", "field", "says"),
    [
        ("wrong bucket", "storage.root", "bucket 'no-such-bucket' does not exist"),
        ("wrong credentials", "storage.options", "refused the credentials"),
        ("unreachable endpoint", "storage.options.endpoint_url", "cannot reach"),
    ],
)
def test_bad_storage_is_refused_in_one_line_before_anything_is_written(case, field, says, s3_server, workspace, capsys):
    options = s3_server.options()
    bucket = s3_server.bucket
    if case == "wrong bucket":
        bucket = "no-such-bucket"
    elif case == "wrong credentials":
        options["secret"] = "not-the-secret"
        options["key"] = "AKIANOTAKEYWEKNOW000"
    else:
        options["endpoint_url"] = f"http://127.0.0.1:{free_port()}"
    prefix = f"refused-{uuid.uuid4().hex[:6]}"
    args = ["run", "cartpole-ppo", "--set", f"storage.root=s3://{bucket}/{prefix}",
            "--set", f"storage.options={json.dumps(options)}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gymflow: error: {field}: ") and says in err and "\n" not in err
    assert s3_server.secret not in err
    assert written_files(workspace) == []
    assert _storage(s3_server, prefix).list("") == []


def test_the_flow_refuses_a_missing_bucket_before_it_starts(prefect_api, workspace, s3_server, tiny_budget):
    overrides = {**tiny_budget, **_s3_overrides(s3_server, workspace, "x"), "storage.root": "s3://no-such-bucket/x"}
    state = improve("cartpole-ppo", overrides, return_state=True)
    assert state.is_failed() and "storage.root: bucket 'no-such-bucket' does not exist" in state.message
    assert written_files(workspace) == []


def test_damaged_checkpoints_on_s3_are_detected_and_an_earlier_valid_version_is_loaded(s3_server):
    storage = _storage(s3_server, f"damage-{uuid.uuid4().hex[:6]}")
    layout = RunLayout("run")
    for version in range(4):
        commit_checkpoint(storage, layout, version, {"policy.safetensors": bytes([version]) * 1000})

    blob = f"{layout.checkpoint(3)}/policy.safetensors"
    storage.write(blob, storage.read(blob)[:500])  # truncated
    with pytest.raises(CheckpointError, match="v3: blob 'policy.safetensors' does not match its manifest"):
        read_checkpoint(storage, layout, 3)

    manifest_key = f"{layout.checkpoint(2)}/manifest.json"
    manifest = json.loads(storage.read(manifest_key))
    manifest["blobs"]["policy.safetensors"]["sha256"] = "f" * 64  # tampered
    storage.write(manifest_key, json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="v2: blob 'policy.safetensors' does not match its manifest"):
        read_checkpoint(storage, layout, 2)

    loaded = read_newest_valid_checkpoint(storage, layout)
    assert loaded.version == 1 and loaded.blobs["policy.safetensors"] == bytes([1]) * 1000
    assert len(loaded.refused) == 2 and "v3" in loaded.refused[0] and "v2" in loaded.refused[1]

    storage.fs.rm(storage.path(layout.latest))  # missing pointer
    with pytest.raises(CheckpointError, match="no version has been committed"):
        latest_version(storage, layout)
    loaded = read_newest_valid_checkpoint(storage, layout)
    assert loaded.version == 1 and "latest is missing" in loaded.refused[0]


def test_the_usual_aws_environment_variables_configure_s3(s3_server, monkeypatch):
    from gymflow.errors import StorageRefused
    from gymflow.tasks.storage.objects import check_storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
    location = StorageLocation(f"s3://{s3_server.bucket}/env-{uuid.uuid4().hex[:6]}")
    check_storage(location)
    storage = Storage(location)
    storage.write("a/b.bin", b"payload")
    assert storage.read("a/b.bin") == b"payload" and storage.list("a") == ["a/b.bin"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StorageRefused, match="^storage.options: .* refused the credentials"):
        check_storage(location)


# default tier (one of its 25 slowest): the one end-to-end run on credentials kept in a Prefect block; that they reach
# no sink (MLflow, the bucket, Prefect's database and events) is checked here and in test_redaction's unit tests
def test_credentials_kept_in_a_prefect_block_reach_s3_and_appear_nowhere_else(prefect_api, workspace, s3_server,
                                                                              tiny_budget):
    """An access key of this test's own: its id in the block's options (`key`), its secret given as an
    override (`storage.options.secret`, as a run started in Python or from the command line may):
    neither is in anything the run wrote (MLflow's store and artifacts, the bucket) nor in Prefect's
    database (the flow run's parameters, logs, events, artifacts; the block itself is kept encrypted there)."""
    import boto3
    from prefect.blocks.system import Secret
    from prefect.settings import get_current_settings

    from gymflow.errors import InvalidPreset

    iam = boto3.client("iam", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                       aws_access_key_id=s3_server.key, aws_secret_access_key=s3_server.secret)
    planted = iam.create_access_key(UserName="gymflow")["AccessKey"]  # only here: other tests pass the session's
    key, secret = planted["AccessKeyId"], planted["SecretAccessKey"]
    Secret(value={"key": key, "endpoint_url": s3_server.endpoint}).save("gymflow-test-s3", overwrite=True)
    prefix = f"block-{uuid.uuid4().hex[:6]}"
    overrides = {**tiny_budget, "storage.root": f"s3://{s3_server.bucket}/{prefix}", "storage.options.secret": secret,
                 "storage.options_block": "secret/gymflow-test-s3", "tracking.tracking_uri": f"sqlite:///{workspace / 'mlflow.db'}"}
    summary = improve("cartpole-ppo", overrides)
    check_run_storage(_storage(s3_server, prefix), summary)  # IAM on: only the block's key could write them

    client = MlflowClient(overrides["tracking.tracking_uri"])
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.params["storage.options_block"] == "secret/gymflow-test-s3"
    assert run.data.params["storage.options.key"] == run.data.params["storage.options.secret"] == "***"
    with get_client(sync_client=True) as prefect:  # what Prefect keeps of the run's parameters: masked
        (kept,) = [run.parameters["overrides"] for run in prefect.read_flow_runs(limit=200)
                   if (run.parameters.get("overrides") or {}).get("storage.root") == overrides["storage.root"]]
    assert kept["storage.options.secret"] == "***" and kept["storage.options_block"] == "secret/gymflow-test-s3"
    prefect_events(f"gymflow.run.{summary.run_id}", ["gymflow.run.finished"])  # Prefect holds the run's events
    database = get_current_settings().server.database.connection_url.get_secret_value().split("///", 1)[1]
    bucket = Storage(StorageLocation(f"s3://{s3_server.bucket}", s3_server.options()))
    written = {**{str(path): path.read_bytes() for path in workspace.rglob("*") if path.is_file()},
               **{f"s3://{key}": bucket.read(key) for key in bucket.list("")}}
    assert f"s3://{prefix}/{RunLayout(summary.run_id).preset}" in written and any(".db" in where for where in written)
    leaks = [where for where, data in written.items() if key.encode() in data or secret.encode() in data]
    prefect_holds = b"".join(Path(f"{database}{end}").read_bytes() for end in ("", "-wal") if Path(f"{database}{end}").exists())
    assert not leaks and key.encode() not in prefect_holds and secret.encode() not in prefect_holds, leaks

    with pytest.raises(InvalidPreset, match=r"^storage.options_block: cannot read Prefect block 'secret/none-such'"):
        improve("cartpole-ppo", {**overrides, "storage.options_block": "secret/none-such"})


class _CommandLines:
    """Every process's command line, sampled every 0.2 s while inside: what `ps` shows every user."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> _CommandLines:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            for process in psutil.process_iter():
                try:
                    self.seen.add(" ".join(process.cmdline()))
                except psutil.Error:
                    pass


@pytest.mark.slow  # long tier: a run and a sweep with a secret at each entrance; the default tier's is the block test
def test_a_secret_at_every_entrance_of_a_run_and_a_sweep_is_found_nowhere_after_them(
        prefect_api, workspace, s3_server, tiny_budget, monkeypatch, tmp_path):
    """Secrets planted at each entrance gymflow has: an override (`storage.options.secret`), a Secret
    block (`storage.options_block`'s key), the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY),
    and a tracking URI's password (a real MLflow server, which ignores it). After a run and a sweep,
    none is in the MLflow server's store or artifacts, the bucket, Prefect's database, the working
    folder, any file written meanwhile under the temporary folder that others may read, or any
    command line sampled while they ran. (A deployment run's parameters refuse credentials:
    tests/test_deployments.py; free text holding one is masked: tests/test_redaction.py.)"""
    import boto3
    from prefect.blocks.system import Secret
    from prefect.settings import get_current_settings

    from gymflow.flows.sweep import sweep
    from tests.servers import MlflowServer

    iam = boto3.client("iam", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                       aws_access_key_id=s3_server.key, aws_secret_access_key=s3_server.secret)
    iam.create_user(UserName="gymflow-environment")  # moto holds two keys a user: the session's, the block's
    iam.put_user_policy(UserName="gymflow-environment", PolicyName="everything", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    block_key, env_key = (iam.create_access_key(UserName=user)["AccessKey"] for user in ("gymflow", "gymflow-environment"))
    Secret(value={"key": block_key["AccessKeyId"], "endpoint_url": s3_server.endpoint}).save(
        "gymflow-every-entrance", overwrite=True)
    password = f"uri-{uuid.uuid4().hex}"
    tracking = MlflowServer(tmp_path)
    tracking.start()
    secrets = [block_key["AccessKeyId"], block_key["SecretAccessKey"], env_key["AccessKeyId"],
               env_key["SecretAccessKey"], password]
    uri, started = tracking.url.replace("://", f"://alice:{password}@", 1), time.time()
    # the environment's key, set before the first cluster starts (its workers' processes fork from a server
    # made then, as a user's would from the command's): the sweep's storage finds no other
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", env_key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env_key["SecretAccessKey"])
    try:
        with _CommandLines() as command_lines:
            run = improve("cartpole-ppo", {**tiny_budget, "storage.root": f"s3://{s3_server.bucket}/entrances",
                                           "storage.options_block": "secret/gymflow-every-entrance",
                                           "storage.options.secret": block_key["SecretAccessKey"],
                                           "tracking.tracking_uri": uri, "tracking.experiment": "entrances"})
            swept = sweep({"preset": "cartpole-ppo", "sampler": "grid", "seeds": 1,
                           "space": {"agent.lr": {"values": [0.01]}},
                           "overrides": {**tiny_budget, "storage.root": f"s3://{s3_server.bucket}/entrances-sweep",
                                         "storage.options.endpoint_url": s3_server.endpoint,
                                         "tracking.tracking_uri": uri, "tracking.experiment": "entrances"},
                           "study_storage": f"sqlite:///{workspace / 'sweeps.db'}"}, sweep_id="entrances")
    finally:
        tracking.kill()
    assert run.versions_committed and [row["outcome"] for row in swept.ranking] == ["complete"]

    bucket = Storage(StorageLocation(f"s3://{s3_server.bucket}", s3_server.options()))
    database = get_current_settings().server.database.connection_url.get_secret_value().split("///", 1)[1]
    written = {**{str(path): path.read_bytes() for path in [*workspace.rglob("*"), *tmp_path.rglob("*")]
                  if path.is_file()},
               **{f"s3://{key}": bucket.read(key) for key in bucket.list("")},
               **{f"prefect:{end}": Path(f"{database}{end}").read_bytes() for end in ("", "-wal")
                  if Path(f"{database}{end}").exists()}}
    assert any("mlflow.db" in where for where in written) and any("entrances-sweep" in where for where in written)
    leaks = [(where, secret[:6]) for where, data in written.items() for secret in secrets if secret.encode() in data]
    assert leaks == [], leaks
    readable = [str(path) for path in Path(tempfile.gettempdir()).rglob("*") if _others_may_read(path, started)
                and any(secret.encode() in _read_or_nothing(path) for secret in secrets)]
    assert readable == [], readable
    shown = [line[:120] for line in command_lines.seen for secret in secrets if secret in line]
    assert shown == [], shown


def _others_may_read(path: Path, since: float) -> bool:
    try:
        status = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(status.st_mode) and bool(status.st_mode & 0o004) and status.st_mtime >= since


def _read_or_nothing(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
