"""moekit's launches as `torch.library` custom ops (namespace `moekit`), with fake implementations, for
torch.compile.

Legend: M rows, N groups (experts), I/O a linear's in/out features, H hidden size, F ffn size, D features
of a moved row, J rows summed into one, T tokens, K experts chosen per token.

Every function of a backend that launches work (a Triton kernel, torch's grouped_mm, the loop backend's
per-group matmuls) is one custom op here, whose fake implementation gives its outputs' shapes and dtypes.
The autograd Functions of the ops call these entry points, so torch.compile (dynamo, AOTAutograd) traces
the Functions and sees each launch as one opaque node: host-side work inside a launch (the loop backend
reading device offsets, configuration choice, Triton launches) stays out of the graph, and the compiled
program computes exactly what eager does.

Eager calls the implementations directly: the dispatcher's path for a Python custom op costs host time on
every call, which host-bound small batches would pay in full. Under torch.compile
(`torch.compiler.is_compiling()`) the entry points call the registered ops.

Backends travel by name (a custom op takes tensors and plain values only) and group offsets as `offs`
(N+1,) int64 on the rows' device plus `host_offs`, the same values as a list when the host knows them:
`moekit.ops.splits.GroupOffsets` flattened. Custom ops must not return views of their inputs, so every
implementation here returns fresh tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from moekit.ops.runtime import backends
from moekit.ops.runtime.backends import (
    FusedMLP,
    QuantizedGatedFc1,
    QuantizedGemm,
    backend_named,
    fused_mlp_of,
    quantized_gated_fc1_of,
    quantized_gemm_of,
    quantizer_of,
    without_padding,
    zero_padding_rows,
)
from moekit.ops.splits import GroupOffsets

_R = TypeVar("_R")


def _fused(backend: str) -> FusedMLP:
    fused = fused_mlp_of(backend_named(backend))
    if fused is None:
        raise ValueError(f"backend {backend!r} has no fused MLP kernels")
    return fused


def _quantized(backend: str) -> QuantizedGemm:
    quantized = quantized_gemm_of(backend_named(backend))
    if quantized is None:
        raise ValueError(f"backend {backend!r} has no FP8 GEMM kernels")
    return quantized


def _gated_fc1(backend: str) -> QuantizedGatedFc1:
    gated_fc1 = quantized_gated_fc1_of(backend_named(backend))
    if gated_fc1 is None:
        raise ValueError(f"backend {backend!r} has no FP8 fc1 with a gated epilogue")
    return gated_fc1


def _entry(op: Callable[..., Any], impl: Callable[..., _R]) -> Callable[..., _R]:
    """The entry point of a custom op: the registered op while torch.compile traces, the implementation
    itself in eager. It takes `impl`'s arguments, positionally."""

    def entry(*args: Any) -> _R:
        return (op if torch.compiler.is_compiling() else impl)(*args)

    entry.__doc__ = impl.__doc__
    return entry


# --------------------------------------------------------------------------------------------------
# Grouped linear products (every backend)
# --------------------------------------------------------------------------------------------------


