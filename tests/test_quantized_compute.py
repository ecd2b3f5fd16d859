"""Quantized compute (`quantization=` on grouped_linear, grouped_mlp, moe_experts, the modules,
apply_moekit and the demo): the FP8 bound against float64, the documented straight-through semantics
bit for bit, padding rows, master weights and state dicts, weights quantized once per optimizer step,
refusals in one line, torch.compile, and the demo's training.

The bound (issue 22): relative Frobenius error <= 0.08 of the output and of every gradient against the
float64 reference on unit-variance data; the quantized path runs in float32 here, so its error is the
quantization's (bf16 unquantized is about 0.004 at these shapes, FP8 0.04-0.07).

Legend: N experts, M routed rows, T tokens, K top-k, H hidden size, F ffn size."""

from __future__ import annotations

import copy
import gc
import itertools
import json
import weakref

import pytest
import torch

import moekit
from helpers import assert_no_host_sync, rand, rel_err
from moekit import reference
from moekit.grouped_tensor import recipe_named, rowwise_scale_shape
from moekit.ops.glu import from_held, to_held
from moekit.ops.quantize import QuantizedWeightCache
from moekit.ops.rows import ExpertRoute
from moekit.ops.runtime.backends import quantized_gemm_of, select_backend, triton_unavailable_reason

RECIPES = ["fp8_block", "fp8_rowwise", "mxfp8"]
BOUND = 0.08
TRITON_OK = triton_unavailable_reason(torch.device("cpu"), torch.float32) is None
TRITON_MARK = pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")

# (H, F, m_splits, padding rows): members of 0 rows, dims not multiples of 32 or 128, a group over 128 rows.
SHAPES = [
    pytest.param(96, 80, [40, 0, 97, 33, 1], 7, id="H96-F80-empty-middle-padding"),
    pytest.param(200, 130, [0, 150, 61], 0, id="H200-F130-empty-first-150-rows"),
    pytest.param(33, 70, [5, 0, 0, 90], 3, id="H33-F70-empty-middle-two"),
]


def _leaves(inputs: dict, dtype: torch.dtype, diff: set[str]) -> dict:
    return {
        k: v.detach().to(dtype).requires_grad_(k in diff) if v.is_floating_point() else v for k, v in inputs.items()
    }


def errors_against_float64(ours, ref64, inputs: dict, diff: set[str], dtype=torch.float32) -> dict[str, float]:
    """Relative errors of ours (in dtype) against the float64 reference on the same rounded inputs and
    upstream gradient: the output's and every differentiable input's gradient's."""
    rounded = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    mine, exact = _leaves(rounded, dtype, diff), _leaves(rounded, torch.float64, diff)
    y, y64 = ours(**mine), ref64(**exact)
    upstream = torch.randn(y64.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(upstream.to(y.dtype))
    y64.backward(upstream)
    errors = {"out": rel_err(y, y64)}
    for name in diff:
        assert mine[name].grad is not None, f"{name}: no gradient"
        errors[name] = rel_err(mine[name].grad, exact[name].grad)
    return errors


def mlp_inputs(hidden: int, ffn: int, m_splits: list[int], padding: int, seed: int = 0) -> dict:
    rows, n = sum(m_splits) + padding, len(m_splits)
    return dict(
        x=rand(rows, hidden, seed=seed, dtype=torch.float64),
        w1=rand(n, 2 * ffn, hidden, seed=seed + 1, dtype=torch.float64) / hidden**0.5,
        w2=rand(n, hidden, ffn, seed=seed + 2, dtype=torch.float64) / ffn**0.5,
        b1=rand(n, 2 * ffn, seed=seed + 3, dtype=torch.float64),
        b2=rand(n, hidden, seed=seed + 4, dtype=torch.float64),
        probs=torch.rand(rows, generator=torch.Generator().manual_seed(seed + 5), dtype=torch.float64),
    )


def assert_within_bound(errors: dict[str, float], what: str, exact: tuple[str, ...] = ()) -> None:
    """Every error within the bound; those not in `exact` (a bias gradient straight from dy) above
    float32's by far: quantized, not silently something else."""
    worst = max(errors, key=errors.get)
    assert errors[worst] <= BOUND, f"{what}: {worst} relative error {errors[worst]:.4f} > {BOUND} ({errors})"
    assert min(e for k, e in errors.items() if k not in exact) > 5e-3, f"{what}: errors too small for FP8: {errors}"


# --------------------------------------------------------------------------------------------------
# Accuracy: the FP8 bound against float64
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("hidden", "ffn", "m_splits", "padding"), SHAPES)
def test_grouped_linear_within_the_fp8_bound(recipe, hidden, ffn, m_splits, padding):
    inputs = mlp_inputs(hidden, ffn, m_splits, padding)
    inputs = {"x": inputs["x"], "w": inputs["w1"], "b": inputs["b1"]}
    errors = errors_against_float64(
        lambda x, w, b: moekit.grouped_linear(x, w, m_splits, b, quantization=recipe),
        lambda x, w, b: reference.grouped_linear_reference(x, w, m_splits, b),
        inputs,
        {"x", "w", "b"},
    )
    assert_within_bound(errors, f"grouped_linear {recipe}", exact=("b",))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("hidden", "ffn", "m_splits", "padding"), SHAPES)
def test_grouped_mlp_within_the_fp8_bound(recipe, hidden, ffn, m_splits, padding):
    kwargs = lambda b1, b2, probs: dict(probs=probs, fc1_bias=b1, fc2_bias=b2)  # noqa: E731
    errors = errors_against_float64(
        lambda x, w1, w2, b1, b2, probs: moekit.grouped_mlp(
            x, w1, w2, m_splits, quantization=recipe, **kwargs(b1, b2, probs)
        ),
        lambda x, w1, w2, b1, b2, probs: reference.grouped_mlp_reference(x, w1, w2, m_splits, **kwargs(b1, b2, probs)),
        mlp_inputs(hidden, ffn, m_splits, padding),
        {"x", "w1", "w2", "b1", "b2", "probs"},
    )
    assert_within_bound(errors, f"grouped_mlp {recipe}", exact=("b2",))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("hidden", "ffn", "num_experts", "tokens"), [(96, 80, 5, 160), (33, 130, 4, 97)])
def test_moe_experts_within_the_fp8_bound(recipe, hidden, ffn, num_experts, tokens):
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(tokens)])
    ids[ids == 1] = 0  # expert 1 gets no rows
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 2) % num_experts, ids[:, 1])
    inputs = mlp_inputs(hidden, ffn, [1] * num_experts, 0)
    inputs = dict(
        x=rand(tokens, hidden, seed=7, dtype=torch.float64),
        weights=torch.rand(tokens, 2, generator=g, dtype=torch.float64).softmax(-1),
        w1=inputs["w1"],
        w2=inputs["w2"],
    )
    errors = errors_against_float64(
        lambda x, weights, w1, w2: moekit.moe_experts(x, ids, weights, w1, w2, quantization=recipe),
        lambda x, weights, w1, w2: reference.moe_experts_reference(x, ids, weights, w1, w2),
        inputs,
        {"x", "weights", "w1", "w2"},
    )
    assert_within_bound(errors, f"moe_experts {recipe}")


# --------------------------------------------------------------------------------------------------
# What the quantized layer holds for its backward: h in FP8, x not copied, a not held
# --------------------------------------------------------------------------------------------------


