"""Host time of moekit.moe_experts at small batches, Qwen3-30B-A3B width (N 128, K 8, H 2048, F 768).

Legend: T tokens, N experts, K top-k, H hidden size, F ffn size. bf16, on a GPU.

Per call, the host's enqueue time (no synchronization, mean over a few hundred calls after warm-up)
of each piece of the layer: a torch op, a Triton launch, the routing, each kernel launcher, the
grouped MLP, the layer forward (no grad) and forward+backward; then a torch.profiler table by self
CPU time and where host-device copies come from. Small batches are host-bound (the GPU waits for
launches), so this says which host work to cut. Usage: python benchmarks/profile_layer_host.py [T]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import moekit
from moekit._splits import resolve_splits
from moekit.ops import grouped_gemm as gg
from moekit.ops import grouped_mlp as gm
from moekit.ops import moe_experts as me
from moekit.ops.moe_experts_kernels import _sum_rows_kernel
from moekit.ops.routing import route


def host_us(fn, calls: int = 300) -> float:
    """Mean host time of one call, calls enqueued back to back (the GPU runs behind)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def parent_chain(event, depth: int = 6) -> str:
    names, parent = [], event.cpu_parent
    while parent is not None and len(names) < depth:
        names.append(parent.name)
        parent = parent.cpu_parent
    return " <- ".join(names)


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    dev, bf = "cuda", torch.bfloat16
    N, K, H, F = 128, 8, 2048, 768
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, H, device=dev, dtype=bf, generator=gen).requires_grad_()
    w1 = (torch.randn(N, 2 * F, H, device=dev, generator=gen) * H**-0.5).to(bf).requires_grad_()
    w2 = (torch.randn(N, H, F, device=dev, generator=gen) * F**-0.5).to(bf).requires_grad_()
    weights, ids = torch.softmax(torch.randn(tokens, N, device=dev, generator=gen), -1).topk(K, -1)
    weights = weights.to(bf).requires_grad_()
    dy = torch.randn(tokens, H, device=dev, dtype=bf, generator=gen)

    def step():
        for t in (x, w1, w2, weights):
            t.grad = None
        me.moe_experts(x, ids, weights, w1, w2, backend="triton").backward(dy)

    def forward_no_grad():
        with torch.no_grad():
            me.moe_experts(x, ids, weights, w1, w2, backend="triton")

    tiny = torch.zeros(8, device=dev)
    src = torch.randn(64, 64, device=dev, dtype=bf)
    index = torch.arange(64, device=dev)[:, None]
    out = torch.empty(64, 64, device=dev, dtype=bf)
    routing = route(ids, N)
    m_splits, token_of_row = routing.counts(), routing.token_of_row
    x_sorted = me._sum_rows(x.detach(), token_of_row, True)
    go = resolve_splits(m_splits, N, x_sorted.shape[0], x_sorted.device)
    probs = torch.rand(x_sorted.shape[0], device=dev)
    w1d, w2d = w1.detach(), w2.detach()
    h, act = gm.glu_forward(x_sorted, w1d, go.offs, None, probs, None, "swiglu")
    dy_sorted = torch.randn_like(x_sorted)
    parts = [
        ("torch add_ on 8 elements", lambda: tiny.add_(1)),
        (
            "Triton launch (_sum_rows_kernel)",
            lambda: _sum_rows_kernel[(1, 1)](src, index, out, 64, 64, 1, 64, 64, BLOCK_R=64, BLOCK_D=64, num_warps=4),
        ),
        ("_sum_rows", lambda: me._sum_rows(src, index, True)),
        ("route", lambda: route(ids, N)),
        ("resolve_splits (device)", lambda: resolve_splits(m_splits, N, x_sorted.shape[0], x_sorted.device)),
        ("glu_forward", lambda: gm.glu_forward(x_sorted, w1d, go.offs, None, probs, None, "swiglu")),
        ("grouped_gemm_forward", lambda: gg.grouped_gemm_forward(act, w2d, go.offs)),
        ("glu_backward", lambda: gm.glu_backward(dy_sorted, w2d, h, go.offs, probs, None, "swiglu")),
        ("grouped_gemm_wgrad", lambda: gg.grouped_gemm_wgrad(dy_sorted, x_sorted, go.offs)),
        ("grouped_gemm_dgrad", lambda: gg.grouped_gemm_dgrad(h, w1d, go.offs)),
        (
            "grouped_mlp forward, no grad",
            lambda: _no_grad(lambda: moekit.grouped_mlp(x_sorted, w1, w2, m_splits, probs=probs, backend="triton")),
        ),
        ("moe_experts forward, no grad", forward_no_grad),
        ("moe_experts forward+backward", step),
    ]
    print(f"host us per call, T={tokens}:")
    for name, fn in parts:
        print(f"  {name:34} {host_us(fn, 200 if fn is step else 300):8.1f}")

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70))
    seen = set()
    for event in prof.events():
        if event.name in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaMemsetAsync"):
            key = (event.name, parent_chain(event))
            if key not in seen:
                seen.add(key)
                print(event.name, "<-", key[1])


def _no_grad(fn):
    with torch.no_grad():
        return fn()


if __name__ == "__main__":
    main()
