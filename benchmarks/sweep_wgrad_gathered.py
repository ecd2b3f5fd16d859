"""The grouped wgrad with one operand read through a row map (`gemm.grouped_gemm_wgrad`'s x_rows /
dy_rows: the layer's fc1 wgrad over x's token rows, fc2's over d out's) against the plain wgrad of the
gathered rows, at the layer's widths, for several values of `configs.GATHERED_WGRAD_EXTRA_STAGES`
(the pipeline stages a gathered launch adds). Every gathered result must be the plain one's bits
(`equal`). Times: CUDA events, the median of the repetitions after one warm-up call.

    python benchmarks/sweep_wgrad_gathered.py --out results.json [--extra 0,2,3] [--reps 10]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from runner import machine, write_json

from moekit.ops.runtime import gemm
from moekit.ops.runtime.launch import forget_plans

# name: (tokens T, top-k K, experts N, hidden H, ffn F): the layer benchmark's fine-grained shapes.
SHAPES = {
    "sonicmoe-e256-k16": (32768, 16, 256, 4096, 256),
    "qwen3-30b-a3b": (32768, 8, 128, 2048, 768),
    "sonicmoe": (32768, 8, 128, 4096, 512),
}


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sweep_shape(name: str, extras: list[int], reps: int) -> dict[str, dict[str, object]]:
    """The shape's fc1 and fc2 wgrads, plain and gathered at each extra stage count."""
    T, K, N, H, F = SHAPES[name]
    M = T * K
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, T, (M,), device="cuda", generator=gen)
    offs = torch.linspace(0, M, N + 1, device="cuda").round().to(torch.int64)
    x_T = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    dh = torch.randn(M, 2 * F, device="cuda", dtype=torch.bfloat16, generator=gen)
    act = torch.randn(M, F, device="cuda", dtype=torch.bfloat16, generator=gen)
    x_M = x_T[tokens]
    # fc1: dw1 = dh^T x (x gathered, operand b); fc2: dw2 = dy^T act (dy gathered, operand a; x_T stands
    # for d out, of the same shape).
    products = {
        "fc1_x": (
            lambda: gemm.grouped_gemm_wgrad(dh, x_M, offs),
            lambda: gemm.grouped_gemm_wgrad(dh, x_T, offs, x_rows=tokens),
        ),
        "fc2_dy": (
            lambda: gemm.grouped_gemm_wgrad(x_M, act, offs),
            lambda: gemm.grouped_gemm_wgrad(x_T, act, offs, dy_rows=tokens),
        ),
    }
    default_extra = gemm.GATHERED_WGRAD_EXTRA_STAGES
    cells = {}
    for kind, (plain, gathered) in products.items():
        record: dict[str, object] = {"plain_ms": median_ms(plain, reps)}
        reference = plain()
        for extra in extras:
            gemm.GATHERED_WGRAD_EXTRA_STAGES = extra
            forget_plans()
            record[f"gathered_extra{extra}_ms"] = median_ms(gathered, reps)
            record[f"gathered_extra{extra}_equal"] = bool(torch.equal(gathered(), reference))
        gemm.GATHERED_WGRAD_EXTRA_STAGES = default_extra
        forget_plans()
        cells[f"{name}/{kind}"] = record
        print(name, kind, record, flush=True)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--extra", default="0,2,3", help="comma list of extra pipeline stages")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_wgrad_gathered.py needs a CUDA device")
    cells: dict[str, dict[str, object]] = {}
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r}; expected some of {sorted(SHAPES)}")
        cells.update(sweep_shape(name, [int(e) for e in args.extra.split(",")], args.reps))
        torch.cuda.empty_cache()
    write_json(args.out, {"meta": machine(), "cells": cells})


if __name__ == "__main__":
    main()
