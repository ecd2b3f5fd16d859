"""Probe: two Hopper fused backwards (Gluon) against the library's glu_backward (bits and time).

    OUT=dir MOEKIT_BENCH_COMMIT=<sha> python benchmarks/probe_glu_bwd_hopper.py
"""
import json
import os
import sys
import time

sys.path[:0] = ["src", "benchmarks"]
import runner  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from moekit.ops import grouped_gemm as gg  # noqa: E402
from moekit.ops import grouped_mlp as gm  # noqa: E402
from moekit.ops.grouped_mlp_hopper_kernels import glu_backward_ws2_kernel, glu_backward_ws_kernel  # noqa: E402

dev = torch.device("cuda")
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
ACTS = ("swiglu", "clamped_swiglu")
OUTF = os.path.join(os.environ.get("OUT", "."), "glu_bwd_hopper_probe.json")


def ws_backward(dy, w2, h, offs, probs, k, activation, kind="ws2", epi_cols=8, epi_regs=168, outs=None,
                poison=False):
    M, H = dy.shape
    N, _, F = w2.shape
    k = F if k is None else k
    if outs is None:
        fill = float("nan") if poison else 0.0
        dh = torch.full((M, 2 * F), fill, device=dev, dtype=dy.dtype)
        act = torch.full((M, F), fill, device=dev, dtype=dy.dtype)
        part = torch.full((triton.cdiv(F, 256), M), fill, device=dev) if probs is not None else None
    else:
        dh, act, part = outs
    BG = gg._block_groups(N + 2)
    nprog = gg._grid_size(dev, (triton.cdiv(M, 128) + N + 1) * triton.cdiv(F, 256))
    args = (dy, w2, h, dh, act, probs if probs is not None else dh, part if part is not None else dh, offs,
            M, F, H, N, dy.stride(0), w2.stride(1), h.stride(0), dh.stride(0), act.stride(0))
    common = dict(ACTIVATION=ACTS.index(activation), GLU_BLOCK=k, HAS_PROBS=probs is not None, BLOCK_M=128,
                  BLOCK_C=128, BLOCK_RED=64, GROUP_M=8, BLOCK_GROUPS=BG, NUM_PROGRAMS=nprog, STAGES=3,
                  EPI_COLS=epi_cols, LOAD_REGS=24, num_warps=8)
    if kind == "ws2":
        glu_backward_ws2_kernel[(nprog,)](*args, EPI_REGS=epi_regs, maxnreg=128, **common)
    else:
        glu_backward_ws_kernel[(nprog,)](*args, maxnreg=168, **common)
    return dh, act, (part.sum(0) if part is not None else None)


def offs_of(splits):
    return torch.tensor([0] + list(splits), device=dev).cumsum(0)


out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "commit": os.environ.get("MOEKIT_BENCH_COMMIT", "?"), "checks": [], "timings": []}


def save():
    with open(OUTF, "w") as f:
        json.dump(out, f, indent=1)


def check(name, M, splits, H, F, k=None, probs=True, activation="swiglu", dtype=torch.bfloat16, **kw):
    g = torch.Generator(device=dev).manual_seed(1)
    N = len(splits)
    offs = offs_of(splits)
    h = (torch.randn(M, 2 * F, device=dev, generator=g) * 2).to(dtype)
    p = torch.rand(M, device=dev, generator=g) if probs else None
    dy = torch.randn(M, H, device=dev, generator=g).to(dtype)
    w2 = (torch.randn(N, H, F, device=dev, generator=g) * F**-0.5).to(dtype)
    d0, ap0, dp0 = gm.glu_backward(dy, w2, h, offs, p, k, activation)
    d1, ap1, dp1 = ws_backward(dy, w2, h, offs, p, k, activation, poison=True, **kw)
    torch.cuda.synchronize()
    r = dict(name=name, dtype=str(dtype), kw=kw, dh_equal=bool(torch.equal(d0, d1)),
             actp_equal=bool(torch.equal(ap0, ap1)), dh_nan=bool(d1.isnan().any()), actp_nan=bool(ap1.isnan().any()),
             dh_maxdiff=float((d0.float() - d1.float()).abs().nan_to_num(1e9).max()) if M else 0.0)
    if p is not None:
        r.update(dprobs_nan=bool(dp1.isnan().any()),
                 dprobs_maxrel=float(((dp0 - dp1).abs() / dp0.abs().clamp_min(1e-3)).max()) if M else 0.0)
    out["checks"].append(r)
    print(r, flush=True)
    save()


