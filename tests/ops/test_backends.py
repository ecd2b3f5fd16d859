"""moekit.ops.runtime.backends on the GPU (pytest -m gpu): which backend "auto" picks, and what the
torch backend relies on: torch's grouped_mm wgrad writes zeros for experts without rows.

Legend: N experts, H hidden size, F ffn size.
"""

from __future__ import annotations

import pytest
import torch

from helpers import BF16, CUDA, GPU_F, GPU_H, GPU_N, rel_err
from moekit.ops.runtime.backends import select_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_auto_on_hopper_is_triton_and_elsewhere_torch_first():
    x = torch.zeros(64, GPU_H, device=CUDA, dtype=BF16)
    w = torch.zeros(GPU_N, GPU_F, GPU_H, device=CUDA, dtype=BF16)
    expected = "triton" if torch.cuda.get_device_capability()[0] >= 9 else "torch"
    assert select_backend("auto", x, w).name == expected
    # fp32: grouped_mm would sync on CUDA, so the torch backend refuses it; triton runs anywhere.
    assert select_backend("auto", x.float(), w.float()).name == "triton"


def test_torch_grouped_mm_wgrad_writes_zeros_for_empty_experts():
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        pytest.skip(f"torch {torch.__version__} has no grouped_mm")
    counts = [0, 300, 0, 0, 212, 0]  # empty first, middle and last; 88 padding rows
    rows, out_f, in_f = 600, 256, 384
    gen = torch.Generator(device=CUDA).manual_seed(0)
    dy = torch.randn(rows, out_f, device=CUDA, dtype=BF16, generator=gen)
    x = torch.randn(rows, in_f, device=CUDA, dtype=BF16, generator=gen)
    used = sum(counts)
    dy[used:], x[used:] = 1e3, 1e3  # padding rows must not contribute to any expert
    ends = torch.tensor(counts, device=CUDA).cumsum(0).to(torch.int32)

    for name, wgrad in (
        ("grouped_mm", lambda: grouped_mm(dy.t(), x, offs=ends)),
        ("moekit torch backend", lambda: _torch_backend_wgrad(dy, x, counts)),
    ):
        # Leave NaN in the allocator block the output is likely to get, so unwritten memory shows.
        poison = torch.full((len(counts), out_f, in_f), float("nan"), device=CUDA, dtype=BF16)
        del poison
        dw = wgrad()
        assert dw.shape == (len(counts), out_f, in_f)
        lo = 0
        for g, c in enumerate(counts):
            if c == 0:
                assert torch.count_nonzero(dw[g].nan_to_num(1.0)) == 0, f"{name}: dw[{g}] of an empty expert is not 0"
            else:
                expected = dy[lo : lo + c].t().float() @ x[lo : lo + c].float()
                assert rel_err(dw[g], expected) < 1e-2, f"{name}: dw[{g}] wrong"
            lo += c


def _torch_backend_wgrad(dy, x, counts):
    from moekit.ops.splits import resolve_splits

    impl = select_backend("torch", x, torch.empty(1, dy.shape[1], x.shape[1], device=CUDA, dtype=BF16))
    go = resolve_splits(torch.tensor(counts, device=CUDA), len(counts), x.shape[0], CUDA)
    return impl.wgrad(dy, x, go)
