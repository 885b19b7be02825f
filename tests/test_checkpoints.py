"""The checkpoint protocol and the no-pickle rule, on a local folder."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch
from gymnasium import spaces

from gymflow.agents.configs import PPOConfig
from gymflow.agents.ppo import PPOLearner
from gymflow.presets.model import StorageConfig
from gymflow.tasks.storage.checkpoints import CheckpointError, commit_checkpoint, latest_version, read_checkpoint
from gymflow.tasks.storage.codec import decode_arrays, decode_state, encode_state
from gymflow.tasks.storage.layout import RunLayout
from gymflow.tasks.storage.objects import Storage, StorageLocation
from gymflow.tasks.storage.retention import ShardFloor
from gymflow.tasks.training.commits import Commits
from gymflow.tasks.training.state import LoopState


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage(StorageLocation(str(tmp_path / "store")))


LAYOUT = RunLayout("run-1")


def test_commit_writes_blobs_then_manifest_then_latest(storage):
    commit_checkpoint(storage, LAYOUT, 0, {"a.bin": b"zero"})
    commit_checkpoint(storage, LAYOUT, 1, {"a.bin": b"one", "b.json": b"{}"})
    assert latest_version(storage, LAYOUT) == 1
    manifest = json.loads(storage.read(f"{LAYOUT.checkpoint(1)}/manifest.json"))
    assert manifest["blobs"]["a.bin"]["size"] == 3 and len(manifest["blobs"]["a.bin"]["sha256"]) == 64
    assert read_checkpoint(storage, LAYOUT, 1) == {"a.bin": b"one", "b.json": b"{}"}
    assert read_checkpoint(storage, LAYOUT, 0, ["a.bin"]) == {"a.bin": b"zero"}


def test_a_truncated_blob_is_refused(storage):
    commit_checkpoint(storage, LAYOUT, 3, {"policy.safetensors": b"x" * 100})
    storage.write(f"{LAYOUT.checkpoint(3)}/policy.safetensors", b"x" * 60)
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        read_checkpoint(storage, LAYOUT, 3)


def test_a_tampered_manifest_is_refused(storage):
    commit_checkpoint(storage, LAYOUT, 2, {"policy.safetensors": b"weights"})
    key = f"{LAYOUT.checkpoint(2)}/manifest.json"
    manifest = json.loads(storage.read(key))
    manifest["blobs"]["policy.safetensors"]["sha256"] = "0" * 64
    storage.write(key, json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        read_checkpoint(storage, LAYOUT, 2)


def test_a_version_without_manifest_or_pointer_is_never_loaded(storage):
    storage.write(f"{LAYOUT.checkpoint(5)}/policy.safetensors", b"half written")
    with pytest.raises(CheckpointError, match="no manifest"):
        read_checkpoint(storage, LAYOUT, 5)
    with pytest.raises(CheckpointError, match="no version has been committed"):
        latest_version(storage, LAYOUT)


def test_learner_checkpoint_loads_without_executing_code(storage):
    learner = PPOLearner(PPOConfig(), spaces.Box(-1, 1, (3,)), spaces.Discrete(2), seed=0)
    state = LoopState.start(workers=2, first_evaluation=100)
    Commits(storage, "run-1", StorageConfig(), policy_window=1).checkpoint(learner, state, ShardFloor(2, True))
    blobs = read_checkpoint(storage, LAYOUT, 0)
    assert set(blobs) == {"policy.safetensors", "learner.safetensors", "learner.json", "loop_state.json",
                          "shard_floor.json"}
    assert LoopState.from_json(blobs["loop_state.json"]) == state
    for name, data in blobs.items():  # every blob is safetensors (a JSON header, raw bytes) or JSON
        if name.endswith(".safetensors"):
            header_size = int.from_bytes(data[:8], "little")
            assert json.loads(data[8 : 8 + header_size])
        else:
            json.loads(data)
    state = decode_state(blobs["learner.safetensors"], blobs["learner.json"])
    assert torch.equal(state["network"]["actor.0.weight"], learner.network.actor[0].weight)
    assert state["optimizer"]["param_groups"][0]["lr"] == learner.optimizer.param_groups[0]["lr"]


def test_state_codec_keeps_integer_keys_numpy_and_rng_states():
    generator = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(4)
    tree = {"state": {0: {"step": torch.tensor(2.0)}, 1: {}}, "rng": rng.bit_generator.state,
            "generator": generator.get_state(), "array": np.arange(3), "nested": [1, 2.5, None, "x", True]}
    decoded = decode_state(*encode_state(tree))
    assert list(decoded["state"]) == [0, 1] and decoded["state"][0]["step"].item() == 2.0
    assert decoded["rng"] == rng.bit_generator.state
    assert torch.equal(decoded["generator"], generator.get_state())
    np.testing.assert_array_equal(decoded["array"], np.arange(3))
    assert decoded["nested"] == [1, 2.5, None, "x", True]


def test_shard_arrays_refuse_pickled_objects():
    import io

    buffer = io.BytesIO()
    np.savez(buffer, sneaky=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        decode_arrays(buffer.getvalue())


def test_policies_published_in_a_single_mode_process_are_read_there_from_memory_the_newest_two(storage):
    from gymflow.tasks.storage.checkpoints import policies_kept_in_process, publish_policy, read_policy

    layout = RunLayout("run-1")
    with policies_kept_in_process():
        for version in range(3):
            publish_policy(storage, layout, version, {"policy.safetensors": bytes([version]) * 8})
        for version in range(3):  # written to storage all the same
            assert storage.read(f"{layout.policies.folder(version)}/policy.safetensors") == bytes([version]) * 8
        storage.delete(storage.list(layout.policies.folder(2)) + storage.list(layout.policies.folder(0)))
        assert read_policy(storage, layout, 2, iter(["policy.safetensors"])) == {"policy.safetensors": b"\2" * 8}
        with pytest.raises(CheckpointError, match="no manifest"):  # only the newest two stay in memory
            read_policy(storage, layout, 0)
    with pytest.raises(CheckpointError, match="no manifest"):  # outside, what storage holds
        read_policy(storage, layout, 2)
    assert read_policy(storage, layout, 1) == {"policy.safetensors": b"\1" * 8}


def _slowly(make, writers: list[str]):
    """`_appear_at_once`, noting each writer thread's name, 5 ms late off the test's thread: what
    is read without waiting for it is not there yet."""
    def appear(path, fill):
        writers.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.005)
        make(path, fill)

    return appear


def test_writes_made_behind_are_made_in_order_off_the_callers_thread_and_seen_by_every_other_operation(
        storage, monkeypatch):
    from gymflow.tasks.storage import objects

    writers = []
    monkeypatch.setattr(objects, "_appear_at_once", _slowly(objects._appear_at_once, writers))
    with storage.writing_behind():
        for version in range(20):  # a checkpoint's blobs, manifest, pointer: the pointer last of all
            commit_checkpoint(storage, LAYOUT, version, {"state.json": b"{}", "blob": bytes([version]) * 1000})
        assert latest_version(storage, LAYOUT) == 19  # read after the writes before it
        storage.write("a/b", b"1")
        storage.delete(["a/b"])  # after the write
        storage.write("a/c", b"2")
        assert storage.list("a") == ["a/c"]
        storage.write("a/d", b"3")
    assert storage.read("a/d") == b"3"  # leaving waited for it
    assert set(writers) == {"storage-writes_0"}
    storage.write("a/e", b"4")
    assert writers[-1] == threading.current_thread().name  # outside, written by the caller


def test_a_write_made_behind_that_failed_is_raised_by_the_next_operation(storage):
    storage.write("a/file", b"x")
    with storage.writing_behind():
        storage.write("a/file/below-a-file", b"y")  # a folder where a file is
        with pytest.raises(OSError):
            storage.exists("a/file")
        assert storage.read("a/file") == b"x"


def test_another_process_reads_what_was_written_behind_once_writes_are_settled(storage, monkeypatch):
    from gymflow.tasks.storage import objects
    from gymflow.tasks.storage.objects import settle_writes

    monkeypatch.setattr(objects, "_appear_at_once", _slowly(objects._appear_at_once, []))
    with storage.writing_behind():
        storage.write("policies/v000001/policy", b"p" * 100_000)
        settle_writes()  # what single mode's helper process is sent jobs after
        with open(storage.path("policies/v000001/policy"), "rb") as written:  # not through the storage
            assert written.read() == b"p" * 100_000


def test_the_checkpoints_command_checks_each_version_and_names_the_one_a_resume_loads(tmp_path, capsys):
    from gymflow.flows.cli import main

    storage = Storage(StorageLocation(str(tmp_path / "store")))
    for version in range(3):
        commit_checkpoint(storage, LAYOUT, version, {"policy.safetensors": b"w" * (10 + version)})
    storage.write(f"{LAYOUT.checkpoint(2)}/policy.safetensors", b"w" * 5)  # the newest, truncated
    assert main(["checkpoints", LAYOUT.run_id, "--root", str(tmp_path / "store")]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("v000000  ok") and said[1].startswith("v000001  ok") and "11 bytes in 1 blobs" in said[1]
    assert said[2].startswith("v000002  REFUSED") and "does not match its manifest" in said[2]
    assert said[3] == "newest loadable version: v000001"
    assert main(["checkpoints", "no-such-run", "--root", str(tmp_path / "store")]) == 2
    assert "no checkpoints under" in capsys.readouterr().err
