"""A learning rank beside the flow (distribution.learners > 1): `python -m
gymflow.tasks.training.learner_rank`, started by tasks/training/learner_ranks.py.

It reads its `RankSetup` from stdin, builds the run's learner as the flow did, says it started
(a frame on stdout), joins the ranks' group, then makes each call the flow's learner makes, as the
frames on its stdin say: first the whole training state (`sync`), then `learn`, `insert` and
`train` with their rollouts. It exits when its stdin closes (the flow closed it, or the flow
died) or when the group breaks.
"""

from __future__ import annotations

import os
import sys
from typing import IO

from gymflow.agents.core import Learner, ReplayLearner
from gymflow.tasks.cluster.wire import frames_out, read_frame, write_frame
from gymflow.tasks.training.learner_ranks import (
    LearnerCall,
    RankSetup,
    decode_rollouts,
    load_training_state,
    make_group,
)


def build_learner(setup: RankSetup) -> Learner:
    """The run's learner as the flow's process builds it (its weights come with the first call)."""
    import torch

    from gymflow.presets.model import Preset
    from gymflow.presets.validate import experiment_from

    torch.set_num_threads(setup.threads)
    experiment = experiment_from(Preset.model_validate(setup.preset))
    config = experiment.preset
    return experiment.algorithm.learner(config.agent, experiment.observation_space, experiment.action_space,
                                        config.seed, setup.device)


def make_call(learner: Learner, call: LearnerCall, blobs: list[bytes]) -> None:
    """What the flow's learner does for `call`, done here."""
    if call.op == "sync":
        load_training_state(learner, blobs)
    elif call.op == "learn":
        learner.learn(decode_rollouts(blobs[0]), call.progress, call.streams)
    elif call.op == "insert":
        assert isinstance(learner, ReplayLearner)
        learner.insert(decode_rollouts(blobs[0]))
    elif call.op == "train":
        assert isinstance(learner, ReplayLearner)
        learner.train(call.steps, call.progress)
    else:
        raise ValueError(f"no learner call {call.op!r}")


def follow(learner: Learner, calls: IO[bytes]) -> None:
    """Make each call the flow sends, until its stdin closes."""
    while (header := read_frame(calls)) is not None:
        call = LearnerCall.from_json(header)
        blobs = [read_frame(calls) for _ in range(call.blobs)]
        if any(blob is None for blob in blobs):
            return
        make_call(learner, call, [blob for blob in blobs if blob is not None])


def serve() -> None:
    from gymflow.agents.data_parallel import Ranks

    frames = frames_out()
    calls = sys.stdin.buffer
    setup_frame = read_frame(calls)
    if setup_frame is None:
        return
    setup = RankSetup.from_json(setup_frame)
    learner = build_learner(setup)
    write_frame(frames, b"started")
    group = make_group(setup.store, setup.rank, setup.world, setup.device)
    learner.join(Ranks(setup.rank, setup.world, group, setup.device))
    follow(learner, calls)


if __name__ == "__main__":
    try:
        serve()
    except (RuntimeError, OSError) as error:  # the group broke: the flow lost a rank, or is gone
        print(f"learner rank: {str(error).splitlines()[0][:200]}", file=sys.stderr)
        os._exit(1)
    os._exit(0)
