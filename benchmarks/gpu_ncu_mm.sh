#!/usr/bin/env bash
# One GPU call: Nsight Compute of the Hopper forward/dgrad under both schedules at one fine shape: the
# first launch of each (fc2's forward in `sweep_grouped_mm.py`), `grouped_mm_ws_kernel` (the shared
# 128 x 256 tile) and `grouped_mm_pingpong_kernel` (the ping-pong): what bounds each (tensor pipe, L2,
# shared memory, the math warps' stalls), side by side. The sections' details page as CSV, one file a
# kernel; the sweep's own timings run under the profiler: read times from a sweep without it.
#
#     OUT=/tmp/out C=<commit> [SHAPE=sonicmoe-e256-k16] bash benchmarks/gpu_ncu_mm.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=benchmarks/gpu_prelude.sh
. benchmarks/gpu_prelude.sh
SHAPE=${SHAPE:-sonicmoe-e256-k16}
export PYTHONPATH=$PWD/src:$PWD/benchmarks
for K in grouped_mm_ws_kernel grouped_mm_pingpong_kernel; do
    ncu_first_launch "$K" "${K}_$SHAPE" python3 benchmarks/sweep_grouped_mm.py --variants base,pingpong \
        --triton first --rounds 1 --reps 2 --shapes "$SHAPE" --out "$OUT/sweep_$K.json"
done
rm -f "$OUT"/sweep_*.json
