#!/usr/bin/env bash
# The Hopper forward/dgrad's two schedules on one GPU in one call (<= 10 min, from the repository root):
# the shared 128 x 256 tile (`grouped_mm_ws_kernel`, configs.MM_WS) and the ping-pong (the same kernel
# under configs.MM_PINGPONG, compiled as `grouped_mm_pingpong_kernel`, selected by configs.MM_SCHEDULE).
#
#   1. `pytest -m gpu` of the forward/dgrad kernels under both schedules (bits against the Triton kernel,
#      float64 references, no host sync) and their sm_90a compiles;
#   2. `sweep_grouped_mm.py --variants ... --triton first` at the fine shapes: fc2's forward and fc1's
#      dgrad alone on equal and ragged groups, every variant's bits checked, the dense roof in the same run;
#   3. `ab_builds.py --op layer` for each change in AB (a comma list): the layer's step with src as it is (A)
#      and with that change to the tables (B: gpu_prelude.sh's `changed_src`), bits compared.
#
#   OUT=/path C=<commit> bash benchmarks/gpu_mm_schedules.sh
#
# Results: ${P}_gpu_tests_mm_schedules_$C.log, ${P}_mm_schedules_sweep_$C.json, ${P}_ab_layer_<change>_${C}_$C.json.
# Settings by environment: TESTS_S (150), SWEEP_S (240), AB_S (170), SWEEP_SHAPES, VARIANTS, AB (pingpong;
# changes as changed_src names them, and auto: the sweep's fastest of pingpong, regs208 and load4 on
# the _ragged products, none under 1.02x; AB_S seconds each), AB_SHAPES, AB_ARGS (more ab_builds.py
# arguments, e.g. "--quantization fp8_block" for AB=gated_fc1_epilogue), SKIP_TESTS, SKIP_SWEEP, SKIP_AB.
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=benchmarks/gpu_prelude.sh
. benchmarks/gpu_prelude.sh
export MOEKIT_BENCH_COMMIT=$C PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks
if [ -z "${SKIP_TESTS:-}" ]; then
    t0=$(date +%s)
    timeout "${TESTS_S:-150}" python3 -m pytest -m gpu -n 4 -p no:cacheprovider -q -rfE tests/ops/test_gemm_kernels.py \
        -k "run_the_hopper_kernel or does_not_take or forward_dgrad_kernel_compiles or dy_rows_swapped" \
        >"$OUT/${P}_gpu_tests_mm_schedules_$C.log" 2>&1
    echo "tests rc=$? $(($(date +%s) - t0)) s"
    tail -4 "$OUT/${P}_gpu_tests_mm_schedules_$C.log"
fi
if [ -z "${SKIP_SWEEP:-}" ]; then
    t0=$(date +%s)
    timeout "${SWEEP_S:-240}" python3 benchmarks/sweep_grouped_mm.py --variants "${VARIANTS:-base,unstaged,regs208,load4,pingpong,pingpong_load4}" --triton first \
        --rounds 2 --shapes "${SWEEP_SHAPES:-sonicmoe-e256-k16,qwen3-30b-a3b,sonicmoe-7b,sonicmoe-e64-k4}" \
        --out "$OUT/${P}_mm_schedules_sweep_$C.json" >"$OUT/sweep.log" 2>&1
    echo "sweep rc=$? $(($(date +%s) - t0)) s"
    grep -v "^\s*$" "$OUT/sweep.log" | tail -12
fi
[ -n "${SKIP_AB:-}" ] && { ls "$OUT"; exit 0; }
AB=${AB:-pingpong}
for ab in ${AB//,/ }; do
    if [ "$ab" = auto ]; then  # the variant the sweep found fastest at the layer's routing, if any is 2 % faster
        ab=$(python3 benchmarks/sweep_grouped_mm.py --pick "$OUT/${P}_mm_schedules_sweep_$C.json")
        [ -z "$ab" ] && { echo "AB=auto: no variant 2 % faster on the _ragged products: no layer A/B"; continue; }
        echo "AB=auto: $ab"
    fi
    B=$(changed_src "$ab") || exit 3
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout "${AB_S:-170}" python3 benchmarks/ab_builds.py --a src --b "$B" --op layer --dists balanced --rounds 2 ${AB_ARGS:-} \
        --shapes "${AB_SHAPES:-sonicmoe-e256-k16,qwen3-30b-a3b}" --commit "$C" --commit-b "$C+$ab" \
        --out "$OUT/${P}_ab_layer_${ab}_${C}_$C.json" >"$OUT/ab_$ab.log" 2>&1
    echo "ab $ab rc=$? $(($(date +%s) - t0)) s"
    tail -6 "$OUT/ab_$ab.log"
done
ls "$OUT"
