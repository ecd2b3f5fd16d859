"""Scratch: the warp-specialised Gluon forward against the library's Triton forward (bits, time)."""
import json, os, sys, time
sys.path[:0] = ["src", "benchmarks"]
import torch, triton
import runner
from moekit.ops import grouped_mlp as gm, grouped_gemm as gg
from moekit.ops.grouped_mlp_hopper_kernels import glu_backward_ws_kernel, glu_forward_ws_kernel

dev = torch.device("cuda")
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
ACTS = ("swiglu", "clamped_swiglu")


def ws_forward(x, w1, offs, bias, probs, k, activation, stages=3, epi_cols=16, epi_regs=88, poison=False):
    M, H = x.shape
    N, two_f, _ = w1.shape
    F = two_f // 2
    k = F if k is None else k
    mk = (lambda *s: torch.full(s, float("nan"), device=dev, dtype=x.dtype)) if poison else (
        lambda *s: torch.empty(s, device=dev, dtype=x.dtype))
    h, act = mk(M, two_f), mk(M, F)
    BG = gg._block_groups(N + 2)
    nprog = gg._grid_size(dev, (triton.cdiv(M, 128) + N + 1) * triton.cdiv(F, 128))
    glu_forward_ws_kernel[(nprog,)](
        x, w1, h, act, bias if bias is not None else h, probs if probs is not None else h, offs,
        M, F, H, N, x.stride(0), w1.stride(1), h.stride(0), act.stride(0), bias.stride(0) if bias is not None else 0,
        ACTIVATION=ACTS.index(activation), GLU_BLOCK=k, HAS_BIAS=bias is not None, HAS_PROBS=probs is not None,
        BLOCK_M=128, BLOCK_C=128, BLOCK_RED=64, GROUP_M=8, BLOCK_GROUPS=BG, NUM_PROGRAMS=nprog,
        STAGES=stages, EPI_COLS=epi_cols, EPI_REGS=epi_regs, num_warps=8, maxnreg=128)
    return h, act


def ws_backward(dy, w2, h, offs, probs, k, activation, stages=3, epi_cols=16, epi_regs=232, poison=False):
    M, H = dy.shape
    N, _, F = w2.shape
    k = F if k is None else k
    fill = float("nan") if poison else 0.0
    dh = torch.full((M, 2 * F), fill, device=dev, dtype=dy.dtype)
    act = torch.full((M, F), fill, device=dev, dtype=dy.dtype)
    part = torch.full((triton.cdiv(F, 128), M), fill, device=dev) if probs is not None else None
    BG = gg._block_groups(N + 2)
    nprog = gg._grid_size(dev, (triton.cdiv(M, 128) + N + 1) * triton.cdiv(F, 128))
    glu_backward_ws_kernel[(nprog,)](
        dy, w2, h, dh, act, probs if probs is not None else dh, part if part is not None else dh, offs,
        M, F, H, N, dy.stride(0), w2.stride(1), h.stride(0), dh.stride(0), act.stride(0),
        ACTIVATION=ACTS.index(activation), GLU_BLOCK=k, HAS_PROBS=probs is not None,
        BLOCK_M=128, BLOCK_C=128, BLOCK_RED=64, GROUP_M=8, BLOCK_GROUPS=BG, NUM_PROGRAMS=nprog,
        STAGES=stages, EPI_COLS=epi_cols, EPI_REGS=epi_regs, num_warps=8, maxnreg=128)
    return dh, act, (part.sum(0) if part is not None else None)


def offs_of(splits):
    return torch.tensor([0] + list(splits), device=dev).cumsum(0)


out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "commit": os.environ.get("MOEKIT_BENCH_COMMIT", "?"), "checks": [], "timings": []}