def _held_by_layer(inputs: dict, recipe: str, backend: str) -> tuple[dict, list, dict]:
    """({storage address: (bytes, dtype, shape)} of what one moe_experts forward saves for its backward,
    the caller's tensors and the weight caches' excluded; weak references to those tensors; the
    (M, 2F)-shaped ones' dtypes; the leaves and y). The quantized layer moves its rows inside its nodes
    (an ExpertRoute: no saved-tensor hooks of its own), so every tensor it saves passes these hooks."""
    leaves = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in inputs.items()}
    caches = (QuantizedWeightCache(), QuantizedWeightCache())
    given = {t.untyped_storage().data_ptr() for t in leaves.values()}
    held, refs = {}, []

    def count(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in given:
            held[ptr] = (t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))
            refs.append(weakref.ref(t))

    with torch.autograd.graph.saved_tensors_hooks(lambda t: count(t) or t, lambda t: t):
        y = moekit.moe_experts(**leaves, quantization=recipe, backend=backend, weight_caches=caches)
    for cache in caches:  # the weights' quantizations: kept across steps, not per call
        kept = [*cache.quantized.storage(), *(cache.transposed or ())]
        for t in kept:
            if t is not None:
                held.pop(t.untyped_storage().data_ptr(), None)
    leaves["y"] = y
    return held, refs, leaves


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter"))],
)
def test_quantized_layer_holds_h_in_fp8_only(recipe, backend):
    """Between forward and backward the quantized layer holds h's rowwise FP8 quantization (data and
    scales) and the routing metadata, nothing else: not x's FP8 copy (made again in the backward from
    x, which the layer holds as a reference to the caller's rows), not a, not h in x's dtype. The bound
    is the formula, M*2F bytes of data, the recipe's scales, the metadata's bytes and 1 KiB; what is
    forbidden is each larger than that 1 KiB and the metadata, so holding any of it fails."""
    tokens, top_k, experts, hidden, ffn = 40, 2, 4, 48, 96
    rows = tokens * top_k
    inputs = mlp_inputs(hidden, ffn, [1] * experts, 0)
    g = torch.Generator().manual_seed(4)
    inputs = dict(
        x=rand(tokens, hidden, seed=5),
        topk_ids=torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]),
        topk_weights=torch.rand(tokens, top_k, generator=g).softmax(-1),
        fc1_weight=inputs["w1"].float(),
        fc2_weight=inputs["w2"].float(),
        fc1_bias=inputs["b1"].float(),
        fc2_bias=inputs["b2"].float(),
    )
    held, refs, leaves = _held_by_layer(inputs, recipe, backend)
    info = recipe_named(recipe)
    scales = torch.Size(rowwise_scale_shape(info, (rows, 2 * ffn))).numel() * info.scale_dtype.itemsize
    # probs (M,) fp32; the sorted order's int64 maps: token_of_row (M, 1), copy_of_row (M, 1), row_map
    # (T, K); offsets and group sizes (N + 1,) and (N,) int64.
    metadata = rows * 4 + 3 * rows * 8 + 2 * (experts + 1) * 8
    bound = rows * 2 * ffn + scales + metadata + 1024
    total = sum(nbytes for nbytes, _, _ in held.values())
    assert total <= bound, f"{recipe}: holds {total} bytes, over {bound}: {sorted(held.values(), key=str)}"
    forbidden = {"x's FP8 copy": rows * hidden, "a in FP8": rows * ffn}
    assert min(forbidden.values()) > metadata + 1024, "the shapes must make each forbidden tensor count"
    shaped = [(dtype, shape) for _, dtype, shape in held.values() if rows in shape[:1]]
    assert all(
        shape[1:] in ((), (1,), (2 * ffn,), scales and rowwise_scale_shape(info, (rows, 2 * ffn))[1:])
        for _, shape in shaped
    ), shaped
    assert [dtype for dtype, shape in shaped if shape == (rows, 2 * ffn)] == [torch.float8_e4m3fn], shaped
    leaves["y"].backward(rand(tokens, hidden, seed=6))
    assert all(leaves[k].grad is not None for k in ("x", "topk_weights", "fc1_weight", "fc2_weight", "fc1_bias"))
    gc.collect()
    assert all(r() is None for r in refs), "a saved tensor outlives the backward"


@pytest.mark.parametrize("recipe", RECIPES)
def test_x_is_gathered_again_after_fp8_h_is_freed(recipe, monkeypatch):
    """The backward's order: fc1's node gathers x's sorted rows again (its route's `to_rows` on the token
    rows) only after the activation's node has run its backward and freed FP8 h, so the two are never
    alive together (nor x's rows with dy's quantizations); and the forward never gathers x's rows in
    x's dtype (fc1's operand is quantized from the token rows, its bytes gathered)."""
    tokens, top_k, experts, hidden, ffn = 24, 2, 3, 32, 48
    g = torch.Generator().manual_seed(2)
    leaves = dict(
        x=rand(tokens, hidden, seed=1).requires_grad_(True),
        topk_ids=torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]),
        topk_weights=torch.rand(tokens, top_k, generator=g).requires_grad_(True),
        fc1_weight=(rand(experts, 2 * ffn, hidden, seed=2) / hidden**0.5).requires_grad_(True),
        fc2_weight=(rand(experts, hidden, ffn, seed=3) / ffn**0.5).requires_grad_(True),
    )
    h_refs, alive_at_gather = [], []
    to_rows = ExpertRoute.to_rows

    def watched_to_rows(route, t):
        if t.untyped_storage().data_ptr() == leaves["x"].untyped_storage().data_ptr():  # x's rows
            gc.collect()
            alive_at_gather.append(sum(r() is not None for r in h_refs))
        return to_rows(route, t)

    def watched_pack(t):
        if t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (tokens * top_k, 2 * ffn):
            h_refs.append(weakref.ref(t))
        return t

    monkeypatch.setattr(ExpertRoute, "to_rows", watched_to_rows)
    with torch.autograd.graph.saved_tensors_hooks(watched_pack, lambda t: t):
        y = moekit.moe_experts(**leaves, quantization=recipe, backend="torch")
    assert len(h_refs) == 1 and h_refs[0]() is not None  # FP8 h, held
    assert alive_at_gather == [], "the forward gathered x's rows in x's dtype"
    y.backward(rand(tokens, hidden, seed=4))
    assert alive_at_gather == [0], f"FP8 h alive when x was gathered again: {alive_at_gather}"
    assert leaves["x"].grad is not None and leaves["fc1_weight"].grad is not None


@pytest.mark.parametrize("recipe", RECIPES)
def test_fc1s_dgrad_rows_are_freed_before_its_weight_gradient(recipe, monkeypatch):
    """Node 1's backward runs the dgrad first: dx's (M, H) rows (summed into token order) and dh's
    rowwise FP8 form are freed before x's columnwise form and dw1 are made, so the backward's peak does
    not hold them beside dw1."""
    from moekit.ops import quantized_mlp

    dgrad, wgrad = quantized_mlp.quantized_dgrad_product, quantized_mlp.quantized_wgrad_product
    rows, alive = [], []

    def dgrad_spy(*args):
        out = dgrad(*args)
        rows.append(weakref.ref(out))
        return out

    def wgrad_spy(*args):
        alive.append([r() is not None for r in rows])
        return wgrad(*args)

    monkeypatch.setattr(quantized_mlp, "quantized_dgrad_product", dgrad_spy)
    monkeypatch.setattr(quantized_mlp, "quantized_wgrad_product", wgrad_spy)
    g = torch.Generator().manual_seed(4)
    x = rand(19, 40, seed=1).requires_grad_(True)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(19)])
    w1 = (rand(4, 48, 40, seed=2) / 40**0.5).requires_grad_(True)
    w2 = (rand(4, 40, 24, seed=3) / 24**0.5).requires_grad_(True)
    y = moekit.moe_experts(x, ids, torch.rand(19, 2, generator=g), w1, w2, quantization=recipe, backend="torch")
    y.backward(rand(19, 40, seed=5))
    # node 2's wgrad (no dgrad of node 1 yet), then node 1's: after its dgrad, whose rows are dead
    assert len(rows) == 2 and alive[-1] == [False, False], (len(rows), alive)


@pytest.mark.parametrize("quantized_wgrad", [True, False])
def test_fc1s_incoming_dh_is_freed_once_its_fp8_forms_are_made(quantized_wgrad, monkeypatch):
    """dh, which node 2 makes for node 1 alone and the engine would hold through node 1's whole
    backward, has its memory freed as soon as its FP8 forms exist (with the FP8 wgrad), so it is not
    alive beside dw1 (the quantized layer's peak at large F). With `quantized_wgrad=False` dh is the
    wgrad's operand and stays. The results are checked against the float64 reference elsewhere; here
    that the gradients still come out finite and complete."""
    from moekit.ops import quantized_mlp

    made, seen = [], []
    backward = quantized_mlp.gated_activation_backward

    def backward_spy(*args):
        dh, d_probs = backward(*args)
        made.append(dh)
        return dh, d_probs

    def wgrad_spy(name):
        inner = getattr(quantized_mlp, name)

        def spy(*args, **kwargs):
            seen.append([t.untyped_storage().nbytes() for t in made])
            return inner(*args, **kwargs)

        monkeypatch.setattr(quantized_mlp, name, spy)

    monkeypatch.setattr(quantized_mlp, "gated_activation_backward", backward_spy)
    wgrad_spy("quantized_wgrad_product")
    wgrad_spy("wgrad_in_layout")
    g = torch.Generator().manual_seed(4)
    x = rand(19, 40, seed=1).requires_grad_(True)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(19)])
    w1 = (rand(4, 48, 40, seed=2) / 40**0.5).requires_grad_(True)
    w2 = (rand(4, 40, 24, seed=3) / 24**0.5).requires_grad_(True)
    y = moekit.moe_experts(
        x, ids, torch.rand(19, 2, generator=g), w1, w2, quantization="fp8_block", backend="torch",
        quantized_wgrad=quantized_wgrad,
    )  # fmt: skip
    y.backward(rand(19, 40, seed=5))
    # node 2's wgrad (before dh exists), then node 1's, after its dgrad
    assert len(made) == 1 and len(seen) == 2 and seen[0] == [], (len(made), seen)
    dh_bytes = 19 * 2 * 48 * 4
    assert seen[1] == [0 if quantized_wgrad else dh_bytes], seen
    assert made[0].untyped_storage().nbytes() == (0 if quantized_wgrad else dh_bytes)
    for t in (x, w1, w2):
        assert t.grad is not None and torch.isfinite(t.grad).all()


@pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_mlp_on_triton_matches_the_reference_path(recipe):
    """The quantized MLP on the triton backend (its FP8 kernels where `fp8_compute` holds, its
    quantizer, the gated kernels; interleaved gpt-oss activation with biases) against the torch
    backend's reference path: the same quantized operands, the sums in other orders."""
    m_splits, ffn = [20, 0, 13], 64
    inputs = mlp_inputs(40, ffn, m_splits, 3)
    results = []
    for backend in ("triton", "torch"):
        leaves = {k: v.float().requires_grad_(True) for k, v in inputs.items()}
        y = moekit.grouped_mlp(
            leaves["x"],
            leaves["w1"],
            leaves["w2"],
            m_splits,
            probs=leaves["probs"],
            fc1_bias=leaves["b1"],
            fc2_bias=leaves["b2"],
            activation="clamped_swiglu",
            glu_interleave_size=1,
            backend=backend,
            quantization=recipe,
        )
        y.backward(rand(*y.shape, seed=9))
        results.append([y, *(leaves[k].grad for k in inputs)])
    for name, got, want in zip(["y", *inputs], *results, strict=True):
        assert rel_err(got, want) < 1e-4, name


@pytest.mark.parametrize("glu_interleave_size", [None, 1, 4])
def test_held_form_keeps_every_value_on_its_side_of_the_clamps(glu_interleave_size):
    """gpt-oss's clamps (gate <= 7, |up| <= 7) through to_held, an FP8 rounding and from_held: the
    activation and its derivative are those of h rounded, never those of a value moved across a limit;
    an activation without clamps holds h itself."""
    rows, ffn = 64, 32
    h = torch.linspace(-9, 9, rows * 2 * ffn).reshape(rows, 2 * ffn)
    h = h[torch.randperm(rows, generator=torch.Generator().manual_seed(0))]
    assert to_held(h, glu_interleave_size, "swiglu") is h and from_held(h, glu_interleave_size, "swiglu") is h
    for recipe in RECIPES:
        h_q = moekit.group_quantize(to_held(h, glu_interleave_size, "clamped_swiglu"), [rows], recipe)
        back = from_held(h_q.dequantize(), glu_interleave_size, "clamped_swiglu")
        gate, up = moekit.ops.glu.split_gate_up(h, glu_interleave_size)
        gate_b, up_b = moekit.ops.glu.split_gate_up(back, glu_interleave_size)
        assert torch.equal(gate > 7, gate_b > 7) and torch.equal(up.abs() > 7, up_b.abs() > 7), recipe
        inner = (gate <= 7) & (gate_b <= 7)
        assert rel_err(gate_b[inner], gate[inner]) < 0.05 and rel_err(up_b.clamp(-7, 7), up.clamp(-7, 7)) < 0.05
        # Without the held form the rounding does move values across (the check above means something).
        plain = moekit.group_quantize(h, [rows], recipe).dequantize()
        gate_p, _ = moekit.ops.glu.split_gate_up(plain, glu_interleave_size)
        assert not torch.equal(gate > 7, gate_p > 7), recipe


# --------------------------------------------------------------------------------------------------
# The documented semantics, bit for bit
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_straight_through_semantics(recipe):
    """y = Q(x) Q(w)^T + b; dx = Q(dy) Qc(w); dw = Qc(dy)^T Qc(x); db from dy itself; padding rows zero:
    bit for bit the unquantized op on those dequantized operands."""
    m_splits, rows = [20, 0, 45], 70
    x = rand(rows, 40, seed=1).requires_grad_(True)
    w = rand(3, 24, 40, seed=2).requires_grad_(True)
    b = rand(3, 24, seed=3).requires_grad_(True)
    dy = rand(rows, 24, seed=4)
    y = moekit.grouped_linear(x, w, m_splits, b, quantization=recipe, backend="torch")
    y.backward(dy)

    x_q = moekit.group_quantize(x.detach(), m_splits, recipe, columnwise=True)
    w_q = moekit.group_quantize(w.detach(), None, recipe, columnwise=recipe != "fp8_block")
    dy_q = moekit.group_quantize(dy, m_splits, recipe, columnwise=True)
    w_dgrad = w_q.dequantize(columnwise=recipe != "fp8_block")
    assert torch.equal(y, moekit.grouped_linear(x_q.dequantize(), w_q.dequantize(), m_splits, b, backend="torch"))
    x_leaf = x_q.dequantize().requires_grad_(True)
    moekit.grouped_linear(x_leaf, w_dgrad, m_splits, backend="torch").backward(dy_q.dequantize())
    assert torch.equal(x.grad, x_leaf.grad)
    w_leaf, b_leaf = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    moekit.grouped_linear(x_q.dequantize(columnwise=True), w_leaf, m_splits, backend="torch").backward(
        dy_q.dequantize(columnwise=True)
    )
    assert torch.equal(w.grad, w_leaf.grad)
    moekit.grouped_linear(x.detach(), w.detach(), m_splits, b_leaf, backend="torch").backward(dy)
    assert torch.equal(b.grad, b_leaf.grad)
    assert y[65:].eq(0).all() and x.grad[65:].eq(0).all()  # padding rows


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter"))],
)
@pytest.mark.parametrize("recipe", RECIPES)
def test_layer_moves_rows_as_permute_grouped_mlp_unpermute(recipe, backend):
    """moe_experts' quantized nodes move the rows themselves (fc1's operand quantized from the token rows,
    its bytes gathered; y summed back in node 2): output and every gradient bit for bit the composition
    `permute`, `grouped_mlp(quantization=...)`, `unpermute` on the same rows, with an expert left empty
    and an odd width. The interleaved clamped activation with biases covers the held form's clamps."""
    tokens, top_k, experts, hidden, ffn = 23, 3, 5, 40, 48
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, 2] = -1.0  # expert 2 gets no token
    inputs = dict(
        x=rand(tokens, hidden, seed=1),
        topk_weights=torch.rand(tokens, top_k, generator=g),
        fc1_weight=rand(experts, 2 * ffn, hidden, seed=2) / hidden**0.5,
        fc2_weight=rand(experts, hidden, ffn, seed=3) / ffn**0.5,
        fc1_bias=rand(experts, 2 * ffn, seed=4),
        fc2_bias=rand(experts, hidden, seed=5),
    )
    ids = scores.topk(top_k, dim=-1).indices
    options = dict(activation="clamped_swiglu", glu_interleave_size=1, backend=backend, quantization=recipe)
    dy = rand(tokens, hidden, seed=6)
    results = []
    for composed in (False, True):
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        biases = dict(fc1_bias=leaves["fc1_bias"], fc2_bias=leaves["fc2_bias"])
        if composed:
            x_sorted, counts, row_map = moekit.permute(leaves["x"], ids, experts)
            probs = leaves["topk_weights"].reshape(-1)[row_map.reshape(-1).argsort()]
            y_sorted = moekit.grouped_mlp(
                x_sorted, leaves["fc1_weight"], leaves["fc2_weight"], counts, probs=probs, **biases, **options
            )
            y = moekit.unpermute(y_sorted, row_map)
        else:
            y = moekit.moe_experts(
                leaves["x"], ids, leaves["topk_weights"], leaves["fc1_weight"], leaves["fc2_weight"], **biases,
                **options,
            )  # fmt: skip
        y.backward(dy)
        results.append([y, *(leaves[k].grad for k in inputs)])
    for name, a, b in zip(["out", *inputs], *results, strict=True):
        assert torch.equal(a, b), f"{name}: {(a != b).sum()} values differ"


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter"))],
)
@pytest.mark.parametrize("tokens", [0, 1])
@pytest.mark.parametrize("quantized_wgrad", [True, False])
def test_quantized_layer_takes_no_tokens_and_one_token(tokens, backend, quantized_wgrad):
    """The route's edges: no token (every expert empty: the outputs and x's gradient are empty, the
    weights' and biases' gradients zero) and one token (two experts of four used), for every recipe,
    with and without biases (fc2's bias gradient and d probs' bias term read d out through the route),
    with the quantized weight gradients and without.

    The one token's output is checked against its own row in a batch of eight tokens: the forward
    quantizes x and the activation by rows (and the weights alone), so a token's output depends on that
    token only. (The FP8 bound itself is checked at the other tests' sizes: on one token's 40 outputs the
    relative error is a sample of 40 and spreads past 0.08 on some draws: mxfp8's median 0.07.)"""
    g = torch.Generator().manual_seed(9)
    for recipe, bias in itertools.product(RECIPES, (False, True)):
        x = rand(tokens, 40, seed=1).requires_grad_(True)
        ids = torch.tensor([[2, 0]] * tokens, dtype=torch.int64).reshape(tokens, 2)
        weights = torch.rand(tokens, 2, generator=g).requires_grad_(True)
        w1 = (rand(4, 48, 40, seed=2) / 40**0.5).requires_grad_(True)
        w2 = (rand(4, 40, 24, seed=3) / 24**0.5).requires_grad_(True)
        b1, b2 = (rand(4, 48, scale=0.5, seed=5), rand(4, 40, scale=0.5, seed=6)) if bias else (None, None)
        b1, b2 = (b.requires_grad_(True) if b is not None else None for b in (b1, b2))
        biases = dict(fc1_bias=b1, fc2_bias=b2)
        options = dict(quantization=recipe, quantized_wgrad=quantized_wgrad, backend=backend)
        y = moekit.moe_experts(x, ids, weights, w1, w2, **biases, **options)
        y.backward(rand(tokens, 40, seed=4))
        assert y.shape == (tokens, 40) and x.grad.shape == (tokens, 40) and weights.grad.shape == (tokens, 2)
        assert torch.isfinite(y).all() and torch.isfinite(w1.grad).all() and torch.isfinite(w2.grad).all()
        assert torch.isfinite(x.grad).all() and torch.isfinite(weights.grad).all()
        used = w1.grad.flatten(1).abs().sum(1) > 0
        assert used.tolist() == ([True, False, True, False] if tokens else [False] * 4), recipe
        if bias:
            assert b2.grad is not None and torch.isfinite(b2.grad).all()
            assert (b2.grad.abs().sum(1) > 0).tolist() == used.tolist(), recipe
        if tokens:
            others = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
            with torch.no_grad():
                batch = moekit.moe_experts(
                    torch.cat([x, rand(7, 40, seed=7)]), torch.cat([ids, others]),
                    torch.cat([weights, torch.rand(7, 2, generator=g)]), w1, w2, **biases, **options,
                )  # fmt: skip
            assert rel_err(y, batch[:1]) < 1e-5, recipe


