"""Sample Factory 2.1.1's APPO on Breakout through EnvPool, set as gymflow's `breakout-appo` at
`--workers 2 --envs-per-worker 8` with the learner on the CPU: the other side of
benchmarks/appo_vs_sample_factory.py. Run by a venv of its own (it imports no gymflow):

    python3.11 -m venv /tmp/sf-venv
    /tmp/sf-venv/bin/pip install sample-factory==2.1.1 "numpy<2" gymnasium==0.29.1 ale-py==0.9.1 envpool==0.8.4 \
        shimmy==1.3.0                                         # EnvPool 0.8.4 gives gym spaces: SF needs shimmy
    /tmp/sf-venv/bin/pip install --force-reinstall --no-deps torch==2.13.0 \
        --index-url https://download.pytorch.org/whl/cpu      # pip otherwise keeps a CUDA build
    /tmp/sf-venv/bin/python benchmarks/sample_factory_side.py --env-steps 32768

It trains through SF's own EnvPool Atari example (`sf_examples.envpool.atari`: `atari_breakout`,
EnvPool's Breakout-v5, 84x84 grey, 4 stacked frames, frame skip 4, 30 no-ops, reward clipping,
episodic life, no sticky actions) in SF's asynchronous architecture (rollout workers, one
inference worker, one learner; every process one torch thread), and prints `env_steps_per_second
<float>` last.

The rate: ENV STEPS (agent steps: frames / 4; `--summaries_use_frameskip False` makes SF count
steps, not frames) learned per second, from the learner's own reports: each time SF's learner
finishes a batch it reports its env-step count to the runner, which this script timestamps; the
rate is the steps between the first report at or past `--warm-up` (a quarter) of the run's steps
and the first at or past its steps (SF stops there; the batches its learner finishes while it shuts
down drain what its workers had collected ahead, faster than steady state), over the time between:
the window gymflow's side reads from its MLflow metrics (benchmarks/atari_throughput.py). Startup,
the warm-up and shutdown are left out. A report comes a batch (2,048 steps) at a time: a short run
(`--env-steps` 5,000) has only 2-3 in its window, so use >= 32,768 steps for a figure.

Settings: gymflow's (presets/builtin/breakout-appo.yaml, with 2 workers x 8 envs) = SF flag
- distribution.rollout_workers 2 = --num_workers 2
- distribution.envs_per_worker 8 = --env_agents 8 --num_envs_per_worker 1 (one EnvPool of 8 envs a worker, as
  SF's EnvPool example asks) --worker_num_splits 1
- schedule.rollout_steps_per_env 128 = --rollout 128 (a chunk: 8 envs x 128 steps = 1,024 samples)
- gymflow's APPO batch: at least a chunk from each worker (tasks/training/batch_stream.py: 2 x 1,024 = 2,048
  samples; whatever has landed, so 3,072 at times), agent.epochs 4 of agent.minibatch_size 256 =
  --batch_size 256 --num_batches_per_epoch 8 (workers x envs x 128 / 256: a 2,048-sample batch) --num_epochs 4;
  SF's batch is fixed at 2,048, gymflow's grows with what landed: the same SGD work per sample either way
- agent.lr 2.5e-4, anneal_lr = --learning_rate 0.00025 and lr_schedule linear_decay (the example's default,
  not a CLI choice in 2.1.1; to 0 over the run's steps)
- agent.gamma 0.99 = --gamma 0.99; agent.clip_range 0.1 = --ppo_clip_ratio 0.1
- agent.value_coef 0.5 = --value_loss_coeff 0.5; agent.entropy_coef 0.01 = --exploration_loss_coeff 0.01
- agent.max_grad_norm 0.5 = --max_grad_norm 0.5; Adam eps 1e-5 = --adam_eps 1e-5
- Nature CNN + hidden_sizes [512], relu = --encoder_conv_architecture convnet_atari
  --encoder_conv_mlp_layers 512 --nonlinearity relu --use_rnn False, one shared actor-critic; pixels / 255
- V-trace (lambda 1, rho-bar 1, c-bar 1) = --with_vtrace True --vtrace_rho 1 --vtrace_c 1 (SF requires
  --recurrence = --rollout = 128 with it: a minibatch is 2 whole 128-step sequences); `--no-vtrace`: GAE 0.95
- distribution.max_policy_lag 4 = --max_policy_lag 129: gymflow's versions are its learner's commits (one a
  batch, >= 32 SGD steps), SF's its SGD steps (32 a batch: 4 epochs x 8 minibatches), and SF keeps a step whose
  lag is < the flag; at --max_policy_lag 4 SF masks nearly every sample out (its lag runs 30-90 SGD steps here)
- advantages normalised per minibatch (both)
- distribution.learner_device cpu, 1 learner thread = --device cpu (SF sets 1 torch thread a process)
- distribution.mode async = --async_rl True --serial_mode False
Not matched (SF has no setting for it): the unclipped value loss (SF clips it against the acting
values: --ppo_clip_value is set huge, so the clip never bites but is still computed); the surrogate's
ratio (gymflow: against the proximal policy; SF: against the acting one; the same work); SF's
episodic life is EnvPool's (a life lost ends the learner's episode), gymflow's its own mark on the
same steps; inference: gymflow's workers each run their CNN, SF runs it in one inference process
(batched over workers): a process of its own on the 2 cores; EnvPool: SF's 0.8.4 (what 2.1.1's
example was written for), gymflow's venv has its own (1.2.5 here); evaluation and
checkpoints: gymflow's evaluations are pushed past the run, SF never evaluates and saves a
checkpoint at the end (after the window).

SF 2.1.1's `--with_vtrace True` crashes when it records summaries (`mb.advantages` is missing: V-trace
computes them per minibatch); this script patches `Learner._record_summaries` to use the minibatch's
V-trace advantages, at import, so that the spawned learner process has the patch too.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

from sample_factory.algo.learning.learner import Learner


def _patch_vtrace_summaries() -> None:
    record = Learner._record_summaries
    if getattr(record, "patched_for_vtrace", False):
        return

    def _record_summaries(self, train_loop_vars):
        if "advantages" not in train_loop_vars.mb and "adv" in train_loop_vars:
            train_loop_vars.mb["advantages"] = train_loop_vars.adv  # V-trace's, computed per minibatch
        return record(self, train_loop_vars)

    _record_summaries.patched_for_vtrace = True
    Learner._record_summaries = _record_summaries


ROLLOUT, MINIBATCH, EPOCHS = 128, 256, 4  # breakout-appo's rollout_steps_per_env, minibatch_size, epochs
_patch_vtrace_summaries()  # module level: SF spawns its learner, which imports this module as __mp_main__


def sf_arguments(env_steps: int, workers: int, envs: int, train_dir: str, vtrace: bool) -> list[str]:
    minibatches = workers * envs * ROLLOUT // MINIBATCH  # gymflow's batch: a chunk from each worker
    settings = {
        "env": "atari_breakout", "experiment": "breakout_appo_side", "train_dir": train_dir,
        "restart_behavior": "overwrite", "seed": 0, "device": "cpu", "serial_mode": False, "async_rl": True,
        "num_workers": workers, "num_envs_per_worker": 1, "env_agents": envs, "worker_num_splits": 1,
        "batched_sampling": True, "num_policies": 1, "policy_workers_per_policy": 1,
        "rollout": ROLLOUT, "recurrence": ROLLOUT if vtrace else 1, "batch_size": MINIBATCH,
        "num_batches_per_epoch": minibatches,
        "num_epochs": EPOCHS, "learning_rate": 0.00025, "adam_eps": 1e-5,
        "gamma": 0.99, "gae_lambda": 0.95, "ppo_clip_ratio": 0.1, "ppo_clip_value": 1e6,
        "value_loss_coeff": 0.5, "exploration_loss_coeff": 0.01, "exploration_loss": "entropy",
        "max_grad_norm": 0.5, "with_vtrace": vtrace, "vtrace_rho": 1.0, "vtrace_c": 1.0,
        "max_policy_lag": 4 * EPOCHS * minibatches + 1,  # gymflow's 4 versions (a batch each) in SF's SGD steps
        "encoder_conv_architecture": "convnet_atari", "encoder_conv_mlp_layers": 512, "nonlinearity": "relu",
        "use_rnn": False, "obs_scale": 255.0, "normalize_input": False, "normalize_returns": False,
        "env_frameskip": 4, "env_framestack": 4, "summaries_use_frameskip": False,
        "train_for_env_steps": env_steps, "save_every_sec": 10**6, "save_best_every_sec": 10**6,
        "with_wandb": False,
    }
    return [f"--{key}={value}" for key, value in settings.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-steps", type=int, default=32768, help="env steps (agent steps) to train for")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--no-vtrace", action="store_true", help="GAE (lambda 0.95) instead of V-trace")
    parser.add_argument("--warm-up", type=float, default=0.25, help="share of the steps left out of the rate")
    parser.add_argument("--keep-train-dir", action="store_true")
    args = parser.parse_args()

    from sample_factory.algo.utils.misc import LEARNER_ENV_STEPS, SAMPLES_COLLECTED, ExperimentStatus
    from sample_factory.train import make_runner
    from sf_examples.envpool.atari.train_envpool_atari import parse_atari_args, register_atari_components

    train_dir = tempfile.mkdtemp(prefix="sf-side-")
    register_atari_components()
    cfg = parse_atari_args(sf_arguments(args.env_steps, args.workers, args.envs_per_worker, train_dir,
                                        not args.no_vtrace))
    assert cfg.lr_schedule == "linear_decay", cfg.lr_schedule  # the Atari example's default; not a CLI choice
    cfg, runner = make_runner(cfg)
    reports: list[tuple[float, int]] = []  # (seconds, env steps the learner has learned from)
    collected: list[tuple[float, int]] = []  # (seconds, env steps the inference worker has acted for, summed)

    def timestamp(_runner, msg, _policy_id) -> None:
        reports.append((time.perf_counter(), msg[LEARNER_ENV_STEPS]))

    def count_collected(_runner, msg, _policy_id) -> None:
        collected.append((time.perf_counter(), (collected[-1][1] if collected else 0) + msg[SAMPLES_COLLECTED]))

    # appended to SF's own lists (2.1.1's register_policy_msg_handler replaces a list with a function)
    runner.policy_msg_handlers[LEARNER_ENV_STEPS].append(timestamp)
    runner.policy_msg_handlers[SAMPLES_COLLECTED].append(count_collected)
    started = time.perf_counter()
    status = runner.init()
    if status == ExperimentStatus.SUCCESS:
        status = runner.run()
    wall = time.perf_counter() - started
    if not args.keep_train_dir:
        shutil.rmtree(train_dir, ignore_errors=True)
    if status != ExperimentStatus.SUCCESS or len(reports) < 2:
        sys.exit(f"Sample Factory failed (status {status}, {len(reports)} learner reports)")
    last_steps = reports[-1][1]
    # up to the first report at or past the run's steps (SF then stops): the batches learned after it, while SF
    # shuts down, drain what the workers had collected ahead and come faster than steady state
    end = next((i for i, report in enumerate(reports) if report[1] >= args.env_steps), len(reports) - 1)
    window = [report for report in reports[:end + 1] if report[1] >= args.warm_up * args.env_steps]
    if len(window) < 2:
        window = reports[max(end - 1, 0):end + 1]
    (t0, s0), (t1, s1) = window[0], window[-1]
    print(f"Sample Factory APPO: {last_steps:,} env steps learned in {wall:.1f} s (startup included); "
          f"{s1 - s0:,} in the window of {t1 - t0:.1f} s after the warm-up, {len(window)} learner reports")
    in_window = [mark for mark in collected if t0 <= mark[0] <= t1]
    if len(in_window) > 1:
        (c0, n0), (c1, n1) = in_window[0], in_window[-1]
        print(f"(its workers collected {(n1 - n0) / (c1 - c0):.1f}"
              " env steps/s in the window, as its inference worker counts them)")
    print(f"env_steps_per_second {(s1 - s0) / (t1 - t0):.2f}", flush=True)


if __name__ == "__main__":
    main()
