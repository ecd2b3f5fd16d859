"""The `triton` backend through the public ops and modules, under the Triton interpreter on CPU
(float32 operands: the 3.6 interpreter computes bf16 tl.dot wrongly). Outputs and every gradient
against the float64 references, on the edge cases of the contract, with host and device-style
offsets."""

from __future__ import annotations

import pytest
import torch

import moekit
from helpers import (
    check_against_reference,
    rand,
    rel_err,
    tolerance_floor,
    torch_glu,
    torch_grouped_linear,
    torch_grouped_mlp,
)
from moekit.ops.activations import ACTIVATIONS
from moekit.ops.runtime.backends import backend_named
from moekit.ops.splits import device_offsets
from moekit.reference import glu_reference, grouped_linear_reference, grouped_mlp_reference

pytestmark = pytest.mark.skipif(
    backend_named("triton").unavailable_reason(torch.empty(1, 8), torch.empty(1, 8, 8)) is not None,
    reason="triton backend cannot run here (needs CUDA or TRITON_INTERPRET=1)",
)

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
        inputs,
        torch.float32,
    )
    used = sum(m_splits)
    assert torch.equal(out["out"][used:], torch.zeros(rows - used, 20))
    assert torch.equal(out["x"][used:], torch.zeros(rows - used, 24))


