"""A team's stack on one machine, for trials and tests: PostgreSQL, a Prefect server on it (with a
login), an MLflow tracking server on it (the `basic-auth` app, its artifacts in an S3 bucket), the
S3 server (moto, which checks every request's key) and a Dask scheduler with workers (mutual TLS,
certificates made for the stack), each on loopback on a free port, started without systemd under
one folder and stopped by pid (`gymflow stack up|down`, docs/deploy.md).

The folder is its maker's alone (0700), every secret in it is a file made 0600, and no password
is on a command line (`ps` shows them to everyone): the servers read theirs from their
environment or a file."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gymflow.commands import gymflow_command
from gymflow.extras import STACK, extra_missing
from gymflow.files import write_whole
from gymflow.tasks.cluster.clocks import housekeeping_environment
from gymflow.tasks.tracking.servers import basic_authorization

STATE_FILE = "stack.json"
MARKER_FILE = ".gymflow-stack"  # written first by `up` into the folder it made (or found empty): `down`'s proof
TLS_FOLDER = "tls"  # the Dask cluster's certificate (CA and key), 0600 files in a 0700 folder
ADMIN = "admin"
START_TIMEOUT_S = 120.0


class StackError(RuntimeError):
    """A part of the stack that did not start or stop; the message names it."""


@dataclass(frozen=True)
class Stack:
    """Where each part answers and who may log in; what a team member sets is `environment(user)`."""

    folder: str
    postgres_port: int
    postgres_password: str
    prefect_api_url: str
    prefect_auth_string: str  # "user:password" the Prefect server asks of every client
    mlflow_url: str
    mlflow_passwords: dict[str, str]  # user -> password; "admin" administers users and permissions
    s3_endpoint: str
    bucket: str
    s3_key: str
    s3_secret: str
    scheduler_address: str
    pids: dict[str, int] = field(default_factory=dict)  # part -> process id (PostgreSQL: its postmaster)
    # part -> [pid, start time (clock ticks after boot)]: what proves a pid is still that part
    identities: dict[str, list] = field(default_factory=dict)
    postgres_folder: str = ""  # PostgreSQL's data, socket and log (postgres_home, where `up` put it)

    def database_url(self, database: str, driver: str = "psycopg") -> str:
        return f"postgresql+{driver}://postgres:{self.postgres_password}@127.0.0.1:{self.postgres_port}/{database}"

    def storage_options(self) -> dict[str, object]:
        """s3fs's options; the keys come from the environment (`environment`), never from a preset."""
        return {"endpoint_url": self.s3_endpoint}

    def tls_files(self) -> dict[str, str]:
        """The Dask cluster's certificate files, by `distribution.tls`'s field names."""
        folder = Path(self.folder) / TLS_FOLDER
        return {"ca_file": str(folder / "ca.pem"), "cert_file": str(folder / "cert.pem"),
                "key_file": str(folder / "key.pem")}

    def dask_environment(self) -> dict[str, str]:
        """Dask's own settings for a client of the stack's cluster: its certificate, and TLS required."""
        files = self.tls_files()
        return {"DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True",
                "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": files["ca_file"],
                "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": files["cert_file"],
                "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": files["key_file"]}

    def environment(self, user: str) -> dict[str, str]:
        """What `user` sets to train against the stack: the servers' addresses and their own logins."""
        return {**self.dask_environment(),
                "PREFECT_API_URL": self.prefect_api_url, "PREFECT_API_AUTH_STRING": self.prefect_auth_string,
                "MLFLOW_TRACKING_URI": self.mlflow_url, "MLFLOW_TRACKING_USERNAME": user,
                "MLFLOW_TRACKING_PASSWORD": self.mlflow_passwords[user],
                "AWS_ACCESS_KEY_ID": self.s3_key, "AWS_SECRET_ACCESS_KEY": self.s3_secret,
                "MLFLOW_S3_ENDPOINT_URL": self.s3_endpoint,
                # downloads through the MLflow server without presigned URLs, which moto's server refuses
                # once it checks keys (a 500); a team's S3 takes them
                "MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "false", "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD": "false",
                # Prefect's client tries 429, 502 and 503 again, not the 500 a server answers while its
                # database fails over (its flow-run states would be lost): docs/deploy.md, "For a team"
                "PREFECT_CLIENT_RETRY_EXTRA_CODES": "500"}

    def overrides(self, prefix: str) -> dict[str, object]:
        """A preset's fields for a run on the stack: its storage under `prefix` in the bucket, the
        MLflow server, the stack's Dask scheduler."""
        return {"storage.root": f"s3://{self.bucket}/{prefix}", "storage.options": self.storage_options(),
                "tracking.tracking_uri": self.mlflow_url, "distribution.scheduler_address": self.scheduler_address,
                "distribution.tls": self.tls_files(),
                "storage.shared": True}

    def settings(self, prefix: str) -> list[str]:
        """`overrides` as the command line's KEY=VALUE settings."""
        return [f"storage.root=s3://{self.bucket}/{prefix}", f"storage.options.endpoint_url={self.s3_endpoint}",
                f"tracking.tracking_uri={self.mlflow_url}", f"distribution.scheduler_address={self.scheduler_address}",
                *(f"distribution.tls.{name}={path}" for name, path in self.tls_files().items()),
                "storage.shared=true"]


