"""Benchmark of moekit.grouped_mlp (fc1 -> SwiGLU -> fc2): forward, forward+backward and their peak
memory, for every shape of the README's tables and balanced and skewed splits.

Legend: M rows, N experts, H hidden size, F expert ffn size.

The forward is a training forward (inputs require grad, so the autograd graph and its saved
tensors are built). m_splits is a device tensor. FLOPs: forward = fc1 + fc2 = 2*M*H*2F + 2*M*F*H,
forward+backward = 3x forward. Each backend is first checked (output and the gradients of x and
both weights) against a float32 run of the per-group loop.

    python benchmarks/bench_grouped_mlp.py                             # torch,triton on CUDA
    python benchmarks/bench_grouped_mlp.py --backends loop,torch,triton --dists skewed
    python benchmarks/bench_grouped_mlp.py --smoke                     # tiny shapes, CPU is fine
"""

from __future__ import annotations

import functools

import runner
import torch

import moekit
from moekit.ops.grouped_linear import select_backend

NAME = "bench_grouped_mlp"
GRAD_NAMES = ("x", "fc1_weight", "fc2_weight")


def run(cfg: runner.BenchConfig, roof: dict, records: list[dict]) -> list[dict]:
    """Append the records of every (shape, dist, pass, backend) cell to `records`."""
    for shape in cfg.shapes:
        for dist in cfg.dists:
            records.extend(_bench_cell_group(cfg, roof, shape, dist, runner.make_splits(shape, dist)))
            runner.release_memory(cfg.device)
            runner.save_partial(cfg, records)
    return records


def _unavailable_reason(backend: str, x_MH: torch.Tensor, w1_N2FH, w2_NHF) -> str | None:
    """select_backend's reason for either linear of the MLP (fc2's input is (M, F))."""
    try:
        select_backend(backend, x_MH, w1_N2FH)
        select_backend(backend, x_MH.new_empty(0, w2_NHF.shape[2]), w2_NHF)
    except ValueError as exc:
        return str(exc)
    return None


def _reference(inputs: dict, splits: list[int], dy_MH: torch.Tensor) -> dict[str, torch.Tensor]:
    """float32 output and gradients through the per-group loop backend, host splits."""
    leaves = {k: v.detach().float().requires_grad_(True) for k, v in inputs.items()}
    y = moekit.grouped_mlp(leaves["x"], leaves["fc1_weight"], leaves["fc2_weight"], splits, backend="loop")
    y.backward(dy_MH.float())
    return {"out": y.detach(), **{k: leaves[k].grad for k in GRAD_NAMES}}


def _bench_cell_group(cfg, roof, shape: runner.MoEShape, dist: str, splits: list[int]) -> list[dict]:
    M, N, H, F = shape.rows, shape.experts, shape.hidden, shape.ffn
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    inputs = {
        "x": torch.randn(M, H, device=cfg.device, dtype=cfg.dtype, generator=gen),
        "fc1_weight": (torch.randn(N, 2 * F, H, device=cfg.device, generator=gen) * H**-0.5).to(cfg.dtype),
        "fc2_weight": (torch.randn(N, H, F, device=cfg.device, generator=gen) * F**-0.5).to(cfg.dtype),
    }
    dy_MH = torch.randn(M, H, device=cfg.device, dtype=cfg.dtype, generator=gen)
    m_splits = torch.tensor(splits, dtype=torch.int64, device=cfg.device)
    reasons = {b: _unavailable_reason(b, inputs["x"], inputs["fc1_weight"], inputs["fc2_weight"])
               for b in cfg.backends}
    ref = _reference(inputs, splits, dy_MH) if any(r is None for r in reasons.values()) else None

    flops_fwd = 2 * M * H * 2 * F + 2 * M * F * H
    records = []
    timed = {"mlp.forward": [], "mlp.forward+backward": []}
    # One set of leaves for every backend: each check and each timed call sets the gradients to
    # None first, so nothing accumulates across backends, and every backend's peak memory is
    # measured with the same tensors alive (the interleaved rounds keep all backends' cells live).
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    grads = list(leaves.values())
    for backend in cfg.backends:
        fwd_record = runner.new_record("grouped_mlp", shape, dist, "mlp.forward", backend, flops_fwd, roof)
        bwd_record = runner.new_record("grouped_mlp", shape, dist, "mlp.forward+backward", backend,
                                       3 * flops_fwd, roof)
        if reasons[backend] is not None:
            records += [runner.unavailable_record(r, reasons[backend]) for r in (fwd_record, bwd_record)]
            continue

        def forward(leaves=leaves, backend=backend):
            return moekit.grouped_mlp(leaves["x"], leaves["fc1_weight"], leaves["fc2_weight"], m_splits,
                                      backend=backend)

        def forward_backward(forward=forward):
            forward().backward(dy_MH)

        # One checked run serves both cells: the forward cell checks the output, the other all four.
        checked = functools.cache(functools.partial(_check_all, forward, leaves, dy_MH, ref, cfg.dtype))
        for record, fn, names in ((fwd_record, forward, ("out",)),
                                  (bwd_record, forward_backward, ("out", *GRAD_NAMES))):
            check = functools.partial(_subset, checked, names, cfg.dtype)
            runner.measure_cell(record, fn, check, cfg, grad_to_none=grads)
            record.update(_peak_memory(fn, grads, cfg.device) if record["ms"] is not None else
                          {"peak_bytes": None, "peak_extra_bytes": None})
            records.append(record)
            timed[record["op"]].append((record, fn, grads))
    for cells in timed.values():
        runner.retime_interleaved(cells, cfg)
    # All backends' forward cells first, then the forward+backward ones (stable: backend order kept).
    records.sort(key=lambda r: r["op"] == "mlp.forward+backward")
    return records


def _check_all(forward, leaves: dict, dy_MH, ref: dict, dtype) -> dict:
    for t in leaves.values():
        t.grad = None
    y = forward()
    y.backward(dy_MH)
    return {"out": runner.rel_errors(y, ref["out"]),
            **{k: runner.rel_errors(leaves[k].grad, ref[k]) for k in GRAD_NAMES}}


def _subset(checked, names: tuple[str, ...], dtype) -> dict:
    errors = checked()
    return runner.check_summary({("d " + k if k in GRAD_NAMES else k): errors[k] for k in names}, dtype)


def _peak_memory(fn, grads: list[torch.Tensor], device: torch.device) -> dict:
    """Peak allocated bytes of one call (gradients set to None first, as do_bench leaves them), and
    how far that peak rose above what was allocated before the call (inputs, weights, caches)."""
    if device.type != "cuda":
        return {"peak_bytes": None, "peak_extra_bytes": None}
    for t in grads:
        t.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_bytes": peak, "peak_extra_bytes": peak - before}


def main(argv: list[str] | None = None) -> dict:
    return runner.run_script(NAME, __doc__, run, argv)


if __name__ == "__main__":
    main()
