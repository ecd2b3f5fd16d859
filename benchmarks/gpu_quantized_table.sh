#!/usr/bin/env bash
# The quantized layer on one GPU in one call (<= 10 min, from the repository root, no .git needed):
# `pytest -m gpu` of the kernels a change to the quantized or gated path touches, then bench_quantized's
# layer table (plain bf16, moekit bf16, fp8_block, fp8_rowwise, torchao FP8; dense bf16 and fp8 roofs
# in the same run; with KERNELS=--kernels one profiled step per column, kernels by name).
#
#   OUT=/path C=<commit> bash benchmarks/gpu_quantized_table.sh
#
# torchao and liger-kernel are installed from .whl/ into a temporary --target directory (carry .whl:
# `pip download --no-deps -d .whl torchao==0.18.0 liger-kernel==0.8.5` here). The results are named by
# the GPU (h100_/h200_) and the commit: ${P}_gpu_tests_$C.log, ${P}_${NAME}_$C.{json,md,png}
# (NAME default quantized_layer). Settings by environment: SKIP_TESTS, TESTS_S (300; cold, the default files need about 290 s at 4 workers, extrapolated from the H100 run at 1a128e9), TEST_FILES,
# W (pytest workers, 4), SKIP_TABLE, TABLE_S (270), BUDGET_S (230: no cell starts after it), COLS, SHAPES_ARG
# (e.g. "--shapes qwen3-30b-a3b"), KERNELS, ROUTING (balanced, skewed), NAME. The device returns at most 8 files: keep $OUT small.
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=benchmarks/gpu_prelude.sh
. benchmarks/gpu_prelude.sh
export MOEKIT_BENCH_COMMIT=$C PYTHONUNBUFFERED=1
SITE=$(mktemp -d)/site
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/torchao-*.whl .whl/liger_kernel-*.whl \
    && echo "wheels installed into $SITE"
export PYTHONPATH=$PWD/src:$PWD/benchmarks:$SITE
DEFAULT_TESTS="tests/ops/test_activations.py tests/ops/test_held_columns.py tests/ops/test_gated_quantize.py
  tests/ops/test_glu.py tests/ops/test_glu_gathered.py tests/ops/test_grouped_mlp.py tests/ops/test_moe_experts.py
  tests/ops/test_moe_experts_recompute.py tests/test_quantized_compute.py tests/ops/test_quantized_gated_fc1.py
  tests/ops/test_quantize_for_wgrad.py tests/ops/test_quantize_hopper.py tests/nn/test_moe_layer.py"
if [ -z "${SKIP_TESTS:-}" ]; then
    X=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${W:-4}")
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout "${TESTS_S:-300}" python3 -m pytest -m gpu $X -p no:cacheprovider -q -rfE ${TEST_FILES:-$DEFAULT_TESTS} \
        >"$OUT/${P}_gpu_tests_$C.log" 2>&1
    echo "tests rc=$? $(($(date +%s) - t0)) s"
    tail -8 "$OUT/${P}_gpu_tests_$C.log"
fi
if [ -z "${SKIP_TABLE:-}" ]; then
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout "${TABLE_S:-270}" python3 benchmarks/bench_quantized.py --parts layer --roofs bf16_mm,fp8_mm_rowwise \
        --columns "${COLS:-plain_bf16,moekit_bf16,moekit_fp8_block,moekit_fp8_rowwise,torchao_fp8}" \
        ${SHAPES_ARG:-} ${KERNELS:-} ${ROUTING:+--routing "$ROUTING"} --commit "$C" --budget-s "${BUDGET_S:-230}" --out "$OUT/tab" \
        >"$OUT/table.log" 2>&1
    echo "table rc=$? $(($(date +%s) - t0)) s"
    N=${NAME:-quantized_layer}
    if [ -f "$OUT/tab/quantized.json" ]; then
        mv "$OUT/tab/quantized.json" "$OUT/${P}_${N}_$C.json"
        mv "$OUT/tab/quantized.md" "$OUT/${P}_${N}_$C.md"
        [ -f "$OUT/tab/quantized.png" ] && mv "$OUT/tab/quantized.png" "$OUT/${P}_${N}_$C.png"
        rm -rf "$OUT/tab"
        grep "^|" "$OUT/${P}_${N}_$C.md" | head -40
    else
        tail -30 "$OUT/table.log"
    fi
fi
ls "$OUT"
