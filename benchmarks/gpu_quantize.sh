#!/usr/bin/env bash
# group_quantize on the H200, from the repo root (<= 200 s): this tree's kernels beside the committed run at
# d09248b (the Triton kernels before the Gluon columnwise kernel), HBM copy in the same run, then the GPU tests.
# Leaves $OUT/bench/quantized.{json,md} and $OUT/gpu_tests.log.  Usage: OUT=/path [PY=python3] bash benchmarks/gpu_quantize.sh
set -u
PY=${PY:-python3}
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/gq_out}; mkdir -p "$OUT/bench"
COMMIT=${MOEKIT_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo gq)}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 90 $PY benchmarks/bench_quantized.py --parts quantize --roofs hbm_copy --rounds 2 \
  --quant-steps 10 --budget-s 70 --commit "$COMMIT" --out "$OUT/bench" \
  --baseline benchmarks/results/h200_quantize_d09248b.json > "$OUT/bench/log.txt" 2>&1
echo "bench rc=$?"; grep -A70 "^group_quantize: GB/s" "$OUT/bench/quantized.md" || tail -30 "$OUT/bench/log.txt"
grep "hbm_copy" "$OUT/bench/quantized.md"
X=$($PY -c "import xdist" 2>/dev/null && echo "-n 4")
timeout 100 $PY -m pytest -q -m gpu $X -p no:cacheprovider tests/ops/test_quantize.py tests/ops/test_quantize_hopper.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; tail -15 "$OUT/gpu_tests.log"
