"""Launch plans reuse the binary of their first launch (`moekit.ops.runtime.launch.LaunchPlan`): on Triton
3.6 a later launch goes straight to that binary, which Triton specialized on each tensor argument's dtype
and on whether its address is 16-byte aligned (`launch.arg_key`). So every later launch of a plan must
pass tensors of the first launch's dtypes and alignments, or the binary runs on pointers it was not
compiled for (a 16-byte vector access on an unaligned address: "misaligned address"; an int64 store into
an int32 buffer: writes past its end).

Under the interpreter every launch goes through Triton's own path, so the binary reuse never happens on
the CPU; these tests check the invariant itself, on every plan launched while they run (`plan_spy`).
"""

from __future__ import annotations

import pytest
import torch

from moekit.ops.moe_experts import moe_experts
from moekit.ops.routing import sort_by_expert
from moekit.ops.runtime import launch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter's bfloat16 dot is wrong (float32 there); the GPU's kernels in the layer's dtype.
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
needs_kernels = pytest.mark.skipif(
    launch.unavailable_reason(DEVICE, torch.float32) is not None, reason="moekit's Triton kernels cannot run here"
)


class PlanSpy:
    """What `plan_spy` saw: every launched tensor's specialization (dtype, 16-byte aligned), and every
    launch of a plan whose tensors differ from that plan's first launch: (kernel name, first, later)."""

    def __init__(self) -> None:
        self.launched: set[tuple] = set()
        self.mismatches: list[tuple] = []


@pytest.fixture
def plan_spy(monkeypatch):
    """Watches every `LaunchPlan` launch while the test runs (`PlanSpy`)."""
    spy = PlanSpy()
    first: dict[int, tuple] = {}
    call = launch.LaunchPlan.__call__

    def spied(plan, *tensors):
        keys = tuple(launch.arg_key(t) for t in tensors)
        spy.launched.update(keys)
        seen = first.setdefault(id(plan), (plan, keys))  # the plan held: its id is not reused meanwhile
        if seen[1] != keys:
            kernel = plan.launcher.kernel
            spy.mismatches.append((getattr(kernel, "fn", kernel).__name__, seen[1], keys))
        return call(plan, *tensors)

    monkeypatch.setattr(launch.LaunchPlan, "__call__", spied)
    return spy


def _view(shape: tuple[int, ...], misaligned: bool) -> torch.Tensor:
    """A contiguous DTYPE view of a fresh buffer, from its start or (misaligned) 4 bytes past it: a
    16-byte aligned address or not."""
    numel = 1
    for s in shape:
        numel *= s
    start = 4 // DTYPE.itemsize if misaligned else 0
    return torch.randn(numel + 8, device=DEVICE, dtype=DTYPE)[start : start + numel].view(shape)


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "fp8_block", "fp8_rowwise", "mxfp8"])
def test_moe_experts_plans_keep_their_alignment(plan_spy, quantization):
    """The layer's fused path (routing, row moves, fc1 + activation, fc2, their backward; quantized: the
    quantizations, FP8 GEMMs and wgrads) on aligned and 4-byte-offset views of every input, in turn: no
    plan is launched again with another alignment."""
    T, H, F, N, K = 6, 16, 8, 4, 2
    gen = torch.Generator().manual_seed(0)
    for misaligned in (False, True, False, True):
        x = _view((T, H), misaligned).requires_grad_()
        ids = torch.randint(0, N, (T, K), generator=gen).to(DEVICE)
        weights = _view((T, K), misaligned).abs().requires_grad_()
        w1 = _view((N, H, 2 * F), misaligned).transpose(1, 2).requires_grad_()  # gpt-oss's layout: a transposed view
        w2 = _view((N, F, H), misaligned).transpose(1, 2).requires_grad_()
        b1, b2 = _view((N, 2 * F), misaligned).requires_grad_(), _view((N, H), misaligned).requires_grad_()
        y = moe_experts(
            x,
            ids,
            weights,
            w1,
            w2,
            fc1_bias=b1,
            fc2_bias=b2,
            glu_interleave_size=1,
            backend="triton",
            quantization=quantization,
        )
        y.backward(_view((T, H), misaligned))
    # The plans saw the inputs both ways (so the check below is about something), and no plan both ways.
    assert {(DTYPE, True), (DTYPE, False)} <= plan_spy.launched
    assert plan_spy.mismatches == []


@needs_kernels
def test_routing_plan_is_per_index_dtype(plan_spy):
    """The Triton routing's plan key (`moekit.ops.runtime.routing.sort_by_expert`) must tell int64 maps
    from int32 ones: the scatter kernel stores into them, and a binary compiled for int64 maps that runs on
    int32 ones writes twice their bytes (and int32 stores leave int64 maps' high halves unwritten)."""
    ids = torch.randint(0, 5, (6, 2), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for index_dtype in (torch.int64, torch.int32, torch.int64):
        order = sort_by_expert(ids, 5, use_triton=True, index_dtype=index_dtype)
        assert order.row_map.dtype == index_dtype
    assert {(torch.int64, True), (torch.int32, True)} <= plan_spy.launched
    assert plan_spy.mismatches == []
