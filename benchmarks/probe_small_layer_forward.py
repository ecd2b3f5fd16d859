"""The MoE layer at Qwen3-30B-A3B width and small token counts, forward+backward, with grouped_mlp's
forward on the warp-specialised Hopper kernel and on glu_forward_kernel (the Hopper kernel switched
off for the second build of the plans), timed as bench_moe_layer.py times (do_bench median, L2
flushed), alternating; plus the host's enqueue time of one step.

    OUT=/path python benchmarks/probe_small_layer_forward.py
"""

from __future__ import annotations

import json
import os
import time

import runner
import torch
import triton
from bench_moe_layer import SHAPES, make_inputs, make_routing

import moekit
from moekit.ops import grouped_gemm as gg
from moekit.ops import grouped_mlp as gm

dev = torch.device("cuda")
hopper_ok = gm._glu_forward_ws_ok


def use_hopper_kernel(on: bool) -> None:
    gm._glu_forward_ws_ok = hopper_ok if on else (lambda *a: False)
    gg._PLANS.clear()  # plans are keyed on the problem, not on the kernel: make them again


out = {"machine": runner.machine(), "commit": os.environ.get("MOEKIT_BENCH_COMMIT"), "cells": []}
for name in ("qwen3-256tok", "qwen3-1024tok", "qwen3-4096tok"):
    shape = next(s for s in SHAPES if s.name == name)
    leaves = make_inputs(shape, dev, torch.bfloat16)
    for t in leaves.values():
        t.requires_grad_()
    ids, weights = make_routing(shape, "balanced", dev, torch.bfloat16)
    dy = torch.randn(shape.tokens, shape.hidden, device=dev, dtype=torch.bfloat16)

    def step(leaves=leaves, ids=ids, weights=weights, dy=dy):
        y = moekit.moe_experts(leaves["x"], ids, weights, leaves["w1"], leaves["w2"], backend="triton")
        y.backward(dy)

    cell = {"shape": name, "ms": {"hopper": [], "triton": []}, "host_ms": {"hopper": [], "triton": []}}
    for _ in range(3):
        for kind in ("hopper", "triton"):
            use_hopper_kernel(kind == "hopper")
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            cell["ms"][kind].append(triton.testing.do_bench(step, grad_to_none=list(leaves.values())))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                step()
            cell["host_ms"][kind].append((time.perf_counter() - t0) / 20 * 1e3)
            torch.cuda.synchronize()
    out["cells"].append(cell)
    print(
        name,
        {k: [round(v, 3) for v in vs] for k, vs in cell["ms"].items()},
        {k: [round(v, 3) for v in vs] for k, vs in cell["host_ms"].items()},
        flush=True,
    )
    with open(os.path.join(os.environ.get("OUT", "."), "small_layer_forward.json"), "w") as f:
        json.dump(out, f, indent=1)