def start(folder: Path, users: tuple[str, ...] = ("alice", "bob"), dask_workers: int = 2,
          say: Callable[[str], None] = lambda line: None) -> Stack:
    """Every part started under `folder` (made empty), the MLflow users created with passwords of
    their own; the parts run on after this returns (`stop` ends them). A part that does not start
    stops those started and raises StackError naming it."""
    folder = Path(folder).resolve()
    if missing := extra_missing("`gymflow stack up`", "stack", STACK):
        raise StackError(missing)
    if folder.exists() and any(folder.iterdir()):
        if holds_stack(folder):
            raise StackError(f"{folder}: a stack is there (`{gymflow_command()} stack down --folder {folder}` ends it)")
        raise StackError(f"{folder}: not empty and no stack's folder: give `--folder` a new or empty folder")
    if postgres_home(folder).exists():
        raise StackError(f"{postgres_home(folder)}: PostgreSQL's folder of a stack under {folder} is there "
                         f"(`{gymflow_command()} stack down --folder {folder}`)")
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # its maker's alone: logs, certificates, the state file
    write_whole(folder / MARKER_FILE, f"made by `gymflow stack up` for {folder}\n")
    pids: dict[str, int] = {}
    try:
        return _start(folder, users, dask_workers, say, pids)
    except BaseException:
        _stop_pids(postgres_home(folder), pids)
        raise


