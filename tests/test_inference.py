"""Inference beside the learner (distribution.inference: learner): envs stepped in two halves while
the other half's outputs are computed elsewhere, the server process, and the worker's fallback."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import AuthenticationError, Pipe
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gymflow.agents.rollout import collect, collect_in_halves
from gymflow.envs.vector import make_vector_env
from gymflow.errors import InvalidPreset
from gymflow.presets import load_preset
from gymflow.presets.validate import experiment_from, inference_beside_learner, resolve_experiment
from gymflow.tasks.cluster import inference, inference_client, jobs
from gymflow.tasks.cluster.inference import InferenceServer
from gymflow.tasks.cluster.inference_client import RemoteOutputs, connect
from gymflow.tasks.cluster.messages import InferenceAddress
from gymflow.tasks.cluster.rounds import RoundPlan
from gymflow.tasks.storage.objects import open_storage, storage_location
from gymflow.tasks.storage.shards import read_shard
from gymflow.tasks.training.commits import Commits


def _policy(experiment, seed: int):
    """A freshly drawn PPO policy of the experiment (its network the seed's), acting with `seed`."""
    import torch

    torch.manual_seed(0)
    algorithm, config = experiment.algorithm, experiment.preset
    network = algorithm.network(config.agent, experiment.observation_space, experiment.action_space)
    return algorithm.policy(network, config.agent, 0.0, seed)


class HalfByHalf:
    """The policy, its outputs computed for each half of the rows apart (as the halves are sent)."""

    def __init__(self, policy):
        self.policy, self.network = policy, policy.network

    def outputs(self, obs: np.ndarray) -> np.ndarray:
        half = len(obs) // 2
        return np.concatenate([self.policy.outputs(obs[:half]), self.policy.outputs(obs[half:])])

    def act_on(self, obs, out, explore):
        return self.policy.act_on(obs, out, explore)

    def act(self, obs, explore):
        return self.act_on(obs, self.outputs(obs), explore)


class ComputedHere:
    """An OutputsSource in this process, answering in order."""

    def __init__(self, policy):
        self.policy, self.asked = policy, []

    def request(self, obs: np.ndarray) -> None:
        self.asked.append(obs.copy())

    def receive(self) -> np.ndarray:
        return self.policy.outputs(self.asked.pop(0))


def test_collecting_in_halves_gives_collect_s_rollout_episode_ends_included():
    experiment = resolve_experiment("cartpole-ppo")
    rollouts = []
    for halves in (False, True):
        env = make_vector_env("CartPole-v1", {}, 7, seed=3)  # an odd count: halves of 3 and 4 rows
        env.reset()
        policy = _policy(experiment, seed=11)
        if halves:
            rollouts.append(collect_in_halves(policy, env, 120, ComputedHere(policy)))
        else:
            rollouts.append(collect(HalfByHalf(policy), env, 120))
        rollouts[-1] = (*rollouts[-1], env.cursor())
    (apart, episodes_apart, cursor_apart), (halved, episodes_halved, cursor_halved) = rollouts
    assert len(episodes_apart.returns) > 7  # episodes ended mid-rollout, in both halves
    for name in ("obs", "actions", "log_probs", "rewards", "terminated", "truncated", "done_index", "done_obs",
                 "last_obs"):
        np.testing.assert_array_equal(getattr(apart, name), getattr(halved, name), err_msg=name)
    np.testing.assert_array_equal(episodes_apart.returns, episodes_halved.returns)
    np.testing.assert_array_equal(cursor_apart.actions, cursor_halved.actions)


@pytest.fixture
def published(tmp_path):
    """A Catch APPO experiment (pixels) with versions 0 and 1 in storage."""
    experiment = resolve_experiment("catch-appo", {
        "storage.root": str(tmp_path / "store"), "distribution.rollout_workers": 2,
        "distribution.envs_per_worker": 4, "schedule.rollout_steps_per_env": 16, "distribution.inference": "learner"})
    config = experiment.preset
    storage = open_storage(storage_location(config.storage))
    for version in (0, 1):
        learner = experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space,
                                               config.seed + version)
        Commits(storage, "run", config.storage, policy_window=10).publish(learner, version)
    return experiment


