"""The routed experts of an MoE layer in one call: route, gather, grouped MLP, weighted combine.

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts, H hidden size,
F expert ffn size, J rows summed into one (row movement).

    out[t] = sum_k w[t, k] * (fc2_e(act(fc1_e(x[t]))) + b2_e),   e = topk_ids[t, k]

computed as `unpermute(grouped_mlp(x_sorted, ..., probs=w in sorted order), row_map)`:

1. Routing on the device, no host sync (`moekit.ops.routing.route`): `order` (sorted row -> flat
   copy t*K + k), its inverse `inverse_TK` ((t, k) -> sorted row), the experts' row offsets and the
   row -> token map `order // K`.
2. Gather `x_sorted = x[order // K]`, and the weights in sorted order (`w.flatten()[order]`, a
   permutation: its backward writes each weight's gradient once) as the grouped MLP's `probs`
   (they scale the activation and the fc2 bias, and get their gradient there).
3. `moekit.grouped_mlp` on the sorted rows. Whatever it saves for its backward passes through
   `saved_tensors_hooks`: the saved copy of its input, `x_sorted` (M x H, K times the size of x),
   is replaced by a reference to x and the row -> token map and gathered again in the backward,
   so the layer holds no (M, H) tensor between forward and backward.
4. Combine: `out[t] = sum_k y_sorted[inverse[t, k]]` (the weights are already in y_sorted).

On the triton backend in eager mode the same steps run as two autograd nodes of this module
(`_fused_experts`) over the grouped MLP's fused kernels, instead of five nodes and the hooks: the
same results, less host time per call, which small batches are bound by. torch.compile and the
other backends take the composition above.

Held between forward and backward on that path: x itself, the routing's row maps (inverse,
token_of_row: int64 per row), the probs and fc1's pre-activation h (M, 2F) in x's dtype; the layer's
memory contract is at most 0.4x of what the plain PyTorch layer holds, (4F + 3H) values per routed
row (`HELD_FRACTION_OF_PLAIN`). Where F is above about 3H (Mixtral 8x7B: H 4096, F 14336) h alone
is over that: the layer then holds h of the first `kept` sorted rows only (`_held_h_rows`: the most
that fit, less a spare) and computes the other rows' h again in the backward, before fc2's dgrad
and the activation's backward, with the same kernel on x's rows gathered again: the same bits. It
costs those rows' fc1 GEMM once more, (1 - kept/M) * 2/9 of the layer's forward+backward FLOPs
(Mixtral at T 16384: 3.0% of the rows, 0.67% of the FLOPs; held 0.3995x of plain, measured on the
H200). Under no_grad nothing is held and h is never split.

Row movement is one primitive both ways: out[r] = sum_j src[index[r, j]], summed in fixed j order
in fp32 with one rounding. The gather is its J = 1 case. Each direction's backward is the other
one (the gather's backward sums each token's K row gradients; the combine's backward gathers),
so no step sums rows with atomics and results are bit-identical run to run. On CUDA (and wherever
the Triton backend runs) it is one Triton kernel; elsewhere plain torch (`src[index].sum(1)`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from moekit._splits import GroupOffsets
from moekit.ops import library
from moekit.ops.grouped_linear import _BACKENDS, Weight, _as_list, _probe_weight, select_backend
from moekit.ops.grouped_mlp import (
    _check_mlp,
    _grouped,
    _unstack,
    _unstack_bias,
    fc1_backward_step,
    fc1_step,
    fc2_backward_step,
    fc2_params_backward_step,
    fc2_step,
    glu_backward_partials,
    glu_forward,
    grouped_mlp,
)
from moekit.ops.routing import Routing, check_expert_ids, route
from moekit.ops.swiglu import check_activation, check_interleave, swiglu_reference

_TRITON_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------
# Row movement: out[r] = sum_j src[index[r, j]]
# --------------------------------------------------------------------------------------------------


def _sum_rows_torch(src_SD: torch.Tensor, index_RJ: torch.Tensor) -> torch.Tensor:
    """Plain-torch row sum: a gather then a fixed-order reduction over J (deterministic)."""
    num_out, per_out = index_RJ.shape
    gathered = src_SD.index_select(0, index_RJ.reshape(-1))
    if per_out == 1:
        return gathered
    acc_t = torch.promote_types(src_SD.dtype, torch.float32)
    return gathered.view(num_out, per_out, src_SD.shape[1]).sum(1, dtype=acc_t).to(src_SD.dtype)


@functools.cache
def _sum_rows_launcher():
    """The row kernel's launcher, imported on first use (the module itself needs no triton)."""
    from moekit.ops.moe_experts_kernels import _sum_rows_kernel
    from moekit.ops.triton_launch import Launcher

    return Launcher(_sum_rows_kernel)


