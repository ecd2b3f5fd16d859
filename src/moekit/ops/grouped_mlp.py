"""Grouped MLP: fc1 (H -> 2F) + gated activation (x router probability) + fc2 (F -> H), per expert; and
the fused path that `moe_experts` runs too.

Legend: M routed rows, T tokens, K top-k, N experts, H hidden size, F ffn size.

Per row r of expert e with probability p_r:
    y_r = fc2_e(act(fc1_e(x_r)) * p_r) + b2_e * p_r
so the probability scales both the activation output and the fc2 bias, and `probs` gets a gradient.

Two paths, chosen by the backends' capabilities (`moekit.ops.runtime.backends`), with the same results:
- composed: `grouped_linear`, `glu`, `grouped_linear` (every backend);
- fused, where the backend has the FusedMLP capability (`fused_mlp`), two autograd nodes:

    node 1  fc1 GEMM + bias + activation (+ probs) in one kernel -> h (M, 2F), act (M, F)
    node 2  fc2 GEMM with the probs-scaled bias                   -> y (M, H); act is freed
    node 2's backward: fc2's dgrad + the activation's backward in one kernel -> dh (M, 2F), act_p (M, F),
            d probs partials; fc2's wgrad (dy, act_p); the bias sums
    node 1's backward: fc1's wgrad (dh, x), bias sums, dgrad (dh)

  Autograd runs node 2's backward first and frees what it saved (h and dy among them) before node 1's:
  the peak of the backward holds h or dh, not both, as plain PyTorch's composition does. Held between
  forward and backward: x (the caller's tensor itself), h in x's dtype, probs, the weights; no fp32
  (M, F) or (M, 2F) tensor anywhere.

`moe_experts` runs the same two nodes with an `ExpertRoute`: node 1 gathers the tokens' rows into expert
order (and the router weights into sorted order, as probs) before fc1, node 2 sums each token's K rows
back after fc2, and each backward moves the rows the other way; the layer then never holds an (M, H)
tensor, and where holding h whole would break the layer's memory contract it holds h of the first
`kept` sorted rows only and computes the others' h again in node 2's backward, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from moekit.ops import library
from moekit.ops.activations import activation_named
from moekit.ops.glu import apply_glu, check_interleave, check_probs, gated_on_kernel, glu_reference
from moekit.ops.grouped_linear import (
    Weight,
    check_linear_params,
    fp8_compute,
    fp8_wgrad_compute,
    grouped_linear,
    grouped_linear_reference,
    probe_weight,
    quantized_weight,
    row_major,
    stacked,
    stored_transposed,
    tensor_list,
    unstacked,
    wgrad_in_layout,
)
from moekit.ops.quantize import QuantizedWeightCache, check_quantization
from moekit.ops.quantized_mlp import QuantizedMlpSpec, quantized_mlp
from moekit.ops.rows import ExpertRoute
from moekit.ops.runtime.backends import (
    FusedMLP,
    GemmBackend,
    backend_named,
    fused_mlp_of,
    gated_quantize_unavailable_reason,
    held_columns_unavailable_reason,
    quantized_gated_fc1_of,
    select_backend,
    select_quantizer,
    use_triton_rows,
)
from moekit.ops.splits import GroupOffsets, MSplits, resolve_splits
from moekit.validation import check_bool, check_float_tensor


def check_mlp_params(
    x: torch.Tensor,
    fc1_weights: list[torch.Tensor],
    fc2_weights: list[torch.Tensor],
    fc1_biases: list[torch.Tensor],
    fc2_biases: list[torch.Tensor],
) -> tuple[int, int]:
    """Validate the two linears' parameters against x (rows, H); return (N, F)."""
    n1, two_f = check_linear_params(x, fc1_weights, fc1_biases, what="fc1_")
    if two_f % 2:
        raise ValueError(f"fc1 must map to 2F features (gate and up), got out_features={two_f}")
    ffn = two_f // 2
    fc2_in = [w.shape[-1] for w in fc2_weights]
    if fc2_in and fc2_in[0] != ffn:
        raise ValueError(f"fc2 takes {fc2_in[0]} input features; fc1's 2F = {two_f} outputs give F = {ffn}")
    n2, h_out = check_linear_params(x.new_empty(0, ffn), fc2_weights, fc2_biases, what="fc2_")
    if n1 != n2:
        raise ValueError(f"fc1 has {n1} experts but fc2 has {n2}")
    if h_out != x.shape[1]:
        raise ValueError(f"fc2 maps to {h_out} features; expected the hidden size {x.shape[1]}")
    return n1, ffn


