"""What a run keeps in storage, and what it deletes once nothing can need it.

Each checkpoint records its `ShardFloor`: the oldest shards (and ASYNC ledger segments) a resume
from it reads — the env cursors its rollouts continue from, and the inserted shards whose
transitions its replay memory still held (when the replay memory is rebuilt from shards rather
than stored in the checkpoint). Floors only rise as a run goes on, so once the old checkpoints
are retired, everything below the floor of the oldest checkpoint kept is deleted: no resume, from
any checkpoint left, reads it. Shards above it — the rounds and chunks since — are what the live
run is working on.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from gymflow.tasks.storage.layout import RunLayout, parse_shard_key
from gymflow.tasks.storage.objects import Storage

_SEGMENT = re.compile(r"/ledger/v(\d{6})\.json$")


@dataclass(frozen=True)
class ShardFloor:
    """The oldest stored experience a resume from one checkpoint reads."""

    workers: int  # rollout workers, each with a heatup shard, a shard a round, a stream of chunks
    heatup: bool  # heatup's shards
    round: int = 0  # sync: the rounds of this version and later
    chunks: tuple[int, ...] = ()  # async: per rollout worker, its chunks from this number on
    segment: int = 0  # async: the ledger segments of this version and later

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ShardFloor:
        fields = json.loads(data)
        return cls(fields["workers"], fields["heatup"], fields["round"], tuple(fields["chunks"]), fields["segment"])

    def released_since(self, earlier: ShardFloor, layout: RunLayout) -> list[str]:
        """The keys under this floor that were not under `earlier`: what rising from `earlier` to
        here frees, found without listing storage."""
        workers = range(self.workers)
        keys = [layout.shard(None, w) for w in workers] if earlier.heatup and not self.heatup else []
        keys += [layout.shard(v, w) for v in range(earlier.round, self.round) for w in workers]
        for worker, (before, now) in enumerate(zip(earlier.chunks, self.chunks)):
            keys += [layout.chunk(worker, chunk) for chunk in range(before, now)]
        return keys + [layout.ledger_segment(v) for v in range(earlier.segment, self.segment)]

    def needs(self, key: str) -> bool:
        """Whether a resume from the checkpoint may read the shard or segment at `key`."""
        if shard := parse_shard_key(key):
            if shard.heatup:
                return self.heatup
            if shard.round is not None:
                return shard.round >= self.round
            return shard.worker >= len(self.chunks) or shard.chunk >= self.chunks[shard.worker]
        if found := _SEGMENT.search(key):
            return int(found[1]) >= self.segment
        return True


def delete_below(storage: Storage, layout: RunLayout, floor: ShardFloor, earlier: ShardFloor | None = None) -> None:
    """Delete the shards and ledger segments under `floor`: those freed since `earlier`, the
    floor deleted below last time, or where there is none, whatever a listing finds under it."""
    if earlier is not None:
        storage.delete(floor.released_since(earlier, layout))
        return
    storage.delete(key for key in [*storage.list(layout.shards), *storage.list(layout.ledger)] if not floor.needs(key))