def test_grouped_mlp_triton_device_offsets_and_discrete_weights():
    """GroupedMLP with per-expert weights, probs and biases, offsets as the device path builds them."""
    m_splits, rows = [5, 0, 6], 13
    torch.manual_seed(0)
    mlp = moekit.GroupedMLP(3, 16, 12, bias=True, single_grouped_weight=False, backend="triton", glu_interleave_size=4)
    offsets = device_offsets(torch.tensor(m_splits), 3, rows, torch.device("cpu"))
    x = rand(rows, 16, seed=4).requires_grad_()
    probs = rand(rows, seed=5).abs().requires_grad_()
    y = mlp(x, offsets, probs=probs)
    dy = rand(rows, 16, seed=6)
    y.backward(dy)

    params = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters()}
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    stack = lambda fc, kind: [params[f"{fc}.{kind}{i}"] for i in range(3)]  # noqa: E731
    y64 = grouped_mlp_reference(
        x64,
        stack("fc1", "weight"),
        stack("fc2", "weight"),
        m_splits,
        probs=p64,
        fc1_bias=stack("fc1", "bias"),
        fc2_bias=stack("fc2", "bias"),
        glu_interleave_size=4,
    )
    y64.backward(dy.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    assert rel(y, y64) < 1e-5
    assert rel(x.grad, x64.grad) < 1e-5 and rel(probs.grad, p64.grad) < 1e-5
    for name, p in mlp.named_parameters():
        assert rel(p.grad, params[name].grad) < 1e-5, name
    # fp32 torch-ops twin, as a sanity check of the reference itself
    twin = torch_grouped_mlp(
        x.detach().double(),
        stack("fc1", "weight"),
        stack("fc2", "weight"),
        m_splits,
        probs=probs.detach().double(),
        fc1_bias=stack("fc1", "bias"),
        fc2_bias=stack("fc2", "bias"),
        glu_interleave_size=4,
    )
    assert rel(twin, y64.detach()) < 1e-12


# --------------------------------------------------------------------------------------------------
# grouped_mlp on the triton backend: the fused kernels (fc1 + activation epilogue, fc2 dgrad +
# activation-backward epilogue) through the public op, against the float64 reference
# --------------------------------------------------------------------------------------------------

MLP_SPLITS = {  # (m_splits, rows): 3 experts, tiles of 16 rows under the interpreter
    "empty-first-padding": ([0, 13, 6], 23),
    "empty-middle": ([9, 0, 8], 17),
    "empty-last": ([11, 6, 0], 17),
    "one-row": ([0, 1, 0], 3),
}


def _mlp_inputs(rows, hidden, ffn, experts, *, bias, probs, scale=1.0):
    inputs = {
        "x": rand(rows, hidden, seed=11, scale=scale),
        "fc1_weight": rand(experts, 2 * ffn, hidden, seed=12, scale=hidden**-0.5),
        "fc2_weight": rand(experts, hidden, ffn, seed=13, scale=ffn**-0.5),
    }
    if bias:
        inputs["fc1_bias"] = rand(experts, 2 * ffn, seed=14)
        inputs["fc2_bias"] = rand(experts, hidden, seed=15)
    if probs:
        inputs["probs"] = rand(rows, seed=16).abs()
    return inputs


def _check_mlp(m_splits, rows, inputs, **kw):
    def ours(**t):
        return moekit.grouped_mlp(
            t.pop("x"), t.pop("fc1_weight"), t.pop("fc2_weight"), m_splits, backend="triton", **t, **kw
        )

    out = check_against_reference(
        ours,
        lambda **t: torch_grouped_mlp(t.pop("x"), t.pop("fc1_weight"), t.pop("fc2_weight"), m_splits, **t, **kw),
        lambda **t: grouped_mlp_reference(t.pop("x"), t.pop("fc1_weight"), t.pop("fc2_weight"), m_splits, **t, **kw),
        inputs,
        torch.float32,
    )
    used = sum(m_splits)
    assert torch.equal(out["out"][used:], torch.zeros(rows - used, inputs["x"].shape[1])), "padding rows"
    assert torch.equal(out["x"][used:], torch.zeros(rows - used, inputs["x"].shape[1])), "padding rows' dx"
    if "probs" in out:
        assert torch.equal(out["probs"][used:], torch.zeros(rows - used)), "padding rows' d probs"
    for g, m in enumerate(m_splits):  # experts without rows: zero gradients, not None
        if m == 0:
            assert not out["fc1_weight"][g].any() and not out["fc2_weight"][g].any()
    return out


@pytest.mark.parametrize("interleave", [None, 1, 2, 4, 16], ids=["gate|up", "k1", "k2", "k4", "k16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_grouped_mlp_triton_fused_activations_and_layouts(activation, interleave, nan_poison):
    """Both activations on every GLU layout (k < tile: pointer epilogue; k = F or a multiple of
    the tile: TMA epilogue), biases and probs, an empty expert and padding rows. x is scaled so
    that many pre-activations pass the clamp limit (7) of clamped_swiglu."""
    inputs = _mlp_inputs(23, 24, 32, 3, bias=True, probs=True, scale=4.0)
    _check_mlp([0, 13, 6], 23, inputs, activation=activation, glu_interleave_size=interleave)


@pytest.mark.parametrize("case", list(MLP_SPLITS), ids=list(MLP_SPLITS))
@pytest.mark.parametrize("bias,probs", [(False, False), (True, False), (False, True)], ids=["plain", "bias", "probs"])
def test_grouped_mlp_triton_fused_edges(case, bias, probs, nan_poison):
    m_splits, rows = MLP_SPLITS[case]
    # F = 40: not a multiple of the 16-column tile; H = 24.
    _check_mlp(m_splits, rows, _mlp_inputs(rows, 24, 40, 3, bias=bias, probs=probs))


@pytest.mark.parametrize(
    "ffn,interleave",
    [(4, None), (8, None), (8, 2), (12, None), (12, 4), (20, None)],
    ids=["F4", "F8", "F8-k2", "F12", "F12-k4", "F20"],
)
def test_grouped_mlp_triton_narrow_ffn(ffn, interleave, nan_poison):
    """F narrower than (or not a power-of-two multiple of) the column tile: weight boxes past the
    last GLU block read zeros, epilogue boxes under 16 bytes fall back to pointer stores (these
    shapes failed at launch before)."""
    _check_mlp([5, 0, 9], 16, _mlp_inputs(16, 24, ffn, 3, bias=True, probs=True), glu_interleave_size=interleave)


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "discrete"])
def test_grouped_mlp_triton_one_expert(single_grouped_weight, nan_poison):
    inputs = _mlp_inputs(21, 16, 24, 1, bias=True, probs=True)
    if not single_grouped_weight:
        inputs = {k: (list(v.unbind(0)) if k != "x" and k != "probs" else v) for k, v in inputs.items()}
    _check_mlp([19], 21, inputs)


def test_grouped_mlp_triton_saves_x_itself_and_h_only():
    """What the forward keeps for the backward: x as the caller's tensor (saved-tensor hooks can
    replace it), h (M, 2F) in x's dtype, probs and the weights; no (M, F) activation, nothing in fp32."""
    rows, hidden, ffn = 20, 16, 24
    t = _mlp_inputs(rows, hidden, ffn, 3, bias=False, probs=True)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    packed = []

    def pack(saved):
        packed.append(saved)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        moekit.grouped_mlp(
            leaves["x"], leaves["fc1_weight"], leaves["fc2_weight"], [7, 0, 13], probs=leaves["probs"], backend="triton"
        )
    assert any(s is leaves["x"] for s in packed), "x must be saved as the caller's tensor"
    shapes = sorted(tuple(s.shape) for s in packed if s.dim() == 2)
    assert shapes == [(rows, hidden), (rows, 2 * ffn)], shapes
    assert all(s.dtype == torch.float32 for s in packed if s.is_floating_point())  # nothing wider than x
    assert all(tuple(s.shape) == (4,) for s in packed if not s.is_floating_point()), "only the (N+1,) offsets"


def test_grouped_mlp_triton_h_is_released_before_fc1_backward(monkeypatch):
    """The fused MLP is two autograd nodes: fc2's (which yields dh) frees the saved h (M, 2F)
    before fc1's dgrad and wgrad run, as plain PyTorch's composition frees its h after the SwiGLU
    backward. Checked when fc1's dgrad is launched: nothing refers to h any more."""
    import gc
    import weakref

    from moekit.ops.runtime import gemm as grouped_gemm

    rows, hidden, ffn = 20, 16, 24
    t = _mlp_inputs(rows, hidden, ffn, 3, bias=True, probs=True)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    saved_h = []

    def pack(saved):
        if tuple(saved.shape) == (rows, 2 * ffn):
            saved_h.append(weakref.ref(saved))
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        y = moekit.grouped_mlp(
            leaves.pop("x"), leaves.pop("fc1_weight"), leaves.pop("fc2_weight"), [7, 0, 13], **leaves, backend="triton"
        )
    assert len(saved_h) == 1 and saved_h[0]() is not None, "h is saved once for the backward"
    alive_at_fc1_dgrad = []
    original = grouped_gemm.grouped_gemm_dgrad

    def dgrad(dy, w, offs, *args, **kwargs):
        if tuple(dy.shape) == (rows, 2 * ffn):  # fc1's dgrad: its incoming gradient is dh
            gc.collect()
            alive_at_fc1_dgrad.append(saved_h[0]() is not None)
        return original(dy, w, offs, *args, **kwargs)

    monkeypatch.setattr(grouped_gemm, "grouped_gemm_dgrad", dgrad)
    y.backward(rand(rows, hidden, seed=17))
    assert alive_at_fc1_dgrad == [False], "h is still held when fc1's backward runs"


@pytest.mark.parametrize("glu_interleave_size", [None, 1], ids=["gate|up", "k1"])
def test_transposed_weight_views_give_the_contiguous_results(glu_interleave_size):
    """transformers' gpt-oss keeps gate_up_proj (N, H, 2F) and down_proj (N, F, H); moekit takes their
    transposed views as they are (no copy): the fused MLP gives the contiguous weights' output and
    x, probs and bias gradients bit for bit. The weights' gradients come back in the parameters'
    (N, H, 2F) and (N, F, H) layout, computed as dw^T = x^T dy (no copy into that layout afterwards):
    the interpreter's dot sums a block in an order that depends on its operands' layout, so here they
    agree within fp32 rounding (the GPU test `test_gpu_transposed_weight_grads_are_bit_equal` asks for
    the same bits)."""
    t = _mlp_inputs(20, 16, 24, 3, bias=True, probs=True)
    stored1 = t["fc1_weight"].transpose(1, 2).contiguous()  # (N, H, 2F)
    stored2 = t["fc2_weight"].transpose(1, 2).contiguous()  # (N, F, H)
    dy = rand(20, 16, seed=41)
    results, strides = [], []
    for transposed in (False, True):
        w1 = stored1.clone().requires_grad_()
        w2 = stored2.clone().requires_grad_()
        v1, v2 = w1.transpose(1, 2), w2.transpose(1, 2)
        if not transposed:
            v1, v2 = v1.contiguous(), v2.contiguous()
        else:  # what reaches the views' backward: the gradients in the stored layout already
            for v in (v1, v2):
                v.register_hook(lambda g, v=v: strides.append(g.stride() == v.stride()))
        leaves = {k: t[k].clone().requires_grad_() for k in ("x", "probs", "fc1_bias", "fc2_bias")}
        y = moekit.grouped_mlp(
            leaves["x"], v1, v2, [7, 0, 13], probs=leaves["probs"], fc1_bias=leaves["fc1_bias"],
            fc2_bias=leaves["fc2_bias"], glu_interleave_size=glu_interleave_size, backend="triton",
        )  # fmt: skip
        y.backward(dy)
        results.append([y.detach(), *(v.grad for v in leaves.values()), w1.grad, w2.grad])
    assert strides == [True, True]
    for a, b in zip(results[0][:-2], results[1][:-2], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(results[0][-2:], results[1][-2:], strict=True):
        assert rel_err(a, b) <= tolerance_floor(torch.float32, 20)


GATED_CASES = {  # (rows, F, glu_interleave_size): row tiles of 4 and column steps of 8 under the interpreter
    "k=None": (13, 12, None),
    "k=1": (13, 12, 1),
    "k=3": (9, 12, 3),
    "k=F": (5, 12, 12),
    "one-row": (1, 20, None),
    "no-rows": (0, 12, 2),
}


@pytest.mark.parametrize("case", list(GATED_CASES), ids=list(GATED_CASES))
@pytest.mark.parametrize("with_probs", [False, True], ids=["no-probs", "probs"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_glu_kernel_matches_reference(dtype, activation, with_probs, case, nan_poison):
    """The gated-activation kernel (the composed MLP's activation, `glu(backend="triton")`): output, dh
    and d probs against float64, every GLU order, a partial column step, rows past a tile."""
    rows, ffn, k = GATED_CASES[case]
    inputs = {"h": rand(rows, 2 * ffn, scale=4.0, seed=1)}  # scale 4: clamped_swiglu's limits are hit
    if with_probs:
        inputs["probs"] = rand(rows, seed=2).abs()

    def call(fn, **kw):
        return lambda h, probs=None: fn(h, probs=probs, glu_interleave_size=k, activation=activation, **kw)

    res = check_against_reference(
        call(moekit.glu, backend="triton"), call(torch_glu), call(glu_reference), inputs, dtype
    )
    assert not torch.isnan(res["h"]).any()


def test_glu_backend_torch_and_triton_agree_on_the_composed_mlp():
    """grouped_mlp composed (quantized: fc1 is not fused) takes the kernel on the triton backend: its
    output equals the same MLP with the activation in plain torch within one rounding."""
    x, w1, w2 = rand(11, 16, seed=1), rand(2, 24, 16, seed=2), rand(2, 16, 12, seed=3)
    h = moekit.grouped_linear(x, w1, [5, 6], backend="triton")
    ours = moekit.glu(h, backend="triton")
    theirs = moekit.glu(h, backend="torch")
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=2e-6)
    y = moekit.grouped_mlp(x, w1, w2, [5, 6], backend="triton", quantization="fp8_block")
    assert y.shape == (11, 16) and torch.isfinite(y).all()