def grouped_mlp(
    x: torch.Tensor,
    fc1_weight: Weight,
    fc2_weight: Weight,
    m_splits: MSplits | GroupOffsets,
    *,
    probs: torch.Tensor | None = None,
    fc1_bias: Weight | None = None,
    fc2_bias: Weight | None = None,
    activation: str = "swiglu",
    glu_interleave_size: int | None = None,
    backend: str = "auto",
    quantization: str | None = None,
    quantized_wgrad: bool = True,
    weight_caches: tuple[QuantizedWeightCache, QuantizedWeightCache] | None = None,
) -> torch.Tensor:
    """Expert MLP over rows sorted by expert.

    x: (M, H). fc1_weight: (N, 2F, H) or N x (2F, H), rows in `[gate | up]` order or interleaved with
    `glu_interleave_size`. fc2_weight: (N, H, F) or N x (H, F). probs: optional (M,). Biases: (N, out),
    N x (out,) or None. activation: a name of `moekit.ops.activations.ACTIVATIONS`. Returns (M, H) in x's
    dtype; padding rows (past sum(m_splits)) are zero.

    quantization: None, "fp8_block", "fp8_rowwise" or "mxfp8": both linears on quantized operands
    (`grouped_linear`'s: forward and dgrad on FP8 kernels where the backend has them, e.g. "triton" on
    Hopper for fp8_block and fp8_rowwise, else the reference path: quantize, dequantize, compute in x's
    dtype; the activation between them in x's dtype, quantized as fc2's input). With quantization the
    MLP is two autograd nodes (`moekit.ops.quantized_mlp`) that hold fc1's output in FP8 and x itself,
    never the fused kernels. quantized_wgrad (with quantization): True, the weight gradients from the
    quantized operands (columnwise forms of dy, x, dh and the activation; FP8 kernels where the backend has
    them); False, from the unquantized operands in x's dtype (TransformerEngine's high-precision wgrad
    override, torchao's "rowwise_with_gw_hp"): forward and both dgrads stay quantized, no columnwise form
    is made, and the weight gradients carry no quantization error. weight_caches: (fc1's, fc2's)
    `QuantizedWeightCache`, as modules pass them (weights quantized once per optimizer step).
    """
    check_float_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, hidden), got shape {tuple(x.shape)}")
    w1s, w2s = tensor_list("fc1_weight", fc1_weight), tensor_list("fc2_weight", fc2_weight)
    b1s, b2s = tensor_list("fc1_bias", fc1_bias), tensor_list("fc2_bias", fc2_bias)
    num_experts, ffn = check_mlp_params(x, w1s, w2s, b1s, b2s)
    activation_named(activation)
    check_interleave(ffn, glu_interleave_size)
    # Resolved once: one host->device copy for host splits, shared by both GEMMs and the backward.
    offs = resolve_splits(m_splits, num_experts, x.shape[0], x.device)
    probs = check_probs(probs, x.shape[0], x)
    fc1_impl = select_backend(backend, x, probe_weight(w1s))
    fc2_impl = select_backend(backend, x.new_empty(0, ffn), probe_weight(w2s))
    quantization = check_quantization(quantization)
    quantized_wgrad = check_bool("quantized_wgrad", quantized_wgrad)
    cache1, cache2 = weight_caches if weight_caches is not None else (None, None)
    if fc1_impl is fc2_impl and fused_mlp_of(fc1_impl) is not None and quantization is None:
        spec = FusedSpec(fc1_impl.name, glu_interleave_size, activation, len(w1s), len(w2s))
        return fused_mlp(spec, offs.offs, None, x.shape[0], row_major(x), probs, w1s, b1s, w2s, b2s)
    if quantization is not None:
        return quantized_mlp_of_backends(x, probs, offs, None, quantization, backend, fc1_impl, fc2_impl,
                                         (w1s, b1s, w2s, b2s), glu_interleave_size, activation,
                                         (cache1, cache2), quantized_wgrad)  # fmt: skip
    h = grouped_linear(x, fc1_weight, offs, fc1_bias, backend=backend)
    a = apply_glu(h, probs, glu_interleave_size, activation, use_triton_rows(fc1_impl, x))
    scale = probs if probs is not None and b2s else None
    return grouped_linear(a, fc2_weight, offs, fc2_bias, backend=backend, bias_scale=scale)


