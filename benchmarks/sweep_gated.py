"""Configuration sweep of the gated activation's kernels alone (`moekit.ops.kernels.gated`): the forward
and backward over h in x's dtype (the composed MLP's activation) and over h held in FP8 (the quantized
MLP's backward: a' recomputed for fc2's wgrad, and dh), and the quantized MLP's forward pass that writes
the activation's and h's rowwise forms (`quantize`: [gate | up], `quantize_pairs`: interleave 1), at
the widths of real models; h held in fp8_block's form, or mxfp8's with --recipe.

Each cell varies `configs.GATED_TILES`' entry for the GPU's architecture and the kernel's reading of h
(held in FP8 or not): (BLOCK_ROWS, BLOCK_C, warps), or for the quantize pass `configs.GATED_QUANTIZE_TILES`'
entry of its layout: (BLOCK_ROWS, BLOCK_C, warps, BAND), BAND the programs' order; it times
the kernel with triton's do_bench (median, L2 flushed) and reads it against its floor bytes (h read
once, the output written once; the backward also reads d out) and the HBM copy bandwidth of the same
run. Every configuration's output (a, or dh) must be the bits of the table's current entry
(`same_bits`); the backward's d probs, a sum whose order follows the tile, is reported as its largest
relative difference.

    python benchmarks/sweep_gated.py --out results.json [--shapes deepseek-v3-ep8,qwen3-30b-a3b]
        [--kernels held_forward,held_backward] [--narrowest-one-block 128]
    python benchmarks/sweep_gated.py --out q.json --kernels quantize,quantize_pairs --configs "8,256,4,0;8,256,4,1"

Held tiles are narrowed as the kernels' planner narrows them (`runtime.gated.narrowed`), so an entry
may run as a narrower tile; set MOEKIT_BENCH_COMMIT to the commit measured where the tree's git is not
the commit's.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path

import torch
from runner import machine, write_json
from triton.testing import do_bench

import moekit
from moekit.ops.glu import (
    gated_activation,
    gated_activation_backward,
    held_gated_activation,
    held_gated_activation_backward,
)
from moekit.ops.quantize import group_quantize_gated
from moekit.ops.runtime import configs
from moekit.ops.runtime.backends import gated_quantize_unavailable_reason
from moekit.ops.runtime.launch import arch_of, forget_plans
from moekit.ops.splits import GroupOffsets

# (routed rows M, ffn F) of the layer benchmark's shapes: M = tokens x top-k.
SHAPES = {
    "deepseek-v3-ep8": (131072, 2048),
    "qwen3-30b-a3b": (262144, 768),
    "mixtral-8x7b": (32768, 14336),
    "gpt-oss-20b": (65536, 2880),
}
ROWS, COLS, WARPS = (4, 8, 16, 32), (128, 256, 512, 1024), (4, 8)
QUANTIZE_KERNELS = ("quantize", "quantize_pairs")
BANDS = (0, 1, 8)  # the quantize pass's program orders: row tiles fastest, or bands of row tiles


def hbm_copy_gbs() -> float:
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.nbytes / do_bench(lambda: dst.copy_(src)) / 1e6


def kernels(rows: int, ffn: int, recipe: str) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, floor bytes) at one shape, bf16, [gate | up], swiglu with probs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16, generator=g)
    probs = torch.rand(rows, device="cuda", generator=g)
    d_out = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16, generator=g)
    offs = torch.tensor([0, rows], device="cuda")
    h_q = moekit.group_quantize(h, offs, recipe)
    elems = rows * ffn
    scales = h_q.rowwise_scale_inv.numel() * h_q.rowwise_scale_inv.element_size()
    offsets = GroupOffsets.of(offs, [0, rows], rows)

    def quantize(glu_block: int) -> list[torch.Tensor]:
        forms = group_quantize_gated(h, offsets, recipe, probs, glu_block, "swiglu", 0.0, 0.0)
        return [t for form in forms for t in (form.rowwise_data.view(torch.uint8), form.rowwise_scale_inv)]

    # read h, write both FP8 forms (3F bytes a row) and their scales
    quantize_floor = 4 * elems + 3 * elems + 3 * scales // 2
    passes = {
        "quantize": (lambda: quantize(ffn), quantize_floor),
        "quantize_pairs": (lambda: quantize(1), quantize_floor),
    }
    # the recipe's blocks hold whole runs of gates and ups only where F is a multiple of a block
    if gated_quantize_unavailable_reason(recipe, ffn, ffn) is not None:
        del passes["quantize"]
    return passes | {
        "forward": (lambda: gated_activation(h, probs, None, "swiglu", True), 4 * elems + 2 * elems),
        "backward": (
            lambda: gated_activation_backward(h, probs, d_out, None, "swiglu", True, True),
            4 * elems + 2 * elems + 4 * elems,
        ),
        "held_forward": (lambda: held_gated_activation(h_q, probs, None, "swiglu"), 2 * elems + scales + 2 * elems),
        "held_backward": (
            lambda: held_gated_activation_backward(h_q, probs, d_out, None, "swiglu", True),
            2 * elems + scales + 2 * elems + 4 * elems,
        ),
    }


def bits(out: object) -> list[torch.Tensor]:
    tensors = out if isinstance(out, (tuple, list)) else (out,)
    return [t.clone() for t in tensors if t is not None]


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[bool, float | None]:
    """(the output's bits equal, the largest relative difference of d probs or None): d probs is a sum
    whose order follows the tile (its columns and the warps' layout), so it may move in its last bits.
    The quantize pass's four outputs (data and scales of both forms) must all be equal."""
    if len(got) == 4:
        return all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want, strict=True)), None
    exact = torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    if len(got) == 1:
        return exact, None
    return exact, float(((got[1] - want[1]).abs() / want[1].abs().clamp_min(1e-6)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kernels", default="forward,backward,held_forward,held_backward")
    parser.add_argument("--recipe", default="fp8_block", choices=["fp8_block", "mxfp8"], help="h's held form's")
    parser.add_argument("--configs", default=None, help="R,C,W;R,C,W;... instead of the whole grid")
    parser.add_argument(
        "--narrowest-one-block",
        type=int,
        default=None,
        help="configs.GATED_NARROWEST_ONE_BLOCK for this run: held tiles narrower than this take two scale "
        "blocks a run instead of one (e.g. 128: gpt-oss's F 2880 at the 128-column tile)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_gated needs a CUDA device")
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    arch = arch_of(torch.device("cuda"))
    if args.narrowest_one_block is not None:
        configs.GATED_NARROWEST_ONE_BLOCK[arch] = args.narrowest_one_block
    wanted = args.kernels.split(",")
    quantizing = [k for k in wanted if k in QUANTIZE_KERNELS]
    if quantizing and len(quantizing) != len(wanted):
        raise SystemExit("--kernels: the quantize pass's configurations are of another table; sweep it alone")
    table = configs.GATED_QUANTIZE_TILES[arch] if quantizing else configs.GATED_TILES[arch]
    defaults = dict(table)
    grid = list(itertools.product(ROWS, COLS, WARPS, *([BANDS] if quantizing else [])))
    if args.configs:
        grid = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    for default in defaults.values():
        if default not in grid:
            grid.append(default)
    hbm = hbm_copy_gbs()
    print(f"hbm copy {hbm:.0f} GB/s; {arch} defaults {defaults}", flush=True)
    cells = []
    for name in names:
        rows, ffn = SHAPES[name]
        for kernel, (call, floor) in kernels(rows, ffn, args.recipe).items():
            if kernel not in wanted:
                continue
            # the table's key: held h (GATED_TILES), or runs of gates and ups (GATED_QUANTIZE_TILES)
            key = kernel == "quantize" if quantizing else kernel.startswith("held_")
            default = defaults[key]
            table[key] = default
            forget_plans()
            want = bits(call())
            for cfg in grid:
                table[key] = cfg
                forget_plans()
                try:
                    ok, d_probs_rel = same(bits(call()), want)
                    ms = do_bench(call, warmup=5, rep=25)
                except Exception as exc:  # a configuration that does not compile or launch
                    cells.append(dict(shape=name, kernel=kernel, config=list(cfg), error=str(exc)[:200]))
                    continue
                gbs = floor / ms / 1e6
                cells.append(
                    dict(shape=name, kernel=kernel, config=list(cfg), ms=ms, gb_per_s=gbs, of_copy=gbs / hbm,
                         same_bits=ok, d_probs_max_rel=d_probs_rel, default=cfg == default)
                )  # fmt: skip
            best = min((c for c in cells if c["shape"] == name and c["kernel"] == kernel and "ms" in c),
                       key=lambda c: c["ms"])  # fmt: skip
            here = next(c for c in cells if c["shape"] == name and c["kernel"] == kernel and c.get("default"))
            print(
                f"{name:16s} {kernel:14s} default {here['ms']:.3f} ms ({here['of_copy']:.2f} of copy); best "
                f"{best['config']} {best['ms']:.3f} ms ({best['of_copy']:.2f}); all same bits: "
                f"{all(c.get('same_bits', True) for c in cells if c['shape'] == name and c['kernel'] == kernel)}",
                flush=True,
            )
            # After every kernel, so that a run cut by a time limit keeps what it measured (marked partial).
            meta = {**machine(torch.device("cuda")), "hbm_copy_gb_per_s": hbm, "grid": grid, "recipe": args.recipe}
            meta["narrowest_one_block"] = configs.GATED_NARROWEST_ONE_BLOCK[arch]
            write_json(args.out, dict(meta=meta, cells=cells, partial=True))
    table.update(defaults)
    write_json(args.out, dict(meta=meta, cells=cells))


if __name__ == "__main__":
    main()