t0 = time.time()
check("padding rows, empty experts, F=384 (partial 256 tile)", 1000, [0, 300, 1, 0, 500], 256, 384)
check("clamped, no probs, fp16", 1000, [0, 300, 1, 0, 500], 256, 384, activation="clamped_swiglu", probs=False,
      dtype=torch.float16)
check("one row", 1, [0, 1, 0], 64, 128)
check("all padding", 300, [0, 0, 0], 64, 128)
check("gpt-oss-like F=2880, clamped", 4096, [1000, 0, 2000, 1096], 2880, 2880, activation="clamped_swiglu")
check("interleaved k=128", 2048, [500, 700, 848], 512, 768, k=128)
check("odd rows", 777, [100, 233, 0, 444], 192, 256)
print("checks", round(time.time() - t0, 1), "s", flush=True)

VARIANTS = {"coop": dict(kind="coop", epi_cols=16), "ws2": dict(), "ws2_e16": dict(epi_cols=16, epi_regs=136)}


def time_cell(shape, dist):
    inputs, dy = runner.mlp_inputs(shape, dev, torch.bfloat16)
    x, w1, w2, p = (inputs[n].detach() for n in ("x", "w1", "w2", "probs"))
    offs = offs_of(runner.make_splits(shape, dist))
    h, _ = gm.glu_forward(x, w1, offs, None, p, None, "swiglu")
    del x, w1, inputs
    M, F = h.shape[0], h.shape[1] // 2
    outs = (torch.empty(M, 2 * F, device=dev, dtype=h.dtype), torch.empty(M, F, device=dev, dtype=h.dtype),
            torch.empty(triton.cdiv(F, 256), M, device=dev))
    fns = {"lib": lambda: gm.glu_backward(dy, w2, h, offs, p, None, "swiglu")}
    for n, v in VARIANTS.items():
        fns[n] = (lambda v=v: ws_backward(dy, w2, h, offs, p, None, "swiglu", outs=outs, **v))
    ref = fns["lib"]()
    same = {}
    for n in VARIANTS:
        got = fns[n]()
        same[n] = dict(dh=bool(torch.equal(got[0], ref[0])), actp=bool(torch.equal(got[1], ref[1])),
                       dprobs_maxrel=float(((got[2] - ref[2]).abs() / ref[2].abs().clamp_min(1e-3)).max()))
    times = {n: [] for n in fns}
    for _ in range(3):
        for n, fn in fns.items():
            times[n].append(triton.testing.do_bench(fn, warmup=10, rep=60))
    flops = 2 * shape.rows * shape.hidden * shape.ffn
    r = dict(shape=shape.name, dist=dist, ms={n: sorted(t)[1] for n, t in times.items()}, rounds=times, same=same)
    r["tflops"] = {n: flops / ms / 1e9 for n, ms in r["ms"].items()}
    out["timings"].append(r)
    print(shape.name, dist, {n: (v["dh"], v["actp"]) for n, v in same.items()},
          {n: f"{ms:.3f}" for n, ms in r["ms"].items()}, flush=True)
    save()


shapes = list(runner.SHAPES) + [runner.MoEShape("sonicmoe", rows=262144, experts=128, hidden=4096, ffn=512)]
for shape in shapes:
    for dist in ("balanced", "skewed"):
        if shape.name != "sonicmoe" or dist == "balanced":
            time_cell(shape, dist)
            torch.cuda.empty_cache()
print("total", round(time.time() - t0, 1), "s", flush=True)