def quantized_mlp_of_backends(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    offs: GroupOffsets,
    route: ExpertRoute | None,
    recipe: str,
    backend: str,
    fc1_impl: GemmBackend,
    fc2_impl: GemmBackend,
    params: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    glu_interleave_size: int | None,
    activation: str,
    caches: tuple[QuantizedWeightCache | None, QuantizedWeightCache | None],
    quantized_wgrad: bool,
) -> torch.Tensor:
    """The quantized MLP's nodes (`moekit.ops.quantized_mlp`) on checked arguments, x (M, H) sorted by expert, or
    (T, H) token rows with a route (`moe_experts`: probs then in sorted order, (M,)), with grouped_linear's choices:
    the quantizer it would pick, each linear's FP8 paths (`fp8_compute`, `fp8_wgrad_compute`, fc2's for an (M, F)
    input), the weights' quantizations from the caches, with their transposed copies where an FP8 dgrad may run
    (fc1's where x may get a gradient, fc2's where anything before it may). With `quantized_wgrad` off the
    weight gradients' routed operands are read through the route where the bf16 layer's are (the backend's
    `FusedMLP`: `gathered_wgrad_pays`, `gathered_backward_pays`)."""
    w1s, b1s, w2s, b2s = params
    a_like = x.new_empty(0, w2s[0].shape[-1])
    quantizer = select_quantizer(backend, x).name
    fc1_fp8, fc2_fp8 = fp8_compute(fc1_impl, recipe, x), fp8_compute(fc2_impl, recipe, a_like)
    grad = torch.is_grad_enabled()
    before_fc2 = (x, *(p for p in (probs,) if p is not None), *w1s, *b1s)
    w1_q, w1_t = quantized_weight(w1s, recipe, quantizer, caches[0], fc1_fp8 and grad and x.requires_grad)
    dgrad2 = fc2_fp8 and grad and any(t.requires_grad for t in before_fc2)
    w2_q, w2_t = quantized_weight(w2s, recipe, quantizer, caches[1], dgrad2)
    ffn = a_like.shape[1]
    gated_triton = gated_on_kernel(probs, use_triton_rows(fc1_impl, x))
    glu_block = check_interleave(ffn, glu_interleave_size)
    gated_quantize = gated_triton and gated_quantize_unavailable_reason(recipe, ffn, glu_block) is None
    # fc1's GEMM writing both FP8 forms itself, where the backend has that kernel for this problem.
    gated_fc1 = quantized_gated_fc1_of(fc1_impl)
    act = activation_named(activation)
    fc1_gated_epilogue = (
        gated_quantize
        and fc1_fp8
        and gated_fc1 is not None
        and gated_fc1.quantized_gated_fc1_unavailable_reason(
            recipe, x, ffn, glu_block, act.gate_limit or 0.0, act.up_limit or 0.0
        )
        is None
    )
    fc2_fp8_wgrad = fc2_fp8 and fp8_wgrad_compute(fc2_impl, recipe, a_like)
    # fc2's wgrad operand quantized from the held h by the gated kernel, the activation never written.
    held_columns = (
        gated_triton and quantized_wgrad and fc2_fp8_wgrad and held_columns_unavailable_reason(recipe, x.device) is None
    )
    fused1, fused2 = fused_mlp_of(fc1_impl), fused_mlp_of(fc2_impl)
    routed_hp_wgrad = not quantized_wgrad and route is not None
    spec = QuantizedMlpSpec(
        recipe=recipe,
        quantizer=quantizer,
        fc1_backend=fc1_impl.name,
        fc2_backend=fc2_impl.name,
        fc1_fp8=fc1_fp8,
        fc1_fp8_wgrad=fc1_fp8 and fp8_wgrad_compute(fc1_impl, recipe, x),
        fc2_fp8=fc2_fp8,
        fc2_fp8_wgrad=fc2_fp8_wgrad,
        glu_interleave_size=glu_interleave_size,
        activation=activation,
        gated_triton=gated_triton,
        gated_quantize=gated_quantize,
        fc1_gated_epilogue=fc1_gated_epilogue,
        held_columns=held_columns,
        fc2_bias_fused=fused2 is not None,
        quantized_wgrad=quantized_wgrad,
        fc1_wgrad_x_rows=routed_hp_wgrad and fused1 is not None and fused1.gathered_wgrad_pays(x, ffn),
        fc2_wgrad_dy_rows=(
            routed_hp_wgrad
            and fused2 is not None
            and fused2.gathered_backward_pays(x, probe_weight(w2s), glu_interleave_size)
        ),
        n_w1=len(w1s),
        n_b1=len(b1s),
        n_w2=len(w2s),
        n_b2=len(b2s),
    )
    host_offs = list(offs.host) if offs.host is not None else None
    fc1_q = (w1_q, *((w1_t.data, w1_t.scale_inv) if w1_t is not None else (None, None)))
    fc2_q = (w2_q, *((w2_t.data, w2_t.scale_inv) if w2_t is not None else (None, None)))
    return quantized_mlp(spec, offs.offs, host_offs, route, fc1_q, fc2_q, row_major(x), probs, w1s, b1s, w2s, b2s)


