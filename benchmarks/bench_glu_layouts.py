"""moekit.moe_experts per GLU layout and weight orientation: every `glu_interleave_size` and both
orientations of the expert weights against `[gate | up]` stored, forward and forward+backward.

Legend: T tokens, N experts, K experts per token, M = T*K routed rows, H hidden size, F ffn size,
k the GLU interleave (`glu_interleave_size`; k = F and None are both `[gate | up]`).

The layouts (issue 21): fc1 rows `[gate | up]` (k None) or interleaved in GLU blocks of k for k in
1, 2, 4, ..., 128 where k | F, and k = F; each in two orientations: "stored" (fc1 (N, 2F, H) and
fc2 (N, H, F) tensors) and "transposed" (transposed views of (N, H, 2F) and (N, F, H) tensors, as
transformers' gpt-oss experts keep them; the views are the leaves, so their gradients come back in
that layout). Every case computes the same layer from the same weights (fc1 reordered with
`moekit.interleave_glu`), routing and output gradient.

Timing: runner.time_ms (triton.testing.do_bench median, L2 flushed between calls, no CUDA graph) of
the forward and of the forward+backward, every case of a shape once per round in rounds whose order
rotates (runner.time_rounds: round r starts at case r), so clock drift over the run reaches every
layout alike; each case keeps the median of its rounds. The first forward+backward of each case
(its kernels' compilation, the Triton GEMMs' autotuning) is timed apart (`first_call_s`) and never
mixed with the rounds. The dense bf16 8192^3 roof is measured at the start and the end.

Per case: which kernels run the fused fc1 + activation and fc2 dgrad + activation backward
(`runtime.glu.hopper_kernels_take` for "fwd" and "bwd": the warp-specialised Gluon kernels or the
Triton kernels), ms, TFLOP/s (forward 2*M*H*2F + 2*M*F*H, forward+backward 3x), the ratio of its
speed to `[gate | up]` stored (`x_gate_up`; 1.0 for the baseline itself), the relative error of its
output and gradients against the baseline's (fc1's gradient de-interleaved: a layout mistake reads
O(1)), and on CUDA the GPU time of each kernel in one forward+backward (torch.profiler, the kernel
names as launched; `--no-kernels` leaves it out).

    python benchmarks/bench_glu_layouts.py --out $OUT --commit <commit>       # both models, ~1-3 min
    python benchmarks/bench_glu_layouts.py --shapes qwen3-30b-a3b --interleaves none,4,64 --rounds 5
    TRITON_INTERPRET=1 python benchmarks/bench_glu_layouts.py --smoke --out /tmp/l   # CPU, tiny

Writes OUT/glu_layouts.json (rewritten after every shape, `"partial": true` until the end) and
prints a table. The commit recorded is --commit's, else MOEKIT_BENCH_COMMIT's, else git's.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench_moe_layer import LayerShape

NAME = "glu_layouts"
OPS = ("forward", "forward+backward")
ORIENTATIONS = ("stored", "transposed")
# The interleaves tried where they divide F; F itself is added per shape.
INTERLEAVES = (None, 1, 2, 4, 8, 16, 32, 64, 128)


# Shapes are bench_moe_layer's (LayerShape), taken by name once triton's mode is set: these by default,
# the others of its table (the coarse shapes, SonicMoE's) by name or with --shapes all.
DEFAULT_SHAPES = ("gpt-oss-20b", "qwen3-30b-a3b")
SMOKE_SHAPE = ("smoke", 24, 4, 2, 32, 8)


def interleaves_of(shape: LayerShape, wanted: list[str] | None) -> list[int | None]:
    """The shape's interleaves: INTERLEAVES that divide F, then F; `wanted` (names "none", "F" or
    numbers) keeps those only."""
    ks: list[int | None] = [k for k in INTERLEAVES if k is None or shape.ffn % k == 0]
    if shape.ffn not in ks:
        ks.append(shape.ffn)
    if wanted is None:
        return ks
    keep = {None if w == "none" else shape.ffn if w == "F" else int(w) for w in wanted}
    return [k for k in ks if k in keep]


def label_of(k: int | None, ffn: int) -> str:
    return "gate|up" if k is None else ("k=F" if k == ffn else f"k{k}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes", default=None, help="comma list of bench_moe_layer shape names, or all (default: DEFAULT_SHAPES)"
    )
    p.add_argument(
        "--interleaves",
        default=None,
        help="comma list of interleaves to keep: none (gate|up), F, numbers (default: every one; "
        "gate|up stored is always run, the baseline)",
    )
    p.add_argument("--orientations", default=",".join(ORIENTATIONS), help="stored, transposed or both")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3; smoke 1)")
    p.add_argument("--quick", action="store_true", help="one round, short repetitions (noisier)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    p.add_argument(
        "--backend", default=None, help="moe_experts' backend (default auto; smoke: triton, the interpreted kernels)"
    )
    p.add_argument("--no-kernels", dest="kernels", action="store_false", help="skip the per-kernel profile")
    p.add_argument("--out", type=Path, required=True, help="the directory of glu_layouts.json")
    p.add_argument("--commit", default=None, help="the git commit measured (for a tree without .git)")
    p.add_argument("--max-seconds", type=float, default=None, help="start no new shape after this many seconds")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick or args.smoke else 3)
    args.backend = args.backend or ("triton" if args.smoke else "auto")
    args.warmup_ms, args.rep_ms = (10.0, 30.0) if args.quick or args.smoke else (25.0, 100.0)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        if not args.smoke:
            raise SystemExit("the full shapes need a CUDA device; use --smoke on CPU")
        # Before triton is imported (moekit imports it): the kernels then run on the CPU.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import runner

    device = torch.device("cuda" if cuda else "cpu")
    # bf16 on the GPU; fp32 under the interpreter (its bf16 dot is not the GPU's).
    dtype = torch.bfloat16 if cuda else torch.float32
    import bench_moe_layer as layer

    if args.smoke:
        pool: tuple[LayerShape, ...] = (layer.LayerShape(*SMOKE_SHAPE),)
    else:
        pool = layer.SHAPES + layer.SONICMOE_SHAPES
    if args.shapes == "all" or args.smoke:
        shapes = list(pool)
    elif args.shapes:
        shapes = runner.select_by_name(pool, args.shapes, "shapes", [s.name for s in pool])
    else:
        shapes = [s for s in pool if s.name in DEFAULT_SHAPES]
    orientations = runner.select_by_name(ORIENTATIONS, args.orientations, "orientations", ORIENTATIONS)
    wanted = [w.strip() for w in args.interleaves.split(",") if w.strip()] if args.interleaves else None
    cfg = runner.BenchConfig(
        device=device,
        dtype=dtype,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        smoke=args.smoke,
        quick=args.quick,
        rounds=args.rounds,
        shapes=[],
        dists=["balanced"],
        backends=[args.backend],
        out=args.out,
        plot=False,
    )
    start = time.monotonic()
    roofs = [runner.measure_roof(cfg)]
    meta = runner.environment(cfg, roofs[0])
    if args.commit:
        meta.update(git_commit=args.commit, git_commit_from="--commit", git_dirty=None, git_dirty_paths=[])
    meta.update(
        shapes=[asdict(s) for s in shapes],
        orientations=orientations,
        backend=args.backend,
        routing="balanced: K distinct experts per token drawn uniformly, weights a softmax of random logits",
    )
    records: list[dict] = []
    for shape in shapes:
        if args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
            print(f"{shape.name}: not run, past --max-seconds {args.max_seconds:g}", flush=True)
            continue
        records += bench_shape(shape, interleaves_of(shape, wanted), orientations, args, cfg, runner)
        runner.write_json(args.out / f"{NAME}.json", {"meta": meta, "records": records, "partial": True})
        if cuda:
            torch.cuda.empty_cache()
    roofs.append(runner.measure_roof(cfg))
    meta.update(roofs=roofs, seconds=round(time.monotonic() - start, 1))
    payload = {"meta": meta, "records": records}
    runner.write_json(args.out / f"{NAME}.json", payload)
    print_table(records, roofs)
    return payload


def layer_inputs(shape: LayerShape, device: torch.device, dtype: torch.dtype) -> dict:
    """x (T, H), balanced routing (T, K) ids and weights, fc1 (N, 2F, H) `[gate | up]`, fc2 (N, H, F),
    dy (T, H), from fixed seeds."""
    gen = torch.Generator(device=device).manual_seed(0)
    T, N, K, H, F = shape.tokens, shape.experts, shape.top_k, shape.hidden, shape.ffn
    ids = torch.multinomial(torch.ones(T, N, device=device), K, replacement=False, generator=gen)
    return {
        "x": torch.randn(T, H, device=device, generator=gen).to(dtype),
        "ids": ids,
        "weights": torch.randn(T, K, device=device, generator=gen).softmax(-1).to(dtype),
        "w1": (torch.randn(N, 2 * F, H, device=device, generator=gen) * H**-0.5).to(dtype),
        "w2": (torch.randn(N, H, F, device=device, generator=gen) * F**-0.5).to(dtype),
        "dy": torch.randn(T, H, device=device, generator=gen).to(dtype),
    }


def oriented(w: torch.Tensor, orientation: str) -> torch.Tensor:
    """A leaf of `w`'s values: the tensor itself, or a transposed view of the (N, in, out) tensor."""
    if orientation == "transposed":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    return w.detach().requires_grad_(True)


