"""Where each piece of a run lives in storage, derived from the run id alone."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

_SHARD_KEY = re.compile(r"/shards/(?:heatup/w(?P<heatup>\d{3})|v(?P<round>\d{6})/w(?P<worker>\d{3})"
                        r"|async/w(?P<streamer>\d{3})/c(?P<chunk>\d{6}))\.npz$")


def new_run_id(preset_name: str) -> str:
    """A new run's id: its preset's name, the time and a random part."""
    return f"{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def new_sweep_id(spec_name: str) -> str:
    """A new sweep's id: its preset's name, the time and a random part."""
    return f"{spec_name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class ShardKey:
    """What a shard's key says: the rollout worker that wrote it, and its round (SYNC: the policy
    version that collected it) or its chunk number (ASYNC); heatup's have neither."""

    worker: int
    round: int | None = None
    chunk: int | None = None

    @property
    def heatup(self) -> bool:
        return self.round is None and self.chunk is None

    @property
    def order(self) -> int:
        """Its place in its worker's stream: heatup's first, then by round or chunk."""
        return -1 if self.heatup else self.round if self.round is not None else self.chunk

    @property
    def name(self) -> str:
        return "heatup" if self.heatup else f"v{self.round:06d}" if self.round is not None else f"chunk {self.chunk}"


def parse_shard_key(key: str) -> ShardKey | None:
    """The `ShardKey` of a key `RunLayout.shard` or `.chunk` made; None for any other key."""
    found = _SHARD_KEY.search(key)
    if found is None:
        return None
    if found["heatup"] is not None:
        return ShardKey(int(found["heatup"]))
    if found["round"] is not None:
        return ShardKey(int(found["worker"]), round=int(found["round"]))
    return ShardKey(int(found["streamer"]), chunk=int(found["chunk"]))


@dataclass(frozen=True)
class Shelf:
    """Numbered versions, one folder each, and a `latest` pointer to the newest committed."""

    prefix: str

    def folder(self, version: int) -> str:
        return f"{self.prefix}/v{version:06d}"

    @property
    def latest(self) -> str:
        return f"{self.prefix}/latest"


@dataclass(frozen=True)
class RunLayout:
    """Where each piece of a run lives, derived from the run id alone."""

    run_id: str

    @property
    def prefix(self) -> str:
        return f"runs/{self.run_id}"

    @property
    def preset(self) -> str:
        return f"{self.prefix}/preset.yaml"

    @property
    def shards(self) -> str:
        return f"{self.prefix}/shards"

    def shard(self, version: int | None, worker: int) -> str:
        round_name = "heatup" if version is None else f"v{version:06d}"
        return f"{self.shards}/{round_name}/w{worker:03d}.npz"

    def chunk(self, worker: int, chunk: int) -> str:
        """async: the `chunk`-th shard rollout worker `worker` collected."""
        return f"{self.shards}/async/w{worker:03d}/c{chunk:06d}.npz"

    def video(self, version: int) -> str:
        """A film of an evaluation episode of `version`."""
        return f"{self.prefix}/videos/v{version:06d}.mp4"

    @property
    def tracking_backlog(self) -> str:
        """What MLflow had not got when a checkpoint was committed during its outage (sent on resume)."""
        return f"{self.prefix}/tracking-backlog.json"

    @property
    def ledger(self) -> str:
        """async: the ledger's segments, one per checkpoint that landed shards."""
        return f"{self.prefix}/ledger"

    def ledger_segment(self, version: int) -> str:
        return f"{self.ledger}/v{version:06d}.json"

    @property
    def policies(self) -> Shelf:
        """What rollout workers act with: every committed version, while it may be asked for."""
        return Shelf(f"{self.prefix}/policies")

    @property
    def checkpoints(self) -> str:
        return f"{self.prefix}/checkpoints"

    @property
    def checkpoint_shelf(self) -> Shelf:
        """What a resume needs: full checkpoints, on the preset's cadence."""
        return Shelf(self.checkpoints)

    def checkpoint(self, version: int) -> str:
        return self.checkpoint_shelf.folder(version)

    @property
    def latest(self) -> str:
        return self.checkpoint_shelf.latest

    @property
    def pins(self) -> str:
        """Checkpoints others still read (a population member's that another copies), kept
        whatever the retention settings: one empty object a reader."""
        return f"{self.prefix}/pins"

    def pin(self, version: int, holder: str) -> str:
        return f"{self.pins}/v{version:06d}-{holder}"


def pinned_version(pin_key: str) -> int:
    """The checkpoint version a `RunLayout.pin` key keeps."""
    return int(pin_key.rsplit("/", 1)[-1][1:7])


def sweep_best_preset(sweep_id: str) -> str:
    """A sweep's best configuration as a preset YAML (beside its runs' folders)."""
    return f"sweeps/{sweep_id}/best-preset.yaml"