def grouped_mlp_reference(
    x: torch.Tensor,
    fc1_weight: Weight,
    fc2_weight: Weight,
    m_splits: MSplits,
    *,
    probs: torch.Tensor | None = None,
    fc1_bias: Weight | None = None,
    fc2_bias: Weight | None = None,
    activation: str = "swiglu",
    glu_interleave_size: int | None = None,
    backend: str = "auto",
    quantization: str | None = None,
    quantized_wgrad: bool = True,
    weight_caches: tuple[QuantizedWeightCache, QuantizedWeightCache] | None = None,
) -> torch.Tensor:
    """float64 reference of `grouped_mlp` (unquantized: the exact values quantized compute approximates);
    returns float64."""
    del backend, quantization, quantized_wgrad, weight_caches
    h = grouped_linear_reference(x, fc1_weight, m_splits, fc1_bias)
    a = glu_reference(h, activation=activation, probs=probs, glu_interleave_size=glu_interleave_size)
    return grouped_linear_reference(a, fc2_weight, m_splits, fc2_bias, bias_scale=probs)


# --------------------------------------------------------------------------------------------------
# The fused path
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedSpec:
    """What the fused nodes need besides tensors: the backend (with the FusedMLP capability) by name, the
    GLU block, the activation, and how many fc1 / fc2 weight tensors the parameters start with (1 grouped
    tensor or N per-expert ones; the biases follow)."""

    backend: str
    glu_interleave_size: int | None
    activation: str
    n_w1: int
    n_w2: int


# Positions of the nodes' inputs (their needs_input_grad).
_FC1_X, _FC1_PROBS, _FC1_PARAMS = 4, 5, 6
_FC2_H, _FC2_PROBS, _FC2_PARAMS = 3, 5, 8