def kernels_take(shape: LayerShape, base: dict, w1: torch.Tensor, w2: torch.Tensor, k: int | None) -> dict:
    """Which kernels run the fused fc1 and fc2-dgrad passes: "hopper" (runtime.glu.hopper_kernels_take)
    or "triton". TMA as the runtime decides it for the stored weight."""
    from moekit.ops.runtime import glu as rglu
    from moekit.ops.runtime.launch import use_tma

    block = shape.ffn if k is None else k
    rows = base["x"]
    out = {}
    for kind, w in (("fwd", w1), ("bwd", w2)):
        stored = w.transpose(1, 2) if w.stride(2) != 1 else w
        tma, _ = use_tma(None, True, rows, stored)
        out[kind] = "hopper" if rglu.hopper_kernels_take(kind, rows, w, shape.ffn, block, tma, None) else "triton"
    return out


def bench_shape(shape: LayerShape, ks: list, orientations: list[str], args, cfg, runner) -> list[dict]:
    import moekit

    device, dtype = cfg.device, cfg.dtype
    base = layer_inputs(shape, device, dtype)
    M = shape.tokens * shape.top_k
    flops_fwd = 2 * M * shape.hidden * 2 * shape.ffn + 2 * M * shape.ffn * shape.hidden
    x = base["x"].detach().requires_grad_(True)
    weights = base["weights"].detach().requires_grad_(True)
    print(
        f"== {shape.name}: T {shape.tokens} N {shape.experts} K {shape.top_k} H {shape.hidden} F {shape.ffn}, "
        f"interleaves {[label_of(k, shape.ffn) for k in ks]}",
        flush=True,
    )
    cases = [(o, k) for o in orientations for k in ks]
    if ("stored", None) not in cases:
        cases.insert(0, ("stored", None))  # the baseline of every ratio
    records, timed, reference, steps = [], [], None, {}
    for orientation, k in cases:
        w1_std = base["w1"] if k is None else moekit.interleave_glu(base["w1"], k, dim=1)
        w1, w2 = oriented(w1_std, orientation), oriented(base["w2"], orientation)
        del w1_std
        leaves = [x, weights, w1, w2]

        def fwd(w1=w1, w2=w2, k=k):
            return moekit.moe_experts(x, base["ids"], weights, w1, w2, glu_interleave_size=k, backend=args.backend)

        def fwd_bwd(fwd=fwd):
            fwd().backward(base["dy"])

        case = {
            "bench": NAME,
            **asdict(shape),
            "shape": shape.name,
            "orientation": orientation,
            "glu_interleave_size": k,
            "layout": label_of(k, shape.ffn),
            "kernels": kernels_take(shape, base, w1, w2, k),
        }
        recs = {op: {**case, "op": op, "flops": flops_fwd * (1 if op == "forward" else 3)} for op in OPS}
        records += recs.values()
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for t in leaves:
                t.grad = None
            y = fwd()
            y.backward(base["dy"])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_call_s = round(time.perf_counter() - t0, 3)
            got = {"out": y.detach().float(), "x": x.grad.float(), "weights": weights.grad.float()}
            dw1 = w1.grad if k is None else moekit.deinterleave_glu(w1.grad, k, dim=1)
            got.update(fc1=dw1.float(), fc2=w2.grad.float())
            grad_strides_match = w1.grad.stride() == w1.stride() and w2.grad.stride() == w2.stride()
            del y, dw1
            for t in leaves:
                t.grad = None
            if reference is None:
                reference = got
            errors = {name: rel_err(got[name], reference[name]) for name in got}
            del got
            for r in recs.values():
                r.update(status="ok", first_call_s=first_call_s, errors_vs_gate_up=errors)
                r["grad_layout_as_weight"] = grad_strides_match
            timed += [(recs["forward"], fwd), (recs["forward+backward"], fwd_bwd)]
            steps[(orientation, k)] = (fwd_bwd, leaves)
        except Exception as exc:  # one broken case must not lose the others
            for r in recs.values():
                r["status"], r["reason"] = "error", runner.error_reason(exc)
        print(
            f"  {case['layout']:<8} {orientation:<10} kernels {case['kernels']} compiled/first call "
            f"{records[-1].get('first_call_s')} s {records[-1].get('status')}",
            flush=True,
        )
    grads = [x, weights]
    runner.time_rounds(
        timed, args.rounds, lambda fn: runner.time_ms(fn, cfg, grads + [p for _, ls in steps.values() for p in ls[2:]])
    )
    base_by_op = {r["op"]: r for r in records if r["orientation"] == "stored" and r["glu_interleave_size"] is None}
    for r in records:
        b = base_by_op.get(r["op"], {})
        r["x_gate_up"] = b["ms"] / r["ms"] if r.get("ms") and b.get("ms") else None
    if args.kernels and device.type == "cuda":
        times = kernel_times(steps, device)
        for r in records:
            if r["op"] == "forward+backward":
                r["kernel_us"] = times.get((r["orientation"], r["glu_interleave_size"]))
    for r in records:
        print_record(r)
    return records


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float | None:
    err = ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if err == err and err != float("inf") else None


