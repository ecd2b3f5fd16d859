"""Benchmark of grouped_linear's three products, each timed alone: forward, dgrad and wgrad of fc1
(H -> 2F) and fc2 (F -> H), for every shape of the README's tables and balanced and skewed splits.

Legend: M rows, N experts, I in_features, O out_features.

The products are called directly on the backend (`select_backend(...).forward/dgrad/wgrad`) with
one `GroupOffsets` built from device m_splits, as a training step holds them, so each GEMM is timed
without autograd or the other two. Each cell is first checked against a float32 per-group loop.

    python benchmarks/bench_grouped_linear.py                          # torch,triton on CUDA
    python benchmarks/bench_grouped_linear.py --backends loop,torch,triton --shapes mixtral-8x7b
    python benchmarks/bench_grouped_linear.py --smoke                  # tiny shapes, CPU is fine
"""

from __future__ import annotations

import functools

import runner
import torch

from moekit._splits import resolve_splits
from moekit.ops.grouped_linear import select_backend

NAME = "bench_grouped_linear"
PRODUCTS = ("forward", "dgrad", "wgrad")


def layer_dims(shape: runner.MoEShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each expert linear."""
    return {"fc1": (shape.hidden, 2 * shape.ffn), "fc2": (shape.ffn, shape.hidden)}


def run(cfg: runner.BenchConfig, roof: dict, records: list[dict]) -> list[dict]:
    """Append the records of every (shape, dist, layer, product, backend) cell to `records`."""
    for shape in cfg.shapes:
        for dist in cfg.dists:
            splits = runner.make_splits(shape, dist)
            for layer, (in_f, out_f) in layer_dims(shape).items():
                records.extend(_bench_layer(cfg, roof, shape, dist, splits, layer, in_f, out_f))
                runner.release_memory(cfg.device)
            runner.save_partial(cfg, records)
    return records


def _bench_layer(cfg, roof, shape, dist, splits, layer, in_f, out_f) -> list[dict]:
    M, N = shape.rows, shape.experts
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    x_MI = torch.randn(M, in_f, device=cfg.device, dtype=cfg.dtype, generator=gen)
    w_NOI = (torch.randn(N, out_f, in_f, device=cfg.device, generator=gen) * in_f**-0.5).to(cfg.dtype)
    dy_MO = torch.randn(M, out_f, device=cfg.device, dtype=cfg.dtype, generator=gen)
    # Device splits, as a router produces them: the timed products never read them on the host.
    go = resolve_splits(torch.tensor(splits, dtype=torch.int64, device=cfg.device), N, M, cfg.device)
    # The float32 reference runs the per-group loop over host offsets (no sync per call).
    go_host = resolve_splits(splits, N, M, cfg.device)
    loop = select_backend("loop", x_MI, w_NOI)
    x32, w32, dy32 = x_MI.float(), w_NOI.float(), dy_MO.float()
    product_fns = {
        "forward": (
            lambda impl: impl.forward(x_MI, w_NOI, go, None, None),
            lambda: loop.forward(x32, w32, go_host, None, None),
        ),
        "dgrad": (lambda impl: impl.dgrad(dy_MO, w_NOI, go), lambda: loop.dgrad(dy32, w32, go_host)),
        "wgrad": (lambda impl: impl.wgrad(dy_MO, x_MI, go, N), lambda: loop.wgrad(dy32, x32, go_host, N)),
    }
    impls, reasons = {}, {}
    for backend in cfg.backends:
        try:
            impls[backend] = select_backend(backend, x_MI, w_NOI)
        except ValueError as exc:
            reasons[backend] = str(exc)

    records = []
    flops = 2 * M * in_f * out_f
    for product in PRODUCTS:
        run_op, run_ref = product_fns[product]
        ref = run_ref() if impls else None
        timed = []
        for backend in cfg.backends:
            record = runner.new_record("grouped_linear", shape, dist, f"{layer}.{product}", backend, flops, roof)
            if backend in reasons:
                records.append(runner.unavailable_record(record, reasons[backend]))
                continue
            fn = functools.partial(run_op, impls[backend])
            check = functools.partial(_check, fn, ref, cfg.dtype)
            records.append(runner.measure_cell(record, fn, check, cfg))
            timed.append((record, fn, None))
        runner.retime_interleaved(timed, cfg)
        del ref
    return records


def _check(fn, ref: torch.Tensor, dtype: torch.dtype) -> dict:
    return runner.check_summary({"out": runner.rel_errors(fn(), ref)}, dtype)


def main(argv: list[str] | None = None) -> dict:
    return runner.run_script(NAME, __doc__, run, argv)


if __name__ == "__main__":
    main()