def test_quantization_is_an_argument_and_none_is_unquantized():
    inputs = mlp_inputs(48, 40, [10, 20], 2)
    x, w1, w2 = inputs["x"].float(), inputs["w1"].float(), inputs["w2"].float()
    plain = moekit.grouped_mlp(x, w1, w2, [10, 20])
    assert torch.equal(moekit.grouped_mlp(x, w1, w2, [10, 20], quantization=None), plain)
    results = {r: moekit.grouped_mlp(x, w1, w2, [10, 20], quantization=r) for r in RECIPES}
    for r, y in results.items():
        assert not torch.equal(y, plain) and rel_err(y[:30], plain[:30]) < BOUND, r
    assert not torch.equal(results["mxfp8"], results["fp8_block"])


@pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("recipe", RECIPES)
def test_triton_backend_quantizes_with_its_kernels(recipe, monkeypatch):
    from moekit.ops.runtime import quantize as triton_quantize

    calls = []
    inner = triton_quantize.group_quantize_into
    monkeypatch.setattr(triton_quantize, "group_quantize_into", lambda *a: calls.append(a[0]) or inner(*a))
    m_splits = [20, 0, 13]
    x, w = rand(36, 40, seed=1).requires_grad_(True), rand(3, 24, 40, seed=2).requires_grad_(True)
    y = moekit.grouped_linear(x, w, m_splits, quantization=recipe, backend="triton")
    y.sum().backward()
    assert calls  # x, the weight and dy through moekit's kernels
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y2 = moekit.grouped_linear(x2, w2, m_splits, quantization=recipe, backend="torch")
    y2.sum().backward()
    for got, want in ((y, y2), (x.grad, x2.grad), (w.grad, w2.grad)):
        assert rel_err(got, want) < 1e-5  # the same quantized operands; the GEMMs' sums in other orders


# --------------------------------------------------------------------------------------------------
# Modules: master weights, state dicts, weights quantized once per step
# --------------------------------------------------------------------------------------------------


def _experts_args(layer):
    mlp = layer.experts if isinstance(layer, moekit.MoELayer) else layer
    return mlp.fc1.weights(), mlp.fc2.weights()


@pytest.mark.parametrize("recipe", RECIPES)
def test_modules_match_the_functional_ops(recipe):
    torch.manual_seed(0)
    linear = moekit.GroupedLinear(3, 40, 24, quantization=recipe)
    x, m_splits = rand(30, 40, seed=1), [10, 0, 17]
    assert torch.equal(
        linear(x, m_splits), moekit.grouped_linear(x, linear.weights(), m_splits, linear.biases(), quantization=recipe)
    )
    assert f"quantization='{recipe}'" in repr(linear)
    mlp = moekit.GroupedMLP(3, 40, 32, bias=True, quantization=recipe)
    want = moekit.grouped_mlp(
        x, *_experts_args(mlp), m_splits, fc1_bias=mlp.fc1.biases(), fc2_bias=mlp.fc2.biases(), quantization=recipe
    )
    assert torch.equal(mlp(x, m_splits), want)
    layer = moekit.MoELayer(40, 32, 4, 2, quantization=recipe)
    tokens = rand(2, 9, 40, seed=2)
    routing = layer.route(tokens.reshape(-1, 40))
    want = moekit.moe_experts(
        tokens.reshape(-1, 40), routing.ids, routing.weights, *_experts_args(layer), quantization=recipe
    )
    assert torch.equal(layer(tokens).reshape(-1, 40), want)
    assert layer.experts.quantization == recipe and layer.experts.options()["quantization"] == recipe


@pytest.mark.parametrize("recipe", RECIPES)
def test_state_dicts_are_the_same_with_or_without_quantization(recipe):
    torch.manual_seed(0)
    plain = moekit.MoELayer(40, 32, 4, 2, bias=True)
    torch.manual_seed(0)
    quantized = moekit.MoELayer(40, 32, 4, 2, bias=True, quantization=recipe)
    sd_plain, sd_quant = plain.state_dict(), quantized.state_dict()
    assert sd_plain.keys() == sd_quant.keys()
    for key in sd_plain:
        if isinstance(sd_plain[key], torch.Tensor):
            assert sd_quant[key].dtype == torch.float32 and torch.equal(sd_plain[key], sd_quant[key]), key
        else:
            assert sd_plain[key] == sd_quant[key], key
    tokens = rand(16, 40, seed=3)
    # Both ways: a quantized module loads an unquantized one's state and back, and computes as it should.
    torch.manual_seed(1)
    target_q = moekit.MoELayer(40, 32, 4, 2, bias=True, quantization=recipe, single_grouped_weight=False)
    target_q.load_state_dict(sd_plain)
    assert torch.equal(target_q(tokens), quantized(tokens))
    torch.manual_seed(1)
    target_plain = moekit.MoELayer(40, 32, 4, 2, bias=True)
    target_plain.load_state_dict(quantized.state_dict())
    assert torch.equal(target_plain(tokens), plain(tokens))


