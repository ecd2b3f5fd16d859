"""The quantized layer's errors against float64 over many draws: `moe_experts(..., quantization=...)`'s
output and every gradient (x, the router weights, both weights), relative Frobenius error, for each
recipe and bf16 unquantized beside them, at the shapes of tests/test_quantized_compute.py's bound test
(unit-variance x, weights scaled by 1/sqrt(fan-in), top-2 softmax router weights). One draw is one
seed of every input and of the routing; the table gives the median and the largest error per tensor.

    PYTHONPATH=src python tools/fp8_error_sweep.py [--draws 12] [--tokens 1024] [--backend torch]

Why: a test checks one draw; whether a bound holds with a margin or only on that draw is a question of
the spread, which this answers (notes/quantized_gemm.md quotes its output). CPU: the reference path
(the same quantized operands, products in the input's dtype); `--backend triton` on a GPU runs the
FP8 kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import moekit
from moekit import reference

RECIPES = ("fp8_block", "fp8_rowwise", "mxfp8")
# (H, F, experts, tokens): the bound test's two shapes and a wider one.
SHAPES = ((96, 80, 5, 160), (33, 130, 4, 97), (256, 128, 8, 2048))
TENSORS = ("out", "x", "weights", "w1", "w2")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def draw(shape: tuple[int, int, int, int], seed: int, device: str) -> dict[str, torch.Tensor]:
    hidden, ffn, experts, tokens = shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    tensors = dict(
        x=torch.randn(tokens, hidden, generator=g, dtype=torch.float64),
        weights=torch.rand(tokens, 2, generator=g, dtype=torch.float64).softmax(-1),
        w1=torch.randn(experts, 2 * ffn, hidden, generator=g, dtype=torch.float64) / hidden**0.5,
        w2=torch.randn(experts, hidden, ffn, generator=g, dtype=torch.float64) / ffn**0.5,
    )
    return {"ids": ids.to(device), **{k: v.to(device) for k, v in tensors.items()}}


def errors(inputs: dict[str, torch.Tensor], quantization: str | None, dtype: torch.dtype, backend: str) -> dict:
    """Relative errors of the output and the four gradients, `dtype` inputs against float64 on the same
    rounded inputs and the same upstream gradient."""
    ids = inputs["ids"]
    rounded = {k: inputs[k].to(dtype) for k in ("x", "weights", "w1", "w2")}
    ours = {k: v.clone().requires_grad_(True) for k, v in rounded.items()}
    exact = {k: v.double().requires_grad_(True) for k, v in rounded.items()}
    y = moekit.moe_experts(ours["x"], ids, ours["weights"], ours["w1"], ours["w2"], quantization=quantization,
                           backend=backend)  # fmt: skip
    y64 = reference.moe_experts_reference(exact["x"], ids, exact["weights"], exact["w1"], exact["w2"])
    upstream = torch.randn(y64.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(upstream.to(device=y.device, dtype=y.dtype))
    y64.backward(upstream.to(y64.device))
    found = {"out": rel_err(y, y64)}
    for name in ("x", "weights", "w1", "w2"):
        grad, want = ours[name].grad, exact[name].grad
        assert grad is not None and want is not None
        found[name] = rel_err(grad, want)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=12, help="seeds per shape (default 12)")
    parser.add_argument("--backend", default="auto", help='moekit backend (default "auto")')
    parser.add_argument("--tokens", type=int, default=None, help="tokens of every shape (default: each its own)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.draws < 1:
        parser.error(f"--draws must be at least 1, got {args.draws}")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be at least 1, got {args.tokens}")
    shapes = [s if args.tokens is None else (*s[:3], args.tokens) for s in SHAPES]
    # The quantized columns take float32 inputs on the CPU (the reference path) and bf16 on a GPU.
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"moe_experts errors against float64 over {args.draws} draws, median / largest ({args.device}, {dtype})")
    print("| shape (H, F, experts, tokens) | quantization | " + " | ".join(TENSORS) + " |")
    print("|---|---|" + "---|" * len(TENSORS))
    for shape in shapes:
        for quantization, column_dtype in [(None, torch.bfloat16), *((r, dtype) for r in RECIPES)]:
            found: dict[str, list[float]] = {k: [] for k in TENSORS}
            for seed in range(args.draws):
                print(f"  {shape} {quantization or 'bf16'} draw {seed + 1}/{args.draws}", end="\r", file=sys.stderr)
                one = errors(draw(shape, seed, args.device), quantization, column_dtype, args.backend)
                for k in TENSORS:
                    found[k].append(one[k])
            cells = [f"{statistics.median(found[k]):.3f} / {max(found[k]):.3f}" for k in TENSORS]
            print(f"| {shape} | {quantization or 'none (bf16)'} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
