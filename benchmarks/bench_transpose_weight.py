"""Timing of the FP8 dgrad's transposed weight copy (`moekit.ops.quantize.transposed_weight`, out=) at
DeepSeek-V3 EP8's expert weights: fc1 (32, 4096, 7168) and fc2 (32, 7168, 2048), fp8_block and
fp8_rowwise, moekit's kernel (backend "triton") against the plain torch path (a strided float8 copy_,
backend "torch"), and a 4 GiB device-to-device copy for the bandwidth they are read against.

Bytes moved = the FP8 data and scales read + written; each time the median of triton's do_bench (L2
flushed between calls). Each row also says whether the two paths wrote the same bytes.

    python benchmarks/bench_transpose_weight.py            # CUDA; prints one line per case
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

import moekit
from moekit.ops.quantize import transposed_weight

WEIGHTS = {"fc1": (32, 4096, 7168), "fc2": (32, 7168, 2048)}


def hbm_copy_gbs() -> float:
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.nbytes / do_bench(lambda: dst.copy_(src)) / 1e6


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_transpose_weight needs a CUDA device")
    hbm = hbm_copy_gbs()
    print(f"hbm copy: {hbm:.0f} GB/s (read + write)")
    for recipe in ("fp8_block", "fp8_rowwise"):
        for name, shape in WEIGHTS.items():
            w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            columnwise = recipe == "fp8_rowwise"
            w_q = moekit.group_quantize(w, None, recipe, rowwise=not columnwise, columnwise=columnwise)
            outs = {backend: transposed_weight(w_q, backend=backend) for backend in ("triton", "torch")}
            same = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(outs["triton"], outs["torch"], strict=True)
            )
            moved = 2 * sum(t.nbytes for t in outs["torch"])
            line = [f"{recipe:11s} {name} {shape}:"]
            for backend, out in outs.items():
                ms = do_bench(
                    lambda w_q=w_q, out=out, backend=backend: transposed_weight(w_q, out=out, backend=backend)
                )
                gbs = moved / ms / 1e6
                line.append(f"{backend} {ms:.3f} ms {gbs:.0f} GB/s ({gbs / hbm:.2f} of hbm)")
            print(" ".join(line), f"same_bytes={same}", flush=True)


if __name__ == "__main__":
    main()