def _server(experiment) -> InferenceServer:
    config = experiment.preset
    return InferenceServer.start(storage_location(config.storage), "run", config.agent,
                                 (experiment.observation_space, experiment.action_space), "cpu")


def _chunks(experiment, inference) -> list:
    jobs._LIVE_ENVS.clear()
    plan = RoundPlan(experiment.preset, "run", inference)
    refs = [jobs.run_rollout(plan.chunk(worker, 0, 0.0, None)) for worker in range(2)]
    storage = open_storage(storage_location(experiment.preset.storage))
    return [read_shard(storage, ref) for ref in refs]


def test_workers_act_on_the_server_s_outputs_of_the_version_they_name(published):
    local = _chunks(published, None)
    server = _server(published)
    try:
        remote = _chunks(published, server.address)
    finally:
        served = server.close()
    assert served.problem == "" and served.rows == 2 * 4 * 16 and served.requests == 2 * 2 * 16
    for here, there in zip(local, remote, strict=True):
        # the server's forward batches other rows than the worker's own: equal up to float rounding
        np.testing.assert_array_equal(here.actions, there.actions)
        np.testing.assert_allclose(here.log_probs, there.log_probs, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(here.obs, there.obs)
        np.testing.assert_array_equal(here.rewards, there.rewards)


def test_a_worker_whose_server_is_gone_or_lacks_the_version_computes_the_outputs_itself(published):
    server = _server(published)
    connection = connect(server.address)
    policy = _policy(published, seed=0)
    obs = np.zeros((3, *published.observation_space.shape), np.uint8)
    retired = RemoteOutputs(connection, 7, policy)  # never published there
    retired.request(obs)
    np.testing.assert_array_equal(retired.receive(), policy.outputs(obs))
    assert retired.connection is None and retired.remote_rows == 0
    served = RemoteOutputs(connect(server.address), 0, policy)
    served.request(obs)
    served.receive()
    assert served.remote_rows == 3
    server.close()
    gone = RemoteOutputs(served.connection, 0, policy)
    gone.request(obs)
    gone.request(obs[:1])
    np.testing.assert_array_equal(gone.receive(), policy.outputs(obs))
    np.testing.assert_array_equal(gone.receive(), policy.outputs(obs[:1]))
    assert gone.connection is None and gone.remote_rows == 0
    assert connect(server.address) is None  # its socket went with it: later chunks act on their CPU


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()`'s result (or its error), failing the test if it has none within `seconds`: the calls
    here waited forever on a server that had stopped serving."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as error:  # noqa: BLE001 (raised again in the test's thread)
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no answer within {seconds:.0f} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _served_remotely(address, policy, obs: np.ndarray) -> RemoteOutputs:
    remote = RemoteOutputs(connect(address), 0, policy)
    remote.request(obs)
    np.testing.assert_allclose(remote.receive(), policy.outputs(obs), rtol=1e-5, atol=1e-6)
    return remote


def test_a_client_with_a_wrong_key_is_turned_away_and_the_others_are_still_served(published):
    server = _server(published)
    policy, obs = _policy(published, seed=0), np.zeros((3, *published.observation_space.shape), np.uint8)
    try:
        with pytest.raises(AuthenticationError):
            _within(10, lambda: Client(server.address.path, family="AF_UNIX", authkey=b"not the run's key"))
        assert _within(10, lambda: _served_remotely(server.address, policy, obs)).remote_rows == 3
    finally:
        served = server.close()
    assert served.refused == 1 and served.problem == ""


def test_a_malformed_request_is_answered_as_not_served_and_the_server_serves_on(published):
    server = _server(published)
    policy, obs = _policy(published, seed=0), np.zeros((3, *published.observation_space.shape), np.uint8)
    try:
        connection = connect(server.address)
        connection.send_bytes(inference_client.REQUEST.pack(0, 5) + bytes(7))  # five rows said, seven bytes sent
        assert connection.poll(10), "the server did not answer a malformed request"
        assert connection.recv_bytes() == inference_client.NOT_SERVED
        assert _within(10, lambda: _served_remotely(server.address, policy, obs)).remote_rows == 3
    finally:
        served = server.close()
    assert served.failed == 1 and served.problem == "a malformed request (23 bytes)"


def _stop(pid: int) -> None:
    """SIGSTOP `pid` and return once every thread of it has stopped: kill() returns before a thread
    running on the other core has taken the signal, and such a thread could still answer one request."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [_thread_state(stat) for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
        if states and all(state in "TtZX" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 10 s")


def _thread_state(stat: Path) -> str:
    try:
        return stat.read_text().rpartition(")")[2].split()[0]  # the field after the command's name
    except (FileNotFoundError, ProcessLookupError):
        return "T"  # a thread that ended answers nothing


def test_a_worker_waits_for_a_silent_server_a_bounded_time_then_acts_on_its_cpu(published, monkeypatch):
    monkeypatch.setattr(inference_client, "REPLY_TIMEOUT_S", 1.0)  # absent before its fix
    policy, obs = _policy(published, seed=0), np.zeros((3, *published.observation_space.shape), np.uint8)
    silent, killed = _server(published), _server(published)
    try:
        for server in (silent, killed):
            _served_remotely(server.address, policy, obs)  # its version loaded there
        _stop(silent.process.pid)
        waiting = RemoteOutputs(connect(silent.address), 0, policy)
        waiting.request(obs)
        np.testing.assert_array_equal(_within(10, waiting.receive), policy.outputs(obs))
        assert waiting.remote_rows == 0 and connect(silent.address) is None  # not asked again by this process

        mid_round = RemoteOutputs(connect(killed.address), 0, policy)
        mid_round.request(obs)
        os.kill(killed.process.pid, signal.SIGKILL)
        killed.process.wait()
        mid_round.request(obs[:1])
        np.testing.assert_array_equal(_within(10, mid_round.receive), policy.outputs(obs))
        np.testing.assert_array_equal(_within(10, mid_round.receive), policy.outputs(obs[:1]))
        assert mid_round.connection is None
    finally:
        os.kill(silent.process.pid, signal.SIGCONT)
        silent.close()
        killed.close()


def test_two_threads_of_one_worker_each_get_their_own_replies(published):
    """A job host runs rollouts on a pool of threads: each asks and is answered on its own connection."""
    server = _server(published)
    policy, shape = _policy(published, seed=0), published.observation_space.shape

    def rollout(seed: int) -> int:
        rng, served = np.random.default_rng(seed), 0
        for _ in range(100):
            remote = RemoteOutputs(connect(server.address), 0, policy)
            halves = [rng.integers(0, 2, (rows, *shape), dtype=np.uint8) for rows in (3 + seed, 4 + seed)]
            for obs in halves:
                remote.request(obs)
            for obs in halves:
                np.testing.assert_allclose(remote.receive(), policy.outputs(obs), rtol=1e-5, atol=1e-6)
            served += remote.remote_rows
        return served

    try:
        with ThreadPoolExecutor(2) as pool:
            served_rows = list(pool.map(rollout, (0, 1)))
    finally:
        server.close()
    assert served_rows == [100 * 7, 100 * 9]  # every row served there, none computed here after a mix-up


def test_a_server_whose_forwards_keep_failing_answers_each_then_stops_serving(tmp_path, capfd):
    """A forward that raises (out of memory, a CUDA error: not made for real on a CPU) is each
    request's error; the third in a row ends serving, and every worker sees its connection end."""
    experiment = resolve_experiment("cartpole-ppo")
    address = InferenceAddress(str(tmp_path / "socket"), b"key", inference_client.this_machine())
    setup = inference.InferenceSetup(address, None, "run", experiment.preset.agent, experiment.observation_space,
                                     experiment.action_space, "cpu")
    serving = inference._Serving(setup, Listener(address.path, family="AF_UNIX"))

    class OutOfMemory:
        def outputs(self, obs):
            raise RuntimeError("CUDA out of memory")

    serving.versions.policies[0] = OutOfMemory()
    worker, server_end = Pipe()
    serving.connections.append(server_end)
    obs = np.zeros((2, 4), np.float32)
    for _ in range(inference.FAILURES_IN_A_ROW):
        serving._answer({0: [(server_end, obs)]})
        assert worker.recv_bytes() == inference_client.NOT_SERVED
    assert serving.stopped.is_set() and not os.path.exists(address.path)
    with pytest.raises(EOFError):
        worker.recv_bytes()
    served = serving.served()
    assert served.failed == 3 and served.problem == (
        "a forward raised RuntimeError: CUDA out of memory; stopped serving after 3 failed forwards in a row")
    said = capfd.readouterr().err.splitlines()
    assert len(said) == 2 and said[0].startswith("inference server: a forward raised RuntimeError")


def test_a_worker_closes_its_connections_to_finished_runs_servers(published):
    first = _server(published)
    old = connect(first.address)
    first.close()
    second = _server(published)
    try:
        assert connect(second.address) is not None
        assert old.closed
    finally:
        second.close()


def test_auto_serves_async_runs_whose_learner_is_on_a_gpu_and_nothing_else():
    appo, ppo = load_preset("catch-appo"), load_preset("catch-ppo")
    assert inference_beside_learner(appo, "cuda") and inference_beside_learner(appo, "cuda:1")
    assert not inference_beside_learner(appo, "cpu")
    assert not inference_beside_learner(ppo, "cuda")  # SYNC stays reproducible bit for bit
    assert inference_beside_learner(load_preset("catch-ppo", {"distribution.inference": "learner"}), "cpu")
    assert not inference_beside_learner(load_preset("catch-appo", {"distribution.inference": "worker"}), "cuda")


@pytest.mark.parametrize(("preset", "overrides", "says"), [
    ("cartpole-ppo", {"distribution.mode": "single"}, "single mode has none"),
    ("cartpole-ppo", {"agent.recurrent": 16}, "not recurrent ones"),
    ("pendulum-sac", {}, "sac"),
    pytest.param("spread-ippo", {}, "acts on its workers", marks=pytest.mark.skipif(
        importlib.util.find_spec("pettingzoo") is None, reason="the multi-agent extra (pettingzoo) is not installed")),
])
def test_inference_beside_the_learner_is_refused_for_what_it_cannot_serve(preset, overrides, says):
    config = load_preset(preset, {**overrides, "distribution.inference": "learner"})
    with pytest.raises(InvalidPreset) as refused:
        experiment_from(config)
    assert refused.value.field == "distribution.inference" and says in str(refused.value)


def test_a_connect_to_a_server_that_never_accepts_is_bounded_and_the_worker_acts_on_its_cpu(tmp_path, monkeypatch):
    import socket as sockets

    from gymflow.tasks.cluster.inference_client import this_machine
    from gymflow.tasks.cluster.messages import InferenceAddress

    monkeypatch.setattr(inference_client, "CONNECT_TIMEOUT_S", 1.0)
    listening = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)  # listens, never accepts nor shakes hands
    listening.bind(str(tmp_path / "frozen.sock"))
    listening.listen(1)
    try:
        address = InferenceAddress(str(tmp_path / "frozen.sock"), b"k" * 32, this_machine())
        started = time.monotonic()
        assert _within(10, lambda: connect(address)) is None  # multiprocessing's Client waited here for good
        assert time.monotonic() - started < 5
    finally:
        listening.close()


def test_a_rollout_that_raised_between_request_and_reply_leaves_no_reply_to_the_next(published):
    """A connection is kept per thread: the replies a failed rollout was owed would be read by the
    next rollout on that thread as its own (seen: asked for one batch, got the last one's)."""
    server = _server(published)
    policy, shape = _policy(published, seed=0), published.observation_space.shape
    first, second = np.zeros((3, *shape), np.uint8), np.ones((2, *shape), np.uint8)
    try:
        with pytest.raises(RuntimeError), RemoteOutputs(connect(server.address), 0, policy) as failed:
            failed.request(first)
            raise RuntimeError("the env raised mid-rollout")
        with RemoteOutputs(connect(server.address), 0, policy) as next_rollout:
            next_rollout.request(second)
            np.testing.assert_allclose(_within(10, next_rollout.receive), policy.outputs(second), rtol=1e-5, atol=1e-6)
            assert next_rollout.remote_rows == 2  # served there, on a connection of its own
    finally:
        server.close()
