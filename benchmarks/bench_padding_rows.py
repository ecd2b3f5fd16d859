"""The cost of zeroing padding rows in moekit's `torch` backend with device splits (CUDA).

torch's grouped_mm leaves rows past the last offset unwritten; with device splits the host does not
know where they start. This times, on one (M, O) bf16 output and for several padding sizes:
- `masked_fill`: the whole-output masked pass the backend used before (reads and writes all rows);
- `kernel`: `zero_rows_from_kernel` (writes the padding rows only; every other program reads one int);
- the grouped_mm forward itself, for scale, and the torch backend's forward with device vs host splits.

    python benchmarks/bench_padding_rows.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import moekit
from moekit.ops.grouped_linear import _zero_rows_from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows, hidden, out_features, groups = 65536, 4096, 2048, 8
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    w = torch.randn(groups, out_features, hidden, device=dev, dtype=torch.bfloat16)
    t = torch.empty(rows, out_features, device=dev, dtype=torch.bfloat16)
    row_ids = torch.arange(rows, device=dev)
    results = []
    for padding in (0, 64, 4096, rows // 2):
        used = rows - padding
        end = torch.tensor([used], device=dev)
        counts = [used // groups] * (groups - 1) + [used - (groups - 1) * (used // groups)]
        splits_dev = torch.tensor(counts, device=dev)
        cell = {
            "rows": rows,
            "out_features": out_features,
            "padding_rows": padding,
            "masked_fill_us": 1e3 * do_bench(lambda end=end: t.masked_fill_((row_ids >= end)[:, None], 0)),
            "kernel_us": 1e3 * do_bench(lambda end=end: _zero_rows_from(t, end)),
            "forward_device_splits_us": 1e3
            * do_bench(lambda s=splits_dev: moekit.grouped_linear(x, w, s, backend="torch")),
            "forward_host_splits_us": 1e3 * do_bench(lambda c=counts: moekit.grouped_linear(x, w, c, backend="torch")),
        }
        results.append(cell)
        print(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in cell.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cells": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
