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

# changed_src CHANGE: prints the path of a copy of src whose configs.py holds one of runner.py's
# TABLE_CHANGES (`python3 benchmarks/runner.py --help` names them), what a script times beside src as
# it is without a commit between; fails, naming it, where configs.py does not hold what it changes.
changed_src() {
    local dir
    dir=$(mktemp -d)
    cp -r src "$dir/src"
    PYTHONPATH=$PWD/src:$PWD/benchmarks python3 benchmarks/runner.py "$1" "$dir/src/moekit/ops/runtime/configs.py" || return 3
    echo "$dir/src"
}