def _start(folder: Path, users: tuple[str, ...], dask_workers: int, say: Callable[[str], None],
           pids: dict[str, int]) -> Stack:
    started = time.monotonic()
    partial = _with_postgres(folder, users, pids)
    say(f"PostgreSQL 127.0.0.1:{partial.postgres_port} ({time.monotonic() - started:.1f} s)")
    s3_port = free_port()
    # moto checks every request's signature after the set-up (its user and bucket, made below)
    pids["s3"] = _spawn(folder, "s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)],
                        {"INITIAL_NO_AUTH_ACTION_COUNT": str(SET_UP_REQUESTS)})
    partial = replace(partial, s3_endpoint=f"http://127.0.0.1:{s3_port}")
    s3_endpoint, bucket = partial.s3_endpoint, partial.bucket
    _save(partial)
    prefect_port, mlflow_port, scheduler_port = free_port(), free_port(), free_port()
    pids["prefect"] = _spawn(folder, "prefect", _prefect_command(prefect_port),
                             _prefect_environment(partial, folder, prefect_port))
    _save(partial)
    _wait_until(lambda: _answers(f"{s3_endpoint}/moto-api/"), "the S3 server", pids["s3"], folder / "s3.log")
    s3_key, s3_secret = user_and_bucket(s3_endpoint, bucket, user="gymflow-team")
    partial = replace(partial, s3_key=s3_key, s3_secret=s3_secret)  # the same `pids`, filled as parts start
    pids["mlflow"] = _spawn(folder, "mlflow", _mlflow_command(partial, mlflow_port),
                            _mlflow_environment(partial, folder))
    _save(partial)
    scheduler_address = _spawn_dask(partial, scheduler_port, dask_workers)
    _save(partial)

    prefect_url, mlflow_url = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
    _wait_until(_prefect_ready(prefect_url, partial.prefect_auth_string), "the Prefect server", pids["prefect"],
                folder / "prefect.log")
    say(f"Prefect {prefect_url} ({time.monotonic() - started:.1f} s)")
    admin = f"{ADMIN}:{partial.mlflow_passwords[ADMIN]}"
    _wait_until(_mlflow_ready(mlflow_url), "the MLflow server", pids["mlflow"], folder / "mlflow.log")
    for user in users:
        _mlflow_call(mlflow_url, admin, "2.0/mlflow/users/create",
                     {"username": user, "password": partial.mlflow_passwords[user]})
    say(f"MLflow {mlflow_url} ({time.monotonic() - started:.1f} s)")
    stack = Stack(**{**asdict(partial), "prefect_api_url": prefect_url, "mlflow_url": mlflow_url,
                     "scheduler_address": scheduler_address, "pids": pids, "identities": partial.identities})
    _wait_for_dask_workers(stack, dask_workers, folder)
    say(f"Dask {scheduler_address}, {dask_workers} workers ({time.monotonic() - started:.1f} s)")
    _save(stack)
    return stack


def _with_postgres(folder: Path, users: tuple[str, ...], pids: dict[str, int]) -> Stack:
    """The stack's passwords made and its PostgreSQL started with its databases; the state saved
    before and after (from here on as each part starts: `down` ends what a killed `up` had started)."""
    home = postgres_home(folder)
    partial = Stack(str(folder), 0, _password(), "", f"{ADMIN}:{_password()}", "",
                    {ADMIN: _password(), **{user: _password() for user in users}}, "", "team", "", "", "", pids,
                    postgres_folder=str(home))
    _save(partial)
    partial = replace(partial, postgres_port=_start_postgres(home, partial.postgres_password, pids))
    _save(partial)
    for database in ("prefect", "mlflow", "mlflow_auth"):
        _create_database(home, partial.postgres_port, database)
    return partial


def _spawn_dask(stack: Stack, port: int, workers: int) -> str:
    """The stack's Dask scheduler and workers, on gymflow's clocks and on mutual TLS; its address."""
    folder, pids = Path(stack.folder), stack.pids
    clocks = housekeeping_environment()  # gymflow's, as in a run's own LocalCluster
    tls = _made_certificates(stack)
    # dashboards on loopback too (":0" binds every interface, whatever --host says)
    pids["dask-scheduler"] = _spawn(folder, "dask-scheduler", [
        _dask(), "scheduler", "--protocol", "tls", "--host", "127.0.0.1", "--port", str(port),
        "--dashboard-address", "127.0.0.1:0", *tls], {**clocks, **stack.dask_environment()})
    address = f"tls://127.0.0.1:{port}"
    for index in range(workers):
        working = folder / f"dask-worker-{index}"  # not the stack's folder, where its secrets are
        working.mkdir(mode=0o700)
        pids[f"dask-worker-{index}"] = _spawn(folder, f"dask-worker-{index}", [
            _dask(), "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
            "--dashboard-address", "127.0.0.1:0", *tls],
            {**_s3_environment(stack), **clocks, **stack.dask_environment()}, cwd=working)
    return address


def _save(stack: Stack) -> None:
    """The stack's state file: where each part answers, its pids and what proves them its own (`stop`
    ends those), its passwords."""
    for name, pid in stack.pids.items():
        if stack.identities.get(name, [None])[0] != pid:
            stack.identities[name] = [pid, *_identity(pid)]
    write_whole(Path(stack.folder) / STATE_FILE, json.dumps(asdict(stack), indent=2))


