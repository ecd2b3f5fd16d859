"""Grouped linear: `y_i = x_i W_i^T + b_i` over rows sorted by group.

Legend: M rows, N groups, I in_features, O out_features.

One autograd Function serves every backend (`moekit.ops.runtime.backends`); a backend supplies the three
products (forward, dgrad, wgrad) and the bias sums, each launched through its custom op
(`moekit.ops.library`). Weights arrive as one `(N, O, I)` tensor or as N `(O, I)` tensors; N separate
tensors that are adjacent slices of one buffer (what `GroupedLinear` keeps) are viewed as `(N, O, I)`
without a copy.

Quantized compute (`quantization=` "fp8_block", "fp8_rowwise" or "mxfp8"; `moekit.ops.quantize` for the
formats): x, the weight and, in the backward, dy are quantized with `group_quantize`, and each product
takes the quantized operands below. Gradients pass straight through the quantizers (as
TransformerEngine's FP8 GEMMs). Which path computes the products:

- FP8 compute, where the backend has the QuantizedGemm capability and it can run the recipe
  (`moekit.ops.runtime.backends.quantized_gemm_of`; today the "triton" backend, and "auto" where it
  picks triton, i.e. on Hopper): the forward and the dgrad multiply the FP8 data on the tensor cores
  with fp32 accumulation (fp8_block's 1 x 128 / 128 x 128 block scales applied per 128-wide reduction
  step, fp8_rowwise's row and channel scales in the epilogue; `moekit.ops.runtime.quantized_gemm`).
  That is fp8_block and fp8_rowwise on CUDA devices of compute capability 8.9 or newer (and on the
  CPU under TRITON_INTERPRET=1, for tests). Their wgrads run there too, on the columnwise FP8 data of
  dy and x (`fp8_wgrad_compute`): fp8_rowwise's per-group column scales are constant along the wgrad's
  reduction (the group's rows), so they are applied in the epilogue; fp8_block's 128 x 1 blocks change
  scale every 128 rows of a group, so each 128-row reduction step is promoted with its block's scales,
  as its forward's steps are.
- the reference path everywhere else (the "torch" and "loop" backends, mxfp8, whose 1 x 32 blocks have
  no Hopper FP8 path, and older GPUs), and for mxfp8's wgrad: the quantized operands are
  dequantized and the products run in x's dtype with the backend's GEMMs. It computes the same
  products, at the unquantized path's speed or slower, with the sums in another order (and, in
  bfloat16, one rounding of each dequantized operand).

    forward  y  = Q(x) Q(w)^T (+ bias)       Q: rowwise blocks (along I)
    dgrad    dx = Q(dy) Qc(w)                Qc(w): blocks along O (the weight's columnwise form;
                                             fp8_block's 128 x 128 tiles serve as they are)
    wgrad    dw = Qc(dy)^T Qc(x)             Qc: columnwise blocks along M, per group
    dbias    from dy itself, in dy's dtype

What is held for the backward is x's columnwise quantization (FP8 and its scales), not x. Where the FP8
wgrad runs, x's and dy's columnwise forms are made in its operand layout by the quantization itself
(`moekit.ops.quantize.group_quantize_for_wgrad`, `SegmentedColumns`), so the wgrad transposes nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from moekit.grouped_tensor import GroupedTensor
from moekit.ops import library
from moekit.ops.quantize import (
    QuantizedWeightCache,
    SegmentedColumns,
    TransposedWeight,
    check_quantization,
    dequantize_with,
    group_quantize,
    group_quantize_for_wgrad,
)
from moekit.ops.runtime.backends import (
    BACKENDS,
    GemmBackend,
    bias_rows,
    quantized_gemm_of,
    select_backend,
    select_quantizer,
)
from moekit.ops.splits import GroupOffsets, MSplits, compute_dtype, resolve_splits
from moekit.validation import check_bool, check_float_tensor, check_same_device, check_tensor

__all__ = ["BACKENDS", "Weight", "grouped_linear", "grouped_linear_reference"]

Weight = torch.Tensor | Sequence[torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Grouped parameters: one (N, ...) tensor, or N per-group tensors
# --------------------------------------------------------------------------------------------------


def tensor_list(name: str, value: Weight | None) -> list[torch.Tensor]:
    """A grouped parameter as a list: [] for None, [t] for one tensor, the N tensors of a sequence."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if not isinstance(value, (list, tuple)):
        check_tensor(name, value)
    for t in value:
        check_tensor(f"each {name} entry", t)
    return list(value)


