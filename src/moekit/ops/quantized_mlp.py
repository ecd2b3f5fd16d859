"""The quantized grouped MLP (`grouped_mlp(..., quantization=...)`, and so `moe_experts` and the modules)
in two autograd nodes that hold, for the backward, fc1's output h in FP8 and x itself, nothing else of
the rows' size.

Legend: M routed rows, N experts, H hidden size, F ffn size.

    node 1    h = Q(x) Q(w1)^T + b1             (M, 2F) in x's dtype
              [gated pass: Q(a), Q(held h) from h]  (below)
              held: x itself, the offsets, fc1's weight quantization (the cache's tensors)
    node 2    a = act(gate(h), up(h)) * probs   (M, F), from h as the GEMM gave it
              y = Q(a) Q(w2)^T + b2 * probs     (M, H)
              held: Q(h), h's rowwise quantization (FP8 data and its scales), probs, the offsets,
              fc2's weight quantization and the fc2 bias
    node 2's backward
              h' = the dequantization of Q(h)
              a' = act(gate(h'), up(h')) * probs  -> Qc(a')          fc2's wgrad operand
                   (in one pass from FP8 h where the gated kernel runs: `group_quantize_held_columns`)
              da = Q(dy) Qc(w2); dw2 = Qc(dy)^T Qc(a')
              dh = act'(h', da * probs); d probs from act(h') and da, and <dy, b2> for the bias
    node 1's backward
              dx = Q(dh) Qc(w1); dw1 = Qc(dh)^T Qc(x)          Qc(x) made here, from the saved x
              (dh's memory freed once Q(dh) and Qc(dh) exist, not when the backward returns)

With `quantized_wgrad=False` the weight gradients take the operands unquantized, in x's dtype: dw2 =
dy^T a' and dw1 = dh^T x on the backend's grouped wgrad (the routed rows read through the route where
the backend's `FusedMLP` says so, as the unquantized layer's), and only the dgrads' rowwise forms Q(dy)
and Q(dh) are made: no columnwise form, and d out's rowwise form quantized from its token rows and
gathered, as node 1's Q(x). Everything but the weight gradients is bit for bit the same.

h itself is saved by neither node: it is freed once it is quantized, in node 2's forward or, where
the gated pass quantizes (below), in node 1's before fc2 runs.

Why not the composition `grouped_linear`, `glu`, `grouped_linear`: composed, each piece holds what its
own backward needs, which is x's columnwise FP8 (fc1's wgrad operand, H bytes a row), h in x's dtype
(the activation's backward, 2F values a row) and a's columnwise FP8 (fc2's wgrad operand, F bytes a
row). Node 2 knows that a is a function of h: it holds h once, in FP8 (2F bytes a row and the recipe's
scales), and computes a and its columnwise quantization again in its backward. Node 1 knows that x is
the caller's tensor: it holds x and quantizes it columnwise in its backward.

In `moe_experts` the nodes move the rows themselves (an `ExpertRoute`, as the fused bf16 path's nodes):
node 1 takes the (T, H) token rows, quantizes them rowwise (T rows, not M = T*K) and gathers the FP8
bytes and scales into expert order (`group_quantize_gathered`: the same bytes as quantizing the gathered
rows, since a rowwise block never leaves its row), so no (M, H) tensor in x's dtype is written in the
forward; it holds the token rows (the caller's tensor: nothing), and its backward quantizes Qc(x) from
them through the route's index where the FP8 wgrad's layout is made (`group_quantize_for_wgrad(index=)`;
elsewhere it gathers the sorted rows first), then sums dx back into token order. Node 2 sums each
token's K rows of y; its backward reads d out's rows through the index in the same way, and for fc2's
bias gradient and d probs' bias term on a backend with `FusedMLP` (`dbias_and_dot`), so that d out's
sorted rows are written only where something else needs them. Elsewhere (grouped_mlp's callers,
torch.compile's trace of moe_experts) x is the sorted rows, saved as the very tensor given so that
moe_experts' saved-tensor hooks can replace it by a reference to the token rows.

Why two nodes rather than one: autograd unpacks a node's saved tensors all at once, at the start of its
backward; in one node x's gathered rows (M, H) would be alive through the whole backward, beside dy,
a' and dh. Split, node 2's backward runs first and frees FP8 h and dy's quantizations before node 1's
gathers x (as the fused path's two nodes, `moekit.ops.grouped_mlp`).

The activation's backward and the recomputed a read h' (FP8 values, dequantized): the quantization
error of h reaches dh and fc2's wgrad (as DeepSeek-V3's FP8 training holds the SwiGLU input), while the
forward's a is computed from h itself. An activation with clamps (gpt-oss's) has h held in the form
`moekit.ops.glu.to_held` gives, so that no rounding moves a value across a clamp (and the derivative
with it). On moekit's gated kernels
(`gated_on_kernel`) h' is never written out: the kernels read h's FP8 data and scales and dequantize in
the load (`held_gated_activation`, `held_gated_activation_backward`); elsewhere one pass of the
quantizer (`dequantize_with`) gives h' as an (M, 2F) tensor of the backward, the same values. In the
forward, where the gated kernel runs and the recipe's scale blocks fit the GLU layout (fp8_block and
mxfp8; `spec.gated_quantize`) and h is held, node 1 makes Q(a) and Q(held h) in one pass over h
(`group_quantize_gated`): neither a nor the held form exists in h's dtype, and h does not cross the
node boundary (node 2 gets the FP8 forms and a carrier for h's gradient). Where the backend's
`QuantizedGatedFc1` takes the problem (`spec.fc1_gated_epilogue`: fp8_block on Hopper, when the config
table chooses it), fc1's GEMM writes both forms in its epilogue and h is never written at all.
Elsewhere node 2 runs the activation, then `group_quantize` of held h and of a: the same bytes.

Every product keeps grouped_linear's choice of path (`fp8_compute`, `fp8_wgrad_compute`: FP8 kernels
where the backend has them, the reference path otherwise; the FP8 wgrad's columnwise operands Qc made in
its own layout by `group_quantize_for_wgrad`) and its straight-through gradients; the
quantizations are `group_quantize`'s, by the quantizer that `grouped_linear` would pick. No host reads:
CUDA-graph capturable, and every launch is a custom op, so torch.compile traces the nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moekit.grouped_tensor import GroupedTensor
from moekit.ops import library
from moekit.ops.activations import activation_named
from moekit.ops.glu import (
    check_interleave,
    from_held,
    gated_activation,
    gated_activation_backward,
    held_gated_activation,
    held_gated_activation_backward,
    to_held,
)
from moekit.ops.grouped_linear import (
    bias_scale_grad,
    quantized_dgrad_product,
    quantized_forward_product,
    quantized_wgrad_product,
    release_consumed_gradient,
    row_major,
    stacked,
    stored_transposed,
    unstacked,
    wgrad_in_layout,
)
from moekit.ops.quantize import (
    dequantize_with,
    gated_forms_storage,
    group_quantize,
    group_quantize_for_wgrad,
    group_quantize_gated,
    group_quantize_gathered,
    group_quantize_held_columns,
    rowwise_grouped,
)
from moekit.ops.rows import ExpertRoute
from moekit.ops.splits import GroupOffsets


@dataclass(frozen=True)
class QuantizedMlpSpec:
    """What the nodes need besides tensors: the recipe and the quantizer (a backend name, as `select_quantizer`
    gives it), each linear's backend and FP8 paths (`fp8_compute`, `fp8_wgrad_compute` for fc1 and fc2), the
    activation with its GLU block, whether the gated activation runs on moekit's kernel (`gated_on_kernel`)
    and whether it also quantizes its output and h in that pass (`gated_quantize`:
    `moekit.ops.quantize.group_quantize_gated`), whether fc1's FP8 GEMM makes both quantizations in its
    epilogue instead, h never written (`fc1_gated_epilogue`: the backend's `QuantizedGatedFc1` capability
    takes this problem), whether the backward's gated kernel quantizes the recomputed activation columnwise
    for fc2's FP8 wgrad itself (`held_columns`: `moekit.ops.quantize.group_quantize_held_columns`, the
    activation never written), whether fc2's bias gradient and d probs' bias term come from one pass of the
    backend's `FusedMLP.dbias_and_dot` (`fc2_bias_fused`: d out's token rows read in place), whether the
    weight gradients come from the quantized operands (`quantized_wgrad`) or from the unquantized ones in
    x's dtype, and then whether fc1's reads x's token rows / fc2's reads d out's token rows through the
    route in its loads (`fc1_wgrad_x_rows`, `fc2_wgrad_dy_rows`: the backend's `FusedMLP` says where that
    beats gathering them first), and how many tensors each parameter comes in (1 grouped tensor or N)."""

    recipe: str
    quantizer: str
    fc1_backend: str
    fc2_backend: str
    fc1_fp8: bool
    fc1_fp8_wgrad: bool
    fc2_fp8: bool
    fc2_fp8_wgrad: bool
    glu_interleave_size: int | None
    activation: str
    gated_triton: bool
    gated_quantize: bool
    fc1_gated_epilogue: bool
    held_columns: bool
    fc2_bias_fused: bool
    quantized_wgrad: bool
    fc1_wgrad_x_rows: bool
    fc2_wgrad_dy_rows: bool
    n_w1: int
    n_b1: int
    n_w2: int
    n_b2: int


# Positions of the nodes' inputs (needs_input_grad). Node 1: x, then fc1's parameters; node 2: h (or its
# gradient carrier), probs, then fc2's parameters.
_X1, _PARAMS1 = 9, 10
_H2, _PROBS2, _PARAMS2 = 8, 13, 14


@dataclass(frozen=True)
class _Layout:
    """What rebuilds a quantized GroupedTensor from its saved storage, holding no tensor: a ctx
    attribute outlives the backward (it lives as long as the graph), so a GroupedTensor kept there
    would keep its storage alive after autograd freed the saved tensors."""

    recipe: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    host_first_dims: tuple[int, ...] | None

    @staticmethod
    def of(t: GroupedTensor) -> _Layout:
        assert t.recipe is not None  # quantized
        return _Layout(t.recipe, t.dtype, tuple(t.shape), t.known_host_first_dims)

    def rebuilt(self, tensors: Sequence[torch.Tensor | None]) -> GroupedTensor:
        """The GroupedTensor over `tensors`, in `GroupedTensor.storage()`'s order."""
        first_dims, offsets, row_data, row_scale, col_data, col_scale, col_offs = tensors
        assert first_dims is not None and offsets is not None  # saved from a quantized GroupedTensor
        return GroupedTensor.quantized(
            self.recipe,
            self.dtype,
            self.shape,
            first_dims,
            offsets,
            host_first_dims=self.host_first_dims,
            rowwise_data=row_data,
            rowwise_scale_inv=row_scale,
            columnwise_data=col_data,
            columnwise_scale_inv=col_scale,
            columnwise_scale_offsets=col_offs,
        )