def _made_certificates(stack: Stack) -> list[str]:
    """One key and self-signed certificate for the stack's cluster (Dask's `Security.temporary`),
    which its scheduler, workers and every client present (who holds the key file gets in), written
    0600; the `dask scheduler|worker` options that name them (paths, no secret)."""
    from distributed.security import Security

    made = Security.temporary()
    (Path(stack.folder) / TLS_FOLDER).mkdir(mode=0o700)
    files = stack.tls_files()
    for name, pem in (("ca_file", made.tls_ca_file), ("cert_file", made.tls_scheduler_cert),
                      ("key_file", made.tls_scheduler_key)):
        write_whole(Path(files[name]), pem)
    return ["--tls-ca-file", files["ca_file"], "--tls-cert", files["cert_file"], "--tls-key", files["key_file"]]


def load(folder: Path) -> Stack:
    """The stack started under `folder` (its state file)."""
    path = Path(folder).resolve() / STATE_FILE
    if not path.exists():
        raise StackError(f"{path}: no stack was started there")
    return Stack(**json.loads(path.read_text()))


def holds_stack(folder: Path) -> bool:
    """Whether `up` made `folder`: its marker, or (a stack started before the marker) a state file
    that names this very folder."""
    folder = Path(folder).resolve()
    return _made_by_up(folder, _state_or_none(folder))


def _made_by_up(folder: Path, state: Stack | None) -> bool:
    return (folder / MARKER_FILE).is_file() or (state is not None and Path(state.folder) == folder)


def stop(folder: Path, remove: bool = True) -> list[str]:
    """Every part of the stack under `folder` that still runs ended, then its folders removed, from
    whatever state it is in: an `up` killed half-way, parts already dead, PostgreSQL's folder or the
    state file gone. Only a process proven to be the part it was (its pid and start time,
    as saved when it started) is signalled; returns the parts whose pid is now another process's.
    A folder `up` did not make (`holds_stack`) is refused whole, before anything is touched: the
    folder given may be a user's project."""
    folder = Path(folder).resolve()
    state = _state_or_none(folder)
    if folder.exists() and any(folder.iterdir()) and not _made_by_up(folder, state):
        raise StackError(f"{folder}: holds no stack (no {MARKER_FILE} or {STATE_FILE} of `gymflow stack up`); "
                         "nothing stopped, nothing removed")
    home = Path(state.postgres_folder) if state and state.postgres_folder else postgres_home(folder)
    owned = {name: pid for name, pid in state.pids.items() if _proven(state, name)} if state else {}
    _stop_pids(home, owned)
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
    return sorted(name for name, pid in (state.pids if state else {}).items() if name not in owned and _alive(pid))


def _state_or_none(folder: Path) -> Stack | None:
    """The stack's state file read, or None where there is none to read (gone, never written, cut short)."""
    try:
        return load(folder)
    except (StackError, OSError, ValueError, TypeError):
        return None


def _identity(pid: int) -> list:
    """[start time in clock ticks after boot] of a running process; [] if there is none. Its start
    time, not its command line, which a server may rewrite as it runs (a Dask worker's process title)."""
    try:
        return [int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])]
    except (OSError, IndexError, ValueError):
        return []


def _proven(stack: Stack, name: str) -> bool:
    """Whether the part's pid is still the process it started as (not one that took its pid since)."""
    saved, pid = stack.identities.get(name), stack.pids[name]
    return bool(saved) and saved[0] == pid and len(saved) == 2 and _identity(pid) == saved[1:]


@contextmanager
def running(folder: Path, **options) -> Iterator[Stack]:
    """The stack for the length of a `with` block; nothing of it runs after."""
    stack = start(folder, **options)
    try:
        yield stack
    finally:
        stop(folder)