def packed_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """View N same-shaped contiguous tensors as one (N, ...) tensor when they are adjacent slices of one
    storage (in order); None when they are not."""
    first = tensors[0]
    if not first.is_contiguous():
        return None
    numel = first.numel()
    base = first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (
            t.shape != first.shape
            or t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != base
            or t.storage_offset() != first.storage_offset() + i * numel
        ):
            return None
    return first.as_strided((len(tensors), *first.shape), (numel, *first.stride()), first.storage_offset())


# Marks a first expert tensor whose set was already warned about. An attribute on the tensor itself dies
# with it; a set of id()s would outlive the tensors and, once an id is reused by a new module's parameter,
# silence that module's warning.
_WARNED_ATTR = "_moekit_warned_unpacked"


def stacked(params: Sequence[torch.Tensor], grouped_dim: int, what: str) -> torch.Tensor | None:
    """One (N, ...) tensor of a grouped parameter given as one tensor of `grouped_dim` dims or as N
    per-group tensors (their packed view where they are adjacent slices of one buffer, else a stack,
    with a warning: every call then copies all experts); None for no parameter."""
    if not params:
        return None
    if params[0].dim() == grouped_dim:
        return params[0]
    if torch.compiler.is_compiling():
        # A traced graph cannot look at storage addresses: it stacks (a copy of all experts).
        return torch.stack(list(params))
    view = packed_view(params)
    if view is not None:
        return view
    # Not silent: a wrapper (FSDP2, a manual `.data =`) split the expert weights apart; results are still
    # right but every call now pays a copy of all experts' weights.
    if not getattr(params[0], _WARNED_ATTR, False):
        setattr(params[0], _WARNED_ATTR, True)
        warnings.warn(
            f"moekit: the {len(params)} per-expert {what} tensors are not adjacent slices of one buffer; "
            "each call stacks them (a copy of all experts). GroupedLinear repacks on .to()/.cuda(); use "
            "single_grouped_weight=True to avoid this entirely.",
            stacklevel=4,
        )
    return torch.stack(list(params))


def unstacked(grad: torch.Tensor | None, dims: tuple[int, ...], grouped_dim: int) -> tuple[torch.Tensor | None, ...]:
    """A (N, ...) gradient in the form its parameter came in (`dims`: the dims of the tensors given): none,
    one grouped tensor, or N per-group tensors."""
    if not dims:
        return ()
    if dims[0] == grouped_dim:
        return (grad,)
    return tuple(grad.unbind(0)) if grad is not None else (None,) * len(dims)


def stored_transposed(w_NOI: torch.Tensor | None) -> bool:
    """Whether a grouped (N, O, I) weight is a transposed view of the (N, I, O) tensor it reads (a unit
    middle stride and a non-unit last one: transformers' gpt-oss experts keep theirs so). False while
    torch.compile traces (strides are not known in a traced backward; the compiler lays gradients out)."""
    if torch.compiler.is_compiling():
        return False
    return w_NOI is not None and w_NOI.dim() == 3 and w_NOI.stride(2) != 1 and w_NOI.stride(1) == 1


