"""Where each piece of a run lives in storage, derived from the run id alone."""

from __future__ import annotations

from dataclasses import dataclass


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

    def shard(self, version: int | None, worker: int) -> str:
        round_name = "heatup" if version is None else f"v{version:06d}"
        return f"{self.prefix}/shards/{round_name}/w{worker:03d}.npz"

    def chunk(self, worker: int, chunk: int) -> str:
        """async: the `chunk`-th shard rollout worker `worker` collected."""
        return f"{self.prefix}/shards/async/w{worker:03d}/c{chunk:06d}.npz"

    @property
    def checkpoints(self) -> str:
        return f"{self.prefix}/checkpoints"

    def checkpoint(self, version: int) -> str:
        return f"{self.checkpoints}/v{version:06d}"

    @property
    def latest(self) -> str:
        return f"{self.checkpoints}/latest"