def _cache_addresses(cache: QuantizedWeightCache) -> list[int | None]:
    return [t.data_ptr() if t is not None else None for t in cache.quantized.storage()]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    ("optimizer", "single_grouped_weight"),
    [("sgd", True), ("adamw-foreach", True), ("adamw", False)],
    ids=["sgd-grouped", "adamw-foreach-grouped", "adamw-per-expert"],
)
def test_weights_are_quantized_once_per_optimizer_step(recipe, optimizer, single_grouped_weight):
    """A module reused across steps quantizes its weights again after the optimizer's in-place update,
    into the same storage, and not otherwise."""
    torch.manual_seed(0)
    mlp = moekit.GroupedMLP(3, 40, 32, quantization=recipe, single_grouped_weight=single_grouped_weight)
    if optimizer == "sgd":
        opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(mlp.parameters(), lr=0.01, foreach=optimizer == "adamw-foreach")
    x, m_splits = rand(30, 40, seed=1), [10, 0, 17]
    caches = mlp.weight_caches()
    mlp(x, m_splits).square().mean().backward()
    assert [c.refreshes for c in caches] == [1, 1]
    addresses = [_cache_addresses(c) for c in caches]
    for _ in range(2):  # more forwards (gradient accumulation) without a step: nothing quantized again
        mlp(x, m_splits).square().mean().backward()
    assert [c.refreshes for c in caches] == [1, 1]
    opt.step()
    opt.zero_grad()
    y = mlp(x, m_splits)
    assert [c.refreshes for c in caches] == [2, 2]
    assert [_cache_addresses(c) for c in caches] == addresses  # in place: every address kept
    for cache, linear in zip(caches, (mlp.fc1, mlp.fc2), strict=True):
        w = linear.weights()
        w = w if isinstance(w, torch.Tensor) else torch.stack(w)
        fresh = moekit.group_quantize(w.detach(), None, recipe, columnwise=recipe != "fp8_block")
        assert torch.equal(cache.quantized.dequantize(), fresh.dequantize())
    y.square().mean().backward()
    mlp(x, m_splits)
    assert [c.refreshes for c in caches] == [2, 2]
    with torch.no_grad():  # any in-place change counts, e.g. loading a checkpoint
        mlp.load_state_dict(copy.deepcopy(mlp.state_dict()))
    mlp(x, m_splits)
    assert [c.refreshes for c in caches] == [3, 3]


def test_weight_cache_tells_tensors_apart():
    """Another tensor (even at a recycled address with the same version) is quantized anew; a view of
    the same weight is not."""
    cache = QuantizedWeightCache()
    x = rand(20, 16, seed=1)
    for seed in range(3):
        w = rand(2, 8, 16, seed=seed)
        y = moekit.grouped_linear(x, w, [10, 10], quantization="fp8_block", weight_cache=cache)
        assert torch.equal(y, moekit.grouped_linear(x, w, [10, 10], quantization="fp8_block"))
        del w
    assert cache.refreshes == 3
    base = rand(2, 16, 8, seed=5)
    for _ in range(2):
        moekit.grouped_linear(x, base.transpose(1, 2), [10, 10], quantization="mxfp8", weight_cache=cache)
    assert cache.refreshes == 4
    copied = copy.deepcopy(cache)
    assert copied.quantized is None and copied.refreshes == 0


def test_weight_cache_without_version_tracking_quantizes_every_call():
    """A write that keeps the version counter (as FSDP2's all-gather does) is invisible to a tracking
    cache and seen by one with track_versions=False, which quantizes at every call, in place; a copy
    keeps the setting."""
    x, w = rand(20, 16, seed=1), rand(2, 8, 16, seed=2)
    tracking, untracked = QuantizedWeightCache(), QuantizedWeightCache(track_versions=False)
    for cache in (tracking, untracked):
        moekit.grouped_linear(x, w, [10, 10], quantization="fp8_block", weight_cache=cache)
    addresses = _cache_addresses(untracked)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
        w.mul_(3)
    fresh = moekit.grouped_linear(x, w, [10, 10], quantization="fp8_block")
    stale = moekit.grouped_linear(x, w, [10, 10], quantization="fp8_block", weight_cache=tracking)
    seen = moekit.grouped_linear(x, w, [10, 10], quantization="fp8_block", weight_cache=untracked)
    assert not torch.equal(stale, fresh) and torch.equal(seen, fresh)
    assert (tracking.refreshes, untracked.refreshes) == (1, 2) and _cache_addresses(untracked) == addresses
    assert copy.deepcopy(untracked).track_versions is False


def test_quantized_weight_caches_finds_the_caches_apply_fsdp_turns_off():
    """(apply_fsdp itself: tests/distributed, the fsdp2-quantized check.)"""
    from moekit.distributed.fsdp import quantized_weight_caches

    layer = moekit.MoELayer(16, 12, 4, 2, quantization="fp8_block")
    caches = quantized_weight_caches(layer)
    assert len(caches) == 2 and all(c.track_versions for c in caches)
    assert caches == list(layer.experts.weight_caches())


@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_after_the_weights_were_quantized_again_is_refused(recipe):
    torch.manual_seed(0)
    linear = moekit.GroupedLinear(2, 16, 8, quantization=recipe, single_grouped_weight=True)
    opt = torch.optim.SGD(linear.parameters(), lr=0.1)
    x = rand(12, 16, seed=1)
    stale = linear(x, [6, 6]).sum()
    linear(x, [6, 6]).sum().backward()
    opt.step()
    linear(x, [6, 6])  # quantizes the stepped weight into the storage `stale` saved
    with pytest.raises(RuntimeError, match="modified (by an )?inplace"):
        stale.backward()


# --------------------------------------------------------------------------------------------------
# Weight gradients from the unquantized operands (quantized_wgrad=False)
# --------------------------------------------------------------------------------------------------


def _mlp_step(inputs: dict, m_splits: list[int], recipe: str, backend: str, **kwargs) -> dict[str, torch.Tensor]:
    leaves = {k: v.float().requires_grad_(True) for k, v in inputs.items()}
    y = moekit.grouped_mlp(
        leaves["x"], leaves["w1"], leaves["w2"], m_splits, probs=leaves["probs"], fc1_bias=leaves["b1"],
        fc2_bias=leaves["b2"], backend=backend, quantization=recipe, **kwargs,
    )  # fmt: skip
    y.backward(rand(*y.shape, seed=9))
    return {"y": y.detach(), **{k: t.grad for k, t in leaves.items()}}


@pytest.mark.parametrize("recipe", RECIPES)
def test_unquantized_wgrad_changes_only_the_weight_gradients(recipe, monkeypatch):
    """quantized_wgrad=False: the output and every gradient but the weights' bit for bit those of the
    quantized wgrad (the same Q(dh), Q(dy), h'), and each weight gradient the product of the unquantized
    operands the quantized wgrad would have quantized: dw2 from dy and a' (recomputed from the held h),
    dw1 from dh and x, as the spies see them; within the bound against float64, closer than the quantized
    wgrad's."""
    import moekit.ops.quantized_mlp as qmlp

    hidden, ffn, m_splits, padding = 96, 80, [40, 0, 97, 33, 1], 7
    inputs = mlp_inputs(hidden, ffn, m_splits, padding)
    quantized_operands: list[torch.Tensor] = []
    inner_q = qmlp.group_quantize_for_wgrad
    monkeypatch.setattr(
        qmlp, "group_quantize_for_wgrad", lambda t, *a, **k: quantized_operands.append(t.clone()) or inner_q(t, *a, **k)
    )
    want = _mlp_step(inputs, m_splits, recipe, "torch")
    quantized_by_the_quantized_wgrad = list(quantized_operands)  # (the second run quantizes dy and dh rowwise)
    wgrad_operands: list[tuple[torch.Tensor, torch.Tensor]] = []
    inner_w = qmlp.wgrad_in_layout
    monkeypatch.setattr(
        qmlp,
        "wgrad_in_layout",
        lambda b, dy, x, *a, **k: wgrad_operands.append((dy.clone(), x.clone())) or inner_w(b, dy, x, *a, **k),
    )
    got = _mlp_step(inputs, m_splits, recipe, "torch", quantized_wgrad=False)
    for name in ("y", "x", "probs", "b1", "b2"):
        assert torch.equal(got[name], want[name]), name
    # The quantized wgrad quantized dy, a', dh, x (in that order); the unquantized one multiplies them.
    dy, a_MF, dh, x = quantized_by_the_quantized_wgrad
    assert [t.shape[1] for t in (dy, a_MF, dh, x)] == [hidden, ffn, 2 * ffn, hidden]
    (dy2, a2), (dh1, x1) = wgrad_operands
    for seen, quantized in ((dy2, dy), (a2, a_MF), (dh1, dh), (x1, x)):
        assert torch.equal(seen, quantized)
    offs = [0, *itertools.accumulate(m_splits)]
    for name, (left, right) in (("w2", (dy, a_MF)), ("w1", (dh, x))):
        exact = torch.stack([left[s:e].double().T @ right[s:e].double() for s, e in itertools.pairwise(offs)])
        assert rel_err(got[name], exact) < 1e-5, name
        assert rel_err(want[name], exact) > 5e-3, name  # the quantized wgrad is quantized
    errors = errors_against_float64(
        lambda x, w1, w2, b1, b2, probs: moekit.grouped_mlp(
            x, w1, w2, m_splits, probs=probs, fc1_bias=b1, fc2_bias=b2, quantization=recipe, quantized_wgrad=False
        ),
        lambda x, w1, w2, b1, b2, probs: reference.grouped_mlp_reference(
            x, w1, w2, m_splits, probs=probs, fc1_bias=b1, fc2_bias=b2
        ),
        inputs,
        {"x", "w1", "w2", "b1", "b2", "probs"},
    )
    assert_within_bound(errors, f"grouped_mlp {recipe} quantized_wgrad=False", exact=("b2",))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=TRITON_MARK)])
