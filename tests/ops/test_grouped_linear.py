"""grouped_linear (functional) and GroupedLinear (module) on CPU, backends loop and torch."""

from __future__ import annotations

import copy
import warnings

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
    capture_cuda_graph,
    check_against_reference,
    nan_like,
    on_device,
    rand,
    rel_err,
    require_backend,
    splits_as,
    torch_grouped_linear,
)
from moekit.ops.grouped_linear import packed_view, release_consumed_gradient
from moekit.ops.runtime.backends import select_backend
from moekit.ops.splits import device_offsets
from moekit.reference import grouped_linear_reference

IN, OUT = 16, 32  # multiples of 8: torch's CPU grouped_mm runs them in fp32 and bf16


def _ids(dt):
    return str(dt).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------
# Functional op against the float64 reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m_splits, rows", SPLIT_CASES)
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, m_splits, rows, nan_poison):
    n = len(m_splits)
    inputs = {"x": rand(rows, IN, seed=1), "weight": rand(n, OUT, IN, seed=2), "bias": rand(n, OUT, seed=3)}
    res = check_against_reference(
        lambda x, weight, bias: moekit.grouped_linear(x, weight, m_splits, bias, backend=backend),
        lambda x, weight, bias: torch_grouped_linear(x, weight, m_splits, bias),
        lambda x, weight, bias: grouped_linear_reference(x, weight, m_splits, bias),
        inputs,
        dtype,
    )
    for name in ("out", "x", "weight", "bias"):
        assert_no_nan(res[name], name)
    used = sum(m_splits)
    # Padding rows: zero output and zero gradient, exactly (the upstream gradient there is not zero).
    assert torch.equal(res["out"][used:], torch.zeros(rows - used, OUT, dtype=dtype))
    assert torch.equal(res["x"][used:], torch.zeros(rows - used, IN, dtype=dtype))
    # Experts with no rows: exactly zero weight and bias gradients.
    for g, count in enumerate(m_splits):
        if count == 0:
            assert torch.count_nonzero(res["weight"][g]) == 0
            assert torch.count_nonzero(res["bias"][g]) == 0
        else:
            assert torch.count_nonzero(res["weight"][g]) > 0


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_scale_matches_reference(backend, dtype):
    m_splits, rows = [4, 0, 7, 3], 16
    inputs = {
        "x": rand(rows, IN, seed=4),
        "weight": rand(4, OUT, IN, seed=5),
        "bias": rand(4, OUT, seed=6),
        "bias_scale": rand(rows, seed=7).abs(),
    }
    check_against_reference(
        lambda x, weight, bias, bias_scale: moekit.grouped_linear(
            x, weight, m_splits, bias, backend=backend, bias_scale=bias_scale
        ),
        lambda x, weight, bias, bias_scale: torch_grouped_linear(x, weight, m_splits, bias, bias_scale=bias_scale),
        lambda x, weight, bias, bias_scale: grouped_linear_reference(x, weight, m_splits, bias, bias_scale=bias_scale),
        inputs,
        dtype,
    )


