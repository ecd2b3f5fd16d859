"""float64 inputs: the ops compute in float64 (their elementwise math runs in promote_types(dtype,
float32): fp32 for low-precision inputs), so torch.autograd.gradcheck can verify them."""

from __future__ import annotations

import torch
from torch.autograd import gradcheck

import moekit


def _t(*shape, seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    t = (
        torch.rand(*shape, generator=g, dtype=torch.float64)
        if positive
        else torch.randn(*shape, generator=g, dtype=torch.float64)
    )
    return t.requires_grad_()


def test_gradcheck_grouped_linear_loop_without_bias():
    assert gradcheck(
        lambda x, w: moekit.grouped_linear(x, w, [1, 0, 3], backend="loop"), (_t(5, 3, seed=0), _t(3, 4, 3, seed=1))
    )


def test_gradcheck_permute():
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    assert gradcheck(lambda x: moekit.permute(x, ids, 3)[0], (_t(3, 4, seed=2),))


def test_gradcheck_grouped_linear_loop_with_bias():
    assert gradcheck(
        lambda x, w, b: moekit.grouped_linear(x, w, [1, 0, 3], b, backend="loop"),
        (_t(5, 3, seed=3), _t(3, 4, 3, seed=4), _t(3, 4, seed=5)),
    )


def test_gradcheck_swiglu():
    assert gradcheck(lambda h, p: moekit.glu(h, probs=p), (_t(4, 8, seed=6), _t(4, seed=7, positive=True)))


def test_gradcheck_unpermute():
    row_map = torch.tensor([[0, 2], [1, 3]])
    assert gradcheck(lambda y, w: moekit.unpermute(y, row_map, w), (_t(4, 3, seed=8), _t(2, 2, seed=9, positive=True)))