def test_grouped_linear_unquantized_wgrad_is_dy_times_x(recipe, backend):
    """grouped_linear(quantized_wgrad=False): the output, dx and the bias gradients bit for bit those of
    the quantized wgrad, and dw the product of dy and x themselves (padding rows and an empty group
    included), on the torch backend's reference path and on the triton backend's FP8 kernels."""
    m_splits, padding = [20, 0, 13], 3
    x0, w0, b0 = rand(sum(m_splits) + padding, 40, seed=1), rand(3, 24, 40, seed=2), rand(3, 24, seed=3)
    dy = rand(x0.shape[0], 24, seed=4)
    results = []
    for quantized_wgrad in (True, False):
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        y = moekit.grouped_linear(
            x, w, m_splits, b, quantization=recipe, quantized_wgrad=quantized_wgrad, backend=backend
        )
        y.backward(dy)
        results.append((y.detach(), x.grad, b.grad, w.grad))
    for name, got, want in zip(("y", "x", "b"), results[1], results[0], strict=False):
        assert torch.equal(got, want), name
    offs = [0, *itertools.accumulate(m_splits)]
    exact = torch.stack([dy[s:e].double().T @ x0[s:e].double() for s, e in itertools.pairwise(offs)])
    assert rel_err(results[1][3], exact) < 1e-5
    assert rel_err(results[0][3], exact) > 5e-3  # the quantized wgrad is quantized
    linear = moekit.GroupedLinear(
        3, 40, 24, single_grouped_weight=True, single_grouped_bias=True, backend=backend, quantization=recipe,
        quantized_wgrad=False,
    )  # fmt: skip
    with torch.no_grad():
        linear.weight.copy_(w0)
        linear.bias.copy_(b0)
    linear(x0, m_splits).backward(dy)
    assert torch.equal(linear.weight.grad, results[1][3]) and "quantized_wgrad=False" in repr(linear)


@pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_rowwise"])
@pytest.mark.parametrize("rows_in_loads", [False, True])
def test_unquantized_wgrad_on_triton_matches_the_torch_backend(recipe, rows_in_loads, monkeypatch):
    """moe_experts with quantized_wgrad=False on the triton backend (its FP8 kernels, the quantizer, the
    gated kernels, the bf16 wgrad) against the torch backend's path, outputs and every gradient; with
    `rows_in_loads` the backend is told that reading the routed rows through the route pays (as on sm_90
    for narrow experts), so fc1's wgrad reads x's token rows and fc2's d out's, d out's rowwise form is
    quantized from its token rows: the same bits as gathering them first."""
    from moekit.ops.runtime import gemm as runtime_gemm
    from moekit.ops.runtime import glu as runtime_glu

    tokens, hidden, ffn, num_experts = 24, 40, 64, 4
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(tokens)])
    inputs = dict(
        x=rand(tokens, hidden, seed=1),
        weights=torch.rand(tokens, 2, generator=g).softmax(-1),
        w1=rand(num_experts, 2 * ffn, hidden, seed=2) / hidden**0.5,
        w2=rand(num_experts, hidden, ffn, seed=3) / ffn**0.5,
        b2=rand(num_experts, hidden, seed=4),
    )
    dy = rand(tokens, hidden, seed=6)

    def step(backend: str) -> list[torch.Tensor]:
        leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
        y = moekit.moe_experts(
            leaves["x"], ids, leaves["weights"], leaves["w1"], leaves["w2"], fc2_bias=leaves["b2"],
            backend=backend, quantization=recipe, quantized_wgrad=False,
        )  # fmt: skip
        y.backward(dy)
        return [y.detach(), *(t.grad for t in leaves.values())]

    gathered_first = step("triton")
    asked = []
    if rows_in_loads:
        monkeypatch.setattr(runtime_gemm, "gathered_wgrad_pays", lambda *a: asked.append("x") or True)
        monkeypatch.setattr(runtime_glu, "gathered_backward_pays", lambda *a: asked.append("dy") or True)
    got, want = step("triton"), step("torch")
    assert sorted(set(asked)) == (["dy", "x"] if rows_in_loads else [])
    for name, a, b, c in zip(["y", *inputs], got, gathered_first, want, strict=True):
        assert torch.equal(a, b), name
        assert rel_err(a, c) < 1e-4, name


def test_quantized_wgrad_is_a_flag_of_the_ops_and_modules():
    """The modules pass it to the ops (bit for bit), show it and keep it in `options()` (expert
    parallelism's copies); anything but a bool is refused in one line naming the argument."""
    torch.manual_seed(0)
    layer = moekit.MoELayer(40, 32, 4, 2, bias=True, quantization="fp8_block", quantized_wgrad=False)
    tokens = rand(18, 40, seed=2)
    routing = layer.route(tokens)
    y = layer(tokens)
    y.backward(rand(*y.shape, seed=3))
    experts = layer.experts
    leaves = [p.detach().clone().requires_grad_(True) for p in (experts.fc1.weight, experts.fc2.weight)]
    want = moekit.moe_experts(
        tokens, routing.ids, routing.weights.detach(), *leaves, fc1_bias=experts.fc1.bias, fc2_bias=experts.fc2.bias,
        quantization="fp8_block", quantized_wgrad=False,
    )  # fmt: skip
    assert torch.equal(y, want)
    want.backward(rand(*y.shape, seed=3))
    assert torch.equal(experts.fc1.weight.grad, leaves[0].grad)
    assert torch.equal(experts.fc2.weight.grad, leaves[1].grad)
    assert "quantized_wgrad=False" in repr(layer)
    assert experts.options()["quantized_wgrad"] is False
    assert experts.select_experts(1, 2).quantized_wgrad is False
    with pytest.raises(TypeError, match=r"^quantized_wgrad must be a bool \(True or False\), got "):
        moekit.GroupedMLP(2, 8, 4, quantization="fp8_block", quantized_wgrad="no")
    x, w1, w2 = rand(6, 8, seed=1), rand(2, 8, 8, seed=2), rand(2, 8, 4, seed=3)
    for call in (
        lambda: moekit.grouped_mlp(x, w1, w2, [3, 3], quantization="fp8_block", quantized_wgrad=1),
        lambda: moekit.moe_experts(
            x, torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1), w1, w2, quantized_wgrad=None
        ),
    ):
        with pytest.raises(TypeError, match=r"^quantized_wgrad must be a bool"):
            call()


# --------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------

_x, _w = torch.ones(4, 8), torch.ones(2, 6, 8)
QUANTIZATION_REFUSALS = [
    lambda q: moekit.grouped_linear(_x, _w, [2, 2], quantization=q),
    lambda q: moekit.grouped_mlp(_x, torch.ones(2, 6, 8), torch.ones(2, 8, 3), [2, 2], quantization=q),
    lambda q: moekit.moe_experts(
        _x,
        torch.zeros(4, 1, dtype=torch.long),
        torch.ones(4, 1),
        torch.ones(2, 6, 8),
        torch.ones(2, 8, 3),
        quantization=q,
    ),
    lambda q: moekit.GroupedLinear(2, 8, 6, quantization=q),
    lambda q: moekit.GroupedMLP(2, 8, 3, quantization=q),
    lambda q: moekit.MoELayer(8, 3, 2, 1, quantization=q),
]


@pytest.mark.parametrize(
    "make",
    QUANTIZATION_REFUSALS,
    ids=["grouped_linear", "grouped_mlp", "moe_experts", "GroupedLinear", "GroupedMLP", "MoELayer"],
)
def test_unknown_quantization_refused_in_one_line(make):
    with pytest.raises(
        ValueError, match=r"unknown quantization 'fp8'; expected one of \('mxfp8', 'fp8_block', 'fp8_rowwise'\)"
    ) as info:
        make("fp8")
    assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match=r"quantization must be one of"):
        make(8)


