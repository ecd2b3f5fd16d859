# Sourced by the one-call GPU scripts (gpu_quantized_table.sh, gpu_tests_all.sh), from the repository
# root: checks OUT and C (the commit measured), makes OUT, prints the GPU's name and sets P, the results'
# prefix by GPU (h100 / h200 / gpu).
: "${OUT:?set OUT}" "${C:?set C to the commit measured}"
mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU"
case "$GPU" in *H200*) P=h200 ;; *H100*) P=h100 ;; *) P=gpu ;; esac
export P