def _storage_of(t: GroupedTensor | None) -> tuple[torch.Tensor | None, ...]:
    return t.storage() if t is not None else (None,) * 7


class _QuantizedFc1Fn(torch.autograd.Function):
    """Node 1, fc1: h = Q(x) Q(w1)^T + b1, holding x itself (not its FP8 copy), quantized columnwise in
    the backward for the wgrad. Inputs: spec, offs, host_offs, route (or None), fc1's weight quantization and its
    transposed copy's data and scales (None without the FP8 dgrad), whether it quantizes the activation
    (below), probs (M,) or None (detached: read only where it quantizes), x (M, H), then w1 and b1 as
    tensor lists. With a route x is the (T, H) token rows: fc1's operand Q(x[token of each row]) is
    quantized from the token rows and its bytes gathered (`group_quantize_gathered`: the same bytes, the
    sorted bf16 rows never written), the backward gathers x's rows for Qc(x) and sums dx back into token
    order. Its backward runs after node 2's has freed what that one held, so x's sorted rows (gathered
    again in the backward: by the route, or by moe_experts' hooks) and dh are not alive together with FP8
    h and dy's quantizations. The weight's quantization is saved as tensors, so autograd refuses a backward
    after a cache rewrote it in place (as `grouped_linear`'s node).

    Outputs: where it quantizes (the gated pass writes both FP8 forms, and h is held: `quantized_mlp`
    decides), h's gradient carrier (an (M, 2F) view of one element: node 2 reads nothing of it and returns
    h's gradient for it) and the rowwise data and scales of Q(a) and Q(held h), which node 2 takes as
    they are (not differentiable); otherwise h itself and four Nones. h never crosses to node 2 in the
    first case; with `spec.fc1_gated_epilogue` the GEMM writes the FP8 forms itself (h never exists)."""

    @staticmethod
    def forward(
        ctx: Any,
        spec: QuantizedMlpSpec,
        offs: torch.Tensor,
        host_offs: list[int] | None,
        route: ExpertRoute | None,
        w1_q: GroupedTensor,
        w1t_data: torch.Tensor | None,
        w1t_scale: torch.Tensor | None,
        quantizes: bool,
        probs_M: torch.Tensor | None,
        x_MH: torch.Tensor,
        *params: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        w1s, b1s = params[: spec.n_w1], params[spec.n_w1 :]
        b1 = stacked(b1s, 2, "fc1 bias")
        recipe, quantizer = spec.recipe, spec.quantizer
        rows = x_MH.shape[0] if route is None else route.token_of_row.shape[0]
        go = GroupOffsets.of(offs, host_offs, rows)
        if route is None:
            x_q = group_quantize(x_MH, go, recipe, backend=quantizer)
        else:  # x_MH is the token rows (T, H)
            x_q = group_quantize_gathered(x_MH, route.token_of_row, go, recipe, quantizer, route.use_triton)
        ffn = w1_q.shape[1] // 2
        glu_block = check_interleave(ffn, spec.glu_interleave_size)
        if quantizes and spec.fc1_gated_epilogue:
            # One kernel: fc1's GEMM writes the two FP8 forms itself; h is never written.
            forms: tuple[torch.Tensor | None, ...] = gated_forms_storage(recipe, rows, ffn, x_MH.device, go.num_groups)
            library.quantized_gated_fc1_into(
                spec.fc1_backend, x_q.rowwise_data, x_q.rowwise_scale_inv, w1_q.rowwise_data,
                w1_q.rowwise_scale_inv, offs, b1.contiguous() if b1 is not None else None, probs_M, glu_block,
                spec.activation, x_MH.dtype, *forms,
            )  # fmt: skip
            h_M2F = None
        else:
            h_M2F = quantized_forward_product(
                spec.fc1_backend, quantizer, recipe, spec.fc1_fp8, x_q, w1_q, offs, host_offs, b1, None, x_MH.dtype
            )
        del x_q
        ctx.spec, ctx.host_offs = spec, host_offs
        ctx.w_dims, ctx.b_dims = tuple(w.dim() for w in w1s), tuple(b.dim() for b in b1s)
        ctx.w_transposed, ctx.w_layout = stored_transposed(w1s[0]), _Layout.of(w1_q)
        # x is saved as the tensor given (moe_experts' hooks replace its sorted rows by a reference to x).
        ctx.use_triton, route_tensors = ExpertRoute.to_save(route)
        ctx.save_for_backward(x_MH, offs, w1t_data, w1t_scale, *route_tensors, *w1_q.storage())
        # The FP8 outputs get no gradient: without this autograd would hand the backward zeros of their
        # sizes (materialized), written for nothing.
        ctx.set_materialize_grads(False)
        if not quantizes:
            return h_M2F, None, None, None, None
        if h_M2F is not None:
            # Both quantizations from one read of h, neither a nor h's held form written in h's dtype.
            act = activation_named(spec.activation)
            a_q, h_q = group_quantize_gated(
                h_M2F, go, recipe, probs_M, glu_block, spec.activation, act.gate_limit or 0.0, act.up_limit or 0.0
            )
            del h_M2F
            forms = (a_q.rowwise_data, a_q.rowwise_scale_inv, h_q.rowwise_data, h_q.rowwise_scale_inv)
        carrier = x_MH.new_zeros(1).expand(rows, 2 * ffn)
        ctx.mark_non_differentiable(*forms)
        return (carrier, *forms)

    @staticmethod
    def backward(ctx: Any, dh_M2F: torch.Tensor | None, *forms_grads: Any) -> tuple[torch.Tensor | None, ...]:
        if dh_M2F is None:  # no gradient reached h (grads are not materialized here)
            return (None,) * (_X1 + 1 + len(ctx.w_dims) + len(ctx.b_dims))
        x_MH, offs, w1t_data, w1t_scale, *stored = ctx.saved_tensors
        route, stored = ExpertRoute.from_saved(stored, ctx.use_triton)
        spec, host_offs, need = ctx.spec, ctx.host_offs, ctx.needs_input_grad
        recipe, quantizer, backend = spec.recipe, spec.quantizer, spec.fc1_backend
        w1_q = ctx.w_layout.rebuilt(stored)
        need_x = need[_X1]
        need_w, need_b = any(need[_PARAMS1 : _PARAMS1 + spec.n_w1]), any(need[_PARAMS1 + spec.n_w1 :])
        dh_given, dh_M2F = dh_M2F, row_major(dh_M2F)
        go = GroupOffsets.of(offs, host_offs, dh_M2F.shape[0])
        dx = dw = db = None
        # As grouped_linear's backward: the bias sums from dh with its padding rows zeroed, dh quantized
        # rowwise (the dgrad) and columnwise (the wgrad); x quantized columnwise here.
        if need_b:
            db = library.grouped_linear_dbias(
                backend, library.without_padding_rows(dh_M2F, offs, host_offs), offs, host_offs, None
            )
        if need_x or need_w:
            # The wgrad's columnwise forms in the FP8 wgrad's own layout where it runs (no transpose pass);
            # with the unquantized wgrad only the dgrad's rowwise form, and dh itself is the wgrad's operand.
            quantized_wgrad = spec.quantized_wgrad
            segments = spec.fc1_fp8_wgrad and quantized_wgrad
            dh_q = dh_cols = None
            if need_x or quantized_wgrad:
                dh_q, dh_cols = group_quantize_for_wgrad(
                    dh_M2F, go, recipe, rowwise=need_x, columnwise=need_w and quantized_wgrad, segments=segments,
                    backend=quantizer,
                )  # fmt: skip
            if quantized_wgrad:
                # dh is read by nothing after its FP8 forms: node 2 made it for this node alone, and the
                # engine would hold it through the dgrad and the wgrad (the backward's peak at large F).
                release_consumed_gradient(dh_given)
                del dh_M2F, dh_given
            # dx first: its (M, H) rows are summed into token order and freed, with dh's rowwise form,
            # before x's columnwise form and dw1 are allocated (the backward's peak: notes/quantize.md).
            if need_x:
                assert dh_q is not None  # rowwise
                dx = quantized_dgrad_product(
                    backend, quantizer, recipe, spec.fc1_fp8, dh_q, w1_q, w1t_data, w1t_scale, offs, host_offs
                )
                del dh_q
                if route is not None:
                    dx = route.to_tokens(dx)
            if need_w and not quantized_wgrad:
                # dh^T x in x's dtype, x's token rows read in the wgrad's loads where the backend says so.
                x_rows = None
                if route is not None and spec.fc1_wgrad_x_rows:
                    x_rows = route.token_of_row
                elif route is not None:
                    x_MH = route.to_rows(x_MH)
                dw = wgrad_in_layout(backend, dh_M2F, x_MH, offs, host_offs, ctx.w_transposed, x_rows=x_rows)
            elif need_w:
                assert dh_cols is not None  # need_w
                index = None
                if route is not None and segments:  # x_MH is the token rows: the quantizer gathers them
                    index = route.token_of_row
                elif route is not None:  # the sorted rows gathered again
                    x_MH = route.to_rows(x_MH)
                _, x_cols = group_quantize_for_wgrad(
                    x_MH, go, recipe, segments=segments, index=index, backend=quantizer
                )
                assert x_cols is not None  # columnwise
                del x_MH
                dw = quantized_wgrad_product(
                    backend, quantizer, recipe, spec.fc1_fp8_wgrad, dh_cols, x_cols, offs, host_offs,
                    ctx.w_transposed, w1_q.dtype,
                )  # fmt: skip
                del x_cols, dh_cols
        return (None,) * _X1 + (dx, *unstacked(dw, ctx.w_dims, 3), *unstacked(db, ctx.b_dims, 2))


class _QuantizedGatedFc2Fn(torch.autograd.Function):
    """Node 2, the activation and fc2: a = act(h) * probs, y = Q(a) Q(w2)^T + b2 * probs, holding h's
    rowwise FP8 quantization only (module docstring); its backward returns h's gradient. Inputs: spec,
    grad_enabled (whether grad mode was on at the call: the forward runs with it off, and nothing is
    held without it), offs, host_offs, route (or None: with a route each token's K rows of y are summed
    back into token order, and the backward gathers d out's rows), fc2's weight quantization and its
    transposed copy's data and scales, node 1's outputs (h (M, 2F) and four Nones, or h's gradient
    carrier and the rowwise data and scales of Q(a) and Q(held h)), probs (M,) or None, then w2 and b2 as
    tensor lists."""

    @staticmethod
    def forward(
        ctx: Any,
        spec: QuantizedMlpSpec,
        grad_enabled: bool,
        offs: torch.Tensor,
        host_offs: list[int] | None,
        route: ExpertRoute | None,
        w2_q: GroupedTensor,
        w2t_data: torch.Tensor | None,
        w2t_scale: torch.Tensor | None,
        h_M2F: torch.Tensor,
        a_data: torch.Tensor | None,
        a_scale: torch.Tensor | None,
        h_data: torch.Tensor | None,
        h_scale: torch.Tensor | None,
        probs_M: torch.Tensor | None,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        w2s, b2s = params[: spec.n_w2], params[spec.n_w2 :]
        b2 = stacked(b2s, 2, "fc2 bias")
        recipe, quantizer = spec.recipe, spec.quantizer
        glu_block, activation = spec.glu_interleave_size, spec.activation
        go = GroupOffsets.of(offs, host_offs, h_M2F.shape[0])
        h_q: GroupedTensor | None
        if a_data is not None:  # node 1 quantized the activation and h (h_M2F is the carrier)
            assert a_scale is not None and h_data is not None and h_scale is not None  # node 1's four outputs
            first_dims = offs[1:] - offs[:-1]
            a_q, h_q = (
                rowwise_grouped(recipe, h_M2F.dtype, go, first_dims, a_data, a_scale),
                rowwise_grouped(recipe, h_M2F.dtype, go, first_dims, h_data, h_scale),
            )
        else:
            # h is held as its rowwise quantization only, and only where a gradient may be asked for.
            held = grad_enabled and any(ctx.needs_input_grad)
            a_MF = gated_activation(h_M2F, probs_M, glu_block, activation, spec.gated_triton)
            h_q = group_quantize(to_held(h_M2F, glu_block, activation), go, recipe, backend=quantizer) if held else None
            a_q = group_quantize(a_MF, go, recipe, backend=quantizer)
            del a_MF
        scale = probs_M if b2 is not None else None
        y_MH = quantized_forward_product(
            spec.fc2_backend, quantizer, recipe, spec.fc2_fp8, a_q, w2_q, offs, host_offs, b2, scale, h_M2F.dtype
        )
        ctx.spec, ctx.host_offs = spec, host_offs
        ctx.w_dims, ctx.b_dims = tuple(w.dim() for w in w2s), tuple(b.dim() for b in b2s)
        ctx.w_transposed = stored_transposed(w2s[0])
        ctx.layouts = (_Layout.of(h_q) if h_q is not None else None, _Layout.of(w2_q))
        h_storage = h_q.storage() if h_q is not None else (None,) * 7
        ctx.use_triton, route_tensors = ExpertRoute.to_save(route)
        ctx.save_for_backward(probs_M, offs, b2, w2t_data, w2t_scale, *route_tensors, *h_storage, *w2_q.storage())
        return y_MH if route is None else route.to_tokens(y_MH)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        probs_M, offs, b2, w2t_data, w2t_scale, *stored = ctx.saved_tensors
        route, stored = ExpertRoute.from_saved(stored, ctx.use_triton)
        spec, host_offs, need = ctx.spec, ctx.host_offs, ctx.needs_input_grad
        recipe, quantizer, backend = spec.recipe, spec.quantizer, spec.fc2_backend
        h_layout, w2_layout = ctx.layouts
        h_q, w2_q = h_layout.rebuilt(stored[:7]), w2_layout.rebuilt(stored[7:])
        need_h, need_probs = need[_H2], need[_PROBS2] and probs_M is not None
        need_w, need_b = any(need[_PARAMS2 : _PARAMS2 + spec.n_w2]), any(need[_PARAMS2 + spec.n_w2 :])
        need_da = need_h or need_probs  # a's gradient: h's, and d probs' activation term
        # dy is d out's rows in expert order. The quantizer for the wgrad's layout gathers them itself
        # (`group_quantize_for_wgrad(index=)`), and the bias gradients read them through the same map
        # (`fc2_bias_fused`), so that dy is never written in bf16 where nothing else reads it.
        quantized_wgrad = spec.quantized_wgrad
        segments = spec.fc2_fp8_wgrad and quantized_wgrad
        if quantized_wgrad:
            in_place = segments and need_w and (b2 is None or spec.fc2_bias_fused)
        else:  # the unquantized wgrad reads d out's token rows where the backend says it pays
            in_place = spec.fc2_wgrad_dy_rows and (b2 is None or spec.fc2_bias_fused)
        dy_index = route.token_of_row if route is not None and in_place else None
        dy_MH = row_major(d_out if route is None or dy_index is not None else route.to_rows(d_out))
        rows = dy_MH.shape[0] if dy_index is None else dy_index.shape[0]
        go = GroupOffsets.of(offs, host_offs, rows)
        dh = d_probs = dw = db = None
        glu_block, activation, on_kernel = spec.glu_interleave_size, spec.activation, spec.gated_triton
        if b2 is not None and (need_b or need_probs):
            db, d_probs = _fc2_bias_grads(spec, dy_MH, dy_index, go, host_offs, b2, probs_M, need_b, need_probs)
        if not (need_w or need_da):
            return (None,) * _PARAMS2 + (*unstacked(dw, ctx.w_dims, 3), *unstacked(db, ctx.b_dims, 2))
        # h' for the activation: on moekit's kernels h_q itself, read in their loads; else dequantized once.
        h_M2F = None if on_kernel else from_held(dequantize_with(quantizer, h_q), glu_block, activation)
        # The wgrad's columnwise forms in the FP8 wgrad's own layout where it runs (no transpose pass).
        dy_q: GroupedTensor | None
        if quantized_wgrad:
            dy_q, dy_cols = group_quantize_for_wgrad(
                dy_MH, go, recipe, rowwise=need_da, columnwise=need_w, segments=segments, index=dy_index,
                backend=quantizer,
            )  # fmt: skip
        elif not need_da:
            dy_q = dy_cols = None
        elif dy_index is not None:  # rowwise from d out's token rows, its bytes gathered (as node 1's Q(x))
            assert route is not None  # dy_index
            dy_q, dy_cols = group_quantize_gathered(dy_MH, dy_index, go, recipe, quantizer, route.use_triton), None
        else:
            dy_q, dy_cols = group_quantize(dy_MH, go, recipe, backend=quantizer), None
        if need_w and spec.held_columns:
            # The wgrad's operand a, computed again from the held h and quantized columnwise in one pass.
            assert dy_cols is not None  # columnwise
            act = activation_named(activation)
            a_seg = group_quantize_held_columns(
                h_q, go, probs_M, check_interleave(h_q.shape[1] // 2, glu_block), activation, act.gate_limit or 0.0,
                act.up_limit or 0.0,
            )  # fmt: skip
            dw = quantized_wgrad_product(
                backend, quantizer, recipe, spec.fc2_fp8_wgrad, dy_cols, a_seg, offs, host_offs,
                ctx.w_transposed, w2_q.dtype,
            )  # fmt: skip
            del a_seg, dy_cols
        elif need_w:
            # The wgrad's operand a, computed again from the held h (and quantized columnwise for the
            # quantized wgrad).
            if h_M2F is None:
                a_MF = held_gated_activation(h_q, probs_M, glu_block, activation)
            else:
                a_MF = gated_activation(h_M2F, probs_M, glu_block, activation, on_kernel)
            if quantized_wgrad:
                assert dy_cols is not None  # columnwise
                _, a_cols = group_quantize_for_wgrad(a_MF, go, recipe, segments=segments, backend=quantizer)
                assert a_cols is not None  # columnwise
                del a_MF
                dw = quantized_wgrad_product(
                    backend, quantizer, recipe, spec.fc2_fp8_wgrad, dy_cols, a_cols, offs, host_offs,
                    ctx.w_transposed, w2_q.dtype,
                )  # fmt: skip
                del a_cols, dy_cols
            else:
                dw = wgrad_in_layout(backend, dy_MH, a_MF, offs, host_offs, ctx.w_transposed, dy_rows=dy_index)
                del a_MF
        if need_da:
            assert dy_q is not None  # rowwise
            da_MF = quantized_dgrad_product(
                backend, quantizer, recipe, spec.fc2_fp8, dy_q, w2_q, w2t_data, w2t_scale, offs, host_offs
            )
            del dy_q
            if h_M2F is None:
                dh, d_probs_act = held_gated_activation_backward(h_q, probs_M, da_MF, glu_block, activation, need_probs)
            else:
                dh, d_probs_act = gated_activation_backward(
                    h_M2F, probs_M, da_MF, glu_block, activation, on_kernel, need_probs
                )
            if d_probs_act is not None:
                d_probs = d_probs_act if d_probs is None else d_probs + d_probs_act
        return (
            (None,) * _H2
            + (dh if need_h else None, None, None, None, None, d_probs if need_probs else None)
            + (*unstacked(dw, ctx.w_dims, 3), *unstacked(db, ctx.b_dims, 2))
        )


def _fc2_bias_grads(
    spec: QuantizedMlpSpec,
    dy_MH: torch.Tensor,
    dy_index: torch.Tensor | None,
    go: GroupOffsets,
    host_offs: list[int] | None,
    b2: torch.Tensor,
    probs_M: torch.Tensor | None,
    need_b: bool,
    need_probs: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(fc2's bias gradient: each group's rows of dy summed, times probs where there are probs; d probs'
    bias term <dy[r], b2[group of r]> in probs' dtype), each None where not asked (need_b, need_probs),
    for y = ... + b2 * probs. dy is the (M, H) rows, or with dy_index d out's token rows read through it.
    On a backend with `FusedMLP` both from one pass over dy (no padding row read); elsewhere from dy with
    its padding rows zeroed (an (M, H) copy), as grouped_linear's backward."""
    term_of = probs_M if need_probs else None  # the probs whose gradient is asked for
    if spec.fc2_bias_fused:
        sums, dot = library.dbias_and_dot(spec.fc2_backend, dy_MH, go.offs, b2, probs_M, dy_index)
        return (sums if need_b else None), (dot.to(term_of.dtype) if term_of is not None else None)
    assert dy_index is None  # read in place only with the fused pass
    dy_bias_MH = library.without_padding_rows(dy_MH, go.offs, host_offs)
    db = library.grouped_linear_dbias(spec.fc2_backend, dy_bias_MH, go.offs, host_offs, probs_M) if need_b else None
    return db, (bias_scale_grad(dy_bias_MH, b2, go, term_of) if term_of is not None else None)


def quantized_mlp(
    spec: QuantizedMlpSpec,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    route: ExpertRoute | None,
    fc1_quantized: tuple[GroupedTensor, torch.Tensor | None, torch.Tensor | None],
    fc2_quantized: tuple[GroupedTensor, torch.Tensor | None, torch.Tensor | None],
    x_MH: torch.Tensor,
    probs_M: torch.Tensor | None,
    w1s: list[torch.Tensor],
    b1s: list[torch.Tensor],
    w2s: list[torch.Tensor],
    b2s: list[torch.Tensor],
) -> torch.Tensor:
    """y (M, H) of the quantized MLP over x (M, H) sorted by expert (`offs`, `host_offs`), on checked
    arguments (`grouped_mlp`'s), in the two nodes; with a route (`moe_experts`) x is (T, H) in token
    order, node 1 gathers its rows, node 2 sums them back, and y is (T, H). fc1_quantized / fc2_quantized: each weight's
    quantization and its `TransposedWeight`'s data and scales (None where the FP8 dgrad does not run).
    h, node 1's output and node 2's input, is held by neither: freed once node 2's forward has made its
    FP8 copy."""
    if spec.gated_triton and probs_M is not None:
        probs_M = probs_M.contiguous()
    grad = torch.is_grad_enabled()
    # Node 1 quantizes the activation and h in the gated pass only where h is held (a gradient may be
    # asked for); without it node 2 quantizes a alone.
    inputs = (x_MH, probs_M, *w1s, *b1s, *w2s, *b2s)
    held = grad and any(t is not None and t.requires_grad for t in inputs)
    quantizes = spec.gated_quantize and held
    probs_read = probs_M.detach() if probs_M is not None and quantizes else None
    fc1_out = _QuantizedFc1Fn.apply(
        spec, offs, host_offs, route, *fc1_quantized, quantizes, probs_read, x_MH, *w1s, *b1s
    )
    return _QuantizedGatedFc2Fn.apply(spec, grad, offs, host_offs, route, *fc2_quantized, *fc1_out, probs_M, *w2s, *b2s)
