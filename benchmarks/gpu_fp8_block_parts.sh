#!/usr/bin/env bash
# fp8_block's forward / dgrad kernel with three math warp groups against two, on one sm_90 GPU in one call
# (from the repository root, no .git needed, <= 5 min): `sweep_fp8_block_parts.py` at the large shapes and
# Qwen3-30B-A3B (bits compared between the two), then `pytest -m gpu` of the Gluon kernel's tests (both
# forms against the Triton kernel's bits and float64).
#
#   OUT=/path C=<commit> bash benchmarks/gpu_fp8_block_parts.sh
#
# Leaves ${P}_fp8_block_parts_$C.json and ${P}_gpu_tests_fp8_block_parts_$C.log (P: h100 / h200 by the GPU).
# Settings by environment: SWEEP_S (120), TESTS_S (110), SHAPES (deepseek-v3-ep8,qwen3-30b-a3b,mixtral-8x7b).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=benchmarks/gpu_prelude.sh
. benchmarks/gpu_prelude.sh
export MOEKIT_BENCH_COMMIT=$C PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks
timeout "${SWEEP_S:-120}" python3 benchmarks/sweep_fp8_block_parts.py --rounds 2 \
    --shapes "${SHAPES:-deepseek-v3-ep8,qwen3-30b-a3b,mixtral-8x7b}" --out "$OUT/${P}_fp8_block_parts_$C.json" \
    >"$OUT/parts.log" 2>&1
echo "sweep rc=$?"
tail -34 "$OUT/parts.log"
X=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
# shellcheck disable=SC2086
timeout "${TESTS_S:-110}" python3 -m pytest -q -m gpu $X -p no:cacheprovider tests/ops/test_quantized_gemm.py -k hopper \
    >"$OUT/${P}_gpu_tests_fp8_block_parts_$C.log" 2>&1
echo "tests rc=$?"
tail -4 "$OUT/${P}_gpu_tests_fp8_block_parts_$C.log"
