"""fp8_block's Gluon forward / dgrad kernel (`grouped_mm_fp8_block_ws_kernel`) with two math warp groups on
a 128 x 256 tile (`configs.FP8_BLOCK_WS`) against three on a 192 x 128 tile (`configs.FP8_BLOCK_WS3`), at
the four GEMMs of each layer shape's quantized MLP (fc1 and fc2 forward, fc2 and fc1 dgrad; balanced
routing, every group M / N rows), bf16 output.

Each product's FP8 operands are quantized once (`group_quantize`, as the layer does); then the variants
take turns over `--rounds` rounds, each round the median of `--reps` calls between CUDA events, the cell
the median of its rounds; TFLOP/s on 2 * M * RED * COLS. Every variant's output must be bit-equal to the
first variant's (both reproduce the Triton kernel's fp32 operations in its order). The variant is the
table `configs.FP8_BLOCK_MM_WS` (with its STAGES) the runtime reads, rewritten in place.

    python benchmarks/sweep_fp8_block_parts.py --out results.json [--shapes deepseek-v3-ep8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import bench_moe_layer
import torch
from runner import event_median_ms, machine, select_by_name, write_json

import moekit
from moekit.ops.quantize import transposed_weight
from moekit.ops.runtime import configs
from moekit.ops.runtime import quantized_gemm as qg
from moekit.ops.runtime.launch import forget_plans

SHAPES = {s.name: s for s in bench_moe_layer.SHAPES + bench_moe_layer.SONICMOE_SHAPES}
DEFAULT_SHAPES = "deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b,gpt-oss-20b"
# name: (the kernel's table, its STAGES by output element size)
VARIANTS = {
    "parts2": (configs.FP8_BLOCK_WS, configs.FP8_BLOCK_WS_STAGES),
    "parts3": (configs.FP8_BLOCK_WS3, configs.FP8_BLOCK_WS3_STAGES),
}


# The table as the library ships it (this module is imported before anything rewrites it).
DEFAULT = (dict(configs.FP8_BLOCK_MM_WS), dict(configs.FP8_BLOCK_MM_WS_STAGES))


def use(variant: str | None) -> None:
    """Make `variant` (None: the library's default table) the forward / dgrad kernel's table, in place (the
    runtime holds these dicts); the kept plans are forgotten only where the table changes, so a caller can
    name its variant before every call."""
    if variant is None:
        table, stages = DEFAULT
    else:
        table, stages = {"PARTS": 2, **VARIANTS[variant][0]}, VARIANTS[variant][1]
    if configs.FP8_BLOCK_MM_WS == table and configs.FP8_BLOCK_MM_WS_STAGES == stages:
        return
    configs.FP8_BLOCK_MM_WS.clear()
    configs.FP8_BLOCK_MM_WS.update(table)
    configs.FP8_BLOCK_MM_WS_STAGES.clear()
    configs.FP8_BLOCK_MM_WS_STAGES.update(stages)
    forget_plans()


def products(shape: bench_moe_layer.LayerShape, gen: torch.Generator) -> dict[str, tuple]:
    """The layer's four FP8 products at balanced routing: name -> (call, FLOPs)."""
    M, N, H, F = shape.tokens * shape.top_k, shape.experts, shape.hidden, shape.ffn
    splits = torch.full((N,), M // N, dtype=torch.int64, device="cuda")
    splits[: M % N] += 1
    offs = torch.cat([splits.new_zeros(1), splits.cumsum(0)])

    def rows(cols: int):
        x = torch.randn(M, cols, device="cuda", generator=gen, dtype=torch.bfloat16)
        q = moekit.group_quantize(x, splits, "fp8_block", backend="triton")
        return q.rowwise_data, q.rowwise_scale_inv

    def weight(out: int, red: int):
        w = torch.randn(N, out, red, device="cuda", generator=gen, dtype=torch.bfloat16) / red**0.5
        return moekit.group_quantize(w, None, "fp8_block", backend="triton")

    w1, w2 = weight(2 * F, H), weight(H, F)
    (x, xs), (a, as_), (dy, dys), (dh, dhs) = rows(H), rows(F), rows(H), rows(2 * F)
    w1t, w2t = transposed_weight(w1), transposed_weight(w2)

    def fwd(d, s, w):
        return lambda: qg.quantized_gemm_forward(
            "fp8_block", d, s, w.rowwise_data, w.rowwise_scale_inv, offs, out_dtype=torch.bfloat16
        )

    def dgrad(d, s, wt):
        return lambda: qg.quantized_gemm_dgrad("fp8_block", d, s, wt.data, wt.scale_inv, offs, out_dtype=torch.bfloat16)

    return {
        "fc1_fwd": (fwd(x, xs, w1), 2 * M * H * 2 * F),
        "fc2_fwd": (fwd(a, as_, w2), 2 * M * F * H),
        "fc2_dgrad": (dgrad(dy, dys, w2t), 2 * M * H * F),
        "fc1_dgrad": (dgrad(dh, dhs, w1t), 2 * M * 2 * F * H),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("sweep_fp8_block_parts.py times the Gluon kernel: it needs an sm_90 GPU")
    variants = select_by_name(list(VARIANTS), args.variants, "variants", VARIANTS)
    names = select_by_name(list(SHAPES), args.shapes, "shapes", SHAPES)
    cells: dict[str, dict] = {}
    try:
        for name in names:
            gen = torch.Generator(device="cuda").manual_seed(0)
            for product, (call, flops) in products(SHAPES[name], gen).items():
                times: dict[str, list[float]] = {v: [] for v in variants}
                first = None
                equal = {}
                for _ in range(args.rounds):
                    for variant in variants:
                        use(variant)
                        out = call()
                        first = out if first is None else first
                        equal[variant] = equal.get(variant, True) and torch.equal(out, first)
                        times[variant].append(event_median_ms(call, args.reps))
                for variant in variants:
                    ms = statistics.median(times[variant])
                    cell = {"ms": ms, "ms_rounds": times[variant], "tflops": flops / ms / 1e9, "equal": equal[variant]}
                    cells[f"{name}/{product}/{variant}"] = cell
                    mark = "" if equal[variant] else "  BITS DIFFER"
                    print(f"{name:<18} {product:<10} {variant:<7} {ms:8.3f} ms {cell['tflops']:7.1f} TFLOP/s{mark}")
                torch.cuda.empty_cache()
    finally:
        use(None)
    if any(cell["equal"] is False for cell in cells.values()):
        raise SystemExit("a variant's bits differ from the first variant's (BITS DIFFER above)")
    if args.out is not None:
        write_json(args.out, {"meta": machine(torch.device("cuda")), "variants": VARIANTS, "cells": cells})


if __name__ == "__main__":
    main()
