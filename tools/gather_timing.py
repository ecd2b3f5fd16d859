"""Timing of fc1's row gather fused into the Hopper forward kernel (GATHER), on an sm_90 GPU.

    python tools/gather_timing.py [--out FILE.json]

At Qwen3-30B-A3B's and SonicMoE's shapes (bf16, K 8, E 128), with a random top-k routing sorted as
moe_experts sorts it: (1) the rows gathered (the row kernel), (2) gather + the Hopper forward kernel,
(3) the GATHER kernel alone on x (T, H) and the token map, checked bit for bit against (2) first;
then moe_experts' forward (no grad, and with grad: what a training step's forward runs) with the
GATHER kernel and with the gather-first path (`glu_forward_gathered` made to gather first). Times are
triton.testing.do_bench medians in ms.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.testing import do_bench

import moekit
from moekit.ops import library
from moekit.ops.routing import sort_by_expert
from moekit.ops.runtime import glu as rglu

SHAPES = {  # T, H, E, K, F
    "qwen3_30b_a3b": (32768, 2048, 128, 8, 768),
    "sonicmoe": (32768, 4096, 128, 8, 512),
}


def bench(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def run_shape(T: int, H: int, E: int, K: int, F: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=dt, generator=gen)
    logits = torch.randn(T, E, device=dev, generator=gen)
    weights, ids = logits.softmax(-1).topk(K, dim=-1)
    weights = weights.to(dt)
    w1 = torch.randn(E, 2 * F, H, device=dev, dtype=dt, generator=gen) / H**0.5
    w2 = torch.randn(E, H, F, device=dev, dtype=dt, generator=gen) / F**0.5
    order = sort_by_expert(ids, E, use_triton=True)
    tokens, offs = order.token_of_row, order.offs
    probs = weights.reshape(-1).index_select(0, order.copy_of_row.view(-1))
    assert rglu.gathered_kernel_takes(x, w1, None)

    def gather():
        return library.gather_sum_rows(x, tokens, None, True)

    def gather_then_kernel():
        return rglu.glu_forward(gather(), w1, offs, None, probs, None, "swiglu")

    def gathered_kernel():
        return rglu.glu_forward_gathered(x, tokens, w1, offs, None, probs, None, "swiglu")

    h_ref, act_ref = gather_then_kernel()
    h, act = gathered_kernel()
    row = {"T": T, "H": H, "E": E, "K": K, "F": F}
    row["bits_equal"] = bool(torch.equal(h, h_ref) and torch.equal(act, act_ref))
    del h, act, h_ref, act_ref
    row["gather_ms"] = bench(gather)
    row["gather_then_kernel_ms"] = bench(gather_then_kernel)
    row["gathered_kernel_ms"] = bench(gathered_kernel)
    row["kernel_speedup"] = row["gather_then_kernel_ms"] / row["gathered_kernel_ms"]

    def layer():
        return moekit.moe_experts(x, ids, weights, w1, w2, backend="triton")

    w1.requires_grad_(True)
    w2.requires_grad_(True)
    takes = rglu.gathered_kernel_takes
    for path in ("gathered", "gather_first"):
        if path == "gather_first":
            rglu.gathered_kernel_takes = lambda *a, **k: False  # glu_forward_gathered gathers first
        try:
            with torch.no_grad():
                row[f"moe_experts_fwd_nograd_{path}_ms"] = bench(layer)
            row[f"moe_experts_fwd_grad_{path}_ms"] = bench(layer)
        finally:
            rglu.gathered_kernel_takes = takes
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    assert torch.cuda.get_device_capability() == (9, 0), "needs an sm_90 GPU"
    results: dict = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for name, shape in SHAPES.items():
        results["shapes"][name] = run_shape(*shape)
        print(name, json.dumps(results["shapes"][name]), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(0 if all(r["bits_equal"] for r in results["shapes"].values()) else 1)


if __name__ == "__main__":
    main()
