# Sourced by the one-call GPU scripts (gpu_quantized_table.sh, gpu_ncu_*.sh, ...), from the repository
# root: checks OUT and C (the commit measured), makes OUT, prints the GPU's name and sets P, the results'
# prefix by GPU (h100 / h200 / gpu); defines ncu_first_launch and changed_src.
: "${OUT:?set OUT}" "${C:?set C to the commit measured}"
mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU"
case "$GPU" in *H200*) P=h200 ;; *H100*) P=h100 ;; *) P=gpu ;; esac
export P

# ncu_first_launch KERNEL NAME CMD...: Nsight Compute of KERNEL's first launch in CMD (a regex anchored
# at the name's start), the sections that say what bounds a GEMM (tensor pipe, L2, shared memory, the
# warps' stalls), the details page as CSV in $OUT/${P}_ncu_NAME_$C.csv, CMD's output in $OUT/ncu_NAME.log.
ncu_first_launch() {
    local kernel=$1 name=$2
    shift 2
    ncu --clock-control none -k "regex:^$kernel" --launch-count 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        --section InstructionStats --page details --csv --log-file "$OUT/${P}_ncu_${name}_$C.csv" \
        "$@" >"$OUT/ncu_$name.log" 2>&1
    echo "$kernel: rc $? ($(wc -l <"$OUT/${P}_ncu_${name}_$C.csv") lines)"
}

# changed_src CHANGE: prints the path of a copy of src with one change to configs.py, what a script
# times beside src as it is without a commit between (pingpong: the ping-pong schedule at every
# reduction; staged_rows: the tables' STAGED_ROWS on; regs208: MM_WS's registers 208 / 88, the sweep's
# variant of that name; load4: MM_WS's load partition a warp group, the sweep's variant of that name;
# glu_load4: the fused MLP's TMA forms load from a whole warp group of 40 registers, as their GATHER
# forms); fails, naming it, where configs.py does not hold the lines it changes.
changed_src() {
    local dir
    dir=$(mktemp -d)
    cp -r src "$dir/src"
    python3 - "$1" "$dir/src/moekit/ops/runtime/configs.py" <<'PY' || return 3
import sys

change, path = sys.argv[1:]
# change -> (old text, new text, how many times configs.py holds the old)
edits = {
    "pingpong": ("MM_SCHEDULE = dict(PINGPONG_MAX_RED=0)\n", "MM_SCHEDULE = dict(PINGPONG_MAX_RED=1 << 30)\n", 1),
    "staged_rows": ("    STAGED_ROWS=False,\n", "    STAGED_ROWS=True,\n", 2),
    "regs208": ("    MATH_REGS=224,\n    LOAD_REGS=56,\n", "    MATH_REGS=208,\n    LOAD_REGS=88,\n", 1),
    "load4": ("    LOAD_REGS=56,\n    LOAD_WARPS=1,\n", "    LOAD_REGS=56,\n    LOAD_WARPS=4,\n", 1),
    "glu_load4": ("    LOAD_WARPS=1,\n    LOAD_REGS=24,\n", "    LOAD_WARPS=4,\n    LOAD_REGS=40,\n", 2),
}
if change not in edits:
    sys.exit(f"changed_src: one of {', '.join(edits)}, got {change!r}")
old, new, count = edits[change]
text = open(path).read()
if text.count(old) != count:
    sys.exit(f"changed_src: configs.py holds {old!r} {text.count(old)} times, not {count}")
open(path, "w").write(text.replace(old, new))
PY
    echo "$dir/src"
}