def restart_postgres(stack: Stack, down_s: float = 0.0) -> None:
    """PostgreSQL stopped (fast: its connections cut, as in a failover), `down_s` seconds without it, started again."""
    home = Path(stack.postgres_folder)
    _stop_postgres(home)
    time.sleep(down_s)
    _pg_ctl_start(home, stack.postgres_port)
    stack.pids["postgres"] = _postmaster_pid(home)
    _save(stack)


def restart_server(stack: Stack, name: str, down_s: float = 0.0) -> None:
    """The Prefect or MLflow server ("prefect", "mlflow") ended, `down_s` seconds without it,
    started again on its port; back once it answers."""
    folder = Path(stack.folder)
    _end_groups([stack.pids[name]])
    time.sleep(down_s)
    port = int(stack.prefect_api_url.rsplit(":", 1)[1].split("/")[0] if name == "prefect"
               else stack.mlflow_url.rsplit(":", 1)[1])
    if name == "prefect":
        stack.pids[name] = _spawn(folder, name, _prefect_command(port), _prefect_environment(stack, folder, port))
    else:
        stack.pids[name] = _spawn(folder, name, _mlflow_command(stack, port), _mlflow_environment(stack, folder))
    _save(stack)
    ready = _prefect_ready(stack.prefect_api_url, stack.prefect_auth_string) if name == "prefect" else \
        _mlflow_ready(stack.mlflow_url)
    _wait_until(ready, f"the {name} server", stack.pids[name], folder / f"{name}.log")


def set_password(stack: Stack, user: str, password: str) -> None:
    """`user`'s MLflow password changed by the administrator (what they log in with from now on)."""
    _mlflow_call(stack.mlflow_url, f"{ADMIN}:{stack.mlflow_passwords[ADMIN]}", "2.0/mlflow/users/update-password",
                 {"username": user, "password": password}, method="PATCH")


def grant(stack: Stack, experiment_id: str, user: str, permission: str = "READ") -> None:
    """`user` given `permission` on an experiment, by the MLflow server's administrator."""
    _mlflow_call(stack.mlflow_url, f"{ADMIN}:{stack.mlflow_passwords[ADMIN]}", "3.0/mlflow/users/permissions/grant",
                 {"username": user, "resource_type": "experiment", "resource_id": experiment_id,
                  "permission": permission})


# -- PostgreSQL ---------------------------------------------------------------------------------

def postgres_home(folder: Path) -> Path:
    """Where PostgreSQL keeps its data, socket and log for the stack under `folder`: a folder of
    its own in the system's temporary folder, which its user (`postgres`, where this is root) can
    reach whatever the stack folder's parents allow (pytest's are root's alone)."""
    digest = hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"gymflow-stack-postgres-{digest}"


def _start_postgres(home: Path, password: str, pids: dict[str, int]) -> int:
    port = free_port()
    home.mkdir(mode=0o700)
    password_file = home / "password"
    write_whole(password_file, password)
    if os.geteuid() == 0:
        account = pwd.getpwnam("postgres")
        for path in (home, password_file):
            os.chown(path, account.pw_uid, account.pw_gid)
    _as_postgres([_postgres_binary("initdb"), "-D", str(home / "data"), "-U", "postgres", "--auth-local=trust",
                  "--auth-host=scram-sha-256", f"--pwfile={password_file}", "-E", "UTF8", "--no-sync"], home)
    password_file.unlink()
    _pg_ctl_start(home, port)
    pids["postgres"] = _postmaster_pid(home)
    return port


def _pg_ctl_start(home: Path, port: int) -> None:
    options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off"
    _as_postgres([_postgres_binary("pg_ctl"), "-D", str(home / "data"), "-l", str(home / "postgres.log"),
                  "-o", options, "-w", "-t", "60", "start"], home)


def _stop_postgres(home: Path) -> None:
    """Stopped fast: open connections cut, as a failover cuts them."""
    _as_postgres([_postgres_binary("pg_ctl"), "-D", str(home / "data"), "-m", "fast", "-w", "-t", "60", "stop"], home)


