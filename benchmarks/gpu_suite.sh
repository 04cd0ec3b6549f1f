#!/usr/bin/env bash
# Every GPU measurement of docs/benchmarks.md and the CUDA tests, in stages sized to fit
# in ten minutes each on one H100 (not yet run there), from anywhere in a checkout:
#
#   bash benchmarks/gpu_suite.sh tests      # the CUDA tests (-m "gpu or flash_attn")
#   bash benchmarks/gpu_suite.sh hand       # plain, kit and hand-tuned: VLM base, bf16
#   bash benchmarks/gpu_suite.sh seeds      # plain and kit at seeds 1 and 2 (the loss)
#   bash benchmarks/gpu_suite.sh swap       # swapped attention: gradient error and loss
#   bash benchmarks/gpu_suite.sh all        # the four, in that order
#
# It needs a Python with CUDA torch, Lightning and torchmetrics and no package index:
# the package is imported from this checkout (PYTHON=... picks the interpreter). Results
# go to RESULTS (default benchmarks/results/gpu_suite: the published results stay as
# they are until compared), a log of each stage beside them; STEPS sets the demo runs'
# length (default 300), SEEDS the seeds stage's seeds (default "1 2"), BATCH the
# optimizer's batch of the hand stage (default 32, the demo's: MFU grows with it, the
# plain baseline's loader cost with it). SIZE, PRECISION,
# ACCELERATOR, DATA_DIR and WORK (defaults: base, bf16-mixed, gpu, the demo's corpus,
# .gpu_suite for the runs' own output) let the tests run the stages on a CPU at a tiny
# size, so that no GPU minute goes to a broken script.
set -uo pipefail

PYTHON=${PYTHON:-python}
STEPS=${STEPS:-300}
BATCH=${BATCH:-32}
SEEDS=${SEEDS:-1 2}  # the seeds stage's (seed 0 is the hand stage's)
SIZE=${SIZE:-base}
PRECISION=${PRECISION:-bf16-mixed}
ACCELERATOR=${ACCELERATOR:-gpu}
DATA=()
if [ -n "${DATA_DIR:-}" ]; then DATA=(--data-dir "$DATA_DIR"); fi
case "$ACCELERATOR" in gpu | cuda) DEVICE=cuda ;; *) DEVICE=$ACCELERATOR ;; esac
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
ROOT=$(dirname "$(dirname "$SELF")")
cd "$ROOT" || exit 2
RESULTS=${RESULTS:-benchmarks/results/gpu_suite}
WORK=${WORK:-$ROOT/.gpu_suite}  # the runs' own output (traces, reports, checkpoints)
mkdir -p "$RESULTS" "$WORK/path"
# The example package is installed as `speedkit_examples`; from a checkout it is a link.
ln -sfn "$ROOT/examples" "$WORK/path/speedkit_examples"
export PYTHONPATH="$ROOT:$WORK/path${PYTHONPATH:+:$PYTHONPATH}"
SPEEDKIT=("$PYTHON" -c "import sys; from lightning_speedkit.cli import main; sys.exit(main())")

stage_tests() {
    # No pytest plugins may be installed there: the project's pytest config asks for
    # pytest-timeout, so it is left out (-c /dev/null) and the GPU markers selected.
    "$PYTHON" -m pytest -c /dev/null --rootdir "$ROOT" -p no:cacheprovider -q -rs \
        --continue-on-collection-errors -m "gpu or flash_attn" tests
}

stage_hand() {
    "$PYTHON" benchmarks/hand_tuned.py --size "$SIZE" --precision "$PRECISION" \
        --accelerator "$ACCELERATOR" --steps "$STEPS" --batch-size "$BATCH" --num-workers 8 \
        "${DATA[@]}" --output-dir "$WORK/hand" --out "$RESULTS/hand_tuned_$DEVICE.json"
}

stage_seeds() {
    local seed
    for seed in $SEEDS; do
        "${SPEEDKIT[@]}" demo --accelerator "$ACCELERATOR" --precision "$PRECISION" \
            --size "$SIZE" --steps "$STEPS" --seed "$seed" "${DATA[@]}" \
            --output-dir "$WORK/demo_seed$seed" || return
        cp "$WORK/demo_seed$seed/demo.json" "$RESULTS/demo_${DEVICE/cuda/gpu}_seed$seed.json"
    done
}

stage_swap() {
    "$PYTHON" benchmarks/swap_training.py --accelerator "$DEVICE" "${DATA[@]}" \
        --out "$RESULTS/swap_training_$DEVICE.json"
}

run_stage() {
    local name=$1 start status
    start=$(date +%s)
    echo "== $name: $(date -u +%FT%TZ)"
    "stage_$name" 2>&1 | tee "$RESULTS/gpu_suite_$name.log"
    status=${PIPESTATUS[0]}
    echo "== $name: exit $status after $(($(date +%s) - start)) s"
    return "$status"
}

case "${1:-}" in
    tests | hand | seeds | swap) run_stage "$1" ;;
    all)
        failed=0
        for name in tests hand seeds swap; do run_stage "$name" || failed=1; done
        exit "$failed"
        ;;
    *)
        sed -n '2,20p' "$SELF"
        exit 2
        ;;
esac