def wgrad_in_layout(
    backend: str,
    dy_MO: torch.Tensor,
    x_MI: torch.Tensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    transposed: bool,
    dy_rows: torch.Tensor | None = None,
    x_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight gradient (N, O, I), dense in the layout of the weight's tensor: where the weight is a
    transposed view (`transposed`, from `stored_transposed`), x^T dy is computed as (N, I, O) and
    returned as its transposed view. The gradient that reaches the stored (N, I, O) parameter through
    the view is then dense in that parameter's layout, which autograd's gradient accumulation keeps as
    it is; a row-major (N, O, I) gradient would be copied into the parameter's layout there, a copy of
    the whole weight per backward.

    dy_rows / x_rows: dy's / x's row of each routed row ((M,) or (M, 1)), the operand then holding the
    rows it maps into (the tokens): the gradient of the gathered rows dy_MO[dy_rows] / x_MI[x_rows], read
    in the kernel's loads (backends with the FusedMLP capability; host_offs unused)."""
    if dy_rows is not None or x_rows is not None:
        if transposed:
            return library.wgrad_gathered(backend, x_MI, dy_MO, offs, x_rows, dy_rows).transpose(1, 2)
        return library.wgrad_gathered(backend, dy_MO, x_MI, offs, dy_rows, x_rows)
    if transposed:
        return library.grouped_linear_wgrad(backend, x_MI, dy_MO, offs, host_offs).transpose(1, 2)
    return library.grouped_linear_wgrad(backend, dy_MO, x_MI, offs, host_offs)


def row_major(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with dense row-major strides. `.contiguous()` alone is not enough: a tensor with no
    elements counts as contiguous whatever its strides, e.g. the zero strides of the expanded gradient of
    `y.sum()` when there are no rows, and grouped_mm rejects those strides."""
    if t.numel() == 0:
        return t.clone(memory_format=torch.contiguous_format)  # differentiable, and dense strides
    return t.contiguous()


def release_consumed_gradient(t: torch.Tensor) -> None:
    """Free the memory of an incoming gradient that a backward has finished reading, now rather than
    when the backward returns.

    Why: the autograd engine holds a node's incoming gradients until its backward returns, so a
    gradient consumed early (quantized into its FP8 forms, say) stays alive beside everything the
    backward allocates after it; `del` drops only the backward's own reference. The caller promises
    that nothing else reads `t`: only a gradient that one of moekit's own nodes made for another (never
    a tensor a user passed to `backward`). Freed only where that is certain from the tensor itself: a
    plain tensor (no subclass: not a fake or functional tensor of a trace) that owns its whole storage
    (not a view into a buffer other values may share), takes no gradient and whose storage its allocator
    can resize (not memory from elsewhere); never while torch.compile traces (its graph plans the memory
    itself)."""
    if type(t) is not torch.Tensor or t.requires_grad or torch.compiler.is_compiling():
        return
    storage = t.untyped_storage()
    owns_all = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size() and t.is_contiguous()
    if owns_all and storage.resizable():
        storage.resize_(0)


def check_linear_params(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], *, what: str = ""
) -> tuple[int, int]:
    """Validate weight/bias shapes, dtypes and devices against x (M, in); return (N, out_features).
    `what` prefixes the parameters' names in messages (e.g. "fc1_")."""
    if not weights:
        raise ValueError(f"{what}weight must be a (N, out, in) tensor or a non-empty list of N (out, in) tensors")
    if len(weights) == 1 and weights[0].dim() == 3:
        num_groups, out_f, in_f = weights[0].shape
    else:
        shapes = {tuple(w.shape) for w in weights}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"per-group {what}weights must all be 2-D (out, in) of one shape; got {sorted(shapes)}")
        num_groups = len(weights)
        out_f, in_f = weights[0].shape
    if x.shape[1] != in_f:
        raise ValueError(f"x has {x.shape[1]} features in its last dimension; {what}weight expects in_features={in_f}")
    for w in weights:
        if w.dtype != x.dtype:
            raise TypeError(f"x's dtype {x.dtype} differs from {what}weight's {w.dtype}; cast one to match")
        check_same_device(f"{what}weight", w, "x", x)
    if biases:
        if len(biases) == 1 and biases[0].dim() == 2:
            if tuple(biases[0].shape) != (num_groups, out_f):
                raise ValueError(f"{what}bias has shape {tuple(biases[0].shape)}; expected ({num_groups}, {out_f})")
        elif len(biases) != num_groups or any(tuple(b.shape) != (out_f,) for b in biases):
            raise ValueError(
                f"{what}bias must be a ({num_groups}, {out_f}) tensor or {num_groups} tensors of shape ({out_f},); "
                f"got {[tuple(b.shape) for b in biases]}"
            )
        for b in biases:
            if b.dtype != x.dtype:
                raise TypeError(f"x's dtype {x.dtype} differs from {what}bias's {b.dtype}; cast one to match")
            check_same_device(f"{what}bias", b, "x", x)
    return num_groups, out_f


def probe_weight(weights: list[torch.Tensor]) -> torch.Tensor:
    """A (N, O, I)-shaped stand-in (no copy) for capability checks."""
    w = weights[0]
    return w if w.dim() == 3 else w.unsqueeze(0).expand(len(weights), *w.shape)


# --------------------------------------------------------------------------------------------------
# The quantized products, on FP8 kernels or the reference path (`_QuantizedLinearFn` and the quantized
# MLP's node compute them here)
# --------------------------------------------------------------------------------------------------