def _create_database(home: Path, port: int, name: str) -> None:
    _as_postgres([_postgres_binary("createdb"), "-h", str(home), "-p", str(port), "-U", "postgres", name], home)


def _postmaster_pid(home: Path) -> int:
    return int((home / "data" / "postmaster.pid").read_text().split()[0])


def _postgres_binary(name: str) -> str:
    """PostgreSQL's own programs (Debian keeps them under /usr/lib/postgresql/VERSION/bin, off PATH)."""
    if found := shutil.which(name):
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    raise StackError(f"PostgreSQL's {name} is not installed (Debian: apt-get install postgresql)")


def _as_postgres(command: list[str], folder: Path) -> None:
    """`command` as the user `postgres` where this is root (PostgreSQL refuses to run as root)."""
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise StackError(f"PostgreSQL: {' '.join(command[-2:])} failed: {(done.stderr or done.stdout).strip()[-500:]}")


# -- Prefect, MLflow, S3, Dask ------------------------------------------------------------------

def _prefect_command(port: int) -> list[str]:
    return [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1",
            "--port", str(port)]


def _prefect_environment(stack: Stack, folder: Path, port: int) -> dict[str, str]:
    return {"PREFECT_HOME": str(folder / "prefect-home"),
            "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",  # the UI talks to this API, not to port 4200
            "PREFECT_API_DATABASE_CONNECTION_URL": stack.database_url("prefect", "asyncpg"),
            "PREFECT_SERVER_API_AUTH_STRING": stack.prefect_auth_string,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "true"}


def _mlflow_command(stack: Stack, port: int) -> list[str]:
    """Its database's URI (a password) comes from its environment (`_mlflow_environment`), not from here."""
    return [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
            "--artifacts-destination", f"s3://{stack.bucket}/mlflow-artifacts", "--app-name", "basic-auth",
            "--workers", "1"]  # one process: a password changed (its login cache) is changed for every request


def _mlflow_environment(stack: Stack, folder: Path) -> dict[str, str]:
    config = folder / "mlflow-auth.ini"
    write_whole(config, "[mlflow]\n"
                      "default_permission = NO_PERMISSIONS\n"  # the shipped READ lets everyone read everything
                      f"database_uri = {stack.database_url('mlflow_auth')}\n"
                      f"admin_username = {ADMIN}\n"
                      f"admin_password = {stack.mlflow_passwords[ADMIN]}\n"
                      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                      "auth_cache_ttl_seconds = 60\n")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_FLASK_SERVER_SECRET_KEY": _password(),
            "MLFLOW_BACKEND_STORE_URI": stack.database_url("mlflow"),
            # its job runner (GenAI scorers, trace roll-ups: nothing a training run uses) is 8 processes
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **_s3_environment(stack)}


def _s3_environment(stack: Stack) -> dict[str, str]:
    return {"MLFLOW_S3_ENDPOINT_URL": stack.s3_endpoint, "AWS_ACCESS_KEY_ID": stack.s3_key,
            "AWS_SECRET_ACCESS_KEY": stack.s3_secret, "AWS_DEFAULT_REGION": "us-east-1"}


def _dask() -> str:
    return str(Path(sys.executable).with_name("dask"))


def _wait_for_dask_workers(stack: Stack, count: int, folder: Path) -> None:
    from distributed import Client
    from distributed.security import Security

    files = stack.tls_files()
    security = Security(tls_ca_file=files["ca_file"], tls_client_cert=files["cert_file"],
                        tls_client_key=files["key_file"], require_encryption=True)
    try:
        with Client(stack.scheduler_address, timeout=START_TIMEOUT_S, security=security) as client:
            client.wait_for_workers(count, timeout=START_TIMEOUT_S)
    except (OSError, TimeoutError) as error:
        raise StackError(f"the Dask scheduler at {stack.scheduler_address}: {count} workers did not join "
                         f"({error}); its log: {folder / 'dask-scheduler.log'}") from None


# -- processes ----------------------------------------------------------------------------------