def check(name, M, splits, H, F, k=None, bias=False, probs=True, activation="swiglu", bkw={}, **kw):
    g = torch.Generator(device=dev).manual_seed(1)
    N = len(splits)
    x = torch.randn(M, H, device=dev, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(N, 2 * F, H, device=dev, generator=g) * H**-0.5).to(torch.bfloat16)
    b = torch.randn(N, 2 * F, device=dev, generator=g).to(torch.bfloat16) if bias else None
    p = torch.rand(M, device=dev, generator=g) if probs else None
    offs = offs_of(splits)
    h0, a0 = gm.glu_forward(x, w1, offs, b, p, k, activation)
    h1, a1 = ws_forward(x, w1, offs, b, p, k, activation, poison=True, **kw)
    torch.cuda.synchronize()
    r = dict(name=name, h_equal=bool(torch.equal(h0, h1)), act_equal=bool(torch.equal(a0, a1)),
             h_nan=bool(h1.isnan().any()), act_nan=bool(a1.isnan().any()),
             h_maxdiff=float((h0.float() - h1.float()).abs().nan_to_num(1e9).max()) if M else 0.0,
             act_maxdiff=float((a0.float() - a1.float()).abs().nan_to_num(1e9).max()) if M else 0.0)
    dy = torch.randn(M, H, device=dev, generator=g).to(torch.bfloat16)
    w2 = (torch.randn(N, H, F, device=dev, generator=g) * F**-0.5).to(torch.bfloat16)
    d0, ap0, dp0 = gm.glu_backward(dy, w2, h0, offs, p, k, activation)
    d1, ap1, dp1 = ws_backward(dy, w2, h0, offs, p, k, activation, poison=True, **bkw)
    torch.cuda.synchronize()
    r.update(dh_equal=bool(torch.equal(d0, d1)), actp_equal=bool(torch.equal(ap0, ap1)),
             dh_nan=bool(d1.isnan().any()), actp_nan=bool(ap1.isnan().any()))
    if p is not None:
        r.update(dprobs_nan=bool(dp1.isnan().any()),
                 dprobs_maxrel=float(((dp0 - dp1).abs() / dp0.abs().clamp_min(1e-6)).max()) if M else 0.0,
                 dprobs_maxabs=float((dp0 - dp1).abs().max()) if M else 0.0)
    out["checks"].append(r)
    print(r, flush=True)


t0 = time.time()
check("edge: padding rows, empty experts, bias, F%128=0", 1000, [0, 300, 1, 0, 500], 256, 384, bias=True)
check("edge: clamped, no probs", 1000, [0, 300, 1, 0, 500], 256, 384, activation="clamped_swiglu", probs=False, bias=True)
check("edge: one row", 1, [0, 1, 0], 64, 128)
check("edge: all padding", 300, [0, 0, 0], 64, 128)
check("gpt-oss-like F=2880 (k=F, partial tile)", 4096, [1000, 0, 2000, 1096], 2880, 2880, bias=True, activation="clamped_swiglu")
check("interleaved k=128", 2048, [500, 700, 848], 512, 768, k=128)
check("odd rows", 777, [100, 233, 0, 444], 192, 256)
check("mixtral balanced", 32768, runner.make_splits(runner.SHAPES[0], "balanced"), 4096, 14336)
print("checks", time.time() - t0, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ws_probe.json"), "w"), indent=1)

fwd_variants = []
bwd_variants = [dict(), dict(epi_cols=8, epi_regs=192)]
for shape in runner.SHAPES:
    for dist in ("balanced", "skewed"):
        inputs, dy = runner.mlp_inputs(shape, dev, torch.bfloat16)
        x, w1, w2, p = (inputs[n].detach() for n in ("x", "w1", "w2", "probs"))
        offs = offs_of(runner.make_splits(shape, dist))
        h, _ = gm.glu_forward(x, w1, offs, None, p, None, "swiglu")
        fns = {}
        for i, v in enumerate(fwd_variants):
            fns[f"fwd_ws{i}"] = (lambda v=v: ws_forward(x, w1, offs, None, p, None, "swiglu", **v))
        fns["bwd_lib"] = lambda: gm.glu_backward(dy, w2, h, offs, p, None, "swiglu")
        for i, v in enumerate(bwd_variants):
            fns[f"bwd_ws{i}"] = (lambda v=v: ws_backward(dy, w2, h, offs, p, None, "swiglu", **v))
        ref = fns["bwd_lib"]()
        same = {n: bool(torch.equal(fns[n]()[0], ref[0])) for n in fns if n.startswith("bwd_ws")}
        del ref
        times = {n: [] for n in fns}
        for rnd in range(3):
            for n, fn in fns.items():
                times[n].append(triton.testing.do_bench(fn, warmup=10, rep=50))
        flops = 2 * shape.rows * shape.hidden * shape.ffn
        r = dict(shape=shape.name, dist=dist, ms={n: sorted(t)[1] for n, t in times.items()}, rounds=times, equal_to_lib=same)
        r["tflops"] = {n: (2 if n.startswith("fwd") else 1) * flops / ms / 1e9 for n, ms in r["ms"].items()}
        out["timings"].append(r)
        print(shape.name, dist, same, {n: f"{ms:.3f} ms {r['tflops'][n]:.0f} TF/s" for n, ms in r["ms"].items()}, flush=True)
        json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ws_probe.json"), "w"), indent=1)
        del x, w1, w2, p, inputs, dy, h
        torch.cuda.empty_cache()