def quantized_forward_product(
    backend: str,
    quantizer: str,
    recipe: str,
    fp8: bool,
    x_q: GroupedTensor,
    weight_q: GroupedTensor,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    bias_NO: torch.Tensor | None,
    bias_scale_M: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """y (M, O) in `dtype` = Q(x) Q(w)^T (+ bias (* bias_scale)), from x's rowwise quantization: on the
    backend's FP8 kernels where `fp8` (`fp8_compute`), else dequantized (by `quantizer`, who quantized
    them) and the backend's GEMM in x's dtype."""
    if fp8:
        return library.quantized_linear_forward(
            backend,
            recipe,
            x_q.rowwise_data,
            x_q.rowwise_scale_inv,
            weight_q.rowwise_data,
            weight_q.rowwise_scale_inv,
            offs,
            host_offs,
            bias_NO,
            bias_scale_M,
            dtype,
        )
    return library.grouped_linear_forward(
        backend,
        dequantize_with(quantizer, x_q),
        dequantize_with(quantizer, weight_q),
        offs,
        host_offs,
        bias_NO,
        bias_scale_M,
    )


def quantized_dgrad_product(
    backend: str,
    quantizer: str,
    recipe: str,
    fp8: bool,
    dy_q: GroupedTensor,
    weight_q: GroupedTensor,
    wt_data: torch.Tensor | None,
    wt_scale: torch.Tensor | None,
    offs: torch.Tensor,
    host_offs: list[int] | None,
) -> torch.Tensor:
    """dx (M, I) in dy's dtype = Q(dy) Qc(w), from dy's rowwise quantization. The dgrad reduces over O:
    the weight's columnwise form where it has one (fp8_rowwise: a scale per input channel), else its
    rowwise data (fp8_block's tiles serve both ways); the FP8 kernels (`fp8`) take it transposed
    (wt_*, the `TransposedWeight`: K-major)."""
    if fp8:
        assert wt_data is not None and wt_scale is not None  # given with fp8
        return library.quantized_linear_dgrad(
            backend,
            recipe,
            dy_q.rowwise_data,
            dy_q.rowwise_scale_inv,
            wt_data,
            wt_scale,
            offs,
            host_offs,
            dy_q.dtype,
        )
    w_dgrad = dequantize_with(quantizer, weight_q, columnwise=weight_q.columnwise_data is not None)
    return library.grouped_linear_dgrad(backend, dequantize_with(quantizer, dy_q), w_dgrad, offs, host_offs)


def quantized_wgrad_product(
    backend: str,
    quantizer: str,
    recipe: str,
    fp8_wgrad: bool,
    dy_q: GroupedTensor | SegmentedColumns,
    x_q: GroupedTensor | SegmentedColumns,
    offs: torch.Tensor,
    host_offs: list[int] | None,
    w_transposed: bool,
    w_dtype: torch.dtype,
) -> torch.Tensor:
    """dw (N, O, I) = Qc(dy)^T Qc(x), from the columnwise quantizations of dy and x, in the layout of the
    weight's tensor (`wgrad_in_layout`: x^T dy for a transposed view, `w_transposed`): on the FP8
    kernels where `fp8_wgrad` (`fp8_wgrad_compute`), else both dequantized by the quantizer (one pass
    each on the Triton backend) and the backend's GEMM. The FP8 kernels take both operands as
    `SegmentedColumns` (`group_quantize_for_wgrad`: already in their layout, no transpose pass) or both
    as GroupedTensors (transposed first); the reference path takes GroupedTensors."""
    if fp8_wgrad:
        dy_cols: tuple[torch.Tensor | None, torch.Tensor | None]
        x_cols: tuple[torch.Tensor | None, torch.Tensor | None]
        if isinstance(dy_q, SegmentedColumns) and isinstance(x_q, SegmentedColumns):
            dy_cols, x_cols = (dy_q.data, dy_q.scale_inv), (x_q.data, x_q.scale_inv)
            rows: int | None = dy_q.rows
        elif isinstance(dy_q, GroupedTensor) and isinstance(x_q, GroupedTensor):
            dy_cols = (dy_q.columnwise_data, dy_q.columnwise_scale_inv)
            x_cols = (x_q.columnwise_data, x_q.columnwise_scale_inv)
            rows = None
        else:
            raise TypeError("the FP8 wgrad takes dy's and x's columnwise forms both as SegmentedColumns or both not")
        first, second = (x_cols, dy_cols) if w_transposed else (dy_cols, x_cols)
        dw = library.quantized_linear_wgrad(backend, recipe, *first, *second, offs, host_offs, w_dtype, rows)
        return dw.transpose(1, 2) if w_transposed else dw
    if not (isinstance(dy_q, GroupedTensor) and isinstance(x_q, GroupedTensor)):
        raise TypeError("the reference wgrad dequantizes GroupedTensors; SegmentedColumns are the FP8 wgrad's")
    dy_c = dequantize_with(quantizer, dy_q, columnwise=True)
    x_c = dequantize_with(quantizer, x_q, columnwise=True)
    return wgrad_in_layout(backend, dy_c, x_c, offs, host_offs, w_transposed)


def bias_scale_grad(
    dy_bias_MO: torch.Tensor, bias_NO: torch.Tensor, offs: GroupOffsets, bias_scale_M: torch.Tensor
) -> torch.Tensor:
    """The gradient of a bias_scale (M,) in its dtype: <dy[r], bias[group of r]>, from dy with its padding
    rows zeroed (`library.without_padding_rows`)."""
    acc_t = compute_dtype(dy_bias_MO, bias_scale_M)
    return (dy_bias_MO.to(acc_t) * bias_rows(bias_NO, offs, acc_t)).sum(-1).to(bias_scale_M.dtype)


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


class _GroupedLinearFn(torch.autograd.Function):
    """Inputs after x: n_w weight tensors then the bias tensors, each one grouped tensor or N per-group
    tensors (also when N = 1)."""

    @staticmethod
    def forward(
        ctx: Any,
        backend: str,
        offs: torch.Tensor,
        host_offs: list[int] | None,
        bias_scale_M: torch.Tensor | None,
        n_w: int,
        x_MI: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        weights, biases = params[:n_w], params[n_w:]
        w_NOI, bias_NO = stacked(weights, 3, "weight"), stacked(biases, 2, "bias")
        y_MO = library.grouped_linear_forward(backend, x_MI, w_NOI, offs, host_offs, bias_NO, bias_scale_M)
        ctx.backend, ctx.host_offs, ctx.n_w = backend, host_offs, n_w
        ctx.w_dims, ctx.b_dims = tuple(w.dim() for w in weights), tuple(b.dim() for b in biases)
        ctx.save_for_backward(x_MI, offs, bias_scale_M, bias_NO, *weights)
        return y_MO

    @staticmethod
    def backward(ctx: Any, dy_MO: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_MI, offs, bias_scale_M, bias_NO, *weights = ctx.saved_tensors
        backend, host_offs, n_w = ctx.backend, ctx.host_offs, ctx.n_w
        need_x, need_scale = ctx.needs_input_grad[5], ctx.needs_input_grad[3]
        need_w, need_b = any(ctx.needs_input_grad[6 : 6 + n_w]), any(ctx.needs_input_grad[6 + n_w :])
        dy_MO = row_major(dy_MO)
        dx = dw = db = d_scale = None
        # The GEMMs never read padding rows of dy; the bias sums would (0 * inf = nan), so they get a copy
        # with those rows zeroed: padding rows receive zero gradient whatever dy holds.
        dy_bias_MO = library.without_padding_rows(dy_MO, offs, host_offs) if bias_NO is not None else None
        if need_x:
            dx = library.grouped_linear_dgrad(backend, dy_MO, stacked(weights, 3, "weight"), offs, host_offs)
        if need_w:
            dw = wgrad_in_layout(backend, dy_MO, x_MI, offs, host_offs, stored_transposed(weights[0]))
        if need_b:
            db = library.grouped_linear_dbias(backend, dy_bias_MO, offs, host_offs, bias_scale_M)
        if bias_scale_M is not None and need_scale:
            assert dy_bias_MO is not None  # a bias_scale comes with a bias
            acc_t = compute_dtype(dy_MO, bias_scale_M)
            go = GroupOffsets.of(offs, host_offs, dy_MO.shape[0])
            d_scale = (dy_bias_MO.to(acc_t) * bias_rows(bias_NO, go, acc_t)).sum(-1).to(bias_scale_M.dtype)
        return (None, None, None, d_scale, None, dx, *unstacked(dw, ctx.w_dims, 3), *unstacked(db, ctx.b_dims, 2))


# Positions of _QuantizedLinearFn.forward's bias_scale and x (needs_input_grad); the parameters follow x.
# Module constants: dynamo cannot read an autograd.Function's class attributes.
_Q_SCALE, _Q_X = 8, 13


class _QuantizedLinearFn(torch.autograd.Function):
    """The quantized grouped linear (module docstring). Inputs after x as `_GroupedLinearFn`'s;
    `weight_q` is the weight's quantization (a `GroupedTensor`, from the caller's cache), saved as tensors
    so that autograd refuses a backward after it was rewritten in place. `fp8`: the forward and the dgrad
    run on the backend's FP8 kernels (its QuantizedGemm capability), the dgrad on the weight's transposed
    copy `wt_data` / `wt_scale` (`moekit.ops.quantize.TransposedWeight`, kept beside weight_q and saved
    likewise); otherwise the reference path (wt_* None). `fp8_wgrad`: the wgrad too, from the columnwise
    quantizations of dy and x (fp8_rowwise, fp8_block; `fp8_wgrad_compute`); otherwise it dequantizes them.
    `quantized_wgrad` False: the wgrad from dy and x themselves in x's dtype (x held as it is, not
    quantized columnwise; dy quantized rowwise only, for the dgrad)."""

    @staticmethod
    def forward(
        ctx: Any,
        backend: str,
        quantizer: str,
        recipe: str,
        fp8: bool,
        fp8_wgrad: bool,
        quantized_wgrad: bool,
        offs: torch.Tensor,
        host_offs: list[int] | None,
        bias_scale_M: torch.Tensor | None,
        weight_q: GroupedTensor,
        wt_data: torch.Tensor | None,
        wt_scale: torch.Tensor | None,
        n_w: int,
        x_MI: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        weights, biases = params[:n_w], params[n_w:]
        bias_NO = stacked(biases, 2, "bias")
        go = GroupOffsets.of(offs, host_offs, x_MI.shape[0])
        first_w = _Q_X + 1
        need_w = any(ctx.needs_input_grad[first_w : first_w + n_w])
        # x is held as its columnwise quantization only (the wgrad's operand): in the FP8 wgrad's own
        # layout where that runs (`group_quantize_for_wgrad`), else in the GroupedTensor; with the
        # unquantized wgrad as x itself.
        x_held: GroupedTensor | None = None
        x_cols: SegmentedColumns | None = None
        x_kept = x_MI if need_w and not quantized_wgrad else None  # the unquantized wgrad's operand
        x_q: GroupedTensor | None
        if x_kept is not None:
            x_q = group_quantize(x_MI, go, recipe, backend=quantizer)
        elif need_w and fp8_wgrad:
            x_q, x_seg = group_quantize_for_wgrad(x_MI, go, recipe, rowwise=True, backend=quantizer)
            assert x_q is not None and isinstance(x_seg, SegmentedColumns)  # rowwise, segments
            x_cols = x_seg
        else:
            x_q = group_quantize(x_MI, go, recipe, columnwise=need_w, backend=quantizer)
            if need_w:
                x_held = x_q.with_storage((*x_q.storage()[:2], None, None, *x_q.storage()[4:]))
        y_MO = quantized_forward_product(
            backend, quantizer, recipe, fp8, x_q, weight_q, offs, host_offs, bias_NO, bias_scale_M, x_MI.dtype
        )
        ctx.backend, ctx.quantizer, ctx.recipe, ctx.fp8, ctx.fp8_wgrad = backend, quantizer, recipe, fp8, fp8_wgrad
        ctx.quantized_wgrad = quantized_wgrad
        ctx.host_offs, ctx.n_w = host_offs, n_w
        ctx.w_dims, ctx.b_dims = tuple(w.dim() for w in weights), tuple(b.dim() for b in biases)
        ctx.w_transposed = stored_transposed(weights[0])
        ctx.x_template, ctx.w_template = x_held, weight_q
        ctx.x_rows = x_cols.rows if x_cols is not None else None
        if x_held is not None:
            x_storage = x_held.storage()
        elif x_cols is not None:
            x_storage = (x_cols.data, x_cols.scale_inv, *(None,) * 5)
        else:
            x_storage = (None,) * 7
        ctx.save_for_backward(offs, bias_scale_M, bias_NO, wt_data, wt_scale, x_kept, *x_storage, *weight_q.storage())
        return y_MO

    @staticmethod
    def backward(ctx: Any, dy_MO: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        offs, bias_scale_M, bias_NO, wt_data, wt_scale, x_kept, *stored = ctx.saved_tensors
        x_q: GroupedTensor | SegmentedColumns | None = None
        if ctx.x_template is not None:
            x_q = ctx.x_template.with_storage(stored[:7])
        elif ctx.x_rows is not None:
            x_q = SegmentedColumns(stored[0], stored[1], ctx.x_rows)
        weight_q: GroupedTensor = ctx.w_template.with_storage(stored[7:])
        backend, host_offs, n_w = ctx.backend, ctx.host_offs, ctx.n_w
        first_w = _Q_X + 1
        need_x, need_scale = (
            ctx.needs_input_grad[_Q_X],
            ctx.needs_input_grad[_Q_SCALE],
        )
        need_w, need_b = any(ctx.needs_input_grad[first_w : first_w + n_w]), any(ctx.needs_input_grad[first_w + n_w :])
        dy_MO = row_major(dy_MO)
        go = GroupOffsets.of(offs, host_offs, dy_MO.shape[0])
        dx = dw = db = d_scale = None
        dy_bias_MO = library.without_padding_rows(dy_MO, offs, host_offs) if bias_NO is not None else None
        if need_x or need_w:
            quantized_wgrad = ctx.quantized_wgrad
            dy_q: GroupedTensor | None = None
            dy_cols: GroupedTensor | SegmentedColumns | None = None
            if need_x or quantized_wgrad:
                # The columnwise form in the FP8 wgrad's layout where it runs (as x's in the forward); with
                # the unquantized wgrad only the dgrad's rowwise form.
                dy_q, dy_cols = group_quantize_for_wgrad(
                    dy_MO, go, ctx.recipe, rowwise=need_x, columnwise=need_w and quantized_wgrad,
                    segments=ctx.fp8_wgrad and quantized_wgrad, backend=ctx.quantizer,
                )  # fmt: skip
            if need_x:
                assert dy_q is not None  # rowwise
                dx = quantized_dgrad_product(
                    backend, ctx.quantizer, ctx.recipe, ctx.fp8, dy_q, weight_q, wt_data, wt_scale, offs, host_offs
                )
            if need_w and not quantized_wgrad:
                dw = wgrad_in_layout(backend, dy_MO, x_kept, offs, host_offs, ctx.w_transposed)
            elif need_w and x_q is not None and dy_cols is not None:
                dw = quantized_wgrad_product(
                    backend,
                    ctx.quantizer,
                    ctx.recipe,
                    ctx.fp8_wgrad,
                    dy_cols,
                    x_q,
                    offs,
                    host_offs,
                    ctx.w_transposed,
                    weight_q.dtype,
                )
        if need_b:
            db = library.grouped_linear_dbias(backend, dy_bias_MO, offs, host_offs, bias_scale_M)
        if bias_scale_M is not None and need_scale and dy_bias_MO is not None:
            d_scale = bias_scale_grad(dy_bias_MO, bias_NO, go, bias_scale_M)
        return (
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            d_scale,
            None,
            None,
            None,
            None,
            dx,
            *unstacked(dw, ctx.w_dims, 3),
            *unstacked(db, ctx.b_dims, 2),
        )


def fp8_compute(impl: GemmBackend, recipe: str, x: torch.Tensor) -> bool:
    """Whether a quantized grouped linear on `impl` runs its forward and dgrad on FP8 kernels: where the
    backend has the QuantizedGemm capability and it can take this recipe, device and dtype (moekit's
    Triton kernels: fp8_block and fp8_rowwise on FP8 tensor cores, compute capability >= 8.9, or the
    CPU interpreter); the reference path otherwise."""
    fp8 = quantized_gemm_of(impl)
    return fp8 is not None and fp8.quantized_gemm_unavailable_reason(recipe, x) is None


def fp8_wgrad_compute(impl: GemmBackend, recipe: str, x: torch.Tensor) -> bool:
    """Whether a quantized grouped linear on `impl` also runs its wgrad on FP8 kernels: where the backend's
    QuantizedGemm capability can take this recipe's wgrad (moekit's Triton kernels, where `fp8_compute`
    holds: fp8_rowwise, whose columnwise scales are constant along the wgrad's reduction and applied in
    the epilogue, and fp8_block, whose 128 x 1 columnwise blocks are promoted per 128-row reduction
    step); mxfp8's wgrad (32 x 1 blocks with E8M0 scales, no Hopper FP8 path) dequantizes its operands
    and takes the backend's GEMM."""
    fp8 = quantized_gemm_of(impl)
    return fp8 is not None and fp8.quantized_wgrad_unavailable_reason(recipe, x) is None


def quantized_weight(
    weights: list[torch.Tensor], recipe: str, quantizer: str, cache: QuantizedWeightCache | None, transposed: bool
) -> tuple[GroupedTensor, TransposedWeight | None]:
    """The quantization of a grouped weight (one (N, O, I) tensor or N (O, I) tensors) and, if
    `transposed` (the FP8 dgrad's operand), its `TransposedWeight`: from `cache`, refreshed there when
    the weight changed, or made for this call."""
    w_NOI = stacked(weights, 3, "weight")
    if w_NOI is None:
        raise ValueError("weight must be a (N, out, in) tensor or a non-empty list of N (out, in) tensors")
    if cache is None:
        cache = QuantizedWeightCache()
    if transposed:
        return cache.get_transposed(w_NOI.detach(), weights, recipe, quantizer)
    return cache.get(w_NOI.detach(), weights, recipe, quantizer), None


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def grouped_linear(
    x: torch.Tensor,
    weight: Weight,
    m_splits: MSplits | GroupOffsets,
    bias: Weight | None = None,
    *,
    backend: str = "auto",
    bias_scale: torch.Tensor | None = None,
    quantization: str | None = None,
    quantized_wgrad: bool = True,
    weight_cache: QuantizedWeightCache | None = None,
) -> torch.Tensor:
    """Grouped linear over rows sorted by group.

    x: (M, I). weight: (N, O, I) or N tensors (O, I). m_splits: (N,) rows per group (list, CPU tensor or
    device tensor); rows past sum(m_splits) are padding and give zeros. bias: (N, O), N tensors (O,), or
    None. bias_scale: optional (M,) per-row factor on the bias (router probabilities). Returns (M, O) in
    x's dtype. backend: "auto", "loop", "torch" or "triton" (`moekit.ops.runtime.backends`).

    quantization: None, "fp8_block", "fp8_rowwise" or "mxfp8": the products on quantized operands,
    gradients straight through (module docstring). The forward and the dgrad run on FP8 kernels where
    the backend has them and can run the recipe (the "triton" backend: fp8_block and fp8_rowwise on
    compute capability >= 8.9, e.g. Hopper; `fp8_compute`), on the reference path otherwise (quantize,
    dequantize, the GEMMs in x's dtype: the "torch" and "loop" backends, mxfp8, older GPUs); the wgrad
    on FP8 kernels for fp8_rowwise and fp8_block where the forward's are (`fp8_wgrad_compute`), on the
    reference path for mxfp8. quantized_wgrad (with quantization): False computes the weight gradient
    from dy and x themselves in x's dtype (TransformerEngine's high-precision wgrad override, torchao's
    "rowwise_with_gw_hp"): x is then held in its own dtype for the backward instead of its columnwise
    FP8 copy, and only dy's rowwise form is made. weight_cache: a
    `moekit.ops.quantize.QuantizedWeightCache` that keeps the weight's quantization across calls (the
    modules pass theirs: the weight is quantized once per optimizer step); without one, every call
    quantizes the weight.
    """
    check_float_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, in_features), got shape {tuple(x.shape)}")
    weights, biases = tensor_list("weight", weight), tensor_list("bias", bias)
    num_groups, _ = check_linear_params(x, weights, biases)
    offs = resolve_splits(m_splits, num_groups, x.shape[0], x.device)
    impl = select_backend(backend, x, probe_weight(weights))
    if bias_scale is not None:
        check_float_tensor("bias_scale", bias_scale)
        if not biases:
            raise ValueError("bias_scale scales the bias; it needs a bias")
        if bias_scale.shape not in ((x.shape[0],), (x.shape[0], 1)):
            raise ValueError(f"bias_scale must have shape ({x.shape[0]},), got {tuple(bias_scale.shape)}")
        check_same_device("bias_scale", bias_scale, "x", x)
        bias_scale = bias_scale.reshape(-1)
    host_offs = list(offs.host) if offs.host is not None else None
    quantization = check_quantization(quantization)
    quantized_wgrad = check_bool("quantized_wgrad", quantized_wgrad)
    if quantization is not None:
        quantizer = select_quantizer(backend, x).name
        fp8 = fp8_compute(impl, quantization, x)
        fp8_wgrad = fp8 and fp8_wgrad_compute(impl, quantization, x)
        # The transposed copy serves the FP8 dgrad only: made where x's gradient may be asked for.
        dgrad = fp8 and torch.is_grad_enabled() and x.requires_grad
        weight_q, weight_t = quantized_weight(weights, quantization, quantizer, weight_cache, dgrad)
        return _QuantizedLinearFn.apply(
            impl.name,
            quantizer,
            quantization,
            fp8,
            fp8_wgrad,
            quantized_wgrad,
            offs.offs,
            host_offs,
            bias_scale,
            weight_q,
            weight_t.data if weight_t is not None else None,
            weight_t.scale_inv if weight_t is not None else None,
            len(weights),
            row_major(x),
            *weights,
            *biases,
        )
    return _GroupedLinearFn.apply(
        impl.name, offs.offs, host_offs, bias_scale, len(weights), row_major(x), *weights, *biases
    )


def grouped_linear_reference(
    x: torch.Tensor,
    weight: Weight,
    m_splits: MSplits,
    bias: Weight | None = None,
    *,
    backend: str = "auto",
    bias_scale: torch.Tensor | None = None,
    quantization: str | None = None,
    quantized_wgrad: bool = True,
    weight_cache: QuantizedWeightCache | None = None,
) -> torch.Tensor:
    """float64 reference of `grouped_linear` (unquantized: the exact values quantized compute
    approximates), differentiable by autograd; returns float64."""
    del backend, quantization, quantized_wgrad, weight_cache
    weights = [w.double() for w in tensor_list("weight", weight)]
    w_list = list(weights[0].unbind(0)) if len(weights) == 1 and weights[0].dim() == 3 else weights
    biases = [b.double() for b in tensor_list("bias", bias)]
    b_list = list(biases[0].unbind(0)) if len(biases) == 1 and biases[0].dim() == 2 else biases
    device = m_splits.device if isinstance(m_splits, torch.Tensor) else torch.device("cpu")
    bounds = resolve_splits(m_splits, len(w_list), x.shape[0], device).host_offsets()
    x64 = x.double()
    rows = []
    for g, w in enumerate(w_list):
        y = x64[bounds[g] : bounds[g + 1]] @ w.t()
        if b_list:
            s = 1.0 if bias_scale is None else bias_scale.reshape(-1)[bounds[g] : bounds[g + 1], None].double()
            y = y + b_list[g] * s
        rows.append(y)
    rows.append(x64.new_zeros(x.shape[0] - bounds[-1], w_list[0].shape[0]))
    return torch.cat(rows)
