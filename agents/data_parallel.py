"""A learner's data-parallel ranks (distribution.learners): every rank holds the same learner and
draws the same batches; each runs the forward and backward passes of its own rows only, and the
ranks sum their gradients weighted by their rows' share of the batch, so that every rank takes
the optimiser step the whole batch gives, and their weights stay the same.

What is not a mean over rows is taken over the whole batch before it is shared out (PPO's
advantage normalisation); noise is drawn for the whole batch and sliced (the generators stay as
one rank's would be); the new priorities of a prioritised replay are gathered whole. With one
rank (`ALONE`) nothing here runs: the learner is the one it was, byte for byte.

The collectives are a torch.distributed process group's (gloo on CPU, NCCL on CUDA), called on
the group object itself: the ranks' processes and the group are made by the run
(tasks/training/learner_ranks.py), never by the algorithms.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gymflow.agents.batches import Sample, Transitions


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner's ranks, and the group their collectives run in."""

    rank: int = 0
    world: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (ProcessGroupGloo, ProcessGroupNCCL)
    device: str = "cpu"  # where the group's tensors live (NCCL's: the rank's GPU)

    def share(self, total: int) -> Share:
        """This rank's rows of a batch of `total`: a contiguous run, the ranks' runs in rank order."""
        start, stop = self.rank * total // self.world, (self.rank + 1) * total // self.world
        return Share(self, total, slice(start, stop))

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place (every rank gets the sum)."""
        self.group.allreduce([tensor]).wait()
        return tensor

    def mean(self, metrics: dict[str, float], rows: int) -> dict[str, float]:
        """The ranks' metrics (each its own rows' means over a call's updates), averaged over the
        ranks weighted by the `rows` each had in the call (a minibatch of 10 on three ranks: 3, 3 and
        4 rows, as one rank of all 10 would report it), over the ranks whose figure is a number (a
        rank given no rows of a minibatch has NaN for it): sums and weights in one collective a call,
        not one an update."""
        if not metrics:
            return metrics
        values = torch.tensor(list(metrics.values()), dtype=torch.float64)
        counted = torch.isfinite(values) & (rows > 0)
        weights = torch.where(counted, float(rows), 0.0)
        summed = self.sum(torch.cat([torch.where(counted, values * rows, 0.0), weights]).to(self.device)).cpu()
        sums, totals = summed[: len(metrics)].tolist(), summed[len(metrics):].tolist()
        return {key: total / weight if weight else float("nan")
                for key, total, weight in zip(metrics, sums, totals, strict=True)}

    def rows_in(self, totals: Iterable[int]) -> int:
        """This rank's rows over a call whose updates are of these batch sizes."""
        return sum(self.share(total).size for total in totals)

    def gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (all of one shape), in rank order."""
        self.group.allgather([tensors], [tensor]).wait()
        return tensors


ALONE = Ranks()  # a learner of one rank


@dataclass(frozen=True)
class Share:
    """One rank's rows of a batch, and what the ranks do together with what those rows give."""

    ranks: Ranks
    total: int
    rows: slice

    @property
    def whole(self) -> bool:
        """The rank holds the whole batch (one rank): nothing is sliced, summed or gathered."""
        return self.ranks.world == 1

    @property
    def size(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def weight(self) -> float:
        """The rows' share of the batch: a mean over them, weighted so, sums to the batch's mean."""
        return (self.rows.stop - self.rows.start) / self.total

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor of the whole batch's."""
        return tensor if self.whole else tensor[self.rows]

    def of_sample(self, sample: Sample) -> Sample:
        """This rank's transitions of a sample of the whole batch."""
        if self.whole:
            return sample
        rows = self.rows
        return Sample(Transitions(*(values[rows] for values in sample.transitions)), sample.index[rows],
                      None if sample.weights is None else sample.weights[rows])

    def average_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """The parameters' gradients of this rank's rows become the whole batch's: each weighted by
        its rows' share, summed over the ranks in one flat buffer. Call it between backward and
        the clipping of gradients (their norm is the whole batch's)."""
        if self.whole:
            return
        gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
        if not gradients:
            return
        flat = self.ranks.sum(torch.cat([gradient.reshape(-1) for gradient in gradients]) * self.weight)
        for gradient, summed in zip(gradients, flat.split([g.numel() for g in gradients]), strict=True):
            gradient.copy_(summed.view_as(gradient))

    def gathered(self, values: np.ndarray) -> np.ndarray:
        """The whole batch's values from every rank's rows of it (its priorities' TD errors)."""
        if self.whole:
            return values
        world, device = self.ranks.world, self.ranks.device
        padded = torch.zeros(-(-self.total // world), dtype=torch.float64, device=device)
        padded[: len(values)] = torch.from_numpy(np.asarray(values, np.float64))
        parts = self.ranks.gather([torch.zeros_like(padded) for _ in range(world)], padded)
        lengths = [Ranks(rank, world).share(self.total).rows for rank in range(world)]
        return np.concatenate([part[: rows.stop - rows.start].cpu().numpy()
                               for part, rows in zip(parts, lengths, strict=True)]).astype(values.dtype)


def normalized_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages scaled to mean 0 and standard deviation 1 (PPO's, per minibatch)."""
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def minibatch_sizes(size: int, minibatch_size: int) -> list[int]:
    """The sizes of one epoch's minibatches of a batch of `size` rows, `minibatch_size` at a time."""
    return [min(minibatch_size, size - start) for start in range(0, size, minibatch_size)]