def test_demo_cli_refuses_an_unknown_quantization(capsys, tmp_path):
    from moekit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--quantization", "fp8", "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--quantization: invalid choice: 'fp8'" in err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_fullgraph_matches_eager(recipe):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = moekit.MoELayer(40, 32, 4, 2, bias=True, quantization=recipe)
    tokens = rand(2, 9, 40, seed=2)

    def step(module):
        layer.zero_grad(set_to_none=True)
        leaf = tokens.clone().requires_grad_(True)
        out = module(leaf)
        out.backward(rand(*out.shape, seed=3))
        return [out.detach(), leaf.grad] + [p.grad for p in layer.parameters()]

    eager = step(layer)
    compiled = step(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
    torch._dynamo.reset()


@pytest.mark.skipif(not TRITON_OK, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_compile_fullgraph_traces_the_held_h_kernels(recipe):
    """The quantized MLP on the triton backend (FP8 GEMMs for fp8_block, the gated kernels reading FP8 h,
    gpt-oss's clamps) traced whole: output and every gradient bit for bit eager's."""
    inputs = mlp_inputs(32, 24, [20, 0, 17], 3)

    def step(fn):
        leaves = [v.float().requires_grad_(True) for v in inputs.values()]
        y = fn(*leaves)
        y.backward(rand(*y.shape, seed=9))
        return [y.detach()] + [t.grad for t in leaves]

    def mlp(x, w1, w2, b1, b2, probs):
        return moekit.grouped_mlp(
            x, w1, w2, [20, 0, 17], probs=probs, fc1_bias=b1, fc2_bias=b2, activation="clamped_swiglu",
            glu_interleave_size=1, backend="triton", quantization=recipe,
        )  # fmt: skip

    torch._dynamo.reset()
    eager = step(mlp)
    compiled = step(torch.compile(mlp, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------
# transformers: apply_moekit(model, quantization=...) on two model families
# --------------------------------------------------------------------------------------------------


def _hf_model(name: str):
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if name == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, **common)
    else:
        config = transformers.GptOssConfig(
            intermediate_size=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "experts" in pname else 0.2) if "norm" not in pname else p.uniform_(0.5, 1.5)
    return model


def _experts_step(experts, hidden, ids, weights):
    """The experts module alone on fixed routing: output and its parameters' gradients."""
    experts.zero_grad(set_to_none=True)
    out = experts(hidden, ids, weights)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out.backward(upstream.to(out.dtype))
    return out.detach(), {n: p.grad for n, p in experts.named_parameters()}


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_apply_moekit_with_quantization(name, recipe):
    """The experts within the FP8 bound against the model's own eager experts in float64 (on fixed
    routing: end to end, quantization changes the next layers' routing, which is not an error of the
    experts), the state dict unchanged, the model trains, weights quantized once per step."""
    from moekit.integrations.transformers import apply_moekit

    eager = _hf_model(name)
    model = copy.deepcopy(eager)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_moekit(model, quantization=recipe)
    state_after = model.state_dict()
    assert state_after.keys() == state_before.keys()
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())
    experts = [m for m in model.modules() if hasattr(m, "moekit_quantization")]
    assert len(experts) == 2 and all(m.moekit_quantization == recipe for m in experts)
    assert f"moekit_quantization='{recipe}'" in repr(experts[0])

    g = torch.Generator().manual_seed(1)
    num_experts = 6 if name == "mixtral" else 4
    hidden = torch.randn(40, 32, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(40)])
    weights = torch.rand(40, 2, generator=g, dtype=torch.float64).softmax(-1)
    eager_experts = next(m for m in eager.modules() if type(m).__name__ == type(experts[0]).__name__)
    out64, grads64 = _experts_step(copy.deepcopy(eager_experts).double(), hidden, ids, weights)
    out, grads = _experts_step(experts[0], hidden.float(), ids, weights.float())
    assert rel_err(out, out64) <= BOUND and rel_err(out, out64) > 5e-3
    for key, want in grads64.items():
        assert rel_err(grads[key], want) <= BOUND, key

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 96, (2, 10), generator=g)
    for _ in range(2):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
    # Quantized once at the experts-alone step, once per training step after it (the first step's
    # forward saw the weights unchanged since).
    assert [c.refreshes for m in experts for c in m.moekit_weight_caches()][:2] == [2, 2]
    with pytest.raises(ValueError, match=rf"already applied to this model with .*quantization='{recipe}'"):
        apply_moekit(model, quantization=None)
    with pytest.raises(ValueError, match=r"unknown quantization 'int8'"):
        apply_moekit(copy.deepcopy(eager), quantization="int8")


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("single_grouped_weight", [True, False])
def test_apply_moekit_with_unquantized_wgrad(name, single_grouped_weight):
    """apply_moekit(quantized_wgrad=False), and the interface's config attribute: the experts' output
    and gradients bit for bit moe_experts(quantized_wgrad=False) on the same tensors (the converted
    per-expert modules too), differing from the quantized wgrad's in the weights' gradients only; shown
    in the repr, and a second call asking otherwise refused."""
    from moekit.integrations.transformers import apply_moekit

    eager = _hf_model(name)
    g = torch.Generator().manual_seed(1)
    num_experts = 6 if name == "mixtral" else 4
    hidden = torch.randn(40, 32, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(40)])
    weights = torch.rand(40, 2, generator=g).softmax(-1)
    steps = {}
    for quantized_wgrad in (True, False):
        model = copy.deepcopy(eager)
        apply_moekit(
            model,
            quantization="fp8_block",
            quantized_wgrad=quantized_wgrad,
            single_grouped_weight=single_grouped_weight,
        )
        experts = next(m for m in model.modules() if hasattr(m, "moekit_quantization"))
        assert experts.moekit_quantized_wgrad is quantized_wgrad
        assert ("quantized_wgrad=False" in repr(experts)) is not quantized_wgrad
        out, _ = _experts_step(experts, hidden, ids, weights)
        steps[quantized_wgrad] = out, experts.model_layout_tensors(grads=True)  # the model's names
    interface = copy.deepcopy(eager)
    interface.config.moekit_quantization, interface.config.moekit_quantized_wgrad = "fp8_block", False
    interface.set_experts_implementation("moekit")
    experts = next(m for m in interface.modules() if type(m).__name__ == type(experts).__name__.removeprefix("Moekit"))
    via_config = _experts_step(experts, hidden, ids, weights)
    (out_q, grads_q), (out, grads) = steps[True], steps[False]
    assert torch.equal(out, out_q) and torch.equal(out, via_config[0])
    for key, grad in grads.items():
        assert torch.equal(grad, via_config[1][key]), key
        assert torch.equal(grad, grads_q[key]) is ("bias" in key), key
    with pytest.raises(ValueError, match=r"already applied .*quantized_wgrad=False; asked now .*quantized_wgrad=True"):
        apply_moekit(model, quantization="fp8_block", single_grouped_weight=single_grouped_weight)


# --------------------------------------------------------------------------------------------------
# The demo trained with fp8_block
# --------------------------------------------------------------------------------------------------


def _demo_fp8_block_against_plain(tmp_path, device: str) -> None:
    from moekit.cli import main
    from moekit.demo import run_demo

    steps = "400"
    assert (
        main(
            ["demo", "--steps", steps, "--device", device, "--quantization", "fp8_block", "--out", str(tmp_path / "q")]
        )
        == 0
    )
    quantized = json.loads((tmp_path / "q" / "summary.json").read_text())
    plain = run_demo(steps=int(steps), device=device, out=str(tmp_path / "plain"))
    assert quantized["quantization"] == "fp8_block" and plain["quantization"] is None
    assert quantized["eval_loss_single_grouped"] == quantized["eval_loss_reloaded_discrete"]
    ratio = quantized["eval_loss_single_grouped"] / plain["eval_loss_single_grouped"]
    assert abs(ratio - 1) <= 0.02, (
        f"fp8_block eval loss {quantized['eval_loss_single_grouped']} vs {plain['eval_loss_single_grouped']}"
    )


def test_demo_trains_with_fp8_block_as_without(tmp_path):
    """`moekit demo --quantization fp8_block` ends within 2% of the unquantized run's evaluation loss,
    both trained the demo's default 400 steps (CPU: the reference path)."""
    _demo_fp8_block_against_plain(tmp_path, "cpu")


