"""An actor-critic's minibatch update: the loss, its gradients and their clipping, then Adam's step.

On a GPU the first three are captured once per minibatch shape as a CUDA graph and replayed
after: profiled on an H100, breakout-appo's eager update launched ~169 kernels a minibatch and
left the GPU idle half the wall-clock, the CPU's launches being the limit (docs/benchmarks.md).
A replay is one launch, plus one copy for each of the minibatch's tensors into the graph's own.
Adam (fused) stays eager: it reads the gradients the graph wrote, so loading an optimiser's
state, changing its learning rate or copying weights in (all in place) need no new capture.

What changes between minibatches without changing their shape (the learning rate is Adam's;
PPO's annealed clip range) goes in as `scalars`: a 0-d tensor in the graph, a float when eager,
so that an eager update's numbers are what they were before graphs existed.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gymflow.agents.data_parallel import Ranks

Batch = dict[str, torch.Tensor]
Scalars = dict[str, float]
# a minibatch and its scalars -> the loss to minimise and the metrics to report (unread, on the device)
LossOf = Callable[[Batch, dict[str, float | torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
WARM_UP_PASSES = 2  # eager gradient passes on a side stream before a capture (torch's recipe), then discarded
CAPTURE_AFTER = 2  # a shape is captured the second time it comes (a batch's odd last minibatch may never come back)
MOST_GRAPHS = 4  # shapes beyond these (multi-agent batches' live samples vary) stay eager


@dataclass
class _Captured:
    """One minibatch shape's graph: the tensors it reads, and where it leaves gradients and metrics."""

    graph: torch.cuda.CUDAGraph
    inputs: Batch
    scalars: dict[str, torch.Tensor]
    metrics: torch.Tensor  # the metrics stacked, in `names`' order
    names: tuple[str, ...]
    gradients: list[torch.Tensor | None]


class MinibatchUpdate:
    """Steps `optimizer` on a minibatch's loss, its gradients clipped to `max_grad_norm`; with
    `graphed` (agent.cuda_graph) and the network on a GPU, the gradient pass is a captured graph replayed."""

    def __init__(self, network: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float, graphed: bool):
        self.parameters = list(network.parameters())
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.graphed = graphed and self.parameters[0].is_cuda
        self._captured: dict[tuple, _Captured] = {}
        self._seen: Counter[tuple] = Counter()

    def step(self, loss_of: LossOf, minibatch: Batch, scalars: Scalars, ranks: Ranks | None = None
             ) -> dict[str, torch.Tensor]:
        """One update; the minibatch's metrics, on the device. With `ranks` (one of several), the
        loss of this rank's share of the minibatch's rows, the gradients averaged over the ranks
        (eager: a collective cannot be replayed in a graph)."""
        if ranks is not None:
            return self._shared(loss_of, minibatch, scalars, ranks)
        captured = self._graph_for(loss_of, minibatch, scalars) if self.graphed else None
        metrics = self._eager(loss_of, minibatch, scalars) if captured is None else self._replay(captured, minibatch,
                                                                                                 scalars)
        self.optimizer.step()
        return metrics

    def _eager(self, loss_of: LossOf, minibatch: Batch, scalars: dict[str, float | torch.Tensor]
               ) -> dict[str, torch.Tensor]:
        self.optimizer.zero_grad()
        loss, metrics = loss_of(minibatch, scalars)
        loss.backward()
        nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm)
        return metrics

    def _shared(self, loss_of: LossOf, minibatch: Batch, scalars: Scalars, ranks: Ranks) -> dict[str, torch.Tensor]:
        share = ranks.share(len(next(iter(minibatch.values()))))
        self.optimizer.zero_grad()
        loss, metrics = loss_of({key: share.of(value) for key, value in minibatch.items()}, scalars)
        loss.backward()
        share.average_gradients(self.parameters)
        nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm)
        self.optimizer.step()
        return metrics  # this rank's rows': the learner averages a call's over the ranks (Ranks.mean)

    def _graph_for(self, loss_of: LossOf, minibatch: Batch, scalars: Scalars) -> _Captured | None:
        """The graph of this minibatch's shape: captured now if it is due, None while eager."""
        shape = tuple((key, tuple(value.shape), value.dtype) for key, value in minibatch.items()) + tuple(scalars)
        if shape not in self._captured:
            self._seen[shape] += 1
            if self._seen[shape] < CAPTURE_AFTER or len(self._captured) >= MOST_GRAPHS:
                return None
            try:
                self._captured[shape] = self._capture(loss_of, minibatch, scalars)
            except RuntimeError as error:  # an operation a graph cannot hold: the run goes on, eager
                warnings.warn(f"agent.cuda_graph: the minibatch update could not be captured as a CUDA graph "
                              f"({str(error).splitlines()[0]}); it runs eager", RuntimeWarning, stacklevel=2)
                self.graphed = False
                return None
        return self._captured[shape]

    def _replay(self, captured: _Captured, minibatch: Batch, scalars: Scalars) -> dict[str, torch.Tensor]:
        for key, value in minibatch.items():
            captured.inputs[key].copy_(value, non_blocking=True)
        for key, value in scalars.items():
            captured.scalars[key].fill_(value)
        captured.graph.replay()
        for parameter, gradient in zip(self.parameters, captured.gradients, strict=True):
            parameter.grad = gradient  # the graph's own: whatever set .grad since is replaced
        return dict(zip(captured.names, captured.metrics.clone().unbind(), strict=True))

    def _capture(self, loss_of: LossOf, minibatch: Batch, scalars: Scalars) -> _Captured:
        inputs = {key: value.clone() for key, value in minibatch.items()}
        device = inputs[next(iter(inputs))].device
        held = {key: torch.tensor(value, dtype=torch.float32, device=device) for key, value in scalars.items()}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_PASSES):
                self._eager(loss_of, inputs, held)
        torch.cuda.current_stream(device).wait_stream(side)
        for parameter in self.parameters:
            parameter.grad = None  # the capture's backward allocates them in the graph's memory
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a thread reading weights may go on
            loss, metrics = loss_of(inputs, held)
            loss.backward()
            nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm)
            stacked = torch.stack([value.float() for value in metrics.values()])
        return _Captured(graph, inputs, held, stacked, tuple(metrics), [p.grad for p in self.parameters])
