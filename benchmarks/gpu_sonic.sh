#!/usr/bin/env bash
# moekit's layer beside SonicMoE on one GPU in one call (<= 10 min, from the repository root):
# `bench_moe_layer.py --router --impls moekit,plain,sonicmoe` at SHAPES (balanced routing), SonicMoE from
# the bundle in .bench-sonic (benchmarks/README.md, "SonicMoE": carry .bench-sonic), its commit named in
# the JSON. Each SonicMoE shape pays its first-call JIT (10-110 s) outside the timings.
#
#   OUT=/path C=<commit> SONIC=<sonic-moe commit> [SHAPES=sonicmoe-e256-k16,sonicmoe-7b] bash benchmarks/gpu_sonic.sh
#
# Results: ${P}_moe_layer_sonic_${NAME:-fine}_$C.json (and its plot). Settings: MAX_S (start no shape
# after it, 420), KERNELS=--kernels (a profiled call a cell: its kernels by name), CHANGE (moekit from
# gpu_prelude.sh's `changed_src CHANGE`, recorded as commit C+CHANGE; NAME then defaults to fine_CHANGE).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=benchmarks/gpu_prelude.sh
. benchmarks/gpu_prelude.sh
: "${SONIC:?set SONIC to the sonic-moe commit in the bundle}"
mkdir -p /tmp/sonic && tar -xJf .bench-sonic/sonic.tar.xz -C /tmp/sonic || exit 3
python3 -c "import cuda.bindings" 2>/dev/null || for w in .bench-sonic/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/sonic; done
SRC=$PWD/src N=${NAME:-fine} RUN=$C
if [ -n "${CHANGE:-}" ]; then
    SRC=$(changed_src "$CHANGE") || exit 3
    N=${NAME:-fine_$CHANGE} RUN=$C+$CHANGE
fi
export MOEKIT_BENCH_COMMIT=$RUN PYTHONUNBUFFERED=1
export PYTHONPATH=$SRC:$PWD/benchmarks:/tmp/sonic:/tmp/sonic/nvidia_cutlass_dsl/python_packages
t0=$(date +%s)
# shellcheck disable=SC2086
python3 benchmarks/bench_moe_layer.py --router --impls moekit,plain,sonicmoe --dists balanced \
    --shapes "${SHAPES:-sonicmoe-e256-k16,sonicmoe-7b}" --sonicmoe-commit "$SONIC" --commit "$RUN" \
    --max-seconds "${MAX_S:-420}" ${KERNELS:-} --out "$OUT/sonic" >"$OUT/sonic.log" 2>&1
echo "bench rc=$? $(($(date +%s) - t0)) s"
for f in "$OUT"/sonic/*; do mv "$f" "$OUT/${P}_moe_layer_sonic_${N}_$C.${f##*.}"; done
rmdir "$OUT/sonic"
grep -v "^\s*$" "$OUT/sonic.log" | tail -25
ls "$OUT"
