"""A machine's worker processes share the policy blobs they read: one read from storage a machine."""

from __future__ import annotations

import hashlib
import multiprocessing
from pathlib import Path

from gymflow.tasks.storage.blob_cache import BlobCache

BLOB = b"policy weights" * 1000
SHA = hashlib.sha256(BLOB).hexdigest()


def _fetch_counted(counter: Path) -> bytes:
    with open(counter, "a") as handle:
        handle.write("fetched\n")
    return BLOB


def _get_from_another_process(folder: str, counter: str) -> bytes:
    return BlobCache(Path(folder)).get_or_fetch(SHA, lambda: _fetch_counted(Path(counter)))


def test_processes_asking_for_the_same_blob_at_once_fetch_it_once(tmp_path):
    counter = tmp_path / "fetches"
    with multiprocessing.get_context("spawn").Pool(8) as pool:
        blobs = pool.starmap(_get_from_another_process, [(str(tmp_path / "cache"), str(counter))] * 8)
    assert blobs == [BLOB] * 8
    assert counter.read_text().count("fetched") == 1


def test_a_damaged_cached_blob_is_fetched_again_and_a_wrong_fetch_is_not_kept(tmp_path):
    cache, fetches = BlobCache(tmp_path), []
    assert cache.get_or_fetch(SHA, lambda: fetches.append(1) or BLOB) == BLOB
    (tmp_path / SHA).write_bytes(b"damaged")
    assert cache.get_or_fetch(SHA, lambda: fetches.append(1) or BLOB) == BLOB
    assert len(fetches) == 2 and (tmp_path / SHA).read_bytes() == BLOB
    other = hashlib.sha256(b"other").hexdigest()
    assert cache.get_or_fetch(other, lambda: b"not what the name says") == b"not what the name says"
    assert not (tmp_path / other).exists()


def test_the_folder_is_pruned_to_the_newest_blobs_and_a_folder_that_cannot_be_used_only_costs_reads(tmp_path,
                                                                                                      monkeypatch):
    from gymflow.tasks.storage import blob_cache

    monkeypatch.setattr(blob_cache, "KEEP", 2)
    cache = BlobCache(tmp_path / "cache")
    blobs = [bytes([index]) * 10 for index in range(5)]
    for blob in blobs:
        cache.get_or_fetch(hashlib.sha256(blob).hexdigest(), lambda blob=blob: blob)
    kept = {path.name for path in (tmp_path / "cache").iterdir() if len(path.name) == 64}
    assert kept == {hashlib.sha256(blob).hexdigest() for blob in blobs[-2:]}  # 5 > 2 x 2: back to the newest 2
    (tmp_path / "a file").write_text("not a folder")
    unusable = BlobCache(tmp_path / "a file" / "cache")
    assert unusable.get_or_fetch(SHA, lambda: BLOB) == BLOB
