"""The developer tools in tools/ that the README and notes quote: each runs, reports what it says it
does, and refuses a mistaken argument in one line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"moekit_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_fp8_error_sweep_tool_reports_every_tensor_per_recipe(capsys):
    """tools/fp8_error_sweep.py (the spread the README quotes): a row per shape and column with the
    output's and the four gradients' median / largest errors, bf16 near its rounding and every recipe
    in FP8's range; a mistaken argument refused in one line."""
    tool = _tool("fp8_error_sweep")
    assert tool.main(["--draws", "2", "--tokens", "24", "--device", "cpu"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| (")]
    assert len(rows) == len(tool.SHAPES) * (1 + len(tool.RECIPES))
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 2 + len(tool.TENSORS) and ", 24)" in cells[0]
        errs = [float(x) for c in cells[2:] for x in c.split(" / ")]
        assert all(0 < e < 0.2 for e in errs), row
        assert (max(errs) < 0.01) if cells[1] == "none (bf16)" else (min(errs) > 0.02), row
    with pytest.raises(SystemExit):
        tool.main(["--draws", "0"])
    assert "--draws must be at least 1, got 0" in capsys.readouterr().err


def test_memory_timeline_counts_each_storage_from_its_op_to_its_last_tensor():
    """LiveBytes: a storage counts from the op that makes it until the last tensor on it dies (a view
    keeps it) or it is freed in place, and the peak lists what was alive then, largest first."""
    tool = _tool("memory_timeline")
    with tool.LiveBytes() as mode:
        a = torch.empty(1000)  # 4000 bytes
        view = a[:10]
        b = torch.empty(2000)  # 8000: 12000 alive
        del a  # the view keeps a's storage
        assert mode.live == 12000
        del view
        assert mode.live == 8000
        c = torch.empty(500)  # 2000: 10000 alive, under the peak
        del b, c
        d = torch.empty(250)  # 1000
        d.untyped_storage().resize_(0)  # freed in place, the tensor alive: seen at the next op
        torch.empty(0)
        assert mode.live == 0
        del d
    assert mode.peak == 12000 and mode.live == 0
    assert [s.nbytes for s in mode.at_peak] == [8000, 4000]


def test_memory_timeline_reports_the_layers_peak(capsys):
    """The tool on a layer (the torch backend, a small scale): the peak, its phase and the storages
    alive then, each with its shape and the moekit function that made it; a bad scale refused."""
    tool = _tool("memory_timeline")
    assert tool.main(["--layer", "qwen3-30b-a3b", "--scale", "64", "--backend", "torch", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("peak ") and " MiB in the " in out[1]
    assert len(out) == 5 and all(" MiB  (" in line and " <- " in line for line in out[2:])
    with pytest.raises(SystemExit):
        tool.main(["--scale", "0"])
    assert "--scale must be at least 1, got 0" in capsys.readouterr().err