# --------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu)
# --------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_demo_trains_with_fp8_block_as_without_on_the_gpu(tmp_path):
    """The same 400-step comparison on the GPU, where the demo's float32 layers run moekit's FP8 kernels
    (forward and dgrad): the backend "auto" picks has the QuantizedGemm capability and takes fp8_block
    with float32 outputs on this device."""
    dev = torch.device("cuda")
    impl = select_backend("auto", torch.empty(1, 8, device=dev), torch.empty(1, 8, 8, device=dev))
    fp8 = quantized_gemm_of(impl)
    assert fp8 is not None and fp8.quantized_gemm_unavailable_reason("fp8_block", torch.empty(1, device=dev)) is None
    _demo_fp8_block_against_plain(tmp_path, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_layer_graph_replayed_after_optimizer_steps_equals_eager(recipe):
    """MoELayer forward+backward with quantization captured once in a CUDA graph, replayed after each
    optimizer.step(): output and every gradient bit for bit a twin module's eager step (the weights
    are quantized anew inside every replay, so the steps' new weights are seen)."""
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    layer = moekit.MoELayer(512, 384, 8, top_k=2, quantization=recipe, device=dev, dtype=dt)
    twin = copy.deepcopy(layer)
    x = torch.randn(1000, 512, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    params = list(layer.parameters())

    def step():
        y = layer(x)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in [x, *params]:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in [x, *params]:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    for i in range(3):
        graph.replay()
        torch.cuda.synchronize()
        x_twin = x.detach().clone().requires_grad_(True)
        twin_opt.zero_grad(set_to_none=True)
        y = twin(x_twin)
        y.backward(dy)
        assert torch.equal(y_static, y), f"step {i}: output differs (rel. error {rel_err(y_static, y):.2e})"
        assert torch.equal(x.grad, x_twin.grad), f"step {i}: d x differs"
        for (name, p), q in zip(layer.named_parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"step {i}: d {name} differs"
        opt.step()  # in place: the grads stay the graph's tensors
        twin_opt.step()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("quantized_wgrad", [True, False])
@pytest.mark.parametrize("ffn", [768, 512])
def test_moe_experts_within_the_fp8_bound_on_the_gpu(recipe, quantized_wgrad, ffn):
    """bf16 on the GPU at a realistic width (expert 7 gets no rows): the quantized experts within the FP8
    bound of float64, output and every gradient, with the weight gradients from the quantized operands or
    not (quantized_wgrad=False; on sm_90 at F 768 fc2's wgrad reads d out's token rows in its loads, at
    512 fc1's reads x's too)."""
    g = torch.Generator().manual_seed(0)
    tokens, hidden, experts = 2048, 1024, 8
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:2] for _ in range(tokens)])
    inputs = mlp_inputs(hidden, ffn, [1] * experts, 0)
    inputs = dict(
        x=rand(tokens, hidden, seed=7, dtype=torch.float64),
        weights=torch.rand(tokens, 2, generator=g, dtype=torch.float64).softmax(-1),
        w1=inputs["w1"],
        w2=inputs["w2"],
    )

    def ours(x, weights, w1, w2):
        args = (x.cuda(), ids.cuda(), weights.cuda(), w1.cuda(), w2.cuda())
        return moekit.moe_experts(*args, quantization=recipe, quantized_wgrad=quantized_wgrad).cpu()

    errors = errors_against_float64(
        ours,
        lambda x, weights, w1, w2: reference.moe_experts_reference(x, ids, weights, w1, w2),
        inputs,
        {"x", "weights", "w1", "w2"},
        dtype=torch.bfloat16,
    )
    assert_within_bound(errors, f"moe_experts {recipe} quantized_wgrad={quantized_wgrad} on the GPU")


# (name, H, F, experts on the rank, top-k, activation, GLU block, biases): the four layers.
MODEL_LAYERS = [
    pytest.param(7168, 2048, 32, 8, "swiglu", None, False, id="deepseek-v3-ep8"),
    pytest.param(4096, 14336, 8, 2, "swiglu", None, False, id="mixtral-8x7b"),
    pytest.param(2048, 768, 128, 8, "swiglu", None, False, id="qwen3-30b-a3b"),
    pytest.param(2880, 2880, 32, 4, "clamped_swiglu", 1, True, id="gpt-oss-20b"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("hidden", "ffn", "experts", "top_k", "activation", "glu_block", "bias"), MODEL_LAYERS)
def test_quantized_layer_holds_at_most_0_6_of_bf16_on_the_gpu(
    recipe, hidden, ffn, experts, top_k, activation, glu_block, bias, gpu_to_itself
):
    """The issue's bar: what the quantized moe_experts holds between forward and backward (the CUDA
    allocator's count, the output and the weights' caches apart) is at most 0.6 x what moekit's bf16
    layer holds at the same shape (its fused path on this GPU), at 16384 routed rows of each model's
    layer."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    tokens = 16384 // top_k
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(tokens, experts, generator=g, device=dev).topk(top_k, dim=1).indices
    params = dict(
        fc1_weight=torch.randn(experts, 2 * ffn, hidden, generator=g, device=dev, dtype=dt) * hidden**-0.5,
        fc2_weight=torch.randn(experts, hidden, ffn, generator=g, device=dev, dtype=dt) * ffn**-0.5,
    )
    if bias:
        params.update(
            fc1_bias=torch.randn(experts, 2 * ffn, generator=g, device=dev, dtype=dt),
            fc2_bias=torch.randn(experts, hidden, generator=g, device=dev, dtype=dt),
        )
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    x = torch.randn(tokens, hidden, generator=g, device=dev, dtype=dt, requires_grad=True)
    weights = torch.rand(tokens, top_k, generator=g, device=dev, dtype=dt).softmax(-1).requires_grad_(True)
    dy = torch.randn_like(x)

    def held(quantization):
        caches = (QuantizedWeightCache(), QuantizedWeightCache())
        kwargs = dict(activation=activation, glu_interleave_size=glu_block, quantization=quantization)

        def run():
            return moekit.moe_experts(x, ids, weights, **params, **kwargs, weight_caches=caches)

        run().backward(dy)  # warm: the weights' caches (and their transposed copies) made once
        for t in (x, weights, *params.values()):
            t.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        y = run()
        torch.cuda.synchronize()
        amount = torch.cuda.memory_allocated(dev) - before - y.untyped_storage().nbytes()
        y.backward(dy)
        del y
        for t in (x, weights, *params.values()):
            t.grad = None
        return amount

    plain, quantized = held(None), held(recipe)
    assert quantized <= 0.6 * plain, f"{recipe}: holds {quantized / 2**20:.1f} MiB, bf16 {plain / 2**20:.1f} MiB"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("quantized_wgrad", [True, False])
def test_quantized_moe_experts_has_no_host_sync(recipe, activation, quantized_wgrad):
    """Forward and backward of the quantized layer's one node (h held in FP8, a and x's columnwise FP8
    made again in the backward, or with quantized_wgrad=False the bf16 wgrads with the routed rows read
    through the route: F 384 on sm_90) never wait on the device: what CUDA-graph capture needs."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    tokens, experts, hidden, ffn = 512, 8, 256, 384
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(tokens, experts, generator=g, device=dev).topk(2, dim=1).indices
    leaves = dict(
        x=torch.randn(tokens, hidden, generator=g, device=dev, dtype=dt),
        topk_weights=torch.rand(tokens, 2, generator=g, device=dev, dtype=dt),
        fc1_weight=torch.randn(experts, 2 * ffn, hidden, generator=g, device=dev, dtype=dt) * hidden**-0.5,
        fc2_weight=torch.randn(experts, hidden, ffn, generator=g, device=dev, dtype=dt) * ffn**-0.5,
        fc1_bias=torch.randn(experts, 2 * ffn, generator=g, device=dev, dtype=dt),
        fc2_bias=torch.randn(experts, hidden, generator=g, device=dev, dtype=dt),
    )
    leaves = {k: v.requires_grad_(True) for k, v in leaves.items()}
    dy = torch.randn(tokens, hidden, generator=g, device=dev, dtype=dt)
    caches = (QuantizedWeightCache(), QuantizedWeightCache())

    def step():
        y = moekit.moe_experts(
            topk_ids=ids, **leaves, activation=activation, quantization=recipe, quantized_wgrad=quantized_wgrad,
            weight_caches=caches,
        )  # fmt: skip
        y.backward(dy)

    assert_no_host_sync(step)