def kernel_times(steps: dict, device: torch.device) -> dict:
    """{case: {kernel name: GPU microseconds}} of one forward+backward per case (after one untimed
    step), all cases in one torch.profiler session: a case's kernels are those that start inside its
    record_function range, which ends after a synchronization. A failure is recorded, not raised."""
    from torch.profiler import ProfilerActivity, profile, record_function

    labels = {f"glu_layouts_case_{i}": case for i, case in enumerate(steps)}
    try:
        for fwd_bwd, leaves in steps.values():
            fwd_bwd()
            for t in leaves:
                t.grad = None
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for label, case in labels.items():
                fwd_bwd, leaves = steps[case]
                with record_function(label):
                    fwd_bwd()
                    torch.cuda.synchronize(device)
                for t in leaves:
                    t.grad = None
        events = list(prof.events())
        ranges = {
            labels[e.name]: (e.time_range.start, e.time_range.end)
            for e in events
            if e.name in labels and e.device_type == torch.autograd.DeviceType.CPU
        }
        out: dict = {case: collections.Counter() for case in steps}
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CUDA or e.name in labels:
                continue
            for case, (lo, hi) in ranges.items():
                if lo <= e.time_range.start <= hi:
                    out[case][e.name] += e.time_range.elapsed_us()
                    break
        return {case: {n: round(us, 1) for n, us in c.most_common()} for case, c in out.items()}
    except Exception as exc:  # the timings above stand without the breakdown
        print(f"kernel profile failed: {exc!r}", flush=True)
        return {case: {"error": repr(exc)} for case in steps}


