"""permute / unpermute: sorting routed token copies by expert and summing them back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moekit
from helpers import HYPOTHESIS, LOWP_DTYPES, assert_no_nan, check_against_reference, rand, rel_err
from moekit.reference import permute_reference, unpermute_reference


def _ids(dt):
    return str(dt).removeprefix("torch.")


def _expert_ids(tokens, top_k, num_experts, seed=0):
    """Top-k style ids: K distinct experts per token, random."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=gen)
    return scores.topk(top_k, dim=-1).indices


def test_by_hand(nan_poison):
    """3 tokens, top-2, 4 experts (expert 3 gets nothing); copies of a token to one expert keep token
    order (stable), and unpermute brings the copies back with their weights."""
    x = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    ids = torch.tensor([[1, 0], [0, 2], [1, 1]])
    x_sorted, m_splits, row_map = moekit.permute(x, ids, 4)
    # expert 0: copies (t0,k1), (t1,k0); expert 1: (t0,k0), (t2,k0), (t2,k1); expert 2: (t1,k1).
    assert x_sorted[:, 0].tolist() == [1.0, 2.0, 1.0, 3.0, 3.0, 2.0]
    assert m_splits.tolist() == [2, 3, 1, 0] and m_splits.dtype == torch.int64
    assert row_map.tolist() == [[2, 0], [1, 5], [3, 4]]
    y_sorted = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]])
    w = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.1, 0.2]])
    out = moekit.unpermute(y_sorted, row_map, w)
    # token 0: 0.5 * row 2 + 0.25 * row 0 = 1.5 + 0.25; token 1: row 1 + 2 * row 5; token 2: 0.1*4 + 0.2*5
    torch.testing.assert_close(out, torch.tensor([[1.75], [14.0], [1.4]]))
    torch.testing.assert_close(moekit.unpermute(y_sorted, row_map), torch.tensor([[4.0], [8.0], [9.0]]))


@pytest.mark.parametrize(
    "tokens, top_k, num_experts",
    [
        pytest.param(13, 2, 4, id="T13-K2-N4"),
        pytest.param(9, 4, 4, id="top_k=num_experts"),
        pytest.param(1, 2, 5, id="one-token"),
        pytest.param(20, 1, 7, id="top1-prime-N7"),
        pytest.param(6, 3, 16, id="more-experts-than-copies"),
    ],
)
def test_permute_matches_reference(tokens, top_k, num_experts, nan_poison):
    x = rand(tokens, 8, seed=1)
    ids = _expert_ids(tokens, top_k, num_experts, seed=2)
    x_sorted, m_splits, row_map = moekit.permute(x, ids, num_experts)
    ref_sorted, ref_splits, ref_map = permute_reference(x, ids, num_experts)
    assert torch.equal(x_sorted.double(), ref_sorted)
    assert torch.equal(m_splits, ref_splits)
    assert torch.equal(row_map, ref_map)
    assert int(m_splits.sum()) == tokens * top_k
    # Each sorted row is a copy of the token that routed it there, and rows are sorted by expert.
    for t in range(tokens):
        for k in range(top_k):
            assert torch.equal(x_sorted[row_map[t, k]], x[t])
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts), m_splits)
    assert torch.equal(expert_of_row[row_map], ids)


def _lowp_permute(ids):
    """torch's own permute: a stable argsort and a gather."""
    order = torch.sort(ids.reshape(-1), stable=True).indices
    return lambda x: x[order // ids.shape[1]]


@pytest.mark.parametrize("top_k, num_experts", [(2, 4), (4, 4)], ids=["K2-N4", "top_k=num_experts"])
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
def test_permute_gradient(dtype, top_k, num_experts, nan_poison):
    tokens = 11
    ids = _expert_ids(tokens, top_k, num_experts, seed=3)
    res = check_against_reference(
        lambda x: moekit.permute(x, ids, num_experts)[0],
        _lowp_permute(ids),
        lambda x: permute_reference(x, ids, num_experts)[0],
        {"x": rand(tokens, 8, seed=4)},
        dtype,
    )
    assert_no_nan(res["x"], "d x")


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
def test_unpermute_matches_reference(dtype, weighted, nan_poison):
    tokens, top_k, num_experts = 10, 3, 5
    ids = _expert_ids(tokens, top_k, num_experts, seed=5)
    _, _, row_map = moekit.permute(rand(tokens, 8, seed=6), ids, num_experts)
    inputs = {"y_sorted": rand(tokens * top_k, 8, seed=7)}
    if weighted:
        inputs["weights"] = rand(tokens, top_k, seed=8).abs()

    def lowp(y_sorted, weights=None):
        y = y_sorted[row_map]
        return (y if weights is None else y * weights[..., None]).sum(1)

    res = check_against_reference(
        lambda y_sorted, weights=None: moekit.unpermute(y_sorted, row_map, weights),
        lowp,
        lambda y_sorted, weights=None: unpermute_reference(y_sorted, row_map, weights),
        inputs,
        dtype,
    )
    assert_no_nan(res["y_sorted"], "d y_sorted")  # every sorted row written exactly once


def test_round_trip_with_normalised_weights():
    tokens, top_k, num_experts = 12, 2, 6
    x = rand(tokens, 8, seed=9)
    ids = _expert_ids(tokens, top_k, num_experts, seed=10)
    w = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(11))
    w = w / w.sum(-1, keepdim=True)
    x_sorted, _, row_map = moekit.permute(x, ids, num_experts)
    torch.testing.assert_close(moekit.unpermute(x_sorted, row_map, w), x, rtol=1e-6, atol=1e-6)
    assert torch.equal(moekit.unpermute(x_sorted, row_map), x * top_k)


