"""One local expert (N = 1, an ordinary expert-parallel setting) in both weight layouts, on every
backend that runs here: outputs and every gradient against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import moekit
from helpers import check_against_reference, rand, torch_grouped_linear
from moekit.ops.runtime.backends import backend_named
from moekit.reference import grouped_linear_reference

RUNNABLE = [
    b
    for b in ("loop", "torch", "triton")
    if backend_named(b).unavailable_reason(torch.empty(1, 8), torch.empty(1, 8, 8)) is None
]


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("single_grouped_weight", [False, True], ids=["discrete", "single-grouped"])
@pytest.mark.parametrize("m_splits,rows", [([9], 9), ([6], 9)], ids=["all-rows", "padding-rows"])
def test_grouped_linear_one_expert(backend, single_grouped_weight, m_splits, rows):
    torch.manual_seed(0)
    layer = moekit.GroupedLinear(
        1,
        16,
        24,
        bias=True,
        single_grouped_weight=single_grouped_weight,
        single_grouped_bias=single_grouped_weight,
        backend=backend,
    )
    weight = [p.detach() for n, p in layer.named_parameters() if n.startswith("weight")]
    bias = [p.detach() for n, p in layer.named_parameters() if n.startswith("bias")]
    assert len(weight) == len(bias) == 1
    # The module's own parameter layout: one (1, O, I) tensor, or a list of one (O, I) tensor.
    inputs = {
        "x": rand(rows, 16, seed=1),
        "weight": weight[0] if single_grouped_weight else weight,
        "bias": bias[0] if single_grouped_weight else bias,
    }

    def ours(x, weight, bias):
        return moekit.grouped_linear(x, weight, m_splits, bias, backend=backend)

    out = check_against_reference(
        ours,
        lambda x, weight, bias: torch_grouped_linear(x, weight, m_splits, bias),
        lambda x, weight, bias: grouped_linear_reference(x, weight, m_splits, bias),
        inputs,
        torch.float32,
    )
    wname, bname = ("weight", "bias") if single_grouped_weight else ("weight[0]", "bias[0]")
    assert out[wname].shape == weight[0].shape and out[bname].shape == bias[0].shape
    assert torch.equal(out["out"][sum(m_splits) :], torch.zeros(rows - sum(m_splits), 24))
    # The module itself, as the issue reported it (forward and backward run, shapes kept).
    y = layer(rand(rows, 16, seed=2), m_splits)
    y.sum().backward()
    for p in layer.parameters():
        assert p.grad is not None and p.grad.shape == p.shape
