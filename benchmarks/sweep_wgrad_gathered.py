"""The grouped wgrad with one operand read through a row map (`gemm.grouped_gemm_wgrad`'s x_rows /
dy_rows: the layer's fc1 wgrad over x's token rows, fc2's over d out's) against the plain wgrad of the
gathered rows, at the layer's widths, for several values of `configs.GATHERED_WGRAD_EXTRA_STAGES`
(the pipeline stages a gathered launch adds). Every gathered result must be the plain one's bits
(`equal`), and other (O, I) tiles of the gathered launch (`--tiles`, the same reduction step), and fc1's
with x as the narrow a operand (its (N, H, 2F) transposed). On sm_90 a gathered x runs the Gluon kernel
(`configs.WGRAD_GATHERED_WS`): `--ws-forms` times it with its tile split along O (256 x 128, "split_o")
and along I (128 x 256, "split_i"). Times: CUDA events, the median of the
repetitions after one warm-up call.

    python benchmarks/sweep_wgrad_gathered.py --out results.json [--extra 0,2,3] [--tiles 128x128] [--reps 10]
        [--ws-forms split_o,split_i]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from runner import event_median_ms, machine, write_json

from moekit.ops.runtime import gemm
from moekit.ops.runtime.configs import GemmConfig, gemm_candidates
from moekit.ops.runtime.launch import arch_of, forget_plans

# name: (tokens T, top-k K, experts N, hidden H, ffn F): the layer benchmark's fine-grained shapes.
SHAPES = {
    "sonicmoe-e256-k16": (32768, 16, 256, 4096, 256),
    "qwen3-30b-a3b": (32768, 8, 128, 2048, 768),
    "sonicmoe": (32768, 8, 128, 4096, 512),
}
SMOKE_SHAPES = {"smoke": (40, 2, 3, 64, 32)}


def _copied(fn: Callable[..., torch.Tensor], cfg: GemmConfig | None) -> torch.Tensor:
    return fn(cfg).contiguous()


def tile_config(tile: str, x: torch.Tensor) -> GemmConfig:
    """The device's wgrad entry with another (O, I) tile, e.g. "128x128": the same reduction step
    (BLOCK_M), so the same order of the sums."""
    rows, cols = (int(v) for v in tile.split("x"))
    base = gemm_candidates("wgrad", x.dtype, True, arch_of(x.device), cols)[0]
    return dataclasses.replace(base, block_rows=rows, block_cols=cols)


# The Gluon gathered wgrad's forms (`--ws-forms`): its configuration's tile and split.
WS_FORMS = {
    "split_o": dict(BLOCK_O=256, BLOCK_I=128, SPLIT_O=True),
    "split_i": dict(BLOCK_O=128, BLOCK_I=256, SPLIT_O=False),
    # Split along O with a copy partition of two warp groups (16 warps: 128 registers a thread at launch).
    "split_o_load8": dict(BLOCK_O=256, BLOCK_I=128, SPLIT_O=True, LOAD_WARPS=8, maxnreg=128),
}


def sweep_shape(
    name: str, extras: list[int], tiles: list[str], reps: int, device: str = "cuda", ws_forms: list[str] = ()
) -> dict[str, dict[str, object]]:
    """The shape's fc1 and fc2 wgrads, plain and gathered: at each extra stage count (the table's tile),
    and at each other tile (the table's extra stages). fc1's also with x as the a operand (the narrow
    one, as fc2's d out): (N, H, 2F) computed and transposed, timed without and with the copy into
    fc1's (N, 2F, H) layout that autograd would make."""
    T, K, N, H, F = (SHAPES | SMOKE_SHAPES)[name]
    M = T * K
    # The interpreter's bfloat16 dot is wrong: float32 there (--smoke).
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, T, (M,), device=device, generator=gen)
    offs = torch.linspace(0, M, N + 1, device=device).round().to(torch.int64)
    x_T = torch.randn(T, H, device=device, dtype=dtype, generator=gen)
    dh = torch.randn(M, 2 * F, device=device, dtype=dtype, generator=gen)
    act = torch.randn(M, F, device=device, dtype=dtype, generator=gen)
    x_M = x_T[tokens]
    wgrad = gemm.grouped_gemm_wgrad
    # fc1: dw1 = dh^T x (x gathered, operand b); fc2: dw2 = dy^T act (dy gathered, operand a; x_T stands
    # for d out, of the same shape).
    products: dict[str, tuple[Callable[[], torch.Tensor], Callable[..., torch.Tensor]]] = {
        "fc1_x": (lambda: wgrad(dh, x_M, offs), lambda cfg=None: wgrad(dh, x_T, offs, x_rows=tokens, cfg=cfg)),
        "fc2_dy": (lambda: wgrad(x_M, act, offs), lambda cfg=None: wgrad(x_T, act, offs, dy_rows=tokens, cfg=cfg)),
        "fc1_x_as_a": (
            lambda: wgrad(dh, x_M, offs),
            lambda cfg=None: wgrad(x_T, dh, offs, dy_rows=tokens, cfg=cfg).transpose(1, 2),
        ),
    }
    default_extra = gemm.GATHERED_WGRAD_EXTRA_STAGES
    cells = {}
    for kind, (plain, gathered) in products.items():
        record: dict[str, object] = {"plain_ms": event_median_ms(plain, reps)}
        reference = plain()
        variants: dict[str, tuple[int, GemmConfig | None, str | None]] = {f"extra{e}": (e, None, None) for e in extras}
        variants.update({f"tile{t}": (default_extra, tile_config(t, x_T), None) for t in tiles})
        if kind == "fc1_x":
            variants.update({f"ws_{f}": (default_extra, None, f) for f in ws_forms})
        default_ws = dict(gemm.WGRAD_GATHERED_WS)  # every key a form sets is in the table
        for label, (extra, cfg, form) in variants.items():
            gemm.GATHERED_WGRAD_EXTRA_STAGES = extra
            gemm.WGRAD_GATHERED_WS.update(WS_FORMS[form] if form else default_ws)
            forget_plans()
            record[f"gathered_{label}_ms"] = event_median_ms(functools.partial(gathered, cfg), reps)
            record[f"gathered_{label}_equal"] = bool(torch.equal(gathered(cfg), reference))
            if kind == "fc1_x_as_a":
                record[f"gathered_{label}_with_copy_ms"] = event_median_ms(
                    functools.partial(_copied, gathered, cfg), reps
                )
        gemm.GATHERED_WGRAD_EXTRA_STAGES = default_extra
        gemm.WGRAD_GATHERED_WS.update(default_ws)
        forget_plans()
        cells[f"{name}/{kind}"] = record
        print(name, kind, record, flush=True)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--extra", default="0,2,3", help="comma list of extra pipeline stages")
    parser.add_argument(
        "--tiles", default="", help="comma list of other (O, I) tiles of the gathered launch, e.g. 128x128"
    )
    parser.add_argument(
        "--ws-forms", default="", help=f"comma list of the Gluon kernel's forms for fc1's x: {','.join(WS_FORMS)}"
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (interpreter): the plumbing")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("sweep_wgrad_gathered.py needs a CUDA device (or --smoke)")
    pool = SMOKE_SHAPES if args.smoke else SHAPES
    cells: dict[str, dict[str, object]] = {}
    for name in list(pool) if args.smoke else args.shapes.split(","):
        if name not in pool:
            raise SystemExit(f"--shapes: unknown shape {name!r}; expected some of {sorted(pool)}")
        extras = [int(e) for e in args.extra.split(",") if e]
        tiles = [t for t in args.tiles.split(",") if t]
        forms = [f for f in args.ws_forms.split(",") if f]
        if any(f not in WS_FORMS for f in forms):
            raise SystemExit(f"--ws-forms: expected some of {sorted(WS_FORMS)}, got {args.ws_forms!r}")
        cells.update(sweep_shape(name, extras, tiles, args.reps, "cpu" if args.smoke else "cuda", forms))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_json(args.out, {"meta": machine(), "cells": cells})


if __name__ == "__main__":
    main()
