#!/usr/bin/env bash
# One GPU call: Nsight Compute of fp8_block's two Hopper GEMM kernels at one layer shape's fc1, each
# kernel's first launch in `bench_quantized.py --parts gemm` (the forward, `grouped_mm_fp8_block_ws_kernel`,
# and the weight gradient, `grouped_wgrad_fp8_block_ws_kernel`): what bounds each (tensor pipe, shared
# memory, L2, issue), side by side. The sections' details page as CSV, one file a kernel, and the bench's
# own JSON (its timings run under the profiler's replay: read the kernels' times from a table run, not
# from this one).
#
#     OUT=/tmp/out C=<commit> [SHAPE=deepseek-v3-ep8] bash benchmarks/gpu_ncu_fp8_block.sh
set -uo pipefail
. benchmarks/gpu_prelude.sh
SHAPE=${SHAPE:-deepseek-v3-ep8}
export PYTHONPATH=$PWD/src:$PWD/benchmarks
for K in grouped_mm_fp8_block_ws_kernel grouped_wgrad_fp8_block_ws_kernel; do
    ncu_first_launch "$K" "${K}_$SHAPE" python3 benchmarks/bench_quantized.py --parts gemm --shapes "$SHAPE" \
        --recipes fp8_block --roofs bf16_mm --rounds 1 --out "$OUT/gemm_$K" --commit "$C"
done