def _sum_rows_triton(src_SD: torch.Tensor, index_RJ: torch.Tensor) -> torch.Tensor:
    from moekit.ops.grouped_gemm import _planned
    from moekit.ops.triton_launch import tensor_key

    num_out, per_out = index_RJ.shape
    out_RD = src_SD.new_empty(num_out, src_SD.shape[1])
    if out_RD.numel() == 0:
        return out_RD
    if per_out == 0:
        return out_RD.zero_()
    key = ("sum_rows", tensor_key(src_SD), tensor_key(index_RJ))
    _planned(key, lambda: _sum_rows_launch(src_SD, index_RJ))(src_SD, index_RJ, out_RD)
    return out_RD


def _sum_rows_launch(src_SD: torch.Tensor, index_RJ: torch.Tensor):
    """The row kernel's launch for these shapes; tensors: (src, index, out)."""
    import triton

    from moekit.ops.triton_launch import LaunchPlan

    num_out, per_out = index_RJ.shape
    num_features = src_SD.shape[1]
    # A tile of about 4096 elements: 8 KiB of bf16 per source row block, enough bytes in flight per
    # program to stream at HBM speed; narrow rows (the (M, 1) weights) get many rows per program.
    block_d = min(triton.next_power_of_2(num_features), 1024)
    block_r = max(1, 4096 // block_d)
    grid = (triton.cdiv(num_out, block_r), triton.cdiv(num_features, block_d))
    return LaunchPlan(
        _sum_rows_launcher(),
        grid,
        (num_out, num_features, per_out, src_SD.stride(0), num_features),
        dict(BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4),
    )


def _sum_rows(src_SD: torch.Tensor, index_RJ: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """(R, D): row r is the sum of src's rows index[r, 0..J-1], in that order, in src's dtype."""
    src_SD, index_RJ = src_SD.contiguous(), index_RJ.contiguous()
    if use_triton and src_SD.dtype in _TRITON_ROW_DTYPES:
        return _sum_rows_triton(src_SD, index_RJ)
    return _sum_rows_torch(src_SD, index_RJ)


class _MoveRowsFn(torch.autograd.Function):
    """out[r] = sum_j src[index_fwd[r, j]]; d src[s] = sum_j d out[index_bwd[s, j]].

    Used with index_bwd the transpose of index_fwd's map: gather (J = 1 forward, each source row
    used J' times) and combine (J rows summed, each source row used once) are each other's backward.
    """

    @staticmethod
    def forward(ctx, src_SD, index_fwd_RJ, index_bwd_SJ, use_triton):
        ctx.save_for_backward(index_fwd_RJ, index_bwd_SJ)
        ctx.use_triton = use_triton
        return library.sum_rows(src_SD, index_fwd_RJ, use_triton)

    @staticmethod
    def backward(ctx, d_out_RD):
        index_fwd_RJ, index_bwd_SJ = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the backward itself is differentiable
            d_src = _MoveRowsFn.apply(d_out_RD, index_bwd_SJ, index_fwd_RJ, ctx.use_triton)
        else:  # the usual backward: the kernel alone, without a node's host cost
            d_src = library.sum_rows(d_out_RD, index_bwd_SJ, ctx.use_triton)
        return d_src, None, None, None


def move_rows(
    src_SD: torch.Tensor, index_fwd_RJ: torch.Tensor, index_bwd_SJ: torch.Tensor, use_triton: bool
) -> torch.Tensor:
    """out (R, D): out[r] = sum_j src[index_fwd[r, j]], differentiable; the backward is
    d src[s] = sum_j d out[index_bwd[s, j]], so index_bwd must be index_fwd's transpose (the
    package's other layers, expert parallelism among them, move rows with this one primitive)."""
    return _MoveRowsFn.apply(src_SD, index_fwd_RJ, index_bwd_SJ, use_triton)


# --------------------------------------------------------------------------------------------------
# Saved-tensor hooks: the fc1 input is not kept, it is gathered again in the backward
# --------------------------------------------------------------------------------------------------


def _tensor_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's memory and view without holding a reference to it."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


class _RegatherRows:
    """Packed form of the gathered rows: rebuilt from the token rows and the row -> token map.

    Checks, as autograd does for the tensors it saves, that x was not modified in place between
    the forward and the backward."""

    def __init__(self, x_TH: torch.Tensor, token_of_row_M1: torch.Tensor, use_triton: bool) -> None:
        self.x_TH, self.token_of_row_M1, self.use_triton = x_TH, token_of_row_M1, use_triton
        self.version = x_TH._version

    def unpack(self) -> torch.Tensor:
        if self.x_TH._version != self.version:
            raise RuntimeError(
                "moe_experts: x was modified in place after the forward (version "
                f"{self.version} -> {self.x_TH._version}); its backward gathers x again and needs it unchanged"
            )
        with torch.no_grad():
            return _sum_rows(self.x_TH.detach(), self.token_of_row_M1, self.use_triton)


def _regathering_hooks(x_TH, x_sorted_MH, token_of_row_M1, use_triton):
    """(pack, unpack) for saved_tensors_hooks. The hooks live as long as the autograd graph, so
    they refer to x_sorted only by its key (a reference would keep it alive)."""
    key = _tensor_key(x_sorted_MH)
    regather = _RegatherRows(x_TH, token_of_row_M1, use_triton)

    def pack(t: torch.Tensor):
        # The shape first: most saved tensors (weights, offsets, h) differ there, and the full key
        # (storage address) costs a few microseconds of host time per saved tensor.
        return regather if t.shape == key[4] and _tensor_key(t) == key else t

    def unpack(packed):
        return packed.unpack() if isinstance(packed, _RegatherRows) else packed

    return pack, unpack


# --------------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------------


def _num_experts(fc1_weight: Weight) -> int:
    weights = _as_list(fc1_weight)
    if not weights or not all(isinstance(w, torch.Tensor) for w in weights):
        raise TypeError("fc1_weight must be a (N, 2F, H) tensor or a non-empty list of N (2F, H) tensors")
    return weights[0].shape[0] if len(weights) == 1 and weights[0].dim() == 3 else len(weights)


def _check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        what = f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D floating tensor (tokens, hidden), got {what}")
    if not isinstance(topk_ids, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
        raise TypeError("topk_ids and topk_weights must be tensors of shape (tokens, top_k)")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids must be (tokens, top_k) with tokens = {x.shape[0]} (x's rows), got shape {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor (expert indices), got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; pass both on x's device")
    top_k = topk_ids.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k (topk_ids.shape[1]) must be in [1, num_experts={num_experts}], got {top_k}")
    check_expert_ids(topk_ids, num_experts, "topk_ids")


def use_triton_rows(backend_name: str, x: torch.Tensor) -> bool:
    """The Triton row kernel runs wherever the Triton backend can: on CUDA whatever GEMM backend was
    chosen, and on CPU (interpreter) when the Triton backend itself was chosen."""
    if backend_name == "triton":
        return True
    if x.device.type != "cuda":
        return False
    return _BACKENDS["triton"].unavailable_reason(x, x.new_empty(1, 1, x.shape[1])) is None


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1_weight: Weight,
    fc2_weight: Weight,
    *,
    fc1_bias: Weight | None = None,
    fc2_bias: Weight | None = None,
    activation: str = "swiglu",
    glu_interleave_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The routed experts of an MoE layer: each token's K expert outputs, weighted and summed.

    x: (T, H) tokens. topk_ids: (T, K) integer experts of each token. topk_weights: (T, K) float
    weight of each (scales the activation and the fc2 bias, as grouped_mlp's probs).
    fc1_weight: (N, 2F, H) or N x (2F, H); fc2_weight: (N, H, F) or N x (H, F); biases (N, out),
    N x (out,) or None. `backend` is the grouped GEMMs' ("auto", "loop", "torch", "triton").
    Returns (T, H) in x's dtype. Differentiable with respect to x, topk_weights, weights and
    biases; no host sync on the way (forward and backward), so CUDA-graph capturable.

    The grouped MLP runs under moe_experts' own saved-tensor hooks (they drop its sorted copy of x):
    activation checkpointing around the call works, but an outer `save_on_cpu` does not reach the
    tensors saved inside the MLP. Under torch.compile these hooks are not installed (a traced graph
    does not run them): what the compiled graph keeps for the backward is AOTAutograd's choice (its
    min-cut partitioner may save x_sorted or recompute the gather); the range check of topk_ids
    (a read of the ids on the CPU) runs in eager only.

    Memory held for the backward: at most 0.4x of the plain PyTorch layer's on the fused triton path
    (see the module docstring): where fc1's pre-activation h whole would be over that (F above about
    3H), part of its rows' h is computed again in the backward, bit for bit, at about
    (1 - kept/M) * 2/9 of the layer's FLOPs.
    """
    num_experts = _num_experts(fc1_weight)
    _check_routing(x, topk_ids, topk_weights, num_experts)
    check_activation(activation)
    impl = select_backend(backend, x, _probe_weight(_as_list(fc1_weight)))
    use_triton = use_triton_rows(impl.name, x)
    # The Triton counting sort wherever the row kernel runs (three launches instead of about nine);
    # a traced graph takes the torch ops, which torch.compile knows.
    routing = route(topk_ids, num_experts, use_triton=use_triton and not torch.compiler.is_compiling())
    if impl.name == "triton" and not torch.compiler.is_compiling():
        fused = _fused_experts(
            x,
            topk_weights,
            routing,
            fc1_weight,
            fc2_weight,
            fc1_bias,
            fc2_bias,
            activation,
            glu_interleave_size,
            backend,
        )
        if fused is not None:
            return fused
    offs, order_M1, inverse_TK, token_of_row_M1 = routing
    x_sorted_MH = _MoveRowsFn.apply(x, token_of_row_M1, inverse_TK, use_triton)
    # The weights in sorted order: `order` is a permutation, so this gather's backward (index_add_)
    # writes each weight's gradient exactly once: exact and deterministic, and one plain torch op
    # each way instead of a row-movement node.
    probs_M = topk_weights.reshape(-1).index_select(0, order_M1.view(-1))
    mlp_kwargs = dict(
        probs=probs_M,
        fc1_bias=fc1_bias,
        fc2_bias=fc2_bias,
        activation=activation,
        glu_interleave_size=glu_interleave_size,
        backend=backend,
    )
    if torch.compiler.is_compiling():
        # The traced graph decides itself what to keep (AOTAutograd's partitioner may recompute the
        # gather in the backward); saved-tensor hooks are not traced.
        y_sorted_MH = grouped_mlp(x_sorted_MH, fc1_weight, fc2_weight, offs.diff(), **mlp_kwargs)
    else:
        # On an accelerator, the offsets as grouped_mlp takes them (it need not rebuild them from
        # counts); on the CPU the counts, which it reads on the host for free (then the torch
        # backend knows there are no padding rows to zero).
        splits = (
            offs.diff() if offs.device.type == "cpu" else GroupOffsets(offs=offs, host=None, rows=x_sorted_MH.shape[0])
        )
        pack, unpack = _regathering_hooks(x, x_sorted_MH, token_of_row_M1, use_triton)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y_sorted_MH = grouped_mlp(x_sorted_MH, fc1_weight, fc2_weight, splits, **mlp_kwargs)
    del x_sorted_MH
    return _MoveRowsFn.apply(y_sorted_MH, inverse_TK, token_of_row_M1, use_triton)


# --------------------------------------------------------------------------------------------------
# The fused triton path: the layer in two autograd nodes
# --------------------------------------------------------------------------------------------------


def _fused_experts(
    x_TH,
    topk_weights_TK,
    routing: Routing,
    fc1_weight,
    fc2_weight,
    fc1_bias,
    fc2_bias,
    activation,
    glu_interleave_size,
    backend,
) -> torch.Tensor | None:
    """The layer on the triton backend in eager mode, or None where fc2 does not run on it.

    The grouped MLP's fused steps (`fc1_step` ... `fc1_backward_step`, shared with `grouped_mlp`) in
    two nodes that also move the rows, the same split as the MLP's (h is freed when node 2's
    backward has run). Against the composition (row movement, grouped_mlp, row movement: five nodes
    and saved-tensor hooks) this saves host time, which small batches are bound by:

        node 1  gather x into expert order and the weights into sorted order, fc1 + activation
                -> h, act, probs; saves x (T, H) itself, not the (M, H) gathered copy
        node 2  fc2, combine the K rows of each token -> out (T, H)
        backward: node 2 gathers dout's rows, runs fc2's and the activation's backward (dh, d probs,
        fc2's weight and bias gradients); node 1 gathers x again for fc1's weight gradient, then
        fc1's dgrad, sums each token's K rows into dx, and reads each weight's gradient at its row.

    Where h whole would break the layer's memory contract (`_held_h_rows`), node 2 keeps h of the
    first `kept` sorted rows only, and its backward computes the other rows' h again before fc2's
    dgrad (`_glu_backward_recomputing`).
    """
    w1s, w2s = _as_list(fc1_weight), _as_list(fc2_weight)
    b1s, b2s = _as_list(fc1_bias), _as_list(fc2_bias)
    _, ffn = _check_mlp(x_TH, fc1_weight, fc2_weight, fc1_bias, fc2_bias)
    check_interleave(ffn, glu_interleave_size)
    if select_backend(backend, x_TH.new_empty(0, ffn), _probe_weight(w2s)).name != "triton":
        return None
    rows = routing.token_of_row.shape[0]
    kept = rows
    if torch.is_grad_enabled():  # else nothing is held: h whole, one launch
        # Saved per routed row besides h: inverse (T, K) and token_of_row (M, 1) have one element a
        # row, the probs (M,) are in topk_weights' dtype.
        meta_bytes_per_row = (
            routing.inverse.element_size() + routing.token_of_row.element_size() + topk_weights_TK.element_size()
        )
        kept = _held_h_rows(rows, x_TH.shape[1], ffn, x_TH.element_size(), meta_bytes_per_row)
    h, act, probs_M, h_head = _ExpertsFc1Fn.apply(
        x_TH, topk_weights_TK, routing, kept, glu_interleave_size, activation, len(w1s), *w1s, *b1s
    )
    fc1 = None if h_head is None else _Fc1Operands(x_TH, tuple(w1s), tuple(b1s))
    return _ExpertsFc2Fn.apply(
        h, act, probs_M, h_head, routing, glu_interleave_size, activation, fc1, len(w2s), *w2s, *b2s
    )


# The layer's memory contract: what it holds between forward and backward is at most this fraction
# of what the plain PyTorch layer holds, (4F + 3H) values of x's dtype per routed row (the README's
# "held" column and benchmarks/summarize.py's bar). h alone is 2F values a row, over the bar once F
# is above about 3H (Mixtral 8x7B: H 4096, F 14336).
HELD_FRACTION_OF_PLAIN = 0.4

# Bytes of the bar the layer leaves unused where it holds part of h: the CUDA caching allocator may
# give a large tensor (the held rows of h) a cached block up to 1 MiB over its size (it splits a
# block only where more than 1 MiB would be left; measured: 480 KiB over at H 256, F 1024), and the
# layer holds a few tensors per layer rather than per row (offs (N+1,), the gradient slot of
# `_ExpertsFc1Fn`, each rounded up to 512 bytes; a stacked fc2 bias (N, H) where the biases come per
# expert). At Mixtral's width 2 MiB is 37 rows of h.
_HELD_SPARE_BYTES = 2 * 2**20


def _held_h_rows(rows: int, hidden: int, ffn: int, itemsize: int, meta_bytes_per_row: int) -> int:
    """How many of the layer's `rows` sorted rows keep their h (2F values of `itemsize` bytes)
    between forward and backward, with `meta_bytes_per_row` saved per row besides, under
    HELD_FRACTION_OF_PLAIN of the plain layer's (4F + 3H) values per row: all of them where they
    fit, else the most that fit in the bar less _HELD_SPARE_BYTES (at least 0). From shapes alone:
    no host sync."""
    h_row_bytes = 2 * ffn * itemsize
    room = HELD_FRACTION_OF_PLAIN * rows * (4 * ffn + 3 * hidden) * itemsize - rows * meta_bytes_per_row
    if h_row_bytes == 0 or rows * h_row_bytes <= room:  # no h, or all of it fits
        return rows
    return max(0, math.floor((room - _HELD_SPARE_BYTES) / h_row_bytes))


class _Fc1Operands(NamedTuple):
    """What node 2's backward computes h's tail rows from: x (T, H) and fc1's weights and biases as
    the layer took them (references: they are alive anyway)."""

    x_TH: torch.Tensor
    w1s: tuple[torch.Tensor, ...]
    b1s: tuple[torch.Tensor, ...]


def _split_offsets(offs: torch.Tensor, kept: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert offsets (N+1,) of the sorted rows [0, kept) and of the rows [kept, rows), the
    latter counted from row `kept`: an expert across the split has rows in both, rows past offs[N]
    (padding) stay padding. Device ops, no host read."""
    return offs.clamp(max=kept), (offs - kept).clamp(min=0, max=rows - kept)


def _fc1_forward_split(x_MH, offs, probs_M, kept: int, glu_interleave_size, activation, w1s, b1s):
    """fc1 + activation (`fc1_step`) of the rows [0, kept) and of the rows [kept, M), one launch
    each: (h of the rows [0, kept) (kept, 2F), act (M, F)). The same bits as one launch: a row's h
    and act depend on its x, probs and expert only. The tail's h is dropped here.

    grouped_mlp.glu_forward is called directly, not through `library`: `out` (act's rows, so that
    fc2 reads one (M, F) tensor) is not part of the custom op, and these nodes run in eager only."""
    rows = x_MH.shape[0]
    w1, b1 = _grouped(w1s, 3, "fc1 weight"), _grouped(b1s, 2, "fc1 bias")
    ffn = w1.shape[1] // 2
    offs_head, offs_tail = _split_offsets(offs, kept, rows)
    h_head, act_MF = x_MH.new_empty(kept, 2 * ffn), x_MH.new_empty(rows, ffn)
    glu_forward(
        x_MH[:kept], w1, offs_head, b1, probs_M[:kept], glu_interleave_size, activation, out=(h_head, act_MF[:kept])
    )
    glu_forward(
        x_MH[kept:],
        w1,
        offs_tail,
        b1,
        probs_M[kept:],
        glu_interleave_size,
        activation,
        out=(x_MH.new_empty(rows - kept, 2 * ffn), act_MF[kept:]),
    )
    return h_head, act_MF


def _glu_backward_recomputing(
    dy_MH, h_head, offs, probs_M, token_of_row_M1, fc1: _Fc1Operands, w2s, glu_interleave_size, activation
):
    """glu_backward of all M rows (dh (M, 2F), act_p (M, F), dprobs (M,) fp32) where only the first
    kept = len(h_head) rows' h was held: the others' h is computed again first (x's rows gathered
    again, fc1 + activation as `_fc1_forward_split` ran it, the same bits), then one launch per part.
    The parts' d probs partials are summed as one (F tiles, M) tensor, as one launch's would be."""
    rows, kept = dy_MH.shape[0], h_head.shape[0]
    w1, b1 = _grouped(fc1.w1s, 3, "fc1 weight"), _grouped(fc1.b1s, 2, "fc1 bias")
    w2 = _grouped(w2s, 3, "fc2 weight")
    ffn = w2.shape[2]
    offs_head, offs_tail = _split_offsets(offs, kept, rows)
    dh_M2F, act_p_MF = dy_MH.new_empty(rows, 2 * ffn), dy_MH.new_empty(rows, ffn)
    x_tail = library.sum_rows(fc1.x_TH, token_of_row_M1[kept:], True)
    # The recomputed act goes to act_p's tail rows, which glu_backward then overwrites.
    h_tail, _ = glu_forward(
        x_tail,
        w1,
        offs_tail,
        b1,
        probs_M[kept:],
        glu_interleave_size,
        activation,
        out=(x_tail.new_empty(rows - kept, 2 * ffn), act_p_MF[kept:]),
    )
    del x_tail
    partials = [
        glu_backward_partials(
            dy_MH[lo:hi],
            w2,
            h_part,
            offs_part,
            probs_M[lo:hi],
            glu_interleave_size,
            activation,
            out=(dh_M2F[lo:hi], act_p_MF[lo:hi]),
        )[2]
        for lo, hi, h_part, offs_part in ((0, kept, h_head, offs_head), (kept, rows, h_tail, offs_tail))
        if hi > lo
    ]
    return dh_M2F, act_p_MF, torch.cat(partials, dim=1).sum(0)


class _ExpertsFc1Fn(torch.autograd.Function):
    """Node 1 of the fused layer. Inputs: x (T, H), topk_weights (T, K), the `Routing`, kept (the
    rows whose h is held, `_held_h_rows`), the GLU block, the activation, n_w1, then n_w1 fc1 weights
    and the fc1 biases. Returns (h, act (M, F), probs (M,), h_head): with kept = M, h (M, 2F) and
    h_head None; else h is a gradient slot, an (M, 2F) tensor of one element (node 2's backward
    returns the whole dh for it: an output's gradient has the output's shape), and h_head (kept, 2F)
    the rows held. act is not differentiable (node 2's backward yields h's gradient through it, as
    in `_FusedFc1Fn`), nor is h_head."""

    @staticmethod
    def forward(ctx, x_TH, topk_weights_TK, routing, kept, glu_interleave_size, activation, n_w1, *params):
        w1s, b1s = params[:n_w1], params[n_w1:]
        probs_M = topk_weights_TK.reshape(-1).index_select(0, routing.order.view(-1))
        x_sorted_MH = library.sum_rows(x_TH, routing.token_of_row, True)
        rows = x_sorted_MH.shape[0]
        if kept == rows:
            h, act = fc1_step(x_sorted_MH, routing.offs, probs_M, glu_interleave_size, activation, w1s, b1s)
            h_head = None
            ctx.mark_non_differentiable(act)
        else:
            h_head, act = _fc1_forward_split(
                x_sorted_MH, routing.offs, probs_M, kept, glu_interleave_size, activation, w1s, b1s
            )
            h = torch.empty_strided((rows, h_head.shape[1]), (0, 0), dtype=act.dtype, device=act.device)
            ctx.mark_non_differentiable(act, h_head)
        if not topk_weights_TK.requires_grad:
            ctx.mark_non_differentiable(probs_M)
        ctx.set_materialize_grads(False)
        ctx.n_w1 = n_w1
        ctx.b1_dims = tuple(b.dim() for b in b1s)
        ctx.save_for_backward(x_TH, routing.offs, routing.inverse, routing.token_of_row, *w1s)
        return h, act, probs_M, h_head

    @staticmethod
    def backward(ctx, dh_M2F, _d_act, d_probs_M, _d_h_head):
        x_TH, offs, inverse_TK, token_of_row_M1, *w1s = ctx.saved_tensors
        w1s = tuple(w1s)
        n_w1 = ctx.n_w1
        need = ctx.needs_input_grad  # forward's inputs: x, weights, routing, kept, glu, activation, n_w1, *params
        dx_TH = d_weights_TK = None
        dw1 = db1 = None
        if dh_M2F is not None:
            dx_MH, dw1, db1 = fc1_backward_step(
                dh_M2F,
                lambda: library.sum_rows(x_TH, token_of_row_M1, True),
                offs,
                w1s,
                need[0],
                any(need[7 : 7 + n_w1]),
                any(need[7 + n_w1 :]),
            )
            if dx_MH is not None:
                dx_TH = library.sum_rows(dx_MH, inverse_TK, True)
        if need[1] and d_probs_M is not None:
            # Row inverse[t, k] holds copy (t, k): its weight's gradient, read once (no scatter).
            d_weights_TK = d_probs_M.index_select(0, inverse_TK.view(-1)).view(inverse_TK.shape)
        return (
            dx_TH,
            d_weights_TK,
            None,
            None,
            None,
            None,
            None,
            *_unstack(dw1, w1s, 3),
            *_unstack_bias(db1, ctx.b1_dims),
        )


class _ExpertsFc2Fn(torch.autograd.Function):
    """Node 2 of the fused layer. Inputs: h, act, probs, h_head (node 1's outputs), the `Routing`,
    the GLU block, the activation, fc1 (`_Fc1Operands` where h_head is given, else None), n_w2, then
    n_w2 fc2 weights and the fc2 biases. Returns out (T, H). Saves h, or h_head and what the backward
    computes the other rows' h from."""

    @staticmethod
    def forward(ctx, h_M2F, act_MF, probs_M, h_head, routing, glu_interleave_size, activation, fc1, n_w2, *params):
        w2s, b2s = params[:n_w2], params[n_w2:]
        b2 = _grouped(b2s, 2, "fc2 bias")
        y_sorted_MH = fc2_step(act_MF, routing.offs, probs_M, w2s, b2)
        ctx.glu, ctx.activation, ctx.n_w2 = glu_interleave_size, activation, n_w2
        ctx.b2_dims = tuple(b.dim() for b in b2s)
        if fc1 is None:
            ctx.save_for_backward(h_M2F, routing.offs, probs_M, b2, routing.token_of_row, *w2s)
        else:
            ctx.n_w1 = len(fc1.w1s)
            ctx.save_for_backward(
                h_head, routing.offs, probs_M, b2, routing.token_of_row, *w2s, fc1.x_TH, *fc1.w1s, *fc1.b1s
            )
        ctx.recomputes = fc1 is not None
        return library.sum_rows(y_sorted_MH, routing.inverse, True)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out_TH):
        h_held, offs, probs_M, b2, token_of_row_M1, *rest = ctx.saved_tensors
        n_w2 = ctx.n_w2
        w2s = tuple(rest[:n_w2])
        # forward's inputs: h, act, probs, h_head, routing, glu, activation, fc1, n_w2, *params
        need = ctx.needs_input_grad
        need_w2, need_b2 = any(need[9 : 9 + n_w2]), any(need[9 + n_w2 :])
        dy_sorted_MH = library.sum_rows(d_out_TH, token_of_row_M1, True)
        if ctx.recomputes:
            x_TH, *fc1_params = rest[n_w2:]
            fc1 = _Fc1Operands(x_TH, tuple(fc1_params[: ctx.n_w1]), tuple(fc1_params[ctx.n_w1 :]))
            dh, act_p, dprobs = _glu_backward_recomputing(
                dy_sorted_MH, h_held, offs, probs_M, token_of_row_M1, fc1, w2s, ctx.glu, ctx.activation
            )
            d_probs, dw2, db2 = fc2_params_backward_step(
                dy_sorted_MH, act_p, dprobs, offs, probs_M, b2, need[2], need_w2, need_b2
            )
        else:
            dh, d_probs, dw2, db2 = fc2_backward_step(
                dy_sorted_MH, h_held, offs, probs_M, b2, w2s, ctx.glu, ctx.activation, need[2], need_w2, need_b2
            )
        return (
            dh,
            None,
            d_probs,
            None,
            None,
            None,
            None,
            None,
            None,
            *_unstack(dw2, w2s, 3),
            *_unstack_bias(db2, ctx.b2_dims),
        )


def moe_experts_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1_weight: Weight,
    fc2_weight: Weight,
    *,
    fc1_bias: Weight | None = None,
    fc2_bias: Weight | None = None,
    activation: str = "swiglu",
    glu_interleave_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """float64 reference of `moe_experts`: a loop over experts, each on the copies routed to it,
    weighted and added into the tokens' rows. Returns float64 (T, H), differentiable by autograd."""
    del backend
    check_activation(activation)

    w1, w2 = _per_expert(fc1_weight, 3), _per_expert(fc2_weight, 3)
    b1, b2 = _per_expert(fc1_bias, 2), _per_expert(fc2_bias, 2)
    check_interleave(w1[0].shape[0] // 2, glu_interleave_size)
    x64, w64 = x.double(), topk_weights.double()
    out = x64.new_zeros(x.shape)
    for e in range(len(w1)):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x64[tokens] @ w1[e].t()
        if b1:
            h = h + b1[e]
        a = swiglu_reference(h, glu_interleave_size=glu_interleave_size, activation=activation)
        y = a @ w2[e].t()
        if b2:
            y = y + b2[e]
        out = out.index_add(0, tokens, y * w64[tokens, slots][:, None])
    return out


def _per_expert(t: Weight | None, stacked_dims: int) -> list[torch.Tensor]:
    """float64 per-expert tensors of a stacked (N, ...) tensor or a list; [] for None."""
    tensors = [v.double() for v in _as_list(t)]
    return list(tensors[0].unbind(0)) if len(tensors) == 1 and tensors[0].dim() == stacked_dims else tensors