def _linear_forward(backend: str, x_MI: torch.Tensor, w_NOI: torch.Tensor, offs: torch.Tensor,
                    host_offs: list[int] | None, bias_NO: torch.Tensor | None,
                    bias_scale_M: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """(M, O) = grouped linear of x (M, I) with w (N, O, I) (+ bias (N, O) (* bias_scale (M,)))."""
    return backend_named(backend).forward(
        x_MI, w_NOI, GroupOffsets.of(offs, host_offs, x_MI.shape[0]), bias_NO, bias_scale_M
    )


def _linear_dgrad(backend: str, dy_MO: torch.Tensor, w_NOI: torch.Tensor, offs: torch.Tensor,
                  host_offs: list[int] | None) -> torch.Tensor:  # fmt: skip
    """(M, I) = dy (M, O) through w (N, O, I), per group."""
    return backend_named(backend).dgrad(dy_MO, w_NOI, GroupOffsets.of(offs, host_offs, dy_MO.shape[0]))


def _linear_wgrad(backend: str, dy_MO: torch.Tensor, x_MI: torch.Tensor, offs: torch.Tensor,
                  host_offs: list[int] | None) -> torch.Tensor:  # fmt: skip
    """(N, O, I) per-group dy^T x."""
    return backend_named(backend).wgrad(dy_MO, x_MI, GroupOffsets.of(offs, host_offs, dy_MO.shape[0]))


def _linear_dbias(backend: str, dy_MO: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None,
                  bias_scale_M: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """(N, O) per-group sums of dy's rows (* bias_scale); dy's padding rows must be zero."""
    return backend_named(backend).dbias(dy_MO, GroupOffsets.of(offs, host_offs, dy_MO.shape[0]), bias_scale_M)


def _padding_zeroed(t_MX: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None) -> torch.Tensor:
    """t with its padding rows (past the last offset) zeroed: t itself in eager where the host knows there
    are none, else a copy."""
    return without_padding(t_MX, GroupOffsets.of(offs, host_offs, t_MX.shape[0]))


def _padding_zeroed_copy(t_MX: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None) -> torch.Tensor:
    """A copy of t with its padding rows zeroed (a custom op returns no input)."""
    return zero_padding_rows(t_MX.clone(), GroupOffsets.of(offs, host_offs, t_MX.shape[0]))


_linear_forward_op = torch.library.custom_op("moekit::grouped_linear_forward", _linear_forward, mutates_args=())
_linear_dgrad_op = torch.library.custom_op("moekit::grouped_linear_dgrad", _linear_dgrad, mutates_args=())
_linear_wgrad_op = torch.library.custom_op("moekit::grouped_linear_wgrad", _linear_wgrad, mutates_args=())
_linear_dbias_op = torch.library.custom_op("moekit::grouped_linear_dbias", _linear_dbias, mutates_args=())
_padding_zeroed_op = torch.library.custom_op("moekit::padding_zeroed", _padding_zeroed_copy, mutates_args=())


@_linear_forward_op.register_fake
def _(
    backend: str,
    x_MI: torch.Tensor,
    w_NOI: torch.Tensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    bias_NO: torch.Tensor | None,
    bias_scale_M: torch.Tensor | None,
) -> torch.Tensor:
    return x_MI.new_empty(x_MI.shape[0], w_NOI.shape[1])


@_linear_dgrad_op.register_fake
def _(
    backend: str, dy_MO: torch.Tensor, w_NOI: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None
) -> torch.Tensor:
    return dy_MO.new_empty(dy_MO.shape[0], w_NOI.shape[2])


@_linear_wgrad_op.register_fake
def _(
    backend: str, dy_MO: torch.Tensor, x_MI: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None
) -> torch.Tensor:
    return dy_MO.new_empty(offs.shape[0] - 1, dy_MO.shape[1], x_MI.shape[1])


@_linear_dbias_op.register_fake
def _(
    backend: str,
    dy_MO: torch.Tensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    bias_scale_M: torch.Tensor | None,
) -> torch.Tensor:
    return dy_MO.new_empty(offs.shape[0] - 1, dy_MO.shape[1])


@_padding_zeroed_op.register_fake
def _(t_MX: torch.Tensor, offs: torch.Tensor, host_offs: list[int] | None) -> torch.Tensor:
    return torch.empty_like(t_MX, memory_format=torch.contiguous_format)


grouped_linear_forward = _entry(_linear_forward_op, _linear_forward)
grouped_linear_dgrad = _entry(_linear_dgrad_op, _linear_dgrad)
grouped_linear_wgrad = _entry(_linear_wgrad_op, _linear_wgrad)
grouped_linear_dbias = _entry(_linear_dbias_op, _linear_dbias)
without_padding_rows = _entry(_padding_zeroed_op, _padding_zeroed)


# --------------------------------------------------------------------------------------------------
# FP8 products of a quantized grouped linear (backends with the QuantizedGemm capability)
# --------------------------------------------------------------------------------------------------


def _quantized_forward(backend: str, recipe: str, x_data: torch.Tensor, x_scale: torch.Tensor,
                       w_data: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
                       host_offs: list[int] | None, bias_NO: torch.Tensor | None,
                       bias_scale_M: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """(M, O) in out_dtype = x_q (M, I) through w_q (N, O, I), FP8 data with their scales (+ bias (N, O)
    (* bias_scale (M,)))."""
    go = GroupOffsets.of(offs, host_offs, x_data.shape[0])
    return _quantized(backend).quantized_forward(
        recipe, x_data, x_scale, w_data, w_scale, go, bias_NO, bias_scale_M, out_dtype
    )


def _quantized_dgrad(backend: str, recipe: str, dy_data: torch.Tensor, dy_scale: torch.Tensor,
                     w_data: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
                     host_offs: list[int] | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """(M, I) in out_dtype = dy_q (M, O) through w_q (N, O, I), given transposed: w_data (N, I, O) and
    its scales (`moekit.ops.quantize.TransposedWeight`), FP8 data with their scales."""
    go = GroupOffsets.of(offs, host_offs, dy_data.shape[0])
    return _quantized(backend).quantized_dgrad(recipe, dy_data, dy_scale, w_data, w_scale, go, out_dtype)


def _quantized_wgrad(backend: str, recipe: str, dy_data: torch.Tensor, dy_scale: torch.Tensor,
                     x_data: torch.Tensor, x_scale: torch.Tensor, offs: torch.Tensor,
                     host_offs: list[int] | None, out_dtype: torch.dtype,
                     segmented_rows: int | None) -> torch.Tensor:  # fmt: skip
    """(N, O, I) in out_dtype = the weight gradient from the columnwise quantizations of dy (M, O) and
    x (M, I): FP8 data with their per-group column scales. segmented_rows: None for (M, O) / (M, I)
    data; M where the data is already in the FP8 wgrad's transposed layout, (O, pitch) / (I, pitch)
    (`moekit.ops.quantize.group_quantize_for_wgrad`)."""
    segmented = segmented_rows is not None
    go = GroupOffsets.of(offs, host_offs, segmented_rows if segmented_rows is not None else dy_data.shape[0])
    return _quantized(backend).quantized_wgrad(recipe, dy_data, dy_scale, x_data, x_scale, go, out_dtype, segmented)


_quantized_forward_op = torch.library.custom_op("moekit::quantized_linear_forward", _quantized_forward, mutates_args=())
_quantized_dgrad_op = torch.library.custom_op("moekit::quantized_linear_dgrad", _quantized_dgrad, mutates_args=())
_quantized_wgrad_op = torch.library.custom_op("moekit::quantized_linear_wgrad", _quantized_wgrad, mutates_args=())


@_quantized_forward_op.register_fake
def _(
    backend: str,
    recipe: str,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    bias_NO: torch.Tensor | None,
    bias_scale_M: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return x_data.new_empty(x_data.shape[0], w_data.shape[1], dtype=out_dtype)


@_quantized_dgrad_op.register_fake
def _(
    backend: str,
    recipe: str,
    dy_data: torch.Tensor,
    dy_scale: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return dy_data.new_empty(dy_data.shape[0], w_data.shape[1], dtype=out_dtype)


@_quantized_wgrad_op.register_fake
def _(
    backend: str,
    recipe: str,
    dy_data: torch.Tensor,
    dy_scale: torch.Tensor,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    out_dtype: torch.dtype,
    segmented_rows: int | None,
) -> torch.Tensor:
    d = 0 if segmented_rows is not None else 1  # the columns' dimension of the operands
    return dy_data.new_empty(offs.shape[0] - 1, dy_data.shape[d], x_data.shape[d], dtype=out_dtype)


quantized_linear_forward = _entry(_quantized_forward_op, _quantized_forward)
quantized_linear_dgrad = _entry(_quantized_dgrad_op, _quantized_dgrad)
quantized_linear_wgrad = _entry(_quantized_wgrad_op, _quantized_wgrad)


def _quantized_gated_fc1(backend: str, x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                         w_scale: torch.Tensor, offs: torch.Tensor, bias_N2F: torch.Tensor | None,
                         probs_M: torch.Tensor | None, glu_block: int, activation: str, dtype: torch.dtype,
                         a_data: torch.Tensor, a_scale: torch.Tensor, h_data: torch.Tensor,
                         h_scale: torch.Tensor) -> None:  # fmt: skip
    """fc1's FP8 GEMM with the gated activation and the rowwise quantizations of its output and of h in
    one kernel, into the given storage (`moekit.ops.runtime.backends.QuantizedGatedFc1`); the storage is
    declared mutated, as `group_quantize_into`'s."""
    _gated_fc1(backend).quantized_gated_fc1_into(
        x_data, x_scale, w_data, w_scale, offs, bias_N2F, probs_M, glu_block, activation, dtype, a_data, a_scale,
        h_data, h_scale,
    )  # fmt: skip


_quantized_gated_fc1_op = torch.library.custom_op(
    "moekit::quantized_gated_fc1", _quantized_gated_fc1, mutates_args=("a_data", "a_scale", "h_data", "h_scale")
)


@_quantized_gated_fc1_op.register_fake
def _(
    backend: str,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    dtype: torch.dtype,
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
) -> None:
    return None


quantized_gated_fc1_into = _entry(_quantized_gated_fc1_op, _quantized_gated_fc1)


# --------------------------------------------------------------------------------------------------
# The fused MLP's kernels (backends with the FusedMLP capability)
# --------------------------------------------------------------------------------------------------


def _glu_forward(backend: str, x_MH: torch.Tensor, w1_N2FH: torch.Tensor, offs: torch.Tensor,
                 bias_N2F: torch.Tensor | None, probs_M: torch.Tensor | None, glu_interleave_size: int | None,
                 activation: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(h (M, 2F), act (M, F)): fc1 + bias + activation (* probs) in one kernel."""
    return _fused(backend).glu_forward(x_MH, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation)


def _glu_forward_gathered(backend: str, x_TH: torch.Tensor, token_of_row: torch.Tensor, w1_N2FH: torch.Tensor,
                          offs: torch.Tensor, bias_N2F: torch.Tensor | None, probs_M: torch.Tensor | None,
                          glu_interleave_size: int | None,
                          activation: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`_glu_forward` of the routed rows x_TH[token_of_row] (M, H): (h (M, 2F), act (M, F)), the same bits;
    the kernel reads the token rows where it can, else they are gathered first
    (`moekit.ops.runtime.glu.glu_forward_gathered`)."""
    return _fused(backend).glu_forward_gathered(
        x_TH, token_of_row, w1_N2FH, offs, bias_N2F, probs_M, glu_interleave_size, activation
    )


def _wgrad_gathered(backend: str, dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor,
                    dy_rows: torch.Tensor | None,
                    x_rows: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """(N, O, I) per-group dy^T x of the routed rows dy[dy_rows], x[x_rows] (an operand without a row map:
    its own rows), read by the kernel (`moekit.ops.runtime.gemm.grouped_gemm_wgrad`)."""
    return _fused(backend).wgrad_gathered(dy, x, offs, dy_rows, x_rows)


def _glu_backward(backend: str, dy_MH: torch.Tensor, w2_NHF: torch.Tensor, h_M2F: torch.Tensor,
                  offs: torch.Tensor, probs_M: torch.Tensor | None, glu_interleave_size: int | None,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dh (M, 2F), act_p (M, F), d probs (M,) fp32, or (0,) without probs: an op returns tensors)."""
    dh, act_p, part = _fused(backend).glu_backward_partials(
        dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation
    )
    return dh, act_p, _summed_partials(part, dy_MH)


def _summed_partials(part: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """d probs (M,) fp32 from the fused backward's (F tiles, M) partials, or (0,) without probs (an op
    returns tensors). A fixed-shape sum over the column tiles: a fixed order, deterministic."""
    return part.sum(0) if part is not None else like.new_empty(0, dtype=torch.float32)


def _glu_backward_gathered(backend: str, d_out_TH: torch.Tensor, token_of_row: torch.Tensor,
                           w2_NHF: torch.Tensor, h_M2F: torch.Tensor, offs: torch.Tensor,
                           probs_M: torch.Tensor | None, glu_interleave_size: int | None,
                           activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`_glu_backward` of the routed rows d_out_TH[token_of_row] (M, H), the same bits; the kernel reads the
    token rows where it can, else they are gathered first
    (`moekit.ops.runtime.glu.glu_backward_gathered_partials`)."""
    dh, act_p, part = _fused(backend).glu_backward_gathered_partials(
        d_out_TH, token_of_row, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation
    )
    return dh, act_p, _summed_partials(part, d_out_TH)


def _dbias_and_dot(backend: str, dy_MH: torch.Tensor, offs: torch.Tensor, b2_NH: torch.Tensor,
                   probs_M: torch.Tensor | None,
                   token_of_row: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(d fc2 bias (N, H), <dy[r], b2[g]> (M,) fp32) in one pass over dy: its rows, or with token_of_row
    d out's token rows read through the map (`FusedMLP.dbias_and_dot`)."""
    return _fused(backend).dbias_and_dot(dy_MH, offs, b2_NH, probs_M, token_of_row)


_glu_forward_op = torch.library.custom_op("moekit::glu_forward", _glu_forward, mutates_args=())
_glu_forward_gathered_op = torch.library.custom_op(
    "moekit::glu_forward_gathered", _glu_forward_gathered, mutates_args=()
)
_glu_backward_op = torch.library.custom_op("moekit::glu_backward", _glu_backward, mutates_args=())
_wgrad_gathered_op = torch.library.custom_op("moekit::wgrad_gathered", _wgrad_gathered, mutates_args=())
_glu_backward_gathered_op = torch.library.custom_op(
    "moekit::glu_backward_gathered", _glu_backward_gathered, mutates_args=()
)
_dbias_and_dot_op = torch.library.custom_op("moekit::dbias_and_dot", _dbias_and_dot, mutates_args=())


@_glu_forward_op.register_fake
def _(
    backend: str,
    x_MH: torch.Tensor,
    w1_N2FH: torch.Tensor,
    offs: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    two_f = w1_N2FH.shape[1]
    return x_MH.new_empty(x_MH.shape[0], two_f), x_MH.new_empty(x_MH.shape[0], two_f // 2)


@_glu_forward_gathered_op.register_fake
def _(
    backend: str,
    x_TH: torch.Tensor,
    token_of_row: torch.Tensor,
    w1_N2FH: torch.Tensor,
    offs: torch.Tensor,
    bias_N2F: torch.Tensor | None,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, two_f = token_of_row.shape[0], w1_N2FH.shape[1]
    return x_TH.new_empty(rows, two_f), x_TH.new_empty(rows, two_f // 2)


@_glu_backward_op.register_fake
def _(
    backend: str,
    dy_MH: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, ffn = dy_MH.shape[0], w2_NHF.shape[2]
    dprobs = dy_MH.new_empty(rows if probs_M is not None else 0, dtype=torch.float32)
    return dy_MH.new_empty(rows, 2 * ffn), dy_MH.new_empty(rows, ffn), dprobs


@_glu_backward_gathered_op.register_fake
def _(
    backend: str,
    d_out_TH: torch.Tensor,
    token_of_row: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, ffn = token_of_row.shape[0], w2_NHF.shape[2]
    dprobs = d_out_TH.new_empty(rows if probs_M is not None else 0, dtype=torch.float32)
    return d_out_TH.new_empty(rows, 2 * ffn), d_out_TH.new_empty(rows, ffn), dprobs


@_wgrad_gathered_op.register_fake
def _(
    backend: str,
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    dy_rows: torch.Tensor | None,
    x_rows: torch.Tensor | None,
) -> torch.Tensor:
    return dy.new_empty(offs.shape[0] - 1, dy.shape[1], x.shape[1])


@_dbias_and_dot_op.register_fake
def _(
    backend: str,
    dy_MH: torch.Tensor,
    offs: torch.Tensor,
    b2_NH: torch.Tensor,
    probs_M: torch.Tensor | None,
    token_of_row: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = dy_MH.shape[0] if token_of_row is None else token_of_row.shape[0]
    return dy_MH.new_empty(offs.shape[0] - 1, dy_MH.shape[1]), dy_MH.new_empty(rows, dtype=torch.float32)


glu_forward = _entry(_glu_forward_op, _glu_forward)
glu_forward_gathered = _entry(_glu_forward_gathered_op, _glu_forward_gathered)
dbias_and_dot = _entry(_dbias_and_dot_op, _dbias_and_dot)
wgrad_gathered = _entry(_wgrad_gathered_op, _wgrad_gathered)
_glu_backward_gathered_entry = _entry(_glu_backward_gathered_op, _glu_backward_gathered)
_glu_backward_entry = _entry(_glu_backward_op, _glu_backward)


def glu_backward(
    backend: str,
    dy_MH: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dh (M, 2F), act_p (M, F), d probs (M,) fp32 or None)."""
    dh, act_p, dprobs = _glu_backward_entry(
        backend, dy_MH, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation
    )
    return dh, act_p, (dprobs if probs_M is not None else None)


def glu_backward_gathered(
    backend: str,
    d_out_TH: torch.Tensor,
    token_of_row: torch.Tensor,
    w2_NHF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`glu_backward` of the routed rows d_out_TH[token_of_row]: (dh (M, 2F), act_p (M, F), d probs (M,)
    fp32 or None)."""
    dh, act_p, dprobs = _glu_backward_gathered_entry(
        backend, d_out_TH, token_of_row, w2_NHF, h_M2F, offs, probs_M, glu_interleave_size, activation
    )
    return dh, act_p, (dprobs if probs_M is not None else None)


# --------------------------------------------------------------------------------------------------
# The gated activation on its own (moekit's kernel; `backends.gated_uses_triton` says where)
# --------------------------------------------------------------------------------------------------


def _gated_forward(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int,
                   activation: str) -> torch.Tensor:  # fmt: skip
    """(M, F): ACT(gate(h), up(h)) (* probs) (`moekit.ops.runtime.gated.gated_forward`)."""
    return backends.gated_forward(h_M2F, probs_M, glu_block, activation)


_gated_forward_op = torch.library.custom_op("moekit::gated_forward", _gated_forward, mutates_args=())


@_gated_forward_op.register_fake
def _(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int, activation: str) -> torch.Tensor:
    return h_M2F.new_empty(h_M2F.shape[0], h_M2F.shape[1] // 2)


gated_forward = _entry(_gated_forward_op, _gated_forward)


def _gated_backward(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, d_out_MF: torch.Tensor, glu_block: int,
                    activation: str, need_d_probs: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dh (M, 2F), d probs: (M,) fp32 where probs and need_d_probs, else (0,))
    (`moekit.ops.runtime.gated.gated_backward`; a custom op returns no None)."""
    dh, d_probs = backends.gated_backward(h_M2F, probs_M, d_out_MF, glu_block, activation, need_d_probs)
    return dh, d_probs if d_probs is not None else h_M2F.new_empty(0, dtype=torch.float32)


_gated_backward_op = torch.library.custom_op("moekit::gated_backward", _gated_backward, mutates_args=())


@_gated_backward_op.register_fake
def _(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, d_out_MF: torch.Tensor, glu_block: int, activation: str,
      need_d_probs: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    rows = h_M2F.shape[0] if need_d_probs and probs_M is not None else 0
    return torch.empty_like(h_M2F), h_M2F.new_empty(rows, dtype=torch.float32)


gated_backward = _entry(_gated_backward_op, _gated_backward)


def _held_gated_forward(h_data: torch.Tensor, h_scale: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int,
                        activation: str, recipe: str, dtype: torch.dtype, gate_limit: float,
                        up_limit: float) -> torch.Tensor:  # fmt: skip
    """(M, F) in dtype: the gated activation of h held in FP8, data (M, 2F) and rowwise scales of
    `recipe`, dequantized in the kernel's load (`moekit.ops.runtime.gated.held_gated_forward`)."""
    return backends.held_gated_forward(
        h_data, h_scale, probs_M, glu_block, activation, recipe, dtype, gate_limit, up_limit
    )


_held_gated_forward_op = torch.library.custom_op("moekit::held_gated_forward", _held_gated_forward, mutates_args=())


@_held_gated_forward_op.register_fake
def _(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    recipe: str,
    dtype: torch.dtype,
    gate_limit: float,
    up_limit: float,
) -> torch.Tensor:
    return h_data.new_empty(h_data.shape[0], h_data.shape[1] // 2, dtype=dtype)


held_gated_forward = _entry(_held_gated_forward_op, _held_gated_forward)


def _held_gated_backward(h_data: torch.Tensor, h_scale: torch.Tensor, probs_M: torch.Tensor | None,
                         d_out_MF: torch.Tensor, glu_block: int, activation: str, recipe: str, gate_limit: float,
                         up_limit: float, need_d_probs: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dh (M, 2F) in d_out's dtype, d probs (M,) fp32 or (0,)) of `held_gated_forward`
    (`moekit.ops.runtime.gated.held_gated_backward`)."""
    dh, d_probs = backends.held_gated_backward(
        h_data, h_scale, probs_M, d_out_MF, glu_block, activation, recipe, gate_limit, up_limit, need_d_probs
    )
    return dh, d_probs if d_probs is not None else d_out_MF.new_empty(0, dtype=torch.float32)


_held_gated_backward_op = torch.library.custom_op("moekit::held_gated_backward", _held_gated_backward, mutates_args=())


@_held_gated_backward_op.register_fake
def _(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    recipe: str,
    gate_limit: float,
    up_limit: float,
    need_d_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = h_data.shape[0] if need_d_probs and probs_M is not None else 0
    return d_out_MF.new_empty(h_data.shape), d_out_MF.new_empty(rows, dtype=torch.float32)


held_gated_backward = _entry(_held_gated_backward_op, _held_gated_backward)


def _gated_quantize(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, offs: torch.Tensor, glu_block: int,
                    activation: str, recipe: str, gate_limit: float, up_limit: float, a_data: torch.Tensor,
                    a_scale: torch.Tensor, h_data: torch.Tensor, h_scale: torch.Tensor) -> None:  # fmt: skip
    """The rowwise quantizations of the gated activation of h and of h's held form, into the given
    storage (`moekit.ops.runtime.gated.gated_quantize_into`); the storage is declared mutated, as
    `group_quantize_into`'s."""
    backends.gated_quantize_into(
        h_M2F, probs_M, offs, glu_block, activation, recipe, gate_limit, up_limit, a_data, a_scale, h_data, h_scale
    )


_gated_quantize_op = torch.library.custom_op(
    "moekit::gated_quantize", _gated_quantize, mutates_args=("a_data", "a_scale", "h_data", "h_scale")
)


@_gated_quantize_op.register_fake
def _(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    offs: torch.Tensor,
    glu_block: int,
    activation: str,
    recipe: str,
    gate_limit: float,
    up_limit: float,
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
) -> None:
    return None


gated_quantize_into = _entry(_gated_quantize_op, _gated_quantize)


def _held_columns(h_data: torch.Tensor, h_scale: torch.Tensor, probs_M: torch.Tensor | None, offs: torch.Tensor,
                  slot_offs: torch.Tensor, glu_block: int, activation: str, recipe: str, dtype: torch.dtype,
                  gate_limit: float, up_limit: float, col_data: torch.Tensor,
                  col_scale: torch.Tensor) -> None:  # fmt: skip
    """The columnwise quantization of `held_gated_forward`'s activation into the FP8 wgrad's segments,
    into the given storage (`moekit.ops.runtime.gated.held_columns_into`); the storage is declared
    mutated, as `group_quantize_into`'s."""
    backends.held_columns_into(
        h_data, h_scale, probs_M, offs, slot_offs, glu_block, activation, recipe, dtype, gate_limit, up_limit,
        col_data, col_scale,
    )  # fmt: skip


_held_columns_op = torch.library.custom_op(
    "moekit::held_columns", _held_columns, mutates_args=("col_data", "col_scale")
)


@_held_columns_op.register_fake
def _(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    offs: torch.Tensor,
    slot_offs: torch.Tensor,
    glu_block: int,
    activation: str,
    recipe: str,
    dtype: torch.dtype,
    gate_limit: float,
    up_limit: float,
    col_data: torch.Tensor,
    col_scale: torch.Tensor,
) -> None:
    return None


held_columns_into = _entry(_held_columns_op, _held_columns)


# --------------------------------------------------------------------------------------------------
# Row movement
# --------------------------------------------------------------------------------------------------


def _gather_sum_rows(src_SD: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None,
                     use_triton: bool) -> torch.Tensor:  # fmt: skip
    """(rows of index, D): row r is the sum of (weight[r, j] *) src[index[r, j]] over j, in order
    (`moekit.ops.runtime.backends.gather_sum_rows`)."""
    return backends.gather_sum_rows(src_SD, index, weight, use_triton)


_gather_sum_rows_op = torch.library.custom_op("moekit::gather_sum_rows", _gather_sum_rows, mutates_args=())


@_gather_sum_rows_op.register_fake
def _(src_SD: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None, use_triton: bool) -> torch.Tensor:
    return src_SD.new_empty(index.shape[0], src_SD.shape[1])


gather_sum_rows = _entry(_gather_sum_rows_op, _gather_sum_rows)


# --------------------------------------------------------------------------------------------------
# The router's top-k + softmax (moekit's kernel; `backends.topk_uses_triton` says where)
# --------------------------------------------------------------------------------------------------


def _topk_softmax(logits_TN: torch.Tensor, top_k: int, ids_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, K) fp32, ids (T, K) in ids_dtype): the top-k logits of each row and the softmax over
    them (`moekit.ops.runtime.topk.topk_softmax`)."""
    return backends.topk_softmax(logits_TN, top_k, ids_dtype)


_topk_softmax_op = torch.library.custom_op("moekit::topk_softmax", _topk_softmax, mutates_args=())


@_topk_softmax_op.register_fake
def _(logits_TN: torch.Tensor, top_k: int, ids_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = logits_TN.shape[0]
    return logits_TN.new_empty(num_tokens, top_k, dtype=torch.float32), logits_TN.new_empty(
        num_tokens, top_k, dtype=ids_dtype
    )


topk_softmax = _entry(_topk_softmax_op, _topk_softmax)


def _topk_softmax_backward(weights_TK: torch.Tensor, ids_TK: torch.Tensor, d_weights_TK: torch.Tensor,
                           num_experts: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """d logits (T, N) in dtype of `topk_softmax`'s weights (`moekit.ops.runtime.topk.topk_softmax_backward`)."""
    return backends.topk_softmax_backward(weights_TK, ids_TK, d_weights_TK, num_experts, dtype)


_topk_softmax_backward_op = torch.library.custom_op(
    "moekit::topk_softmax_backward", _topk_softmax_backward, mutates_args=()
)


@_topk_softmax_backward_op.register_fake
def _(
    weights_TK: torch.Tensor, ids_TK: torch.Tensor, d_weights_TK: torch.Tensor, num_experts: int, dtype: torch.dtype
) -> torch.Tensor:
    return weights_TK.new_empty(weights_TK.shape[0], num_experts, dtype=dtype)


topk_softmax_backward = _entry(_topk_softmax_backward_op, _topk_softmax_backward)


# --------------------------------------------------------------------------------------------------
# Grouped quantization and dequantization (backends with the GroupQuantizer capability: every backend)
# --------------------------------------------------------------------------------------------------


def _group_quantize(backend: str, recipe: str, x: torch.Tensor, offs: torch.Tensor, slot_offs: torch.Tensor,
                    noop: torch.Tensor | None, row_data: torch.Tensor | None, row_scale: torch.Tensor | None,
                    col_data: torch.Tensor | None, col_scale: torch.Tensor | None,
                    col_segments: bool, index: torch.Tensor | None,
                    data_t: torch.Tensor | None = None, scale_t: torch.Tensor | None = None) -> None:  # fmt: skip
    """Quantize x into the given storage, in place (`moekit.ops.runtime.quantize_torch.group_quantize_into`;
    col_segments: the columnwise data in the FP8 wgrad's transposed layout; index: the rows x[index];
    data_t, scale_t: a weight's transposed copy too). Storage is an input, declared mutated: `out=` must
    keep every data pointer (torch.compile functionalizes it)."""
    quantizer = quantizer_of(backend_named(backend))
    if quantizer is None:
        raise ValueError(f"backend {backend!r} cannot quantize")
    quantizer.group_quantize_into(
        recipe, x, offs, slot_offs, noop, row_data, row_scale, col_data, col_scale, col_segments, index, data_t, scale_t
    )


_group_quantize_op = torch.library.custom_op(
    "moekit::group_quantize",
    _group_quantize,
    mutates_args=("row_data", "row_scale", "col_data", "col_scale", "data_t", "scale_t"),
)


@_group_quantize_op.register_fake
def _(
    backend: str,
    recipe: str,
    x: torch.Tensor,
    offs: torch.Tensor,
    slot_offs: torch.Tensor,
    noop: torch.Tensor | None,
    row_data: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    col_data: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    col_segments: bool,
    index: torch.Tensor | None,
    data_t: torch.Tensor | None = None,
    scale_t: torch.Tensor | None = None,
) -> None:
    return None


group_quantize_into = _entry(_group_quantize_op, _group_quantize)


def _group_dequantize(backend: str, recipe: str, data: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                      slot_offs: torch.Tensor | None, columnwise: bool,
                      dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """One form of a quantized tensor back in `dtype`, a fresh tensor of data's shape
    (`moekit.ops.runtime.quantize_torch.group_dequantize`)."""
    quantizer = quantizer_of(backend_named(backend))
    if quantizer is None:
        raise ValueError(f"backend {backend!r} cannot dequantize")
    return quantizer.group_dequantize(recipe, data, scale, offs, slot_offs, columnwise, dtype)


_group_dequantize_op = torch.library.custom_op("moekit::group_dequantize", _group_dequantize, mutates_args=())


@_group_dequantize_op.register_fake
def _(
    backend: str,
    recipe: str,
    data: torch.Tensor,
    scale: torch.Tensor,
    offs: torch.Tensor,
    slot_offs: torch.Tensor | None,
    columnwise: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    return data.new_empty(data.shape, dtype=dtype)


group_dequantize = _entry(_group_dequantize_op, _group_dequantize)


def _transpose_weight(backend: str, recipe: str, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor,
                      scale_t: torch.Tensor) -> None:  # fmt: skip
    """A quantized (N, O, I) weight's data and scales transposed into the given (N, I, O) storage, in
    place (`moekit.ops.runtime.quantize_torch.transpose_weight_into`): the storage is an input, declared
    mutated, as group_quantize's."""
    quantizer = quantizer_of(backend_named(backend))
    if quantizer is None:
        raise ValueError(f"backend {backend!r} cannot transpose a quantized weight")
    quantizer.transpose_weight_into(recipe, data, scale, data_t, scale_t)


_transpose_weight_op = torch.library.custom_op(
    "moekit::transpose_weight", _transpose_weight, mutates_args=("data_t", "scale_t")
)


@_transpose_weight_op.register_fake
def _(
    backend: str, recipe: str, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor
) -> None:
    return None


transpose_weight_into = _entry(_transpose_weight_op, _transpose_weight)