@pytest.mark.filterwarnings("ignore:moekit. the 4 per-expert")
@pytest.mark.parametrize("backend", BACKENDS)
def test_list_weights_match_reference(backend):
    """Weights and biases as N separate tensors (not one buffer) still work, each gets its gradient."""
    m_splits, rows = [0, 6, 0, 5], 13
    inputs = {
        "x": rand(rows, IN, seed=8),
        "weight": list(rand(4, OUT, IN, seed=9)),
        "bias": list(rand(4, OUT, seed=10)),
    }
    res = check_against_reference(
        lambda x, weight, bias: moekit.grouped_linear(x, weight, m_splits, bias, backend=backend),
        lambda x, weight, bias: torch_grouped_linear(x, weight, m_splits, bias),
        lambda x, weight, bias: grouped_linear_reference(x, weight, m_splits, bias),
        inputs,
        torch.float32,
    )
    assert torch.count_nonzero(res["weight[0]"]) == 0 and torch.count_nonzero(res["bias[2]"]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_bias(backend):
    m_splits = [3, 0, 2]
    x, w = rand(6, IN, seed=11), rand(3, OUT, IN, seed=12)
    y = moekit.grouped_linear(x, w, m_splits, backend=backend)
    ref = grouped_linear_reference(x, w, m_splits)
    assert rel_err(y, ref) < 1e-6
    assert torch.equal(y[5:], torch.zeros(1, OUT))


@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_m_splits_forms_agree(backend, kind):
    m_splits, rows = [2, 0, 5, 1], 9
    x, w, b = rand(rows, IN, seed=13), rand(4, OUT, IN, seed=14), rand(4, OUT, seed=15)
    expected = moekit.grouped_linear(x, w, m_splits, b, backend=backend)
    got = moekit.grouped_linear(x, w, splits_as(kind, m_splits), b, backend=backend)
    assert torch.equal(got, expected)
    assert rel_err(got, grouped_linear_reference(x, w, m_splits, b)) < 1e-6


@pytest.mark.parametrize(
    "m_splits, rows",
    [
        pytest.param([2, 0, 5, 1], 8, id="exact"),
        pytest.param([2, 0, 5, 1], 11, id="padding-rows"),
        pytest.param([0, 0, 0, 0], 3, id="nothing-routed"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_device_offsets_path(backend, m_splits, rows, nan_poison):
    """Offsets the host does not know (what device m_splits become) give the host path's results;
    the torch backend then zeroes padding rows without reading the offsets on the host."""
    go = device_offsets(torch.tensor(m_splits, dtype=torch.int32), 4, rows, torch.device("cpu"))
    assert go.host is None
    x = rand(rows, IN, seed=16).requires_grad_()
    w, b = rand(4, OUT, IN, seed=17).requires_grad_(), rand(4, OUT, seed=18).requires_grad_()
    dy = rand(rows, OUT, seed=19)
    y_dev = moekit.grouped_linear(x, w, go, b, backend=backend)
    grads_dev = torch.autograd.grad(y_dev, (x, w, b), dy)
    y_host = moekit.grouped_linear(x, w, m_splits, b, backend=backend)
    grads_host = torch.autograd.grad(y_host, (x, w, b), dy)
    torch.testing.assert_close(y_dev, y_host, rtol=1e-6, atol=1e-6)
    for a, h in zip(grads_dev, grads_host, strict=True):
        assert_no_nan(a, "gradient")
        torch.testing.assert_close(a, h, rtol=1e-6, atol=1e-6)
    used = sum(m_splits)
    assert torch.equal(y_dev[used:], torch.zeros(rows - used, OUT))
    assert torch.equal(grads_dev[0][used:], torch.zeros(rows - used, IN))


@pytest.mark.parametrize(
    "in_f, out_f",
    [
        pytest.param(97, 97, id="97x97"),
        pytest.param(97, 32, id="in97"),
        pytest.param(32, 97, id="out97"),
        pytest.param(2880, 96, id="in2880"),  # gpt-oss's hidden size
        pytest.param(96, 2880, id="out2880"),
    ],
)
def test_odd_dims(in_f, out_f):
    """auto runs whatever the dims; torch is refused (ValueError saying why) where grouped_mm cannot."""
    m_splits, rows = [3, 0, 2], 6
    x, w, b = rand(rows, in_f, seed=20), rand(3, out_f, in_f, seed=21), rand(3, out_f, seed=22)
    torch_ok = in_f % 4 == 0 and out_f % 4 == 0
    backends = ["auto", "loop"] + (["torch"] if torch_ok else [])
    for backend in backends:
        res = check_against_reference(
            lambda x, weight, bias, backend=backend: moekit.grouped_linear(x, weight, m_splits, bias, backend=backend),
            lambda x, weight, bias: torch_grouped_linear(x, weight, m_splits, bias),
            lambda x, weight, bias: grouped_linear_reference(x, weight, m_splits, bias),
            {"x": x, "weight": w, "bias": b},
            torch.float32,
        )
        assert torch.equal(res["out"][5:], torch.zeros(1, out_f))
    assert select_backend("auto", x, w).name == ("torch" if torch_ok else "loop")
    if not torch_ok:
        msg = r"backend='torch' cannot run here: .*multiple of 4.*Usable here: \['loop'"
        with pytest.raises(ValueError, match=msg):
            moekit.grouped_linear(x, w, m_splits, b, backend="torch")


def test_auto_picks_a_working_backend():
    w32 = torch.zeros(2, 32, 16)
    assert select_backend("auto", torch.zeros(4, 16), w32).name == "torch"
    assert select_backend("auto", torch.zeros(4, 16, dtype=torch.bfloat16), w32.bfloat16()).name == "torch"
    # float64 and odd sizes: grouped_mm cannot, the loop can.
    assert select_backend("auto", torch.zeros(4, 16, dtype=torch.float64), w32.double()).name == "loop"
    assert select_backend("auto", torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(2, 36, 16)).name == "loop"
    x64 = rand(5, 16, dtype=torch.float64, seed=23)
    w64 = rand(2, 32, 16, dtype=torch.float64, seed=24)
    y = moekit.grouped_linear(x64, w64, [2, 3])
    assert rel_err(y, grouped_linear_reference(x64, w64, [2, 3])) < 1e-14


def test_zero_rows_input():
    for backend in BACKENDS:
        x = torch.zeros(0, IN, requires_grad=True)
        w = rand(3, OUT, IN, seed=25).requires_grad_()
        y = moekit.grouped_linear(x, w, [0, 0, 0], backend=backend)
        assert y.shape == (0, OUT)
        y.sum().backward()
        assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", BACKENDS)
@HYPOTHESIS
@given(data=st.data())
def test_random_splits_hypothesis(backend, data):
    n = data.draw(st.integers(1, 7), label="N")
    m_splits = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n), label="m_splits")
    pad = data.draw(st.integers(0, 3), label="padding")
    dtype = data.draw(st.sampled_from(LOWP_DTYPES), label="dtype")
    rows = sum(m_splits) + pad
    inputs = {"x": rand(rows, IN, seed=26), "weight": rand(n, OUT, IN, seed=27), "bias": rand(n, OUT, seed=28)}
    check_against_reference(
        lambda x, weight, bias: moekit.grouped_linear(x, weight, m_splits, bias, backend=backend),
        lambda x, weight, bias: torch_grouped_linear(x, weight, m_splits, bias),
        lambda x, weight, bias: grouped_linear_reference(x, weight, m_splits, bias),
        inputs,
        dtype,
    )


def test_reference_is_independent_float64():
    """moekit's reference equals a plain per-group float64 computation written from the contract."""
    m_splits, rows = [2, 0, 3, 1], 8
    x, w, b = (
        rand(rows, IN, dtype=torch.float64, seed=29),
        rand(4, OUT, IN, dtype=torch.float64, seed=30),
        rand(4, OUT, dtype=torch.float64, seed=31),
    )
    s = rand(rows, dtype=torch.float64, seed=32)
    ref = grouped_linear_reference(x, w, m_splits, b, bias_scale=s)
    mine = torch_grouped_linear(x, w, m_splits, b, bias_scale=s)
    torch.testing.assert_close(ref, mine, rtol=1e-13, atol=1e-13)
    expected_row = x[3] @ w[2].t() + b[2] * s[3]  # row 3 is the second row of group 2
    torch.testing.assert_close(ref[3], expected_row, rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------------------------------
# GroupedLinear module: layouts
# --------------------------------------------------------------------------------------------------

LAYOUTS = [
    pytest.param(False, False, id="discrete-w-discrete-b"),
    pytest.param(True, False, id="single-w-discrete-b"),
    pytest.param(False, True, id="discrete-w-single-b"),
    pytest.param(True, True, id="single-w-single-b"),
]


def _module(n, in_f, out_f, single_w, single_b, *, bias=True, backend="auto", dtype=torch.float32, seed=0):
    m = moekit.GroupedLinear(
        n,
        in_f,
        out_f,
        bias=bias,
        single_grouped_weight=single_w,
        single_grouped_bias=single_b,
        backend=backend,
        dtype=dtype,
    )
    with torch.no_grad():
        w = rand(n, out_f, in_f, dtype=dtype, seed=seed)
        b = rand(n, out_f, dtype=dtype, seed=seed + 1)
        for i in range(n):
            (m.weight[i] if single_w else getattr(m, f"weight{i}")).copy_(w[i])
            if bias:
                (m.bias[i] if single_b else getattr(m, f"bias{i}")).copy_(b[i])
    return m, w, b


def _grads(m, n, single_w, single_b, bias=True):
    gw = m.weight.grad if single_w else torch.stack([getattr(m, f"weight{i}").grad for i in range(n)])
    gb = None
    if bias:
        gb = m.bias.grad if single_b else torch.stack([getattr(m, f"bias{i}").grad for i in range(n)])
    return gw, gb


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts_identical(backend, dtype):
    """Every layout gives bitwise the same output and gradients on one backend; every parameter gets
    a gradient (zeros for experts with no rows); a single grouped weight gets one (N, O, I) gradient."""
    n, m_splits, rows = 5, [0, 4, 0, 3, 0], 9
    x = rand(rows, IN, dtype=dtype, seed=33)
    dy = rand(rows, OUT, dtype=dtype, seed=34)
    results = []
    for single_w, single_b in [(False, False), (True, False), (False, True), (True, True)]:
        m, w, b = _module(n, IN, OUT, single_w, single_b, backend=backend, dtype=dtype)
        xi = x.clone().requires_grad_()
        y = m(xi, m_splits)
        y.backward(dy)
        for name, p in m.named_parameters():
            assert p.grad is not None, f"{name} got no gradient"
            assert p.grad.shape == p.shape
        if single_w:
            assert m.weight.grad.shape == (n, OUT, IN)
        gw, gb = _grads(m, n, single_w, single_b)
        for g in (0, 2, 4):
            assert torch.count_nonzero(gw[g]) == 0 and torch.count_nonzero(gb[g]) == 0
        results.append((y.detach(), xi.grad, gw, gb))
    ref = grouped_linear_reference(x, w, m_splits, b)
    assert rel_err(results[0][0], ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    for other in results[1:]:
        for a, o in zip(results[0], other, strict=True):
            assert torch.equal(a, o)


@pytest.mark.parametrize("single_w, single_b", LAYOUTS)
def test_module_matches_reference_and_3d_input(single_w, single_b):
    n, m_splits = 3, [5, 0, 6]
    m, w, b = _module(n, IN, OUT, single_w, single_b)
    x = rand(2, 6, IN, seed=35)  # 12 rows, the last one padding
    y = m(x, m_splits)
    assert y.shape == (2, 6, OUT)
    ref = grouped_linear_reference(x.reshape(-1, IN), w, m_splits, b).reshape(2, 6, OUT)
    assert rel_err(y, ref) < 1e-6
    assert torch.equal(y[1, 5], torch.zeros(OUT))


def test_module_no_bias_layouts():
    for single_w in (False, True):
        m, w, _ = _module(4, IN, OUT, single_w, False, bias=False)
        assert m.bias is None and not any(n.startswith("bias") for n, _ in m.named_parameters())
        x = rand(7, IN, seed=36)
        assert rel_err(m(x, [2, 2, 0, 3]), grouped_linear_reference(x, w, [2, 2, 0, 3])) < 1e-6


def test_module_defaults_and_init():
    m = moekit.GroupedLinear(3, 10, 6)
    assert [n for n, _ in m.named_parameters()] == [f"weight{i}" for i in range(3)] + [f"bias{i}" for i in range(3)]
    bound = 1 / 10**0.5
    for i in range(3):
        w = getattr(m, f"weight{i}")
        assert w.shape == (6, 10) and w.abs().max() <= bound and w.std() > 0
        assert torch.equal(getattr(m, f"bias{i}"), torch.zeros(6))
    # Experts are initialised independently, not as copies.
    assert not torch.equal(m.weight0, m.weight1)


# --------------------------------------------------------------------------------------------------
# Discrete layout: one buffer underneath
# --------------------------------------------------------------------------------------------------


def test_discrete_parameters_are_views_of_one_buffer():
    m, _, _ = _module(4, IN, OUT, False, False)
    weights, biases = m.weights(), m.biases()
    view = packed_view(weights)
    assert view is not None and view.shape == (4, OUT, IN)
    assert torch.equal(view[2], m.weight2)
    assert packed_view(biases) is not None
    with torch.no_grad():
        m.weight3.fill_(7.0)  # writing a parameter writes the buffer
    assert torch.equal(packed_view(m.weights())[3], torch.full((OUT, IN), 7.0))
    # Still packed after a dtype conversion, and still equal.
    before = torch.stack([w.detach().clone() for w in m.weights()])
    m.to(torch.float64)
    assert m.weight0.dtype == torch.float64
    assert packed_view(m.weights()) is not None and packed_view(m.biases()) is not None
    torch.testing.assert_close(packed_view(m.weights()), before.double(), rtol=0, atol=0)


def test_deepcopy_keeps_one_buffer():
    """copy.deepcopy (EMA or reference copies) gives an independent module whose discrete parameters
    are still views of one buffer: no warning, no per-call stacking, same results."""
    m, _, _ = _module(4, IN, OUT, False, False, seed=45)
    c = copy.deepcopy(m)
    assert packed_view(c.weights()) is not None and packed_view(c.biases()) is not None
    x = rand(9, IN, seed=46)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(c(x, [2, 3, 0, 4]), m(x, [2, 3, 0, 4]))
    with torch.no_grad():
        c.weight2.add_(1.0)
    assert not torch.equal(c.weight2, m.weight2)
    assert c.weight2.untyped_storage().data_ptr() != m.weight2.untyped_storage().data_ptr()


def test_replaced_storage_still_correct_and_warns():
    m, w, b = _module(4, IN, OUT, False, False, seed=40)
    with torch.no_grad():
        m.weight1.data = m.weight1.data.clone()
    assert packed_view(m.weights()) is None
    x = rand(10, IN, seed=41).requires_grad_()
    with pytest.warns(UserWarning, match="not adjacent slices of one buffer"):
        y = m(x, [3, 3, 0, 4])
    assert rel_err(y, grouped_linear_reference(x, w, [3, 3, 0, 4], b)) < 1e-6
    y.sum().backward()
    assert torch.count_nonzero(m.weight1.grad) > 0 and torch.count_nonzero(m.weight2.grad) == 0
    expected = grouped_linear_reference(x.detach(), w.requires_grad_(), [3, 3, 0, 4], b)
    (dw,) = torch.autograd.grad(expected.sum(), w)
    assert rel_err(m.weight1.grad, dw[1]) < 1e-6
    # A conversion repacks the buffer; no warning any more, same result.
    m.to(torch.float32)
    assert packed_view(m.weights()) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y2 = m(x, [3, 3, 0, 4])
    assert torch.equal(y2, y)


def test_replaced_storage_warns_for_every_module():
    """The warning is per module, not once per process: a second module split apart warns too."""
    for seed in (50, 51, 52):
        m, _, _ = _module(3, IN, OUT, False, False, seed=seed)
        m.weight0.data = m.weight0.data.clone()
        with pytest.warns(UserWarning, match="not adjacent slices"):
            m(rand(3, IN, seed=seed), [1, 1, 1])
        del m


# --------------------------------------------------------------------------------------------------
# Padding rows holding garbage
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_in_padding_input_rows_does_not_leak(backend):
    """Padding rows of x may be an unwritten buffer (NaN here): outputs and every gradient stay finite,
    and the padding rows' output and gradient are zeros."""
    m_splits, rows, used = [3, 0, 4], 10, 7
    x = torch.cat([rand(used, IN, seed=60), nan_like(torch.zeros(rows - used, IN))]).requires_grad_()
    w, b = rand(3, OUT, IN, seed=61).requires_grad_(), rand(3, OUT, seed=62).requires_grad_()
    s = rand(rows, seed=63).abs().requires_grad_()
    y = moekit.grouped_linear(x, w, m_splits, b, backend=backend, bias_scale=s)
    y.backward(rand(rows, OUT, seed=64))
    for name, t in (("y", y), ("dx", x.grad), ("dw", w.grad), ("db", b.grad), ("d bias_scale", s.grad)):
        assert_no_nan(t, name)
    assert torch.equal(y[used:], torch.zeros(rows - used, OUT))
    assert torch.equal(x.grad[used:], torch.zeros(rows - used, IN))
    assert torch.equal(s.grad[used:], torch.zeros(rows - used))
    ref = grouped_linear_reference(x.detach()[:used], w.detach(), m_splits, b.detach(), bias_scale=s.detach()[:used])
    assert rel_err(y[:used], ref) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_gradient_in_padding_rows_does_not_leak(backend):
    m_splits, rows, used = [3, 0, 4], 10, 7
    x = rand(rows, IN, seed=65).requires_grad_()
    w, b = rand(3, OUT, IN, seed=66).requires_grad_(), rand(3, OUT, seed=67).requires_grad_()
    s = rand(rows, seed=68).abs().requires_grad_()
    y = moekit.grouped_linear(x, w, m_splits, b, backend=backend, bias_scale=s)
    dy = rand(rows, OUT, seed=69)
    dy[used:] = float("nan")  # e.g. a downstream normalisation of the all-zero padding rows
    y.backward(dy)
    for name, t in (("dx", x.grad), ("dw", w.grad), ("db", b.grad), ("d bias_scale", s.grad)):
        assert_no_nan(t, name)


# --------------------------------------------------------------------------------------------------
# Padding rows with device splits: zeroed at the cost of the padding (issue: not a whole-output pass)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, cols, end",
    [
        pytest.param(200, 300, 137, id="mid-block-end"),
        pytest.param(200, 300, 0, id="all-padding"),
        pytest.param(200, 300, 200, id="no-padding"),
        pytest.param(128, 128, 64, id="block-aligned"),
        pytest.param(1, 5, 0, id="one-row"),
        pytest.param(67, 1, 66, id="last-row-only"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_zero_rows_from_kernel(rows, cols, end, dtype):
    """The padding kernel (run by the Triton interpreter here) writes zeros into rows [end, M) and
    nothing else: the rows before `end` keep their NaN poison, so a kernel that touched them (or a
    whole-tensor pass) would show here as zeros, and an unwritten padding row as NaN."""
    pytest.importorskip("triton")
    from moekit.ops.runtime.rows import zero_rows_from

    t = nan_like(torch.zeros(rows, cols, dtype=dtype))
    assert zero_rows_from(t, torch.tensor([end])) is t
    assert torch.isnan(t[:end]).all()
    assert torch.equal(t[end:], torch.zeros(rows - end, cols, dtype=dtype))


def test_zero_rows_from_kernel_respects_the_row_stride():
    """A row-major view with a wider row stride (a column slice): columns outside it stay untouched."""
    pytest.importorskip("triton")
    from moekit.ops.runtime.rows import zero_rows_from

    base = nan_like(torch.zeros(70, 150))
    view = base[:, 10:140]
    assert zero_rows_from(view, torch.tensor([33])) is view
    assert torch.equal(view[33:], torch.zeros(37, 130))
    assert torch.isnan(view[:33]).all() and torch.isnan(base[:, :10]).all() and torch.isnan(base[:, 140:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows, used",
    [(4096, 4000), (4096, 0), (4096, 4096), (333, 100)],
    ids=["some-padding", "all-padding", "no-padding", "odd-rows"],
)
def test_torch_backend_device_splits_zero_padding_on_cuda(rows, used):
    """CUDA, device splits: forward and dgrad padding rows are exact zeros (grouped_mm leaves them
    unwritten), the real rows match host splits bit for bit, and the kernel alone, given a NaN
    buffer, writes exactly the padding rows."""
    from moekit.ops.runtime.rows import zero_rows_from

    dev = torch.device("cuda")
    counts = [used // 4] * 3 + [used - 3 * (used // 4)]
    x = torch.randn(rows, 256, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(4, 512, 256, device=dev, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(rows, 512, device=dev, dtype=torch.bfloat16)
    outs = []
    for m_splits in (torch.tensor(counts, device=dev), counts):
        y = moekit.grouped_linear(x, w, m_splits, backend="torch")
        outs.append((y, *torch.autograd.grad(y, (x, w), dy)))
    for dev_t, host_t in zip(outs[0], outs[1], strict=True):
        assert torch.equal(dev_t, host_t)
    assert torch.equal(outs[0][0][used:], torch.zeros_like(outs[0][0][used:]))
    assert torch.equal(outs[0][1][used:], torch.zeros_like(outs[0][1][used:]))
    t = torch.full((rows, 512), float("nan"), device=dev, dtype=torch.bfloat16)
    assert zero_rows_from(t, torch.tensor([used], device=dev)) is t
    assert torch.isnan(t[:used]).all() and torch.equal(t[used:], torch.zeros_like(t[used:]))


# --------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu): bf16 results and gradients against float64 at real-ish sizes, the
# tolerance rule of conftest (buffers that moekit allocates from Python start as NaN: nan_poison, so
# rows a kernel leaves unwritten fail); no host sync with device m_splits; CUDA graph: capture once,
# replay with other device m_splits
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m_splits", GPU_SPLITS)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_grouped_linear_bf16_matches_float64(backend, m_splits, nan_poison, device=CUDA):
    require_backend(backend, GPU_H, 2 * GPU_F, device)
    splits_dev = torch.tensor(m_splits, device=device)
    inputs = {
        "x": rand(GPU_M, GPU_H, seed=1),
        "weight": rand(GPU_N, 2 * GPU_F, GPU_H, scale=GPU_H**-0.5, seed=2),
        "bias": rand(GPU_N, 2 * GPU_F, seed=3),
    }
    # torch's own bf16 computation (helpers' per-group loop) runs on the CPU: same rounding of
    # each product (fp32 accumulation, one bf16 rounding), so the same error scale.
    res = check_against_reference(
        on_device(lambda x, weight, bias: moekit.grouped_linear(x, weight, splits_dev, bias, backend=backend), device),
        lambda x, weight, bias: torch_grouped_linear(x, weight, m_splits, bias),
        on_device(lambda x, weight, bias: grouped_linear_reference(x, weight, m_splits, bias), device),
        inputs,
        BF16,
    )
    assert_padding_and_empty_experts(res, m_splits, weight_keys=("weight", "bias"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_grouped_linear_with_device_splits_has_no_host_sync(backend):
    require_backend(backend, GPU_H, GPU_F)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(GPU_M, GPU_H, device=CUDA, dtype=BF16, generator=gen).requires_grad_()
    w = (torch.randn(GPU_N, GPU_F, GPU_H, device=CUDA, generator=gen) * GPU_H**-0.5).to(BF16).requires_grad_()
    b = torch.randn(GPU_N, GPU_F, device=CUDA, dtype=BF16, generator=gen).requires_grad_()
    scale = torch.rand(GPU_M, device=CUDA, generator=gen).requires_grad_()
    splits = torch.tensor([0, 700, 512, 0, 900, 333, 1100, 0], device=CUDA)
    dy = torch.randn(GPU_M, GPU_F, device=CUDA, dtype=BF16, generator=gen)

    def step():
        moekit.grouped_linear(x, w, splits, b, backend=backend, bias_scale=scale).backward(dy)

    assert_no_host_sync(step)


GRAPH_ROWS, GRAPH_I, GRAPH_O = 2048, 512, 768
GRAPH_SPLITS = {
    "captured": [256] * 8,
    "skewed+padding": [0, 1000, 24, 0, 500, 300, 0, 24],
    "all-on-one": [0, 0, 0, 2048, 0, 0, 0, 0],
    "nothing-routed": [0] * 8,
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_replay_with_new_splits_matches_eager(backend):
    require_backend(backend, GRAPH_I, GRAPH_O)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(GRAPH_ROWS, GRAPH_I, device=CUDA, dtype=BF16, generator=gen).requires_grad_()
    w = (torch.randn(GPU_N, GRAPH_O, GRAPH_I, device=CUDA, generator=gen) * GRAPH_I**-0.5).to(BF16).requires_grad_()
    b = torch.randn(GPU_N, GRAPH_O, device=CUDA, dtype=BF16, generator=gen).requires_grad_()
    dy = torch.randn(GRAPH_ROWS, GRAPH_O, device=CUDA, dtype=BF16, generator=gen)
    static_splits = torch.tensor(GRAPH_SPLITS["captured"], device=CUDA)
    leaves = (x, w, b)

    def step():
        y = moekit.grouped_linear(x, w, static_splits, b, backend=backend)
        y.backward(dy)
        return y

    graph, y_static = capture_cuda_graph(step, leaves)
    static = {"out": y_static, "x": x.grad, "weight": w.grad, "bias": b.grad}

    for case, splits in GRAPH_SPLITS.items():
        static_splits.copy_(torch.tensor(splits))
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: t.clone() for k, t in static.items()}
        eager = _eager_grouped_linear(x, w, b, dy, splits, backend)
        for k in replayed:
            assert_no_nan(replayed[k], f"{case}: replayed {k}")
            err = rel_err(replayed[k], eager[k])
            assert err < 1e-2, f"{case}: replayed {k} differs from eager (relative error {err:.2e})"
        used = sum(splits)
        assert torch.count_nonzero(replayed["out"][used:]) == 0, f"{case}: padding rows of the output not zero"
        for g, count in enumerate(splits):
            if count == 0:
                assert torch.count_nonzero(replayed["weight"][g]) == 0, f"{case}: d weight[{g}] not zero"


def _eager_grouped_linear(x, w, b, dy, splits, backend) -> dict[str, torch.Tensor]:
    xe, we, be = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = moekit.grouped_linear(xe, we, torch.tensor(splits, device=CUDA), be, backend=backend)
    y.backward(dy)
    return {"out": y.detach(), "x": xe.grad, "weight": we.grad, "bias": be.grad}


def test_release_consumed_gradient_frees_only_what_the_tensor_owns_alone():
    """The incoming gradient a backward has consumed loses its memory in place (every holder sees a
    storage of 0 bytes); a view into a larger buffer, a tensor that takes gradients and a subclass
    (a trace's stand-in) are left alone."""
    owned = torch.randn(6, 5)
    holder = owned.view(30)  # another reference to the same storage, as the engine's
    release_consumed_gradient(owned)
    assert owned.untyped_storage().nbytes() == 0 and holder.untyped_storage().nbytes() == 0
    buffer = torch.randn(7, 5)
    for kept in (buffer[1:], buffer[:6], buffer.t(), torch.randn(4, requires_grad=True)):
        before = kept.untyped_storage().nbytes()
        release_consumed_gradient(kept)
        assert kept.untyped_storage().nbytes() == before > 0
    assert torch.isfinite(buffer).all()

    class Stand(torch.Tensor):
        pass

    stand = torch.randn(3).as_subclass(Stand)
    release_consumed_gradient(stand)
    assert stand.untyped_storage().nbytes() == 12
