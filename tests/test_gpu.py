"""GPU tests, run on the device machine with `pytest -m gpu`: bf16 grouped ops at real-ish sizes
against float64, no host syncs, torch grouped_mm's wgrad of empty experts, bit-identical gradients,
CUDA graph replay with new splits.

Legend: M routed rows, N experts, H hidden size, F ffn size, I/O in/out features.
"""

from __future__ import annotations

import functools

import pytest
import torch

import moekit
from helpers import assert_no_nan, check_against_reference, rand, rel_err, torch_grouped_linear, torch_grouped_mlp
from moekit.ops.activations import ACTIVATIONS
from moekit.ops.runtime.backends import select_backend
from moekit.reference import grouped_linear_reference, grouped_mlp_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
# "auto" on Hopper is triton (measured at least as fast in every product).
GPU_BACKENDS = ("torch", "triton", "auto")
M, N, H, F = 4096, 8, 1024, 1536

SPLITS = [
    pytest.param([512] * 8, id="balanced"),
    # 3545 of 4096 rows routed: empty experts first, in the middle and last, and padding rows.
    pytest.param([0, 700, 512, 0, 900, 333, 1100, 0], id="empty-first-middle-last+padding"),
]


def _capture(step, leaves):
    """Capture step() (a forward+backward) in a CUDA graph; returns (graph, step's output). Warms up
    on a side stream first (lazy init, autotuning), as torch.cuda.graphs asks; grads are set to None
    so the captured backward allocates them from the graph's pool and writes them on every replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in leaves:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    return graph, y_static


def _require_backend(backend: str, in_features: int, out_features: int, device=None, dtype=BF16) -> None:
    """Skip (with select_backend's reason) when the backend cannot run these operands."""
    device = device or CUDA
    try:
        select_backend(
            backend,
            torch.empty(0, in_features, device=device, dtype=dtype),
            torch.empty(1, out_features, in_features, device=device, dtype=dtype),
        )
    except ValueError as exc:
        pytest.skip(str(exc))


def _on_device(fn, device):
    """Wrap `fn` so that it receives its tensor arguments on `device` and returns its result on the
    CPU, both moves differentiable: check_against_reference makes its leaves and the upstream
    gradient on the CPU (as do the plain-torch helpers of tests/helpers.py), while the op under test and the
    float64 reference run on the GPU."""

    def wrapped(**tensors):
        return fn(**{k: v.to(device) for k, v in tensors.items()}).cpu()

    return wrapped


# --------------------------------------------------------------------------------------------------
# (a) bf16 results and gradients against float64, the tolerance rule of conftest; buffers that
# moekit allocates from Python start as NaN (nan_poison), so rows a kernel leaves unwritten fail
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_grouped_linear_bf16_matches_float64(backend, m_splits, nan_poison, device=CUDA):
    _require_backend(backend, H, 2 * F, device)
    splits_dev = torch.tensor(m_splits, device=device)
    inputs = {
        "x": rand(M, H, seed=1),
        "weight": rand(N, 2 * F, H, scale=H**-0.5, seed=2),
        "bias": rand(N, 2 * F, seed=3),
    }
    # torch's own bf16 computation (helpers' per-group loop) runs on the CPU: same rounding of
    # each product (fp32 accumulation, one bf16 rounding), so the same error scale.
    res = check_against_reference(
        _on_device(lambda x, weight, bias: moekit.grouped_linear(x, weight, splits_dev, bias, backend=backend), device),
        lambda x, weight, bias: torch_grouped_linear(x, weight, m_splits, bias),
        _on_device(lambda x, weight, bias: grouped_linear_reference(x, weight, m_splits, bias), device),
        inputs,
        BF16,
    )
    _assert_padding_and_empty_experts(res, m_splits, weight_keys=("weight", "bias"))


@pytest.mark.parametrize("m_splits", SPLITS)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_grouped_mlp_bf16_matches_float64(backend, m_splits, nan_poison, device=CUDA):
    _require_backend(backend, H, 2 * F, device)
    _require_backend(backend, F, H, device)
    splits_dev = torch.tensor(m_splits, device=device)
    inputs = {
        "x": rand(M, H, seed=11),
        "fc1_weight": rand(N, 2 * F, H, scale=H**-0.5, seed=12),
        "fc2_weight": rand(N, H, F, scale=F**-0.5, seed=13),
        "fc1_bias": rand(N, 2 * F, scale=0.1, seed=14),
        "fc2_bias": rand(N, H, scale=0.1, seed=15),
        "probs": rand(M, seed=16).sigmoid(),
    }
    res = check_against_reference(
        _on_device(functools.partial(moekit.grouped_mlp, m_splits=splits_dev, backend=backend), device),
        functools.partial(torch_grouped_mlp, m_splits=m_splits),
        _on_device(functools.partial(grouped_mlp_reference, m_splits=m_splits), device),
        inputs,
        BF16,
    )
    _assert_padding_and_empty_experts(res, m_splits, weight_keys=("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"))


def _assert_padding_and_empty_experts(res: dict, m_splits: list[int], weight_keys: tuple[str, ...]) -> None:
    for name, t in res.items():
        assert_no_nan(t, name)
    used = sum(m_splits)
    assert torch.count_nonzero(res["out"][used:]) == 0, "padding rows of the output are not zero"
    assert torch.count_nonzero(res["x"][used:]) == 0, "padding rows of d x are not zero"
    for key in weight_keys:
        for g, count in enumerate(m_splits):
            if count == 0:
                assert torch.count_nonzero(res[key][g]) == 0, f"d {key}[{g}] of an expert without rows is not zero"


# --------------------------------------------------------------------------------------------------
# (b) no host sync in forward + backward with device m_splits
# --------------------------------------------------------------------------------------------------


def _assert_no_host_sync(step) -> None:
    """Run `step` once to warm up (lazy init, autotuning, which may sync), then once more with the
    CUDA sync debugger set to raise on any host synchronization."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_moe_layer_forward_backward_has_no_host_sync(backend):
    _require_backend(backend, H, 2 * F)
    torch.manual_seed(0)
    layer = moekit.MoELayer(H, F, N, top_k=2, aux_loss_coef=0.01, backend=backend, device=CUDA, dtype=BF16)
    x = torch.randn(M // 2, H, device=CUDA, dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        layer(x).backward(dy)

    _assert_no_host_sync(step)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_grouped_linear_with_device_splits_has_no_host_sync(backend):
    _require_backend(backend, H, F)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(M, H, device=CUDA, dtype=BF16, generator=gen).requires_grad_()
    w = (torch.randn(N, F, H, device=CUDA, generator=gen) * H**-0.5).to(BF16).requires_grad_()
    b = torch.randn(N, F, device=CUDA, dtype=BF16, generator=gen).requires_grad_()
    scale = torch.rand(M, device=CUDA, generator=gen).requires_grad_()
    splits = torch.tensor([0, 700, 512, 0, 900, 333, 1100, 0], device=CUDA)
    dy = torch.randn(M, F, device=CUDA, dtype=BF16, generator=gen)

    def step():
        moekit.grouped_linear(x, w, splits, b, backend=backend, bias_scale=scale).backward(dy)

    _assert_no_host_sync(step)


def test_auto_on_hopper_is_triton_and_elsewhere_torch_first():
    x = torch.zeros(64, H, device=CUDA, dtype=BF16)
    w = torch.zeros(N, F, H, device=CUDA, dtype=BF16)
    expected = "triton" if torch.cuda.get_device_capability()[0] >= 9 else "torch"
    assert select_backend("auto", x, w).name == expected
    # fp32: grouped_mm would sync on CUDA, so the torch backend refuses it; triton runs anywhere.
    assert select_backend("auto", x.float(), w.float()).name == "triton"


# --------------------------------------------------------------------------------------------------
# (c) what the torch backend relies on: grouped_mm's wgrad writes zeros for experts without rows
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# (d) determinism
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_moe_layer_backward_is_bit_identical(backend):
    _require_backend(backend, H, 2 * F)
    torch.manual_seed(0)
    layer = moekit.MoELayer(H, F, N, top_k=2, backend=backend, device=CUDA, dtype=BF16)
    x = torch.randn(M // 2, H, device=CUDA, dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    leaves = {"x": x, **dict(layer.named_parameters())}

    def grads():
        for t in leaves.values():
            t.grad = None
        layer(x).backward(dy)
        return {k: t.grad.clone() for k, t in leaves.items()}

    grads()  # warm-up: autotuning runs here
    first, second = grads(), grads()
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, f"gradients differ between two identical backward passes: {differ}"


# --------------------------------------------------------------------------------------------------
# (e) CUDA graph: capture once, replay with other device m_splits
# --------------------------------------------------------------------------------------------------

GRAPH_ROWS, GRAPH_I, GRAPH_O = 2048, 512, 768
GRAPH_SPLITS = {
    "captured": [256] * 8,
    "skewed+padding": [0, 1000, 24, 0, 500, 300, 0, 24],
    "all-on-one": [0, 0, 0, 2048, 0, 0, 0, 0],
    "nothing-routed": [0] * 8,
}


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_cuda_graph_replay_with_new_splits_matches_eager(backend):
    _require_backend(backend, GRAPH_I, GRAPH_O)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(GRAPH_ROWS, GRAPH_I, device=CUDA, dtype=BF16, generator=gen).requires_grad_()
    w = (torch.randn(N, GRAPH_O, GRAPH_I, device=CUDA, generator=gen) * GRAPH_I**-0.5).to(BF16).requires_grad_()
    b = torch.randn(N, GRAPH_O, device=CUDA, dtype=BF16, generator=gen).requires_grad_()
    dy = torch.randn(GRAPH_ROWS, GRAPH_O, device=CUDA, dtype=BF16, generator=gen)
    static_splits = torch.tensor(GRAPH_SPLITS["captured"], device=CUDA)
    leaves = (x, w, b)

    def step():
        y = moekit.grouped_linear(x, w, static_splits, b, backend=backend)
        y.backward(dy)
        return y

    graph, y_static = _capture(step, leaves)
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


# --------------------------------------------------------------------------------------------------
# moe_experts: the layer's routed experts given the routing (gather, grouped MLP, combine)
# --------------------------------------------------------------------------------------------------

# Tokens, experts, top-k, hidden, ffn: a real size for the layer's row movement and GEMMs.
MOE_T, MOE_N, MOE_K, MOE_H, MOE_F = 2048, 8, 2, 1024, 768
MOE_POOLS = [pytest.param(None, id="all-experts"), pytest.param([1, 2, 3, 5, 6], id="empty-first-middle-last")]


def _moe_inputs(pool=None, seed=0, bias=False) -> dict:
    from test_moe_experts import make_inputs

    inputs = make_inputs(MOE_T, MOE_N, MOE_K, hidden=MOE_H, ffn=MOE_F, experts=pool, seed=seed, bias=bias)
    return {k: v.to(CUDA) for k, v in inputs.items()}


def _moe_leaves(inputs: dict) -> dict:
    return {k: (v.to(BF16).requires_grad_(True) if v.is_floating_point() else v) for k, v in inputs.items()}


@pytest.mark.parametrize("pool", MOE_POOLS)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_moe_experts_bf16_matches_float64(backend, pool, nan_poison):
    from test_moe_experts import make_inputs, torch_moe_experts

    _require_backend(backend, MOE_H, 2 * MOE_F)
    inputs = make_inputs(MOE_T, MOE_N, MOE_K, hidden=MOE_H, ffn=MOE_F, experts=pool, bias=True, seed=3)
    inputs["topk_weights"] = inputs["topk_weights"].to(BF16)
    ours = _on_device(functools.partial(moekit.moe_experts, backend=backend), CUDA)
    res = check_against_reference(
        ours,
        _on_device(torch_moe_experts, CUDA),
        _on_device(moekit.reference.moe_experts_reference, CUDA),
        inputs,
        BF16,
        differentiable=[k for k in inputs if k != "topk_ids"],
    )
    for name, t in res.items():
        assert_no_nan(t, name)
    for e in set(range(MOE_N)) - set(pool or range(MOE_N)):
        for name in ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"):
            assert torch.count_nonzero(res[name][e]) == 0, f"expert {e} has no tokens but d {name}[{e}] != 0"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_moe_experts_forward_backward_has_no_host_sync(backend):
    _require_backend(backend, MOE_H, 2 * MOE_F)
    leaves = _moe_leaves(_moe_inputs(bias=True))
    dy = torch.randn(MOE_T, MOE_H, device=CUDA, dtype=BF16)

    def step():
        moekit.moe_experts(**leaves, backend=backend).backward(dy)

    _assert_no_host_sync(step)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_moe_experts_backward_is_bit_identical(backend):
    _require_backend(backend, MOE_H, 2 * MOE_F)
    leaves = _moe_leaves(_moe_inputs(bias=True, seed=1))
    dy = torch.randn(MOE_T, MOE_H, device=CUDA, dtype=BF16)

    def run():
        for t in leaves.values():
            if t.is_floating_point():
                t.grad = None
        y = moekit.moe_experts(**leaves, backend=backend)
        y.backward(dy)
        return {"out": y.detach(), **{k: t.grad.clone() for k, t in leaves.items() if t.is_floating_point()}}

    run()  # warm-up: autotuning runs here
    first, second = run(), run()
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, f"moe_experts results differ between two identical runs: {differ}"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_moe_experts_cuda_graph_replay_with_new_routing_matches_eager(backend):
    """One capture of forward+backward; replays with other routings (an empty expert, all copies on
    two experts) give what eager gives for those routings, bit for bit."""
    _require_backend(backend, MOE_H, 2 * MOE_F)
    leaves = _moe_leaves(_moe_inputs(bias=True, seed=2))
    floats = [t for t in leaves.values() if t.is_floating_point()]
    static_ids = leaves["topk_ids"]
    dy = torch.randn(MOE_T, MOE_H, device=CUDA, dtype=BF16)

    def step():
        y = moekit.moe_experts(**leaves, backend=backend)
        y.backward(dy)
        return y

    graph, y_static = _capture(step, floats)
    static = {"out": y_static, **{k: t.grad for k, t in leaves.items() if t.is_floating_point()}}

    routings = {"empty-expert-0-and-5": [1, 2, 3, 4, 6, 7], "two-experts": [3, 6], "all-experts": None}
    for case, pool in routings.items():
        new_ids = _moe_inputs(pool=pool, seed=10)["topk_ids"]
        static_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: t.clone() for k, t in static.items()}
        eager_leaves = {
            k: (t.detach().clone().requires_grad_(True) if t.is_floating_point() else new_ids.clone())
            for k, t in leaves.items()
        }
        y = moekit.moe_experts(**eager_leaves, backend=backend)
        y.backward(dy)
        eager = {"out": y.detach(), **{k: t.grad for k, t in eager_leaves.items() if t.is_floating_point()}}
        for k in replayed:
            assert_no_nan(replayed[k], f"{case}: replayed {k}")
            assert torch.equal(replayed[k], eager[k]), (
                f"{case}: replayed {k} differs from eager (relative error {rel_err(replayed[k], eager[k]):.2e})"
            )
        for e in set(range(MOE_N)) - set(pool or range(MOE_N)):
            assert torch.count_nonzero(replayed["fc1_weight"][e]) == 0, f"{case}: d fc1_weight[{e}] not zero"


def test_moe_experts_holds_less_than_the_sorted_copy_of_x():
    """Memory held between forward and backward: no (M, H) copy of x (what a plain gather keeps)."""
    leaves = _moe_leaves(_moe_inputs(seed=4))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = moekit.moe_experts(**leaves, backend="auto")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    rows = MOE_T * MOE_K
    # What the grouped MLP may keep: fc1's output (M, 2F), the activation (M, F), the probs and
    # index vectors; an (M, H) x_sorted on top would add rows * H * 2 bytes.
    allowance = rows * 3 * MOE_F * 2 + rows * 64
    assert held <= allowance, (
        f"moe_experts holds {held / 2**20:.1f} MiB for the backward; at most {allowance / 2**20:.1f} MiB expected "
        f"without a sorted copy of x ({rows * MOE_H * 2 / 2**20:.1f} MiB)"
    )
    y.sum().backward()


# --------------------------------------------------------------------------------------------------
# grouped_mlp's fused triton path (fc1 + activation epilogue, fc2 dgrad + activation backward):
# every activation and GLU layout in bf16, bit-identical gradients, no host sync, graph replay
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleave", [None, 1, 4, 256], ids=["gate|up", "k1", "k4", "k256"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_grouped_mlp_triton_fused_layouts_bf16(activation, interleave, nan_poison):
    _require_backend("triton", H, 2 * F)
    m_splits = [0, 700, 512, 0, 900, 333, 1100, 0]
    splits_dev = torch.tensor(m_splits, device=CUDA)
    inputs = {
        "x": rand(M, H, seed=21, scale=3.0),  # many pre-activations past clamped_swiglu's limit
        "fc1_weight": rand(N, 2 * F, H, scale=H**-0.5, seed=22),
        "fc2_weight": rand(N, H, F, scale=F**-0.5, seed=23),
        "fc1_bias": rand(N, 2 * F, scale=0.1, seed=24),
        "fc2_bias": rand(N, H, scale=0.1, seed=25),
        "probs": rand(M, seed=26).sigmoid(),
    }
    kw = {"activation": activation, "glu_interleave_size": interleave}
    res = check_against_reference(
        _on_device(functools.partial(moekit.grouped_mlp, m_splits=splits_dev, backend="triton", **kw), CUDA),
        functools.partial(torch_grouped_mlp, m_splits=m_splits, **kw),
        _on_device(functools.partial(grouped_mlp_reference, m_splits=m_splits, **kw), CUDA),
        inputs,
        BF16,
    )
    _assert_padding_and_empty_experts(res, m_splits, weight_keys=("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"))
    assert torch.count_nonzero(res["probs"][sum(m_splits) :]) == 0, "padding rows of d probs are not zero"


def test_grouped_mlp_triton_graph_replay_no_sync_bit_identical():
    _require_backend("triton", H, 2 * F)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    leaves = {
        "x": torch.randn(M, H, device=CUDA, dtype=BF16, generator=gen),
        "fc1_weight": (torch.randn(N, 2 * F, H, device=CUDA, generator=gen) * H**-0.5).to(BF16),
        "fc2_weight": (torch.randn(N, H, F, device=CUDA, generator=gen) * F**-0.5).to(BF16),
        "probs": torch.rand(M, device=CUDA, generator=gen),
    }
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    dy = torch.randn(M, H, device=CUDA, dtype=BF16, generator=gen)
    static_splits = torch.tensor([512] * N, device=CUDA)

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
    _assert_no_host_sync(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for case, splits in {
        "skewed+padding": [0, 1000, 24, 0, 500, 300, 0, 24] + [0] * (N - 8),
        "all-on-one": [0, 0, 0, M, 0, 0, 0, 0],
    }.items():
        static_splits.copy_(torch.tensor(splits))
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: t.clone() for k, t in static.items()}
        eager = step()
        for k in replayed:
            assert torch.equal(replayed[k], eager[k]), f"{case}: replayed {k} differs from eager"
        assert torch.count_nonzero(replayed["out"][sum(splits) :]) == 0
