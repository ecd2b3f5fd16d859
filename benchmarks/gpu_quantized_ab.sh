#!/usr/bin/env bash
# A change to the quantized path against the build it replaces, on one GPU, in two calls of <= 10 min
# each (from the repo root; build A a source tree holding moekit/, build B this tree's src/ or B_TREE):
#   PART=1: `pytest -m gpu` of the quantize, wgrad, quantized-compute and moe_experts tests on B, then the wgrad
#           operands' quantization (bench_quantized.py, fp8_block: the segments operands, materialized
#           and gathered from token rows by the routing's index, the latter "unsupported" in a build
#           without it) for A and B at routed splits (bench_moe_layer's routing: counts not multiples
#           of 128), DeepSeek-V3 EP8 and Qwen3-30B-A3B;
#   PART=2: ab_builds.py --op layer --quantization fp8_block, A and B in alternating processes (kernels,
#           step, bit-identity), ab_builds' balanced and skewed routing at the four layer shapes;
#   PART=3: PART=1's quantization at equal splits (every group a multiple of 128 rows: the bars').
# Prepare A here, where git is (it travels in carry):
#   mkdir -p .ab/A && git archive <A> src | tar -x -C .ab/A --strip-components=1 && echo <A> > .ab/commitA
# then run PART=1 and PART=2 with carry [".ab"] (a B other than HEAD likewise in .ab/B, B_TREE=.ab/B,
# B_COMMIT=<B>; a B that differs from HEAD by configuration only, e.g. the Gluon quantizer's gathered
# form switched on: cp -r src .ab/B, then in .ab/B/moekit/ops/runtime/configs.py add to
# QUANTIZE_SLOTS_TMA["sm90"] the entries "segments-gathered" and "segments-columnwise-gathered" equal
# to "segments" and "segments-columnwise"). Leaves $OUT/gpu_tests_<B>.log (the tests run on this tree's src/ and tests/), $OUT/
# q_<splits>_<A|B>/quantized.{json,md} and $OUT/h200_ab_layer_fp8_block_<A>_<B>.json.
#   OUT=/path PART=1 [A_TREE=.ab/A] [A_COMMIT=...] [B_TREE=src] [B_COMMIT=...] bash benchmarks/gpu_quantized_ab.sh
set -u
OUT=${OUT:?set OUT}; PART=${PART:?set PART to 1, 2 or 3}
A_TREE=${A_TREE:-.ab/A}
B_TREE=${B_TREE:-src}
A=${A_COMMIT:-$(cat "$(dirname "$A_TREE")/commitA" 2>/dev/null || echo A)}
B=${B_COMMIT:-${MOEKIT_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo B)}}
[ -d "$A_TREE/moekit" ] || { echo "build A: $A_TREE holds no moekit/ (see the header)"; exit 2; }
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
quantize_ab() {  # the wgrad operands' quantization at splits $1, build A then build B
  for build in A B; do
    if [ $build = A ]; then tree=$A_TREE; commit=$A; else tree=$B_TREE; commit=$B; fi
    t0=$(date +%s)
    PYTHONPATH=$PWD/$tree timeout 140 python3 benchmarks/bench_quantized.py --parts quantize --roofs hbm_copy \
      --recipes fp8_block --operands segments,segments_columnwise,segments_gathered,segments_columnwise_gathered \
      --splits "$1" --shapes deepseek-v3-ep8,qwen3-30b-a3b --rounds 2 --commit "$commit" --out "$OUT/q_$1_$build" \
      > "$OUT/q_$1_$build.log" 2>&1
    echo "quantize $1 $build rc=$? $(($(date +%s) - t0)) s"
    grep -A20 "^group_quantize: GB/s" "$OUT/q_$1_$build/quantized.md" | head -22
  done
}
if [ "$PART" = 1 ]; then
  X=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
  t0=$(date +%s)
  PYTHONPATH=$PWD/src timeout 260 python3 -m pytest -q -m gpu $X -p no:cacheprovider tests/ops/test_quantize_hopper.py \
    tests/ops/test_quantize_for_wgrad.py tests/ops/test_quantized_wgrad.py tests/ops/test_quantize.py \
    tests/test_quantized_compute.py tests/ops/test_moe_experts.py > "$OUT/gpu_tests_$B.log" 2>&1
  echo "tests rc=$? $(($(date +%s) - t0)) s"; tail -6 "$OUT/gpu_tests_$B.log"
  quantize_ab routed
elif [ "$PART" = 3 ]; then
  quantize_ab balanced
elif [ "$PART" = 2 ]; then
  t0=$(date +%s)
  timeout 570 python3 benchmarks/ab_builds.py --a "$A_TREE" --b "$B_TREE" --op layer --quantization fp8_block --rounds 1 \
    --commit "$A" --commit-b "$B" --out "$OUT/h200_ab_layer_fp8_block_${A}_${B}.json" > "$OUT/ab.log" 2>&1
  echo "ab_builds rc=$? $(($(date +%s) - t0)) s"; tail -40 "$OUT/ab.log"
else
  echo "PART must be 1, 2 or 3, got $PART"; exit 2
fi
