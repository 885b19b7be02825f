#!/bin/bash
# What a session lent a GPU machine runs there in one call (../shared/device/README.md), logs under $OUT:
#   ../shared/device/build-wheelhouse.sh --add stable-baselines3==2.9.2 --extra envpool  # here, after committing
# (gymflow's runs step on env.backend auto: SYNC PPO on the ALE's vector env, APPO on EnvPool where the
# wheelhouse carries it; BACKEND=gymnasium for the Python path's figures)
#   run: bash benchmarks/gpu_session.sh [SIDES...]   with carry [".devrun"]
# The CUDA tests, the learner's update on the GPU replayed as CUDA graphs and eager, both profiled
# (breakout-appo, a 14 x 8 round), then benchmarks/atari_throughput.py --mode gpu with the SIDES
# given (default: every side), and with MORE_ENVS set, APPO and stepping alone again at that many
# envs a worker. Stage `pong` (STAGES=pong) trains pong-appo with 14 workers x 8 envs, seed by seed
# (PONG_SEEDS, default "0"; each stops at the target 18 or after PONG_S seconds: ~2 minutes a seed on
# an H100), and prints each run's evaluations (benchmarks/evaluation_history.py): when the greedy
# return first reached 18, in env steps and in minutes from the run's start; $OUT/pong.jsonl holds
# them for benchmarks/records/pong.jsonl. SYNC PPO on Pong for the return per env step, 3 seeds at
# once: PONG_PRESET=breakout-ppo PONG_EXTRA="--set env.id=ALE/Pong-v5 --set schedule.target_return=18"
# PONG_SEEDS="0 1 2" PONG_AT_ONCE=1 PONG_S=490.
set -u
OUT=${OUT:-/tmp/gymflow-gpu-session}
mkdir -p "$OUT"
ROOT=$(pwd)
STEPS=${STEPS:-200000}
source .devrun/install.sh > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
cd /tmp
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/machine.txt" 2>&1
lscpu | grep -E "Model name|^CPU\(s\)" >> "$OUT/machine.txt"
STAGES=${STAGES:-tests learner throughput}  # a first call may run "tests learner", a second "throughput"
if [[ $STAGES == *tests* ]]; then
timeout "${TEST_S:-90}" python3 -m pytest -q -p no:cacheprovider -c "$ROOT/.devrun/pytest.ini" \
    "$ROOT/.devrun/tests/test_agents.py" "$ROOT/.devrun/tests/test_inference.py" "$ROOT/.devrun/tests/test_graphed.py" \
    -k "gpu or cuda or inference or server or graph" \
    > "$OUT/pytest.log" 2>&1
echo "pytest: $(tail -1 "$OUT/pytest.log")"
fi
if [[ $STAGES == *learner* ]]; then
timeout "${LEARNER_S:-90}" python3 "$ROOT/benchmarks/learner_device.py" --presets breakout-appo --round 14 8 \
    --rounds 3 --cuda-only --cuda-eager --profile > "$OUT/learner.log" 2>&1
grep -E "profiled update|breakout-appo " "$OUT/learner.log"
fi
train_pong() {  # one seed in its own folder (its own MLflow store and Prefect database), stopped at PONG_S
    mkdir -p "/tmp/pong-$1" && cd "/tmp/pong-$1" || return
    PREFECT_HOME="/tmp/pong-$1/.prefect" timeout -s INT -k 30 "${PONG_S:-520}" gymflow run "$PRESET" ${PONG_EXTRA:-} \
        --quiet --set distribution.rollout_workers="${WORKERS:-14}" --set distribution.envs_per_worker=8 \
        --set tracking.video=off --set schedule.evaluate_every_env_steps="${PONG_EVAL_EVERY:-250000}" \
        --set seed="$1" > "$OUT/pong-$1.log" 2>&1
    echo "$PRESET seed $1: exit $? (124: stopped at PONG_S)"; tail -3 "$OUT/pong-$1.log"
}
if [[ $STAGES == *pong* ]]; then
PRESET=${PONG_PRESET:-pong-appo}  # PONG_PRESET=breakout-ppo PONG_EXTRA="--set env.id=ALE/Pong-v5": SYNC PPO on Pong
SEEDS=${PONG_SEEDS:-0}  # PONG_AT_ONCE=1 trains them at once (SYNC only: its returns per env step do not depend on speed)
for seed in $SEEDS; do
    if [ -n "${PONG_AT_ONCE:-}" ]; then train_pong "$seed" & sleep 3; else train_pong "$seed"; fi
done
wait
AT_ONCE=${PONG_AT_ONCE:+, $(wc -w <<< "$SEEDS") such runs at once}
for seed in $SEEDS; do
    LABEL="$PRESET ${PONG_EXTRA:-} seed $seed, ${WORKERS:-14} workers x 8 envs$AT_ONCE, $(sed -n 2p "$OUT/machine.txt")"
    python3 "$ROOT/benchmarks/evaluation_history.py" --tracking-uri "sqlite:////tmp/pong-$seed/mlflow.db" --target 18 \
        --record "$OUT/pong.jsonl" --label "$LABEL" | tee -a "$OUT/pong-evaluations.txt" | tail -12
done
cd /tmp
fi
[[ $STAGES == *throughput* ]] || exit 0
ONLY=()
[ $# -gt 0 ] && ONLY=(--only "$@")
timeout "${THROUGHPUT_S:-300}" python3 "$ROOT/benchmarks/atari_throughput.py" --mode gpu --steps "$STEPS" \
    --backend "${BACKEND:-auto}" "${ONLY[@]}" \
    > "$OUT/throughput.log" 2>&1
tail -15 "$OUT/throughput.log"
if [ -n "${MORE_ENVS:-}" ]; then
    timeout "${MORE_S:-120}" python3 "$ROOT/benchmarks/atari_throughput.py" --mode gpu --steps "$STEPS" \
        --envs "$MORE_ENVS" --only stepping appo > "$OUT/throughput-more-envs.log" 2>&1
    tail -6 "$OUT/throughput-more-envs.log"
fi
