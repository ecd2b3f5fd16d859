"""grouped_mlp (functional) and GroupedMLP (module): references, probs semantics, layouts, interleave."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moekit
from helpers import (
    BACKENDS,
    BF16,
    CUDA,
    GPU_BACKENDS,
    GPU_F,
    GPU_H,
    GPU_M,
    GPU_N,
    GPU_SPLITS,
    HYPOTHESIS,
    LOWP_DTYPES,
    SPLIT_CASES,
    SPLIT_KINDS,
    assert_no_host_sync,
    assert_no_nan,
    assert_padding_and_empty_experts,
    check_against_reference,
    nan_like,
    on_device,
    rand,
    rel_err,
    require_backend,
    splits_as,
    torch_grouped_mlp,
)
from moekit.ops.activations import ACTIVATIONS
from moekit.ops.splits import device_offsets
from moekit.reference import grouped_mlp_reference

H, F = 16, 16  # 2F = 32: torch's CPU grouped_mm runs every GEMM of the MLP in fp32 and bf16


def _ids(dt):
    return str(dt).removeprefix("torch.")


def _inputs(n, rows, *, probs=False, bias=False, seed=0):
    d = {
        "x": rand(rows, H, seed=seed),
        "fc1_weight": rand(n, 2 * F, H, scale=H**-0.5, seed=seed + 1),
        "fc2_weight": rand(n, H, F, scale=F**-0.5, seed=seed + 2),
    }
    if probs:
        d["probs"] = rand(rows, seed=seed + 3).abs()
    if bias:
        d["fc1_bias"] = rand(n, 2 * F, seed=seed + 4)
        d["fc2_bias"] = rand(n, H, seed=seed + 5)
    return d


def _fns(m_splits, backend, **kw):
    def ours(x, fc1_weight, fc2_weight, **opt):
        return moekit.grouped_mlp(x, fc1_weight, fc2_weight, m_splits, backend=backend, **kw, **opt)

    def lowp(x, fc1_weight, fc2_weight, **opt):
        return torch_grouped_mlp(x, fc1_weight, fc2_weight, m_splits, **kw, **opt)

    def ref(x, fc1_weight, fc2_weight, **opt):
        return grouped_mlp_reference(x, fc1_weight, fc2_weight, m_splits, **kw, **opt)

    return ours, lowp, ref


@pytest.mark.parametrize("m_splits, rows", SPLIT_CASES)
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "probs+bias"])
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, extras, m_splits, rows, nan_poison):
    n = len(m_splits)
    res = check_against_reference(*_fns(m_splits, backend), _inputs(n, rows, probs=extras, bias=extras, seed=1), dtype)
    for name, t in res.items():
        assert_no_nan(t, name)
    used = sum(m_splits)
    assert torch.equal(res["out"][used:], torch.zeros(rows - used, H, dtype=dtype))
    assert torch.equal(res["x"][used:], torch.zeros(rows - used, H, dtype=dtype))
    if extras:
        assert torch.equal(res["probs"][used:], torch.zeros(rows - used, dtype=dtype))
    for g, count in enumerate(m_splits):
        names = ["fc1_weight", "fc2_weight"] + (["fc1_bias", "fc2_bias"] if extras else [])
        for name in names:
            assert (torch.count_nonzero(res[name][g]) == 0) == (count == 0), f"{name}[{g}]"


@pytest.mark.parametrize("k", [None, 1, 2, F], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_activations_and_interleave_match_reference(backend, dtype, activation, k):
    m_splits, rows = [4, 0, 6, 3], 15
    inputs = _inputs(4, rows, probs=True, bias=True, seed=10)
    inputs["x"] = inputs["x"] * 6  # pre-activations past clamped_swiglu's limit 7 in places
    check_against_reference(*_fns(m_splits, backend, activation=activation, glu_interleave_size=k), inputs, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_is_independent_float64(activation):
    m_splits, rows = [3, 0, 4, 2], 11
    d = {k: v.double() for k, v in _inputs(4, rows, probs=True, bias=True, seed=20).items()}
    for k in (None, 2):
        torch.testing.assert_close(
            grouped_mlp_reference(
                d["x"],
                d["fc1_weight"],
                d["fc2_weight"],
                m_splits,
                probs=d["probs"],
                fc1_bias=d["fc1_bias"],
                fc2_bias=d["fc2_bias"],
                activation=activation,
                glu_interleave_size=k,
            ),
            torch_grouped_mlp(
                d["x"],
                d["fc1_weight"],
                d["fc2_weight"],
                m_splits,
                probs=d["probs"],
                fc1_bias=d["fc1_bias"],
                fc2_bias=d["fc2_bias"],
                activation=activation,
                glu_interleave_size=k,
            ),
            rtol=1e-13,
            atol=1e-13,
        )


@pytest.mark.parametrize("backend", ["loop", "auto"])
def test_probs_semantics_by_hand(backend):
    """y = fc2(act(fc1(x)) * p) + b2 * p, and d probs, on numbers small enough to do by hand.

    H = F = 1, two experts, one row each. Expert 0: fc1 rows (gate, up) = (ln 3, 2), b1 = 0, so for
    x = 1: g = ln 3, u = 2, silu(ln 3) = 3/4 ln 3, act = 3/2 ln 3. fc2 = 4, b2 = 10, p = 1/2:
        y = 4 * (3/2 ln 3) * 1/2 + 10 * 1/2 = 3 ln 3 + 5;  dy/dp = 4 * 3/2 ln 3 + 10 = 6 ln 3 + 10.
    Expert 1: fc1 = (0, 5), b1 = (0, 1), fc2 = 3, b2 = -2, p = 1/4, x = 2: g = 0 so act = 0 and
        y = b2 * p = -1/2;  dy/dp = 3 * 0 + b2 = -2;  dy/db2 = p = 1/4; dy/dW2 = act * p = 0.
    """
    ln3 = math.log(3.0)
    x = torch.tensor([[1.0], [2.0]], requires_grad=True)
    w1 = torch.tensor([[[ln3], [2.0]], [[0.0], [5.0]]], requires_grad=True)  # (N=2, 2F=2, H=1)
    b1 = torch.tensor([[0.0, 0.0], [0.0, 1.0]], requires_grad=True)
    w2 = torch.tensor([[[4.0]], [[3.0]]], requires_grad=True)  # (N=2, H=1, F=1)
    b2 = torch.tensor([[10.0], [-2.0]], requires_grad=True)
    p = torch.tensor([0.5, 0.25], requires_grad=True)
    y = moekit.grouped_mlp(x, w1, w2, [1, 1], probs=p, fc1_bias=b1, fc2_bias=b2, backend=backend)
    torch.testing.assert_close(y, torch.tensor([[3 * ln3 + 5], [-0.5]]), rtol=1e-6, atol=1e-6)
    y.sum().backward()
    torch.testing.assert_close(p.grad, torch.tensor([6 * ln3 + 10, -2.0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b2.grad, torch.tensor([[0.5], [0.25]]))
    torch.testing.assert_close(w2.grad, torch.tensor([[[0.75 * ln3]], [[0.0]]]), rtol=1e-6, atol=1e-6)
    # d b1 = (d gate, d up) per expert, with d act = p * fc2 and silu'(g) = s (1 + g (1 - s)), s = sigmoid(g):
    # expert 0: d up = silu(ln 3) * 1/2 * 4, d gate = u * silu'(ln 3) * 1/2 * 4 (s = 3/4, u = 2);
    # expert 1: u = 5 * 2 + 1 = 11, d gate = u * silu'(0) * 1/4 * 3 (silu'(0) = 1/2), d up = silu(0) ... = 0.
    d_up0 = 0.75 * ln3 * 0.5 * 4.0
    s = 0.75
    d_gate0 = 2.0 * s * (1 + ln3 * (1 - s)) * 0.5 * 4.0
    u1 = 5.0 * 2.0 + 1.0
    d_gate1 = u1 * 0.5 * 0.25 * 3.0
    torch.testing.assert_close(b1.grad, torch.tensor([[d_gate0, d_up0], [d_gate1, 0.0]]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        x.grad, torch.tensor([[d_gate0 * ln3 + d_up0 * 2.0], [d_gate1 * 0.0 + 0.0]]), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("backend", BACKENDS)
@HYPOTHESIS
@given(data=st.data())
def test_random_splits_hypothesis(backend, data):
    n = data.draw(st.integers(1, 6), label="N")
    m_splits = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n), label="m_splits")
    rows = sum(m_splits) + data.draw(st.integers(0, 2), label="padding")
    dtype = data.draw(st.sampled_from(LOWP_DTYPES), label="dtype")
    extras = data.draw(st.booleans(), label="probs+bias")
    check_against_reference(*_fns(m_splits, backend), _inputs(n, rows, probs=extras, bias=extras, seed=30), dtype)


# --------------------------------------------------------------------------------------------------
# GroupedMLP module
# --------------------------------------------------------------------------------------------------


def _mlp(n, *, single, bias, k=None, activation="swiglu", backend="auto", dtype=torch.float32, seed=0):
    """A GroupedMLP whose weights are set from standard-order tensors (interleaved when k is set)."""
    m = moekit.GroupedMLP(
        n,
        H,
        F,
        bias=bias,
        activation=activation,
        glu_interleave_size=k,
        single_grouped_weight=single,
        backend=backend,
        dtype=dtype,
    )
    d = _inputs(n, 1, bias=True, seed=seed)
    w1, b1 = d["fc1_weight"].to(dtype), d["fc1_bias"].to(dtype)
    if k is not None:
        w1, b1 = moekit.interleave_glu(w1, k, dim=1), moekit.interleave_glu(b1, k, dim=1)
    _set(m.fc1, w1, b1 if bias else None)
    _set(m.fc2, d["fc2_weight"].to(dtype), d["fc2_bias"].to(dtype) if bias else None)
    return m


@torch.no_grad()
def _set(lin, w, b):
    if lin.single_grouped_weight:
        lin.weight.copy_(w)
    else:
        for i in range(lin.num_gemms):
            getattr(lin, f"weight{i}").copy_(w[i])
    if b is not None:
        if lin.single_grouped_bias:
            lin.bias.copy_(b)
        else:
            for i in range(lin.num_gemms):
                getattr(lin, f"bias{i}").copy_(b[i])


def _stacked_grads(lin):
    gw = (
        lin.weight.grad
        if lin.single_grouped_weight
        else torch.stack([getattr(lin, f"weight{i}").grad for i in range(lin.num_gemms)])
    )
    gb = None
    if lin.use_bias:
        gb = (
            lin.bias.grad
            if lin.single_grouped_bias
            else torch.stack([getattr(lin, f"bias{i}").grad for i in range(lin.num_gemms)])
        )
    return gw, gb


def _run(m, x, m_splits, probs, dy):
    x = x.clone().requires_grad_()
    p = probs.clone().requires_grad_() if probs is not None else None
    y = m(x, m_splits, probs=p)
    y.backward(dy)
    return y.detach(), x.grad, (p.grad if p is not None else None)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_module_layouts_identical(backend, dtype, bias):
    n, m_splits, rows = 5, [0, 4, 0, 3, 0], 9
    x, dy = rand(rows, H, dtype=dtype, seed=40), rand(rows, H, dtype=dtype, seed=41)
    probs = rand(rows, seed=42).abs()
    outs = []
    for single in (True, False):
        m = _mlp(n, single=single, bias=bias, backend=backend, dtype=dtype)
        y, dx, dp = _run(m, x, m_splits, probs, dy)
        for name, prm in m.named_parameters():
            assert prm.grad is not None, f"{name} got no gradient (single={single})"
            assert prm.grad.shape == prm.shape
        if single:
            assert m.fc1.weight.grad.shape == (n, 2 * F, H) and m.fc2.weight.grad.shape == (n, H, F)
        grads = [*_stacked_grads(m.fc1), *_stacked_grads(m.fc2)]
        for g in grads:
            if g is not None:
                for e in (0, 2, 4):
                    assert torch.count_nonzero(g[e]) == 0
                assert torch.count_nonzero(g[1]) > 0
        outs.append([y, dx, dp, *grads])
    d = _inputs(n, 1, bias=True, seed=0)
    ref = grouped_mlp_reference(
        x,
        d["fc1_weight"].to(dtype),
        d["fc2_weight"].to(dtype),
        m_splits,
        probs=probs,
        fc1_bias=d["fc1_bias"].to(dtype) if bias else None,
        fc2_bias=d["fc2_bias"].to(dtype) if bias else None,
    )
    assert rel_err(outs[0][0], ref) < (1e-6 if dtype == torch.float32 else 2e-2)
    for a, b in zip(outs[0], outs[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("k", [1, 2, 4, F], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("single", [True, False], ids=["single", "discrete"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_interleaved_module_equivalent(backend, single, k):
    """GroupedMLP(k) with interleave_glu(w, k) weights == the standard one; its fc1 gradients are the
    interleaved gradients of the standard module, the rest are the same."""
    n, m_splits, rows = 3, [4, 0, 5], 10
    x, dy, probs = rand(rows, H, seed=50), rand(rows, H, seed=51), rand(rows, seed=52).abs()
    std = _mlp(n, single=single, bias=True, backend=backend)
    inter = _mlp(n, single=single, bias=True, k=k, backend=backend)
    y_s, dx_s, dp_s = _run(std, x, m_splits, probs, dy)
    y_i, dx_i, dp_i = _run(inter, x, m_splits, probs, dy)
    tight = {"rtol": 4e-6, "atol": 1e-6}
    torch.testing.assert_close(y_i, y_s, **tight)
    torch.testing.assert_close(dx_i, dx_s, **tight)
    torch.testing.assert_close(dp_i, dp_s, **tight)
    w1_s, b1_s = _stacked_grads(std.fc1)
    w1_i, b1_i = _stacked_grads(inter.fc1)
    torch.testing.assert_close(w1_i, moekit.interleave_glu(w1_s, k, dim=1), **tight)
    torch.testing.assert_close(b1_i, moekit.interleave_glu(b1_s, k, dim=1), **tight)
    for a, b in zip(_stacked_grads(inter.fc2), _stacked_grads(std.fc2), strict=True):
        torch.testing.assert_close(a, b, **tight)
    if k != F:  # a module told the wrong order really gives something else
        wrong = _mlp(n, single=single, bias=True, backend=backend)
        _set(
            wrong.fc1,
            *(moekit.interleave_glu(t, k, dim=1) for t in (_param(wrong.fc1, "weight"), _param(wrong.fc1, "bias"))),
        )
        assert rel_err(wrong(x, m_splits, probs=probs), y_s) > 1e-2


def _param(lin, name):
    if getattr(lin, f"single_grouped_{name}"):
        return getattr(lin, name).detach().clone()
    return torch.stack([getattr(lin, f"{name}{i}").detach().clone() for i in range(lin.num_gemms)])


def test_module_structure_and_state():
    m = moekit.GroupedMLP(4, H, F, bias=True, glu_interleave_size=2)
    assert m.fc1.weight.shape == (4, 2 * F, H) and m.fc2.weight.shape == (4, H, F)
    assert m.fc1.bias.shape == (4, 2 * F) and m.fc2.bias.shape == (4, H)
    sd = m.state_dict()
    assert sd["fc1._extra_state"]["glu_interleave_size"] == 2 and sd["fc1._extra_state"]["glu"] is True
    assert sd["fc2._extra_state"]["glu"] is False
    d = moekit.GroupedMLP(4, H, F, single_grouped_weight=False)
    names = {n for n, _ in d.named_parameters()}
    assert names == {f"fc{j}.weight{i}" for j in (1, 2) for i in range(4)}


def test_module_odd_dims_auto():
    """H = 97, F = 7 (odd, prime): auto runs them and matches the reference."""
    m = moekit.GroupedMLP(3, 97, 7, bias=True)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(rand(*p.shape, seed=p.numel()) * 0.1)
    x = rand(9, 97, seed=60)
    y = m(x, [4, 0, 3])
    ref = grouped_mlp_reference(x, m.fc1.weight, m.fc2.weight, [4, 0, 3], fc1_bias=m.fc1.bias, fc2_bias=m.fc2.bias)
    assert rel_err(y, ref) < 1e-6
    assert torch.equal(y[7:], torch.zeros(2, 97))
    with pytest.raises(ValueError, match="backend='torch' cannot run here"):
        moekit.GroupedMLP(3, 97, 7, backend="torch")(x, [4, 0, 3])


@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_padding_rows_and_split_forms(backend, kind):
    """NaN in the padding rows of x stays out of every result; every host form of m_splits agrees."""
    m_splits, rows, used = [3, 0, 4, 1], 11, 8
    m = _mlp(4, single=True, bias=True, backend=backend)
    x = torch.cat([rand(used, H, seed=70), nan_like(torch.zeros(rows - used, H))])
    probs = rand(rows, seed=71).abs()
    y, dx, dp = _run(m, x, splits_as(kind, m_splits), probs, rand(rows, H, seed=72))
    for name, t in [("y", y), ("dx", dx), ("dprobs", dp)] + [(n, p.grad) for n, p in m.named_parameters()]:
        assert_no_nan(t, name)
    assert torch.equal(y[used:], torch.zeros(rows - used, H)) and torch.equal(dx[used:], torch.zeros(rows - used, H))
    assert torch.equal(dp[used:], torch.zeros(rows - used))
    y_list, _, _ = _run(_mlp(4, single=True, bias=True, backend=backend), x, m_splits, probs, rand(rows, H, seed=72))
    assert torch.equal(y, y_list)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_offsets_path(backend, nan_poison):
    """Offsets the host does not know (what device m_splits become on CUDA) give the host path's results,
    padding rows included."""
    m_splits, rows = [3, 0, 4, 1], 10
    go = device_offsets(torch.tensor(m_splits), 4, rows, torch.device("cpu"))
    assert go.host is None
    d = _inputs(4, rows, probs=True, bias=True, seed=80)
    dy = rand(rows, H, seed=81)
    outs = []
    for splits in (go, m_splits):
        leaves = {k: v.clone().requires_grad_() for k, v in d.items()}
        y = moekit.grouped_mlp(
            leaves.pop("x"), leaves.pop("fc1_weight"), leaves.pop("fc2_weight"), splits, backend=backend, **leaves
        )
        y.backward(dy)
        outs.append([y.detach()] + [v.grad for v in leaves.values()])
    for a, b in zip(*outs, strict=True):
        assert_no_nan(a, "result")
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(outs[0][0][8:], torch.zeros(2, H))


# --------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu): bf16 results and gradients against float64 at real-ish sizes (buffers
# that moekit allocates from Python start as NaN: nan_poison); the fused triton path (fc1 + activation
# epilogue, fc2 dgrad + activation backward): every activation and GLU layout in bf16, bit-identical
# gradients, no host sync, graph replay
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m_splits", GPU_SPLITS)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_grouped_mlp_bf16_matches_float64(backend, m_splits, nan_poison, device=CUDA):
    require_backend(backend, GPU_H, 2 * GPU_F, device)
    require_backend(backend, GPU_F, GPU_H, device)
    splits_dev = torch.tensor(m_splits, device=device)
    inputs = {
        "x": rand(GPU_M, GPU_H, seed=11),
        "fc1_weight": rand(GPU_N, 2 * GPU_F, GPU_H, scale=GPU_H**-0.5, seed=12),
        "fc2_weight": rand(GPU_N, GPU_H, GPU_F, scale=GPU_F**-0.5, seed=13),
        "fc1_bias": rand(GPU_N, 2 * GPU_F, scale=0.1, seed=14),
        "fc2_bias": rand(GPU_N, GPU_H, scale=0.1, seed=15),
        "probs": rand(GPU_M, seed=16).sigmoid(),
    }
    res = check_against_reference(
        on_device(functools.partial(moekit.grouped_mlp, m_splits=splits_dev, backend=backend), device),
        functools.partial(torch_grouped_mlp, m_splits=m_splits),
        on_device(functools.partial(grouped_mlp_reference, m_splits=m_splits), device),
        inputs,
        BF16,
    )
    assert_padding_and_empty_experts(res, m_splits, weight_keys=("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("interleave", [None, 1, 4, 256], ids=["gate|up", "k1", "k4", "k256"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_grouped_mlp_triton_fused_layouts_bf16(activation, interleave, nan_poison):
    require_backend("triton", GPU_H, 2 * GPU_F)
    m_splits = [0, 700, 512, 0, 900, 333, 1100, 0]
    splits_dev = torch.tensor(m_splits, device=CUDA)
    inputs = {
        "x": rand(GPU_M, GPU_H, seed=21, scale=3.0),  # many pre-activations past clamped_swiglu's limit
        "fc1_weight": rand(GPU_N, 2 * GPU_F, GPU_H, scale=GPU_H**-0.5, seed=22),
        "fc2_weight": rand(GPU_N, GPU_H, GPU_F, scale=GPU_F**-0.5, seed=23),
        "fc1_bias": rand(GPU_N, 2 * GPU_F, scale=0.1, seed=24),
        "fc2_bias": rand(GPU_N, GPU_H, scale=0.1, seed=25),
        "probs": rand(GPU_M, seed=26).sigmoid(),
    }
    kw = {"activation": activation, "glu_interleave_size": interleave}
    res = check_against_reference(
        on_device(functools.partial(moekit.grouped_mlp, m_splits=splits_dev, backend="triton", **kw), CUDA),
        functools.partial(torch_grouped_mlp, m_splits=m_splits, **kw),
        on_device(functools.partial(grouped_mlp_reference, m_splits=m_splits, **kw), CUDA),
        inputs,
        BF16,
    )
    assert_padding_and_empty_experts(res, m_splits, weight_keys=("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"))
    assert torch.count_nonzero(res["probs"][sum(m_splits) :]) == 0, "padding rows of d probs are not zero"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_mlp_triton_graph_replay_no_sync_bit_identical():
    require_backend("triton", GPU_H, 2 * GPU_F)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    leaves = {
        "x": torch.randn(GPU_M, GPU_H, device=CUDA, dtype=BF16, generator=gen),
        "fc1_weight": (torch.randn(GPU_N, 2 * GPU_F, GPU_H, device=CUDA, generator=gen) * GPU_H**-0.5).to(BF16),
        "fc2_weight": (torch.randn(GPU_N, GPU_H, GPU_F, device=CUDA, generator=gen) * GPU_F**-0.5).to(BF16),
        "probs": torch.rand(GPU_M, device=CUDA, generator=gen),
    }
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    dy = torch.randn(GPU_M, GPU_H, device=CUDA, dtype=BF16, generator=gen)
    static_splits = torch.tensor([512] * GPU_N, device=CUDA)

    def step():
        for t in leaves.values():
            t.grad = None
        y = moekit.grouped_mlp(
            leaves["x"],
            leaves["fc1_weight"],
            leaves["fc2_weight"],
            static_splits,
            probs=leaves["probs"],
            backend="triton",
        )
        y.backward(dy)
        return {"out": y.detach(), **{k: t.grad for k, t in leaves.items()}}

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        first, second = step(), step()
    torch.cuda.current_stream().wait_stream(side)
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, f"results differ between two identical steps: {differ}"
    assert_no_host_sync(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for case, splits in {
        "skewed+padding": [0, 1000, 24, 0, 500, 300, 0, 24] + [0] * (GPU_N - 8),
        "all-on-one": [0, 0, 0, GPU_M, 0, 0, 0, 0],
    }.items():
        static_splits.copy_(torch.tensor(splits))
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: t.clone() for k, t in static.items()}
        eager = step()
        for k in replayed:
            assert torch.equal(replayed[k], eager[k]), f"{case}: replayed {k} differs from eager"
        assert torch.count_nonzero(replayed["out"][sum(splits) :]) == 0
