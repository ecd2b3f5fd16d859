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

# changed_src CHANGE: prints the path of a copy of src with one line of configs.py changed, what a
# script times beside src as it is without a commit between (pingpong: the ping-pong schedule at every
# reduction; staged_rows: the tables' STAGED_ROWS on); fails, naming it, where that line is not found.
changed_src() {
    local from to dir cfg
    case "$1" in
        pingpong) from='^MM_SCHEDULE = dict(PINGPONG_MAX_RED=0)$' to='MM_SCHEDULE = dict(PINGPONG_MAX_RED=1 << 30)' ;;
        staged_rows) from='^    STAGED_ROWS=False,$' to='    STAGED_ROWS=True,' ;;
        *) echo "changed_src: pingpong or staged_rows, got $1" >&2; return 2 ;;
    esac
    dir=$(mktemp -d)
    cp -r src "$dir/src"
    cfg=$dir/src/moekit/ops/runtime/configs.py
    grep -q "$from" "$cfg" || { echo "changed_src: no line $from in configs.py" >&2; return 3; }
    sed -i "s/$from/$to/" "$cfg"
    echo "$dir/src"
}