def test_no_tokens():
    x = torch.zeros(0, 8, requires_grad=True)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    x_sorted, m_splits, row_map = moekit.permute(x, ids, 3)
    assert x_sorted.shape == (0, 8) and m_splits.tolist() == [0, 0, 0] and row_map.shape == (0, 2)
    out = moekit.unpermute(x_sorted, row_map)
    assert out.shape == (0, 8)


def test_gradients_are_deterministic():
    tokens, top_k, num_experts = 16, 4, 4
    ids = _expert_ids(tokens, top_k, num_experts, seed=12)
    grads = []
    for _ in range(2):
        x = rand(tokens, 8, seed=13).requires_grad_()
        w = rand(tokens, top_k, seed=14).requires_grad_()
        x_sorted, _, row_map = moekit.permute(x, ids, num_experts)
        out = moekit.unpermute(x_sorted * 3, row_map, w)
        out.backward(rand(tokens, 8, seed=15))
        grads.append((x.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@HYPOTHESIS
@given(data=st.data())
def test_permute_hypothesis(data):
    num_experts = data.draw(st.integers(1, 8), label="N")
    top_k = data.draw(st.integers(1, num_experts), label="K")
    tokens = data.draw(st.integers(0, 9), label="T")
    rows = [data.draw(st.permutations(range(num_experts)), label="experts")[:top_k] for _ in range(tokens)]
    ids = torch.tensor(rows, dtype=torch.int64).reshape(tokens, top_k)
    x = rand(tokens, 4, seed=16)
    x_sorted, m_splits, row_map = moekit.permute(x, ids, num_experts)
    ref_sorted, ref_splits, ref_map = permute_reference(x, ids, num_experts)
    assert torch.equal(x_sorted.double(), ref_sorted)
    assert torch.equal(m_splits, ref_splits) and torch.equal(row_map, ref_map)
    w = rand(tokens, top_k, seed=17)
    torch.testing.assert_close(
        moekit.unpermute(x_sorted, row_map, w).double(),
        unpermute_reference(ref_sorted, ref_map, w),
        rtol=1e-6,
        atol=1e-6,
    )


# On the GPU (pytest -m gpu): real sizes, bf16, no host sync, deterministic gradients.


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_permute_unpermute_on_gpu():
    """Qwen3-like routing (4096 tokens, top-8 of 128 experts, the last expert empty) in bf16 on CUDA:
    the sorted rows, counts and row map equal the CPU's bit for bit; unpermute's output and both
    gradients are within 1e-2 of float64 (one or two bf16 roundings, 2^-8 each, against the 1/K a
    lost or doubled copy would cost); forward+backward never syncs with the host; the gradients are
    bit-identical run to run."""
    tokens, top_k, num_experts, hidden = 4096, 8, 128, 512
    cuda = torch.device("cuda")
    ids = _expert_ids(tokens, top_k, num_experts - 1, seed=20)
    x = rand(tokens, hidden, seed=21).to(torch.bfloat16)
    w = rand(tokens, top_k, seed=22).abs().to(torch.bfloat16)
    d_out = rand(tokens, hidden, seed=23).to(torch.bfloat16)
    cpu_sorted, cpu_splits, cpu_map = moekit.permute(x, ids, num_experts)
    x_d, w_d, ids_d, d_out_d = (t.to(cuda) for t in (x, w, ids, d_out))

    def step():
        x_leaf, w_leaf = x_d.detach().requires_grad_(), w_d.detach().requires_grad_()
        x_sorted, m_splits, row_map = moekit.permute(x_leaf, ids_d, num_experts)
        out = moekit.unpermute(x_sorted * 2, row_map, w_leaf)
        out.backward(d_out_d)
        return x_sorted, m_splits, row_map, out, x_leaf.grad, w_leaf.grad

    x_sorted, m_splits, row_map, out, d_x, d_w = step()
    assert torch.equal(x_sorted.cpu(), cpu_sorted) and torch.equal(row_map.cpu(), cpu_map)
    assert torch.equal(m_splits.cpu(), cpu_splits) and int(m_splits[-1]) == 0
    x64, w64, d_out64 = x.double(), w.double(), d_out.double()
    ref = {
        "out": 2 * (w64[..., None] * x64[:, None, :]).sum(1),
        "d x": 2 * d_out64 * w64.sum(1, keepdim=True),
        "d w": 2 * (x64 * d_out64).sum(1, keepdim=True).expand(-1, top_k),
    }
    for name, got in zip(ref, (out, d_x, d_w), strict=True):
        assert_no_nan(got, name)
        err = rel_err(got.cpu(), ref[name])
        assert err < 1e-2, f"{name}: relative error {err:.2e} against float64"

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(again[4], d_x) and torch.equal(again[5], d_w), "gradients differ between two identical runs"