def fused_mlp(
    spec: FusedSpec,
    offs: torch.Tensor,
    route: ExpertRoute | None,
    kept: int,
    x: torch.Tensor,
    probs: torch.Tensor | None,
    w1s: list[torch.Tensor],
    b1s: list[torch.Tensor],
    w2s: list[torch.Tensor],
    b2s: list[torch.Tensor],
) -> torch.Tensor:
    """The fused MLP in two autograd nodes (module docstring). route None: x (M, H) and probs (M,) are
    in expert order and the result is (M, H); else x (T, H) and probs (T, K) are in token order and the
    result (T, H). kept: the sorted rows whose h is held for the backward (all M of them, or fewer: the
    others' h is computed again in node 2's backward)."""
    h, act, probs_M, h_head = _Fc1Node.apply(spec, offs, route, kept, x, probs, *w1s, *b1s)
    fc1 = None if h_head is None else _Fc1Operands(x, tuple(w1s), tuple(b1s))
    return _Fc2Node.apply(spec, offs, route, h, act, probs_M, h_head, fc1, *w2s, *b2s)


@dataclass(frozen=True)
class _Fc1Operands:
    """What node 2's backward computes h's other rows from: x and fc1's parameters as the layer took them
    (references: they are alive anyway)."""

    x: torch.Tensor
    w1s: tuple[torch.Tensor, ...]
    b1s: tuple[torch.Tensor, ...]


def _fused(spec: FusedSpec) -> FusedMLP:
    fused = fused_mlp_of(backend_named(spec.backend))
    assert fused is not None, "fused_mlp runs on backends with the FusedMLP capability only"
    return fused