def print_record(r: dict) -> None:
    t = f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TF" if r.get("ms") else " " * 21
    ratio = f" x{r['x_gate_up']:.3f}" if r.get("x_gate_up") else "       "
    note = f"  [{r['status']}: {r['reason'][:120]}]" if r.get("reason") else ""
    kern = f"{r['kernels']['fwd']}/{r['kernels']['bwd']}"
    print(
        f"  {r['shape']:<14} {r['layout']:<8} {r['orientation']:<10} {r['op']:<16} {kern:<13} {t}{ratio}{note}",
        flush=True,
    )


def print_table(records: list[dict], roofs: list[dict]) -> None:
    print("\ndense roof: " + ", ".join(f"{r['tflops']:.1f}" for r in roofs) + " TFLOP/s (bf16 8192^3)")
    header = (
        f"{'shape':<14} {'layout':<8} {'orientation':<11} {'fwd/bwd kernels':<16} {'fwd ms':>8} {'fwd TF':>7} "
        f"{'x gate|up':>9} {'f+b ms':>8} {'f+b TF':>7} {'x gate|up':>9} {'spread':>7} {'max err':>8}"
    )
    print(header)
    print("-" * len(header))
    by = {(r["shape"], r["orientation"], r["glu_interleave_size"], r["op"]): r for r in records}
    cases = list(dict.fromkeys((r["shape"], r["orientation"], r["glu_interleave_size"]) for r in records))

    def f(v, spec):
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])

    for case in cases:
        fw, fb = by[(*case, "forward")], by[(*case, "forward+backward")]
        rounds = fb.get("ms_rounds") or []
        spread = (max(rounds) - min(rounds)) / statistics.median(rounds) if len(rounds) > 1 else None
        errs = [v for v in (fb.get("errors_vs_gate_up") or {}).values()]
        worst = max((e if e is not None else float("inf")) for e in errs) if errs else None
        kern = f"{fb['kernels']['fwd']}/{fb['kernels']['bwd']}"
        print(
            f"{case[0]:<14} {fb['layout']:<8} {case[1]:<11} {kern:<16} {f(fw.get('ms'), '8.3f')} "
            f"{f(fw.get('tflops'), '7.1f')} {f(fw.get('x_gate_up'), '9.3f')} {f(fb.get('ms'), '8.3f')} "
            f"{f(fb.get('tflops'), '7.1f')} {f(fb.get('x_gate_up'), '9.3f')} {f(spread, '7.3f')} {f(worst, '8.1e')}"
        )


if __name__ == "__main__":
    main()