def _spawn(folder: Path, name: str, command: list[str], environment: Mapping[str, str] | None = None,
           cwd: Path | None = None) -> int:
    """`command` in a session of its own (it outlives `gymflow stack up`), its output in NAME.log."""
    # its log made 0600 from its first byte: a server may write a connection string into it
    descriptor = os.open(folder / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "ab") as log:
        process = subprocess.Popen(command, cwd=cwd or folder, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env={**os.environ, **(environment or {})},
                                   start_new_session=True)
    return process.pid


def _wait_until(ready: Callable[[], bool], what: str, pid: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if not _alive(pid):
            raise StackError(f"{what} ended while starting; its log: {log}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} did not answer within {START_TIMEOUT_S:.0f} s; its log: {log}")
        time.sleep(0.2)


def _stop_pids(home: Path, pids: Mapping[str, int]) -> None:
    """The Dask workers first (a worker whose scheduler goes first waits to reconnect), then the
    servers at once, PostgreSQL last (where its data is still there to stop it by), its folder
    `home` removed."""
    workers = [pid for name, pid in pids.items() if name.startswith("dask-worker")]
    servers = [pid for name, pid in pids.items() if not name.startswith("dask-worker") and name != "postgres"]
    _end_groups(workers)
    _end_groups(servers)
    if (home / "data" / "postmaster.pid").exists():
        with suppress(StackError, OSError):
            _stop_postgres(home)
    if "postgres" in pids:
        _end_groups([pids["postgres"]])
    shutil.rmtree(home, ignore_errors=True)


def _end_groups(pids: list[int], grace_s: float = 10.0) -> None:
    """Each process and its session's others (a server's workers) ended: SIGTERM, then SIGKILL
    to what is left after `grace_s`."""
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)


def _signal_group(pid: int, number: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, number)
        else:
            os.kill(pid, number)


def _alive(pid: int) -> bool:
    """Running: not ended, and not a zombie its parent has yet to reap (`stack up` is long gone)."""
    with suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


# -- HTTP ----------------------------------------------------------------------------------------

def _answers(url: str, headers: Mapping[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})), timeout=5) as response:
            return response.status < 400
    except (urllib.error.URLError, OSError):
        return False


def _prefect_ready(api_url: str, login: str) -> Callable[[], bool]:
    """Its /ready (which asks the database; /health answers without one), with the login it asks for."""
    return lambda: _answers(f"{api_url}/ready", {"Authorization": basic_authorization(login)})


def _mlflow_ready(url: str) -> Callable[[], bool]:
    return lambda: _answers(f"{url}/health")


def _mlflow_call(url: str, login: str, endpoint: str, body: Mapping[str, object], method: str = "POST") -> None:
    request = urllib.request.Request(f"{url}/api/{endpoint}", data=json.dumps(body).encode(), method=method,
                                     headers={"Authorization": basic_authorization(login),
                                              "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=30).close()
    except urllib.error.HTTPError as error:
        raise StackError(f"the MLflow server at {url}: {endpoint} refused ({error.code}: "
                         f"{error.read().decode(errors='replace')[:200]})") from None


def _password() -> str:
    return secrets.token_urlsafe(18)


# -- S3 (moto) ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# moto's server checks every request's signature once this many have gone unchecked (its IAM
# authentication): the four of `user_and_bucket`
SET_UP_REQUESTS = 4


def user_and_bucket(endpoint: str, bucket: str, user: str = "gymflow") -> tuple[str, str]:
    """On a fresh moto server started with INITIAL_NO_AUTH_ACTION_COUNT=SET_UP_REQUESTS: a user
    allowed everything, its access key (returned: key, secret) and `bucket`. Every later request
    must be signed with a key the server made."""
    import boto3

    admin = {"endpoint_url": endpoint, "region_name": "us-east-1",
             "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
    iam = boto3.client("iam", **admin)
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="everything", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    boto3.client("s3", **admin).create_bucket(Bucket=bucket)
    return key["AccessKeyId"], key["SecretAccessKey"]
