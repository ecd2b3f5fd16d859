"""topk_softmax: the router's top-k + softmax, on moekit's kernel (the CPU under the Triton interpreter,
CUDA with -m gpu) and on torch ops, against its float64 reference."""

from __future__ import annotations

import pytest
import torch

import moekit
from helpers import (
    assert_no_host_sync,
    assert_no_nan,
    assert_within_tolerance,
    capture_cuda_graph,
    rand,
    run_on_kernel,
)
from moekit.ops.runtime.backends import triton_unavailable_reason
from moekit.ops.runtime.configs import TOPK_MAX_EXPERTS
from moekit.reference import topk_softmax_reference

INTERPRETER = triton_unavailable_reason(torch.device("cpu"), torch.float32) is None
NEEDS_INTERPRETER = pytest.mark.skipif(not INTERPRETER, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
# Both paths on the CPU: moekit's kernel (under the interpreter) and torch ops.
BACKENDS = [pytest.param("triton", marks=NEEDS_INTERPRETER), "torch"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (T, N, k): several programs and a partial last one, N not a power of two, k = 1 and k = N, one row.
SHAPES = [(13, 7, 3), (9, 60, 8), (5, 129, 16), (6, 8, 1), (4, 8, 8), (1, 33, 5)]


def _ids(v):
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """(T, N) logits whose values are distinct within each row and exact in `dtype`: a random permutation
    of the multiples of 1/64 around 0, shifted per row by a multiple of 1/2 (64 times each value is an
    integer of at most 8 bits for N <= 256: exact in bfloat16 and float16)."""
    gen = torch.Generator().manual_seed(seed)
    grid = (torch.arange(experts, dtype=torch.float64) - experts // 2) / 64
    order = torch.rand(tokens, experts, generator=gen).argsort(-1)
    shift = torch.randint(-1, 2, (tokens, 1), generator=gen).double() / 2
    out = (grid[order] + shift).to(dtype)
    assert (out.double().sort(-1).values.diff(dim=-1) > 0).all(), "test logits must be distinct within a row"
    return out


def torch_router(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same thing as torch computes it (moekit's router before this op): softmax over all N in fp32,
    torch.topk, renormalised."""
    scores = logits.float().softmax(-1)
    top, ids = scores.topk(k, dim=-1)
    return top / top.sum(-1, keepdim=True), ids


def _run(fn, logits: torch.Tensor, d_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids, d logits) of fn(leaf) with upstream gradient d_weights."""
    leaf = logits.detach().clone().requires_grad_(True)
    weights, ids = fn(leaf)
    weights.backward(d_weights.to(weights.dtype))
    assert leaf.grad is not None
    return weights.detach(), ids, leaf.grad


def _check(logits: torch.Tensor, k: int, backend: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_softmax on `backend` against the float64 reference (on a float64 copy of the rounded logits,
    so its gradient is float64 too): ids equal (the values are distinct or the contract orders their
    ties), weights and d logits within the tolerance rule of torch's own computation (`torch_router`);
    d logits exactly zero off the chosen experts. Returns (weights, ids)."""
    num_tokens, num_experts = logits.shape
    d_weights = torch.randn(num_tokens, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w, ids, d_logits = _run(lambda x: moekit.topk_softmax(x, k, backend=backend), logits, d_weights)
    w_ref, ids_ref, d_ref = _run(lambda x: topk_softmax_reference(x, k), logits.double(), d_weights)
    w_torch, _, d_torch = _run(lambda x: torch_router(x, k), logits, d_weights)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and d_logits.dtype == logits.dtype
    assert w.shape == ids.shape == (num_tokens, k) and d_logits.shape == logits.shape
    assert torch.equal(ids, ids_ref), f"ids differ from the reference's in rows {(ids != ids_ref).any(1).nonzero()}"
    assert_no_nan(w, "weights")
    assert_no_nan(d_logits, "d logits")
    assert_within_tolerance(w, w_ref, w_torch, "weights", reduction_length=num_experts)
    assert_within_tolerance(d_logits, d_ref, d_torch, "d logits", reduction_length=num_experts)
    chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, ids, True)
    assert torch.count_nonzero(d_logits[~chosen]) == 0, "d logits is not zero off the chosen experts"
    return w, ids


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-N{}-k{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, shape, nan_poison):
    num_tokens, num_experts, k = shape
    logits = distinct_logits(num_tokens, num_experts, dtype, seed=num_experts)
    w, ids = _check(logits, k, backend)
    # Descending order of the logits along k, and weights that sum to 1.
    chosen = logits.gather(1, ids).double()
    assert (chosen[:, :-1] > chosen[:, 1:]).all()
    torch.testing.assert_close(w.double().sum(-1), torch.ones(num_tokens, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_logits_with_bf16_ties(backend, nan_poison):
    """randn logits rounded to bf16 (ties among 64 experts in some rows): the ids still equal the
    reference's (both keep the contract's order of ties) and the values are within the rule."""
    logits = rand(24, 64, seed=5, scale=0.25).to(torch.bfloat16)
    assert any(row.unique().numel() < 64 for row in logits), "the test needs ties"
    # The lowest column first among a row's ties, checked directly on one row.
    w, ids = moekit.topk_softmax(logits, 64, backend=backend)
    for row in range(logits.shape[0]):
        values = logits[row, ids[row]].double()
        tied = values[:-1] == values[1:]
        assert (ids[row, :-1][tied] < ids[row, 1:][tied]).all()
    d_weights = torch.randn(24, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    w, ids, d_logits = _run(lambda x: moekit.topk_softmax(x, 6, backend=backend), logits, d_weights[:, :6])
    w_ref, ids_ref, _ = _run(lambda x: topk_softmax_reference(x, 6), logits.double(), d_weights[:, :6])
    assert torch.equal(ids, ids_ref)
    w_torch, _, _ = _run(lambda x: torch_router(x, 6), logits, d_weights[:, :6])
    assert_within_tolerance(w, w_ref, w_torch, "weights", reduction_length=64)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_by_hand(backend, dtype):
    """Equal values: the lower expert first (-0.0 equals +0.0); a row of equal values gives 0..k-1. In
    every dtype (the kernel packs the column into the keys' low bits for the 16-bit ones)."""
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, -0.0, 0.0, 2.0],
            [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0],
            [-0.0, 0.0, -1.0, -0.0, -2.0, 0.0, -3.0, -4.0],
        ],
        dtype=dtype,
    )
    w, ids = moekit.topk_softmax(logits, 8, backend=backend)
    assert ids.tolist() == [[1, 2, 4, 7, 0, 3, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 3, 5, 2, 4, 6, 7]]
    torch.testing.assert_close(w[1], torch.full((8,), 0.125))
    _, ids3 = moekit.topk_softmax(logits, 3, backend=backend)
    assert ids3.tolist() == [[1, 2, 4], [0, 1, 2], [0, 1, 3]]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_rows(backend, dtype, nan_poison):
    """NaN counts as larger than every number: a row's NaNs are chosen first (lowest expert first) and
    its weights are all NaN; +inf chosen gives NaN weights (as torch's softmax); -inf logits chosen past
    the finite ones get weight 0; a row of -inf gives NaN weights. Ids stay distinct, in [0, N), and
    equal the reference's; the rows without such values are untouched. In every dtype."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [0.5, nan, 2.0, -1.0, nan, 0.0],
            [0.5, 1.0, inf, -1.0, 2.0, 0.0],
            [-inf, 1.0, -inf, -inf, 2.0, -inf],
            [-inf, -inf, -inf, -inf, -inf, -inf],
            [0.5, 1.0, 2.0, -1.0, 3.0, 0.0],
        ],
        dtype=dtype,
    )
    w, ids = moekit.topk_softmax(logits, 4, backend=backend)
    w_ref, ids_ref = topk_softmax_reference(logits, 4)
    assert torch.equal(ids, ids_ref)
    assert ids[0].tolist() == [1, 4, 2, 0] and ids[1].tolist() == [2, 4, 1, 0] and ids[2].tolist() == [4, 1, 0, 2]
    assert ((ids >= 0) & (ids < 6)).all() and all(row.unique().numel() == 4 for row in ids)
    assert torch.isnan(w[[0, 1, 3]]).all()
    assert w[2, 2:].tolist() == [0.0, 0.0]
    torch.testing.assert_close(w.double(), w_ref, equal_nan=True)
    assert not torch.isnan(w[[2, 4]]).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_widest_rows_with_ties_and_subnormals(backend, dtype, nan_poison):
    """The widest rows the kernel takes (TOPK_MAX_EXPERTS columns), in the 16-bit dtypes whose keys carry
    the column in their low bits: values drawn from a few levels (many ties, the lowest expert first),
    subnormals, both zeros and values one unit apart; the ids equal the reference's and the weights its
    within the rule."""
    gen = torch.Generator().manual_seed(11)
    tiny = torch.finfo(dtype).smallest_normal
    levels = torch.tensor([-3.0, -1.0, -tiny / 4, -0.0, 0.0, tiny / 8, tiny / 2, 1.0, 1.0 + torch.finfo(dtype).eps])
    logits = levels[torch.randint(0, len(levels), (6, TOPK_MAX_EXPERTS), generator=gen)].to(dtype)
    assert (logits != 0).logical_and(logits.abs() < tiny).any(), "the test needs subnormals"
    w, ids = moekit.topk_softmax(logits, 16, backend=backend)
    w_ref, ids_ref = topk_softmax_reference(logits, 16)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens(backend, nan_poison):
    logits = torch.zeros(0, 6, requires_grad=True)
    w, ids = moekit.topk_softmax(logits, 2, backend=backend, ids_dtype=torch.int32)
    assert w.shape == ids.shape == (0, 2) and w.dtype == torch.float32 and ids.dtype == torch.int32
    w.sum().backward()
    assert logits.grad is not None and logits.grad.shape == (0, 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_ids_strided_logits_and_expanded_gradient(backend, nan_poison):
    """ids_dtype=int32; logits as a transposed view (not unit column stride); an upstream gradient with
    zero strides (from weights.sum()): the same values as the contiguous int64 call, whose gradient
    sum(dw) = 0 makes d logits w * (1 - 1) = 0 up to rounding."""
    base = distinct_logits(10, 12, torch.float32, seed=3)
    strided = base.t().contiguous().t()
    assert strided.stride(-1) != 1
    leaf = strided.detach().requires_grad_(True)
    w, ids = moekit.topk_softmax(leaf, 4, ids_dtype=torch.int32, backend=backend)
    w_c, ids_c = moekit.topk_softmax(base, 4, backend=backend)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ids_c) and torch.equal(w, w_c)
    w.sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().max() < 1e-6


def test_float64_runs_torch_ops_in_float64():
    """float64 logits: backend="auto" takes torch ops in float64 (weights float64, equal to the
    reference), "triton" refuses (moekit's kernels take 16- and 32-bit floats)."""
    logits = rand(7, 9, dtype=torch.float64, seed=4).requires_grad_(True)
    w, ids = moekit.topk_softmax(logits, 3)
    w_ref, ids_ref = topk_softmax_reference(logits, 3)
    assert w.dtype == torch.float64 and torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-14, atol=1e-14)
    (d,) = torch.autograd.grad(w, logits, w_ref.detach())
    (d_ref,) = torch.autograd.grad(w_ref, logits, w_ref.detach())
    torch.testing.assert_close(d, d_ref, rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="backend='triton' cannot run the router's top-k here"):
        moekit.topk_softmax(logits, 3, backend="triton")


def test_reference_is_independent():
    """The reference's order is the contract's, checked against a Python sort by (value descending,
    column ascending, NaN first) on rows with ties, signed zeros, infinities and NaN."""
    nan, inf = float("nan"), float("inf")
    rows = [[0.0, -0.0, 1.0, 1.0, nan, -inf, inf, 0.0, nan], [2.0, 2.0, 2.0, -1.0, -1.0, 3.0, -0.0, 0.0, -inf]]
    logits = torch.tensor(rows, dtype=torch.bfloat16)
    _, ids = topk_softmax_reference(logits, 9)
    for row, got in zip(rows, ids.tolist(), strict=True):
        want = sorted(range(len(row)), key=lambda c: (row[c] != row[c], row[c] if row[c] == row[c] else 0, -c))
        assert got == want[::-1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_order(backend):
    """create_graph: the backward is itself differentiable (torch ops over the saved weights and ids),
    giving torch's own second derivative."""
    logits = distinct_logits(5, 10, torch.float32, seed=6)
    d_weights = rand(5, 3, seed=7)

    def second(fn):
        leaf = logits.detach().clone().requires_grad_(True)
        (d,) = torch.autograd.grad(fn(leaf)[0], leaf, d_weights, create_graph=True)
        (dd,) = torch.autograd.grad((d * d).sum(), leaf)
        return dd

    torch.testing.assert_close(
        second(lambda x: moekit.topk_softmax(x, 3, backend=backend)),
        second(lambda x: topk_softmax_reference(x, 3)).float(),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "call, error, needle",
    [
        (lambda: moekit.topk_softmax(torch.zeros(4), 1), ValueError, "logits must be 2-D"),
        (lambda: moekit.topk_softmax(torch.zeros(2, 3, 4), 1), ValueError, "logits must be 2-D"),
        (lambda: moekit.topk_softmax(torch.zeros(2, 4, dtype=torch.int64), 1), TypeError, "logits is torch.int64"),
        (lambda: moekit.topk_softmax([[1.0, 2.0]], 1), TypeError, "logits must be a torch.Tensor"),
        (lambda: moekit.topk_softmax(torch.zeros(2, 0), 1), ValueError, "logits must have at least one column"),
        (lambda: moekit.topk_softmax(torch.zeros(2, 4), 0), ValueError, "k must be an int in [1, 4]"),
        (lambda: moekit.topk_softmax(torch.zeros(2, 4), 5), ValueError, "k must be an int in [1, 4]"),
        (lambda: moekit.topk_softmax(torch.zeros(2, 4), 2.0), TypeError, "k must be an int"),
        (lambda: moekit.topk_softmax(torch.zeros(2, 4), True), TypeError, "k must be an int"),
        (
            lambda: moekit.topk_softmax(torch.zeros(2, 4), 1, ids_dtype=torch.float32),
            ValueError,
            "unknown ids_dtype",
        ),
        (lambda: moekit.topk_softmax(torch.zeros(2, 4), 1, backend="cuda"), ValueError, "unknown backend 'cuda'"),
    ],
    ids=[
        "1-D",
        "3-D",
        "int",
        "list",
        "no-experts",
        "k=0",
        "k>N",
        "k-float",
        "k-bool",
        "ids-dtype",
        "backend",
    ],
)
def test_refusals(call, error, needle):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert needle in message and "\n" not in message, message


@NEEDS_INTERPRETER
def test_kernel_refuses_more_experts_than_it_holds():
    """N over TOPK_MAX_EXPERTS: backend="triton" refuses in one line naming logits; "auto" (torch ops on
    the CPU anyway) and "torch" run."""
    logits = torch.zeros(2, TOPK_MAX_EXPERTS + 1)
    with pytest.raises(ValueError) as info:
        moekit.topk_softmax(logits, 2, backend="triton")
    message = str(info.value)
    assert f"logits has {TOPK_MAX_EXPERTS + 1} experts" in message and "\n" not in message
    assert moekit.topk_softmax(logits, 2, backend="torch")[1].tolist() == [[0, 1], [0, 1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiles_fullgraph(backend):
    """torch.compile(fullgraph=True) traces the op (the kernel as the custom ops of moekit.ops.library):
    aot_eager's weights, ids and d logits equal eager's bit for bit."""
    torch._dynamo.reset()
    logits = distinct_logits(6, 12, torch.float32, seed=8)
    d_weights = rand(6, 3, seed=9)

    def fn(x):
        return moekit.topk_softmax(x, 3, backend=backend)

    try:
        eager = _run(fn, logits, d_weights)
        compiled = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), logits, d_weights)
    finally:
        torch._dynamo.reset()
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu): real router sizes in bf16, no host sync, CUDA graphs
# --------------------------------------------------------------------------------------------------

CUDA_CASES = [
    pytest.param(32768, 256, 16, id="T32768-N256-K16"),
    pytest.param(32768, 128, 8, id="T32768-N128-K8"),
    pytest.param(4099, 129, 5, id="T4099-N129-K5"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens, experts, k", CUDA_CASES)
def test_matches_reference_on_gpu(tokens, experts, k):
    """bf16 logits on CUDA through the kernel (backend="auto" picks it there): distinct logits against the
    float64 reference (ids equal, weights and d logits within the rule); randn logits, whose bf16 values
    tie in many rows, give the reference's ids too; forward+backward never syncs with the host and
    runs the kernels."""
    cuda = torch.device("cuda")
    logits = distinct_logits(tokens, experts, torch.bfloat16, seed=10).to(cuda)
    d_weights = torch.randn(tokens, k, generator=torch.Generator().manual_seed(11), dtype=torch.float64).to(cuda)
    w, ids, d_logits = _run(lambda x: moekit.topk_softmax(x, k), logits, d_weights)
    w_ref, ids_ref, d_ref = _run(lambda x: topk_softmax_reference(x, k), logits.double(), d_weights)
    w_torch, _, d_torch = _run(lambda x: torch_router(x, k), logits, d_weights)
    assert torch.equal(ids, ids_ref)
    assert_within_tolerance(w.cpu(), w_ref.cpu(), w_torch.cpu(), "weights", reduction_length=experts)
    assert_within_tolerance(d_logits.cpu(), d_ref.cpu(), d_torch.cpu(), "d logits", reduction_length=experts)

    tied = rand(tokens, experts, seed=12).to(torch.bfloat16).to(cuda)
    assert torch.equal(moekit.topk_softmax(tied, k)[1], topk_softmax_reference(tied, k)[1])

    leaf = logits.detach().requires_grad_(True)

    def step():
        weights, _ = moekit.topk_softmax(leaf, k)
        (d,) = torch.autograd.grad(weights, leaf, d_weights.float())
        return d

    assert_no_host_sync(step)
    run_on_kernel(lambda: moekit.topk_softmax(logits, k), "topk_softmax_kernel")
    run_on_kernel(step, "topk_softmax_backward_kernel")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_on_gpu():
    """Forward and backward captured in a CUDA graph and replayed on new logits: the same weights, ids and
    d logits as eager on those logits."""
    cuda = torch.device("cuda")
    logits = distinct_logits(4096, 128, torch.bfloat16, seed=13).to(cuda).requires_grad_(True)
    d_weights = torch.randn(4096, 8, device=cuda)

    def step():
        weights, ids = moekit.topk_softmax(logits, 8)
        weights.backward(d_weights)
        return weights, ids

    graph, (w_static, ids_static) = capture_cuda_graph(step, [logits])
    with torch.no_grad():
        logits.copy_(distinct_logits(4096, 128, torch.bfloat16, seed=14).to(cuda))
    graph.replay()
    torch.cuda.synchronize()
    w_eager, ids_eager, d_eager = _run(lambda x: moekit.topk_softmax(x, 8), logits.detach(), d_weights)
    assert torch.equal(w_static, w_eager) and torch.equal(ids_static, ids_eager)
    assert logits.grad is not None and torch.equal(logits.grad, d_eager)