def _split_offsets(offs: torch.Tensor, kept: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert offsets (N+1,) of the sorted rows [0, kept) and of the rows [kept, rows), the latter
    counted from row `kept`: an expert across the split has rows in both, rows past offs[N] (padding)
    stay padding. Device ops, no host read."""
    return offs.clamp(max=kept), (offs - kept).clamp(min=0, max=rows - kept)


class _Fc1Node(torch.autograd.Function):
    """Node 1: (rows gathered into expert order), fc1 + activation. Inputs: spec, offs, route, kept, x,
    probs, then the fc1 weights and biases. Returns (h, act (M, F), probs (M,) or None, h_head): with
    kept = M, h (M, 2F) and h_head None; else h is a gradient slot, an (M, 2F) tensor of one element
    (node 2's backward returns the whole dh for it: an output's gradient has the output's shape), and
    h_head (kept, 2F) the rows held.

    act is not differentiable here: it is act(h) * probs, a function of h, and node 2's backward already
    returns h's gradient through it (the fused backward computes dh from fc2's dgrad through the
    activation's derivative, and d probs); a second path through act would count it twice."""

    @staticmethod
    def forward(
        ctx: Any,
        spec: FusedSpec,
        offs: torch.Tensor,
        route: ExpertRoute | None,
        kept: int,
        x: torch.Tensor,
        probs: torch.Tensor | None,
        *params: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        w1s, b1s = params[: spec.n_w1], params[spec.n_w1 :]
        w1, b1 = stacked(w1s, 3, "fc1 weight"), stacked(b1s, 2, "fc1 bias")
        assert w1 is not None  # check_mlp_params: fc1 has weights
        glu_block, activation = spec.glu_interleave_size, spec.activation
        rows = x.shape[0] if route is None else route.token_of_row.shape[0]
        # With a route whose h is held whole, fc1 reads x's token rows in its loads where the backend says
        # that beats gathering them first (narrow experts); the same bits either way.
        in_loads = route is not None and kept == rows and _fused(spec).gathered_fc1_pays(x, w1, glu_block)
        x_MH: torch.Tensor | None = x
        probs_M = probs
        if route is not None:
            assert probs is not None  # a route's probs: the router weights (T, K)
            x_MH, probs_M = (None if in_loads else route.to_rows(x)), route.sorted_weights(probs)
        if kept == rows:
            if x_MH is None:  # in_loads
                assert route is not None  # in_loads
                h, act = library.glu_forward_gathered(
                    spec.backend, x, route.token_of_row, w1, offs, b1, probs_M, glu_block, activation
                )
            else:
                h, act = library.glu_forward(spec.backend, x_MH, w1, offs, b1, probs_M, glu_block, activation)
            h_head = None
            ctx.mark_non_differentiable(act)
        else:
            # The rows [0, kept) and [kept, M) in one launch each, act into one (M, F) tensor: the same bits
            # as one launch (a row's h and act depend on its x, probs and expert only). The tail's h is
            # dropped. `out` is not part of the custom op: this node runs in eager only.
            assert probs_M is not None  # h is split for a route only (moe_experts), which has router weights
            assert x_MH is not None  # fc1 reads the token rows itself only where h is held whole
            fused, ffn = _fused(spec), w1.shape[1] // 2
            offs_head, offs_tail = _split_offsets(offs, kept, rows)
            h_head, act = x_MH.new_empty(kept, 2 * ffn), x_MH.new_empty(rows, ffn)
            fused.glu_forward(
                x_MH[:kept], w1, offs_head, b1, probs_M[:kept], glu_block, activation, out=(h_head, act[:kept])
            )
            tail = (x_MH.new_empty(rows - kept, 2 * ffn), act[kept:])
            fused.glu_forward(x_MH[kept:], w1, offs_tail, b1, probs_M[kept:], glu_block, activation, out=tail)
            h = torch.empty_strided((rows, 2 * ffn), (0, 0), dtype=act.dtype, device=act.device)
            ctx.mark_non_differentiable(act, h_head)
        if probs is not None and not probs.requires_grad:
            ctx.mark_non_differentiable(probs_M)
        ctx.set_materialize_grads(False)
        ctx.spec, ctx.b1_dims = spec, tuple(b.dim() for b in b1s)
        ctx.use_triton, route_tensors = ExpertRoute.to_save(route)
        # x is saved as the caller's tensor itself (token order for a route): saved-tensor hooks may replace it.
        ctx.save_for_backward(x, offs, *route_tensors, *w1s)
        return h, act, probs_M, h_head

    @staticmethod
    def backward(
        ctx: Any,
        dh_M2F: torch.Tensor | None,
        _d_act: torch.Tensor | None,
        d_probs_M: torch.Tensor | None,
        _d_h_head: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        x, offs, *rest = ctx.saved_tensors
        route, w1s = ExpertRoute.from_saved(rest, ctx.use_triton)
        spec, need = ctx.spec, ctx.needs_input_grad
        dx = d_probs = dw1 = db1 = None
        if dh_M2F is not None:
            # dx first: with a route its (M, H) rows are summed into token order and freed before the
            # weight gradient allocates dw1 and x's rows (gathered again, where the kernel does not read
            # them in its loads), so the peak holds dw1 beside one (M, H) tensor at most, not beside dx's
            # rows and x's (notes/moe_experts.md).
            if need[_FC1_X]:
                dx = library.grouped_linear_dgrad(spec.backend, dh_M2F, stacked(w1s, 3, "fc1 weight"), offs, None)
                if route is not None:
                    dx = route.to_tokens(dx)
            if any(need[_FC1_PARAMS : _FC1_PARAMS + spec.n_w1]):
                transposed = stored_transposed(w1s[0])
                if route is not None and _fused(spec).gathered_wgrad_pays(x, dh_M2F.shape[1] // 2):
                    # The kernel reads x's token rows itself: the same bits, no (M, H) copy.
                    dw1 = wgrad_in_layout(spec.backend, dh_M2F, x, offs, None, transposed, x_rows=route.token_of_row)
                else:
                    x_MH = x if route is None else route.to_rows(x)
                    dw1 = wgrad_in_layout(spec.backend, dh_M2F, x_MH, offs, None, transposed)
                    del x_MH
            if any(need[_FC1_PARAMS + spec.n_w1 :]):
                db1 = library.grouped_linear_dbias(spec.backend, dh_M2F, offs, None, None)
        if need[_FC1_PROBS] and d_probs_M is not None:
            d_probs = d_probs_M if route is None else route.weight_grads(d_probs_M)
        return (
            None,
            None,
            None,
            None,
            dx,
            d_probs,
            *unstacked(dw1, tuple(w.dim() for w in w1s), 3),
            *unstacked(db1, ctx.b1_dims, 2),
        )


class _Fc2Node(torch.autograd.Function):
    """Node 2: fc2 with the probs-scaled bias (then each token's K rows summed, for a route), whose
    backward also runs the activation's backward and so returns h's gradient. Inputs: spec, offs, route,
    h, act, probs, h_head, fc1 (`_Fc1Operands` where only h_head is held, else None), then the fc2 weights
    and biases."""

    @staticmethod
    def forward(
        ctx: Any,
        spec: FusedSpec,
        offs: torch.Tensor,
        route: ExpertRoute | None,
        h: torch.Tensor,
        act: torch.Tensor,
        probs_M: torch.Tensor | None,
        h_head: torch.Tensor | None,
        fc1: _Fc1Operands | None,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        w2s, b2s = params[: spec.n_w2], params[spec.n_w2 :]
        w2, b2 = stacked(w2s, 3, "fc2 weight"), stacked(b2s, 2, "fc2 bias")
        scale = probs_M if b2 is not None else None
        y_MH = library.grouped_linear_forward(spec.backend, act, w2, offs, None, b2, scale)
        ctx.spec, ctx.recomputes, ctx.b2_dims = spec, fc1 is not None, tuple(b.dim() for b in b2s)
        ctx.use_triton, route_tensors = ExpertRoute.to_save(route)
        held = h if fc1 is None else h_head
        fc1_tensors = () if fc1 is None else (fc1.x, *fc1.w1s, *fc1.b1s)
        ctx.save_for_backward(held, offs, probs_M, b2, *route_tensors, *w2s, *fc1_tensors)
        return y_MH if route is None else route.to_tokens(y_MH)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        spec, need = ctx.spec, ctx.needs_input_grad
        h_held, offs, probs_M, b2, *rest = ctx.saved_tensors
        # Autograd keeps what a node saved until its backward returns; let go of it here (unless the graph
        # is retained), so that h, whose last reader is the activation's backward, is freed before fc2's
        # weight gradient is allocated, not after: the layer's peak where that moment is its peak.
        _release_saved(ctx)
        route, rest = ExpertRoute.from_saved(rest, ctx.use_triton)
        w2s = tuple(rest[: spec.n_w2])
        w2 = stacked(w2s, 3, "fc2 weight")
        assert w2 is not None  # check_mlp_params: fc2 has weights
        glu_block, activation = spec.glu_interleave_size, spec.activation
        # With a route and h held whole, the backward's kernels (fc2's bias gradient and d probs' bias term
        # too) read d out's token rows in their loads where the backend says that beats gathering them
        # first (narrow experts); the same bits either way.
        in_loads = (
            route is not None and not ctx.recomputes and _fused(spec).gathered_backward_pays(d_out, w2, glu_block)
        )
        # dy: fc2's output gradient as its kernels read it, the (M, H) rows in expert order, or d out's (T, H)
        # token rows read through dy_rows.
        dy_rows = None
        if in_loads:
            assert route is not None  # in_loads
            dy, dy_rows = row_major(d_out), route.token_of_row
            dh, act_p, dprobs = library.glu_backward_gathered(
                spec.backend, dy, dy_rows, w2, h_held, offs, probs_M, glu_block, activation
            )
        else:
            dy = row_major(d_out if route is None else route.to_rows(d_out))
            if not ctx.recomputes:
                dh, act_p, dprobs = library.glu_backward(
                    spec.backend, dy, w2, h_held, offs, probs_M, glu_block, activation
                )
            else:
                x, *fc1_params = rest[spec.n_w2 :]
                fc1 = _Fc1Operands(x, tuple(fc1_params[: spec.n_w1]), tuple(fc1_params[spec.n_w1 :]))
                dh, act_p, dprobs = _glu_backward_recomputing(spec, dy, w2, h_held, offs, probs_M, route, fc1)
        del h_held  # its last reader; freed here where the saved copy was released
        need_probs = need[_FC2_PROBS] and probs_M is not None
        dw2 = db2 = d_probs = bias_dot = None
        if any(need[_FC2_PARAMS : _FC2_PARAMS + spec.n_w2]):
            dw2 = wgrad_in_layout(spec.backend, dy, act_p, offs, None, stored_transposed(w2), dy_rows=dy_rows)
        if b2 is not None and (need_probs or any(need[_FC2_PARAMS + spec.n_w2 :])):
            # One pass over dy (through dy_rows where the kernels read d out's token rows) gives fc2's bias
            # gradient and the bias term of d probs, <dy[r], b2[group of r]> (y = ... + b2 * p).
            db2, bias_dot = library.dbias_and_dot(spec.backend, dy, offs, b2, probs_M, dy_rows)
        if need_probs:
            assert dprobs is not None and probs_M is not None  # the fused backward gives d probs with probs
            d_probs = (dprobs if bias_dot is None else dprobs + bias_dot).to(probs_M.dtype)
        return (
            None,
            None,
            None,
            dh,
            None,
            d_probs,
            None,
            None,
            *unstacked(dw2, tuple(w.dim() for w in w2s), 3),
            *unstacked(db2, ctx.b2_dims, 2),
        )


def _release_saved(ctx: Any) -> None:
    """Drop autograd's references to what ctx saved, once the backward has unpacked them, where the graph
    is not retained (`retain_graph=True` keeps them for the next backward): each saved tensor then lives
    as long as the backward's own reference to it. Not under torch.compile (its traced backward manages
    the saved tensors itself)."""
    if not torch.compiler.is_compiling():
        ctx.maybe_clear_saved_tensors()


def _glu_backward_recomputing(
    spec: FusedSpec,
    dy_MH: torch.Tensor,
    w2: torch.Tensor,
    h_head: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    route: ExpertRoute | None,
    fc1: _Fc1Operands,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused backward of all M rows (dh (M, 2F), act_p (M, F), d probs (M,) fp32) where only the first
    kept = len(h_head) rows' h was held: the others' h is computed again first (x's rows gathered again,
    fc1 + activation as node 1 ran them, the same bits), then one launch per part. The parts' d probs
    partials are summed as one (F tiles, M) tensor, as one launch's would be."""
    fused = _fused(spec)
    rows, kept = dy_MH.shape[0], h_head.shape[0]
    w1, b1 = stacked(fc1.w1s, 3, "fc1 weight"), stacked(fc1.b1s, 2, "fc1 bias")
    # h is held in part for a route only (moe_experts), which has router weights; fc1 has weights.
    assert route is not None and probs_M is not None and w1 is not None
    ffn = w2.shape[2]
    offs_head, offs_tail = _split_offsets(offs, kept, rows)
    dh_M2F, act_p_MF = dy_MH.new_empty(rows, 2 * ffn), dy_MH.new_empty(rows, ffn)
    x_tail = library.gather_sum_rows(fc1.x, route.token_of_row[kept:], None, route.use_triton)
    # The recomputed act goes to act_p's tail rows, which the backward kernel then overwrites.
    glu_block, activation = spec.glu_interleave_size, spec.activation
    tail = (x_tail.new_empty(rows - kept, 2 * ffn), act_p_MF[kept:])
    h_tail, _ = fused.glu_forward(x_tail, w1, offs_tail, b1, probs_M[kept:], glu_block, activation, out=tail)
    del x_tail
    partials = [
        fused.glu_backward_partials(
            dy_MH[lo:hi],
            w2,
            h_part,
            offs_part,
            probs_M[lo:hi],
            glu_block,
            activation,
            out=(dh_M2F[lo:hi], act_p_MF[lo:hi]),
        )[2]
        for lo, hi, h_part, offs_part in ((0, kept, h_head, offs_head), (kept, rows, h_tail, offs_tail))
        if hi > lo
    ]
    # With probs every launch gives its d probs partials (never None).
    return dh_M2F, act_p_MF, torch.cat(cast(list[torch.Tensor], partials), dim=1).sum(0)
