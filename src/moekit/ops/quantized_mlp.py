"""The quantized grouped MLP (`grouped_mlp(..., quantization=...)`, and so `moe_experts` and the modules)
in one autograd node, which holds for its backward fc1's output h in FP8 only.

Legend: M routed rows, N experts, H hidden size, F ffn size.

    forward   h = Q(x) Q(w1)^T + b1             (M, 2F) in x's dtype
              a = act(gate(h), up(h)) * probs   (M, F), from h as the GEMM gave it
              y = Q(a) Q(w2)^T + b2 * probs     (M, H)
              held: Q(h), h's rowwise quantization (FP8 data and its scales), x itself, probs, the
              offsets, the weights' quantizations (the caches' tensors) and the fc2 bias
    backward  h' = the dequantization of Q(h)
              a' = act(gate(h'), up(h')) * probs  -> Qc(a')          fc2's wgrad operand
              da = Q(dy) Qc(w2); dw2 = Qc(dy)^T Qc(a')
              dh = act'(h', da * probs); d probs from act(h') and da, and <dy, b2> for the bias
              dx = Q(dh) Qc(w1); dw1 = Qc(dh)^T Qc(x)          Qc(x) made here, from the saved x

Why one node rather than the composition `grouped_linear`, `glu`, `grouped_linear`: composed, each
piece holds what its own backward needs, which is x's columnwise FP8 (fc1's wgrad operand, H bytes a
row), h in x's dtype (the activation's backward, 2F values a row) and a's columnwise FP8 (fc2's wgrad
operand, F bytes a row). One node knows that a is a function of h and that x is the caller's tensor: it
holds h once, in FP8 (2F bytes a row and the recipe's scales), computes a and its columnwise
quantization again in the backward, and quantizes x columnwise there. x itself costs nothing in
`moe_experts`, whose saved-tensor hooks turn the saved sorted rows into a reference to the token rows
(gathered again in the backward); the node saves x as the very tensor it was given so that the hooks recognise it.

The activation's backward and the recomputed a read h' (FP8 values, dequantized): the quantization
error of h reaches dh and fc2's wgrad (as DeepSeek-V3's FP8 training holds the SwiGLU input), while the
forward's a is computed from h itself. An activation with clamps (gpt-oss's) has h held in the form
`moekit.ops.glu.to_held` gives, so that no rounding moves a value across a clamp (and the derivative
with it). On moekit's gated kernels
(`gated_on_kernel`) h' is never written out: the kernels read h's FP8 data and scales and dequantize in
the load (`held_gated_activation`, `held_gated_activation_backward`); elsewhere one pass of the
quantizer (`dequantize_with`) gives h' as an (M, 2F) tensor of the backward, the same values. The
forward's gated kernel does not quantize h in its pass: one `group_quantize` of h follows it.

Every product keeps grouped_linear's choice of path (`fp8_compute`, `fp8_wgrad_compute`: FP8 kernels
where the backend has them, the reference path otherwise) and its straight-through gradients; the
quantizations are `group_quantize`'s, by the quantizer that `grouped_linear` would pick. No host reads:
CUDA-graph capturable, and every launch is a custom op, so torch.compile traces the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moekit.grouped_tensor import GroupedTensor
from moekit.ops import library
from moekit.ops.glu import (
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
    row_major,
    stacked,
    stored_transposed,
    unstacked,
)
from moekit.ops.quantize import dequantize_with, group_quantize
from moekit.ops.splits import GroupOffsets


@dataclass(frozen=True)
class QuantizedMlpSpec:
    """What the node needs besides tensors: the recipe and the quantizer (a backend name, as
    `select_quantizer` gives it), each linear's backend and FP8 paths (`fp8_compute`, `fp8_wgrad_compute`
    for fc1 and fc2), the activation with its GLU block, whether the gated activation runs on moekit's
    kernel (`gated_on_kernel`), and how many tensors each parameter comes in (1 grouped tensor or N)."""

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
    n_w1: int
    n_b1: int
    n_w2: int
    n_b2: int


# Positions of the node's inputs (needs_input_grad): x, probs, then the parameters.
_X, _PROBS, _PARAMS = 10, 11, 12


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


class _QuantizedMlpFn(torch.autograd.Function):
    """The quantized MLP (module docstring). Inputs: spec, grad_enabled (whether grad mode was on at the
    call: the forward runs with it off, and nothing is held without it), offs (N+1,) on the device,
    host_offs (or None), fc1's weight quantization and its transposed copy's data and scales (None
    without the FP8 dgrad), fc2's likewise, x (M, H), probs (M,) or None, then w1, b1, w2, b2 as tensor
    lists (the spec's counts). The weights' quantizations are saved as tensors, so autograd refuses a
    backward after a cache rewrote them in place (as `grouped_linear`'s node)."""

    @staticmethod
    def forward(
        ctx: Any,
        spec: QuantizedMlpSpec,
        grad_enabled: bool,
        offs: torch.Tensor,
        host_offs: list[int] | None,
        w1_q: GroupedTensor,
        w1t_data: torch.Tensor | None,
        w1t_scale: torch.Tensor | None,
        w2_q: GroupedTensor,
        w2t_data: torch.Tensor | None,
        w2t_scale: torch.Tensor | None,
        x_MH: torch.Tensor,
        probs_M: torch.Tensor | None,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        n1, n2 = spec.n_w1 + spec.n_b1, spec.n_w1 + spec.n_b1 + spec.n_w2
        w1s, b1s, w2s, b2s = params[: spec.n_w1], params[spec.n_w1 : n1], params[n1:n2], params[n2:]
        b1, b2 = stacked(b1s, 2, "fc1 bias"), stacked(b2s, 2, "fc2 bias")
        rows, dtype, recipe, quantizer = x_MH.shape[0], x_MH.dtype, spec.recipe, spec.quantizer
        go = GroupOffsets(offs=offs, host=tuple(host_offs) if host_offs is not None else None, rows=rows)
        x_q = group_quantize(x_MH, go, recipe, backend=quantizer)
        h_M2F = quantized_forward_product(
            spec.fc1_backend, quantizer, recipe, spec.fc1_fp8, x_q, w1_q, offs, host_offs, b1, None, dtype
        )
        del x_q
        a_MF = gated_activation(h_M2F, probs_M, spec.glu_interleave_size, spec.activation, spec.gated_triton)
        # h is held as its rowwise quantization only, and only where a gradient may be asked for.
        held = grad_enabled and any(ctx.needs_input_grad)
        glu_block, activation = spec.glu_interleave_size, spec.activation
        h_q = group_quantize(to_held(h_M2F, glu_block, activation), go, recipe, backend=quantizer) if held else None
        del h_M2F
        a_q = group_quantize(a_MF, go, recipe, backend=quantizer)
        del a_MF
        scale = probs_M if b2 is not None else None
        y_MH = quantized_forward_product(
            spec.fc2_backend, quantizer, recipe, spec.fc2_fp8, a_q, w2_q, offs, host_offs, b2, scale, dtype
        )
        ctx.spec, ctx.host_offs = spec, host_offs
        ctx.w1_dims, ctx.b1_dims = tuple(w.dim() for w in w1s), tuple(b.dim() for b in b1s)
        ctx.w2_dims, ctx.b2_dims = tuple(w.dim() for w in w2s), tuple(b.dim() for b in b2s)
        ctx.w1_transposed, ctx.w2_transposed = stored_transposed(w1s[0]), stored_transposed(w2s[0])
        ctx.layouts = tuple(_Layout.of(t) if t is not None else None for t in (h_q, w1_q, w2_q))
        # x is saved as the tensor given (moe_experts' hooks replace its sorted rows by a reference to x).
        ctx.save_for_backward(
            x_MH,
            probs_M,
            offs,
            b2,
            w1t_data,
            w1t_scale,
            w2t_data,
            w2t_scale,
            *_storage_of(h_q),
            *w1_q.storage(),
            *w2_q.storage(),
        )
        return y_MH

    @staticmethod
    def backward(ctx: Any, dy_MH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_MH, probs_M, offs, b2, w1t_data, w1t_scale, w2t_data, w2t_scale, *stored = ctx.saved_tensors
        spec, host_offs, need = ctx.spec, ctx.host_offs, ctx.needs_input_grad
        recipe, quantizer = spec.recipe, spec.quantizer
        h_layout, w1_layout, w2_layout = ctx.layouts
        h_q, w1_q, w2_q = h_layout.rebuilt(stored[:7]), w1_layout.rebuilt(stored[7:14]), w2_layout.rebuilt(stored[14:])
        p1, p2, p3 = _PARAMS + spec.n_w1, _PARAMS + spec.n_w1 + spec.n_b1, _PARAMS + spec.n_w1 + spec.n_b1 + spec.n_w2
        need_x, need_probs = need[_X], need[_PROBS] and probs_M is not None
        need_w1, need_b1 = any(need[_PARAMS:p1]), any(need[p1:p2])
        need_w2, need_b2 = any(need[p2:p3]), any(need[p3:])
        # Anything before fc2 (x, probs, fc1's parameters) needs a's gradient, and so fc2's dgrad.
        need_da = need_x or need_probs or need_w1 or need_b1
        dy_MH = row_major(dy_MH)
        go = GroupOffsets(offs=offs, host=tuple(host_offs) if host_offs is not None else None, rows=dy_MH.shape[0])
        dx = d_probs = dw1 = db1 = dw2 = db2 = None
        glu_block, activation, on_kernel = spec.glu_interleave_size, spec.activation, spec.gated_triton

        # fc2: its bias sums and d probs' bias term from dy itself (padding rows zeroed); the wgrad from a
        # computed again from the held h, quantized columnwise; the dgrad gives a's gradient.
        dy_bias_MH = library.without_padding_rows(dy_MH, offs, host_offs) if b2 is not None else None
        scale = probs_M if b2 is not None else None
        if need_b2:
            db2 = library.grouped_linear_dbias(spec.fc2_backend, dy_bias_MH, offs, host_offs, scale)
        if need_probs and dy_bias_MH is not None:
            assert probs_M is not None  # need_probs
            d_probs = bias_scale_grad(dy_bias_MH, b2, go, probs_M)
        # h' for the activation: on moekit's kernels h_q itself, read in their loads; else dequantized once.
        h_M2F = None
        if not on_kernel and (need_w2 or need_da):
            h_M2F = from_held(dequantize_with(quantizer, h_q), glu_block, activation)
        if need_w2 or need_da:
            dy_q = group_quantize(dy_MH, go, recipe, rowwise=need_da, columnwise=need_w2, backend=quantizer)
        if need_w2:
            if on_kernel:
                a_MF = held_gated_activation(h_q, probs_M, glu_block, activation)
            else:
                assert h_M2F is not None
                a_MF = gated_activation(h_M2F, probs_M, glu_block, activation, on_kernel)
            a_q = group_quantize(a_MF, go, recipe, rowwise=False, columnwise=True, backend=quantizer)
            del a_MF
            dw2 = quantized_wgrad_product(
                spec.fc2_backend,
                quantizer,
                recipe,
                spec.fc2_fp8_wgrad,
                dy_q,
                a_q,
                offs,
                host_offs,
                ctx.w2_transposed,
                w2_q.dtype,
            )
            del a_q
        if need_da:
            da_MF = quantized_dgrad_product(
                spec.fc2_backend, quantizer, recipe, spec.fc2_fp8, dy_q, w2_q, w2t_data, w2t_scale, offs, host_offs
            )
            del dy_q
            if on_kernel:
                dh_M2F, d_probs_act = held_gated_activation_backward(
                    h_q, probs_M, da_MF, glu_block, activation, need_probs
                )
            else:
                assert h_M2F is not None
                dh_M2F, d_probs_act = gated_activation_backward(
                    h_M2F, probs_M, da_MF, glu_block, activation, on_kernel, need_probs
                )
            del h_M2F, h_q, da_MF
            if d_probs_act is not None:
                d_probs = d_probs_act if d_probs is None else d_probs + d_probs_act
            # fc1, as grouped_linear's backward: dh quantized rowwise (the dgrad) and columnwise (the
            # wgrad), x quantized columnwise here, the bias sums from dh with its padding rows zeroed.
            if need_b1:
                dh_bias = library.without_padding_rows(dh_M2F, offs, host_offs)
                db1 = library.grouped_linear_dbias(spec.fc1_backend, dh_bias, offs, host_offs, None)
                del dh_bias
            if need_x or need_w1:
                dh_q = group_quantize(dh_M2F, go, recipe, rowwise=need_x, columnwise=need_w1, backend=quantizer)
                del dh_M2F
                if need_w1:
                    x_q = group_quantize(x_MH, go, recipe, rowwise=False, columnwise=True, backend=quantizer)
                    dw1 = quantized_wgrad_product(
                        spec.fc1_backend,
                        quantizer,
                        recipe,
                        spec.fc1_fp8_wgrad,
                        dh_q,
                        x_q,
                        offs,
                        host_offs,
                        ctx.w1_transposed,
                        w1_q.dtype,
                    )
                    del x_q
                if need_x:
                    dx = quantized_dgrad_product(
                        spec.fc1_backend,
                        quantizer,
                        recipe,
                        spec.fc1_fp8,
                        dh_q,
                        w1_q,
                        w1t_data,
                        w1t_scale,
                        offs,
                        host_offs,
                    )
        return (
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            dx,
            d_probs if need_probs else None,
            *unstacked(dw1, ctx.w1_dims, 3),
            *unstacked(db1, ctx.b1_dims, 2),
            *unstacked(dw2, ctx.w2_dims, 3),
            *unstacked(db2, ctx.b2_dims, 2),
        )


def quantized_mlp(
    spec: QuantizedMlpSpec,
    offs: torch.Tensor,
    host_offs: list[int] | None,
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
    arguments (`grouped_mlp`'s). fc1_quantized / fc2_quantized: each weight's quantization and its
    `TransposedWeight`'s data and scales (None where the FP8 dgrad does not run)."""
    if spec.gated_triton and probs_M is not None:
        probs_M = probs_M.contiguous()
    return _QuantizedMlpFn.apply(
        spec,
        torch.is_grad_enabled(),
        offs,
        host_offs,
        *fc1_quantized,
        *fc2_quantized,
        x_MH,
        probs_M,
        *w1s,
        *b1s,
        *w2s,
        *b2s,
    )
