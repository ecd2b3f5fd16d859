"""The `triton` backend through the public ops and modules, under the Triton interpreter on CPU
(float32 operands: the 3.6 interpreter computes bf16 tl.dot wrongly). Outputs and every gradient
against the float64 references, on the edge cases of the contract, with host and device-style
offsets."""

from __future__ import annotations

import pytest
import torch

import moekit
from helpers import check_against_reference, rand, torch_grouped_linear, torch_grouped_mlp
from moekit._splits import _device_splits
from moekit.reference import grouped_linear_reference, grouped_mlp_reference

pytestmark = pytest.mark.skipif(
    moekit.ops.grouped_linear._BACKENDS["triton"].unavailable_reason(torch.empty(1, 8), torch.empty(1, 8, 8))
    is not None, reason="triton backend cannot run here (needs CUDA or TRITON_INTERPRET=1)")

SPLITS = {
    "empty-first": ([0, 7, 5], 12),
    "empty-middle": ([6, 0, 5], 11),
    "empty-last-and-padding": ([4, 9, 0], 16),
    "all-on-one": ([0, 13, 0], 13),
    "one-row": ([0, 1, 0], 1),
}


@pytest.mark.parametrize("case", list(SPLITS), ids=list(SPLITS))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_grouped_linear_triton_matches_reference(case, with_bias):
    m_splits, rows = SPLITS[case]
    inputs = {"x": rand(rows, 24, seed=1), "weight": rand(3, 20, 24, seed=2)}
    if with_bias:
        inputs["bias"] = rand(3, 20, seed=3)

    def ours(x, weight, bias=None):
        return moekit.grouped_linear(x, weight, m_splits, bias, backend="triton")

    out = check_against_reference(
        ours,
        lambda x, weight, bias=None: torch_grouped_linear(x, weight, m_splits, bias),
        lambda x, weight, bias=None: grouped_linear_reference(x, weight, m_splits, bias),
        inputs, torch.float32,
    )
    used = sum(m_splits)
    assert torch.equal(out["out"][used:], torch.zeros(rows - used, 20))
    assert torch.equal(out["x"][used:], torch.zeros(rows - used, 24))


def test_grouped_mlp_triton_device_offsets_and_discrete_weights():
    """GroupedMLP with per-expert weights, probs and biases, offsets as the device path builds them."""
    m_splits, rows = [5, 0, 6], 13
    torch.manual_seed(0)
    mlp = moekit.GroupedMLP(3, 16, 12, bias=True, single_grouped_weight=False, backend="triton",
                            glu_interleave_size=4)
    offsets = _device_splits(torch.tensor(m_splits), 3, rows, torch.device("cpu"))
    x = rand(rows, 16, seed=4).requires_grad_()
    probs = rand(rows, seed=5).abs().requires_grad_()
    y = mlp(x, offsets, probs=probs)
    dy = rand(rows, 16, seed=6)
    y.backward(dy)

    params = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters()}
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    stack = lambda fc, kind: [params[f"{fc}.{kind}{i}"] for i in range(3)]  # noqa: E731
    y64 = grouped_mlp_reference(x64, stack("fc1", "weight"), stack("fc2", "weight"), m_splits, probs=p64,
                                fc1_bias=stack("fc1", "bias"), fc2_bias=stack("fc2", "bias"), glu_interleave_size=4)
    y64.backward(dy.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    assert rel(y, y64) < 1e-5
    assert rel(x.grad, x64.grad) < 1e-5 and rel(probs.grad, p64.grad) < 1e-5
    for name, p in mlp.named_parameters():
        assert rel(p.grad, params[name].grad) < 1e-5, name
    # fp32 torch-ops twin, as a sanity check of the reference itself
    twin = torch_grouped_mlp(x.detach().double(), stack("fc1", "weight"), stack("fc2", "weight"), m_splits,
                             probs=probs.detach().double(), fc1_bias=stack("fc1", "bias"),
                             fc2_bias=stack("fc2", "bias"), glu_interleave_size=4)
    assert rel(twin, y64.detach()) < 1e-12
