"""SBX's side of a learner-update race: SBX's SAC or TD3 (Stable-Baselines3 on JAX) doing gradient steps on
request, so that a gymflow benchmark can time gymflow's learner and SBX's alternately in one run.

Runs in SBX's own environment, never in gymflow's (it imports no gymflow). The side venv, as made for this
script (CPU torch first: SB3 imports torch, and plain `pip install sbx-rl` pulls a CUDA torch build):

    python3.11 -m venv /tmp/sbx-venv
    /tmp/sbx-venv/bin/pip install -U pip
    /tmp/sbx-venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/sbx-venv/bin/pip install sbx-rl "jax[cpu]" "gymnasium[mujoco]"

which gave sbx-rl 0.28.0, jax/jaxlib 0.10.2, flax 0.12.8, optax 0.2.8, stable-baselines3 2.9.2,
gymnasium 1.4.0, mujoco 4.0.1, torch 2.13.0+cpu, numpy 2.4.6.

Driven as a subprocess over pipes:

    /tmp/sbx-venv/bin/python benchmarks/sbx_side.py --algo sac --env HalfCheetah-v5 --batch 256 \\
        --hidden 256 256 --gradient-steps-per-call 1 [--threads T]

It builds the model (seed 0), fills the replay buffer with `model.learn(--fill)` (SBX's own loop, run with
learning_starts raised to --fill for it, so that it only collects, with uniform random actions, and costs no
updates; set back to 0 after), warms up (`train` calls until JAX has compiled every variant the loop will
meet), then prints `ready`. After that each stdin line is an integer N:
it runs N gradient steps as N/G calls of `model.train(gradient_steps=G, batch_size=B)` (N rounded up to a
whole number of calls), blocks until the resulting parameters exist, and prints one line, the updates a
second (gradient steps done / seconds). EOF ends it. Only these lines go to stdout: whatever the libraries
print there (MuJoCo, SB3, JAX) is sent to stderr.

The settings are rl-zoo's / CleanRL's: SAC lr 3e-4, gamma 0.99, tau 0.005, buffer 1e6, learning_starts 0,
automatic entropy coefficient (target -|A|), two critics; TD3 lr 1e-3, policy_delay 2, target policy noise
0.2 clipped at 0.5, Gaussian action noise 0.1; `--hidden` the actor's and the critics' layers for both.

What one SBX "update" (one gradient step) is, read from sbx 0.28's `SAC.train` / `TD3.train` / `_train`:
- on the host, once a `train` call (so once an update at G=1, which is what SBX does in a real run with
  train_freq=1, gradient_steps=1): SB3's ReplayBuffer samples B*G transitions (numpy fancy indexing, then
  torch tensors, then back to numpy), SAC sets the Adam learning rates (optax.inject_hyperparams), the
  arrays are handed to the jitted `_train` (static gradient_steps, policy_delay and policy-delay offset,
  so an odd G with TD3 compiles two variants; the warm-up covers both), and `.item()` on the losses for the
  logger waits for the call to finish;
- inside the jitted `jax.lax.fori_loop`, each step: the critic update (SAC: next actions sampled from the
  current actor, entropy term; TD3: target actor's actions plus clipped noise; min of the two target
  critics; one Adam step on both critics), then the Polyak update of the targets (SAC: the critics; TD3:
  critics and actor, every step, where SB3's and CleanRL's TD3 update targets only on actor steps), then
  under `lax.cond` every policy_delay-th step (SAC 1, TD3 2) the actor's Adam step and, for SAC, the
  entropy coefficient's.

Threads: by default XLA's CPU client uses the machine's default (its pool is sized from the CPUs the
process may run on). `--threads T` sets PJRT_NPROC=T before jax is imported (and torch's threads to T):
with jaxlib 0.10.2 that is what limits XLA's CPU thread pool (seen on a 2-core machine: TD3 at G=64 kept
two threads busy by default, one with PJRT_NPROC=1). The old recipe, `XLA_FLAGS=--xla_cpu_multi_thread_eigen=
false intra_op_parallelism_threads=1` (or `=true`), left as many threads busy as no flags did (the bare token
is ignored after a `--` flag; first in the list it is taken for a flag file and aborts), and
`--intra_op_parallelism_threads=T` is an unknown XLA flag that aborts. Pinning with `taskset` works too.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

WARMUP_STEPS = 256  # gradient steps of warm-up at least, after the fill


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="SBX's side of a learner-update race (see the module docstring)")
    parser.add_argument("--algo", choices=["sac", "td3"], default="sac")
    parser.add_argument("--env", default="HalfCheetah-v5")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--gradient-steps-per-call", type=int, default=1, help="G: gradient steps one train call")
    parser.add_argument("--fill", type=int, default=2000, help="env steps of model.learn before the updates")
    parser.add_argument("--threads", type=int, default=None, help="XLA CPU (and torch) threads; default: all")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def protocol_stdout():
    """A private copy of stdout for the protocol's lines; fd 1 itself is pointed at stderr, so that what
    the libraries print (C code included) cannot land between them."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def build(args: argparse.Namespace):
    import numpy as np
    from sbx import SAC, TD3
    from stable_baselines3.common.noise import NormalActionNoise

    common = dict(buffer_size=1_000_000, learning_starts=0, batch_size=args.batch, tau=0.005, gamma=0.99,
                  train_freq=1, gradient_steps=1, policy_kwargs=dict(net_arch=list(args.hidden)), seed=args.seed,
                  verbose=0)
    if args.algo == "sac":
        return SAC("MlpPolicy", args.env, learning_rate=3e-4, ent_coef="auto", **common)
    from gymnasium import make

    actions = make(args.env).action_space.shape[0]
    noise = NormalActionNoise(mean=np.zeros(actions), sigma=0.1 * np.ones(actions))
    return TD3("MlpPolicy", args.env, learning_rate=1e-3, policy_delay=2, target_policy_noise=0.2,
               target_noise_clip=0.5, action_noise=noise, **common)


def trained_state(model) -> tuple:
    """What a train call leaves behind: blocking on it waits for every update the calls dispatched."""
    state = (model.policy.qf_state, model.policy.actor_state, model.key)
    return state + ((model.ent_coef_state,) if hasattr(model, "ent_coef_state") else ())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        os.environ["PJRT_NPROC"] = str(args.threads)  # read when jax makes its CPU client
    out = protocol_stdout()
    import jax

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = build(args)
    model.learning_starts = args.fill  # the fill only collects (uniform random actions); the warm-up compiles
    model.learn(args.fill)
    model.learning_starts = 0
    per_call, batch = args.gradient_steps_per_call, args.batch

    def run(calls: int) -> None:
        for _ in range(calls):
            model.train(gradient_steps=per_call, batch_size=batch)
        jax.block_until_ready(trained_state(model))

    run(max(4, math.ceil(WARMUP_STEPS / per_call)))  # >= 2 calls a policy-delay offset: every variant compiled
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        calls = max(1, math.ceil(int(line) / per_call))
        start = time.perf_counter()
        run(calls)
        seconds = time.perf_counter() - start
        print(f"{calls * per_call / seconds:.3f}", file=out, flush=True)


if __name__ == "__main__":
    main()
