#!/bin/bash
# What a session lent a GPU machine runs there in one call (../shared/device/README.md), logs under $OUT:
#   ../shared/device/build-wheelhouse.sh --add stable-baselines3==2.9.2     # here, after committing
#   run: bash benchmarks/gpu_session.sh [SIDES...]   with carry [".devrun"]
# The CUDA tests, the learner's update on the GPU replayed as CUDA graphs and eager, both profiled
# (breakout-appo, a 14 x 8 round), then benchmarks/atari_throughput.py --mode gpu with the SIDES
# given (default: every side), and with MORE_ENVS set, APPO and stepping alone again at that many
# envs a worker. Stage `pong` (STAGES=pong, alone: ~9.5 minutes) trains pong-appo with 14 workers x 8
# envs for PONG_S seconds and prints its evaluations (benchmarks/evaluation_history.py): when the
# greedy return first reached 18, in env steps and in minutes from the run's start; $OUT/pong.jsonl
# holds them for benchmarks/records/pong.jsonl (PONG_SEED: a seed a session, compared with
# CleanRL's published PPO curve at the same env steps).
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
if [[ $STAGES == *pong* ]]; then
PRESET=${PONG_PRESET:-pong-appo}  # PONG_PRESET=breakout-ppo PONG_EXTRA="--set env.id=ALE/Pong-v5": SYNC PPO on Pong
mkdir -p /tmp/pong && cd /tmp/pong
timeout -s INT -k 30 "${PONG_S:-520}" gymflow run "$PRESET" ${PONG_EXTRA:-} --quiet \
    --set distribution.rollout_workers="${WORKERS:-14}" --set distribution.envs_per_worker=8 \
    --set tracking.video=off --set schedule.evaluate_every_env_steps="${PONG_EVAL_EVERY:-250000}" \
    --set seed="${PONG_SEED:-0}" > "$OUT/pong.log" 2>&1
echo "$PRESET: exit $? (124: stopped at PONG_S)"; tail -3 "$OUT/pong.log"
LABEL="$PRESET ${PONG_EXTRA:-} seed ${PONG_SEED:-0}, ${WORKERS:-14} workers x 8 envs, $(sed -n 2p "$OUT/machine.txt")"
python3 "$ROOT/benchmarks/evaluation_history.py" --tracking-uri sqlite:////tmp/pong/mlflow.db --target 18 \
    --record "$OUT/pong.jsonl" --label "$LABEL" | tee "$OUT/pong-evaluations.txt" | tail -25
cd /tmp
fi
[[ $STAGES == *throughput* ]] || exit 0
ONLY=()
[ $# -gt 0 ] && ONLY=(--only "$@")
timeout "${THROUGHPUT_S:-300}" python3 "$ROOT/benchmarks/atari_throughput.py" --mode gpu --steps "$STEPS" "${ONLY[@]}" \
    > "$OUT/throughput.log" 2>&1
tail -15 "$OUT/throughput.log"
if [ -n "${MORE_ENVS:-}" ]; then
    timeout "${MORE_S:-120}" python3 "$ROOT/benchmarks/atari_throughput.py" --mode gpu --steps "$STEPS" \
        --envs "$MORE_ENVS" --only stepping appo > "$OUT/throughput-more-envs.log" 2>&1
    tail -6 "$OUT/throughput-more-envs.log"
fi
