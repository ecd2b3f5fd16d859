"""The routed experts of an MoE layer in one call: sort by expert, gather, grouped MLP, weighted combine.

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts, H hidden size, F expert
ffn size.

    out[t] = sum_k w[t, k] * (fc2_e(act(fc1_e(x[t]))) + b2_e),   e = topk_ids[t, k]

computed as `unpermute(grouped_mlp(x_sorted, ..., probs=w in sorted order), row_map)`:

1. The copies sorted by expert on the device, no host sync (`moekit.ops.routing.sort_by_expert`).
2. Gather `x_sorted = x[token of each sorted row]`, and the weights in sorted order as the grouped MLP's
   `probs` (they scale the activation and the fc2 bias, and get their gradient there).
3. The grouped MLP on the sorted rows.
4. Combine: `out[t] = sum_k y_sorted[row_map[t, k]]` (the weights are already in y_sorted).

Where the backend has the fused MLP kernels (eager), the layer is the grouped MLP's two fused nodes with
an `ExpertRoute` (`moekit.ops.rows`): the gather happens inside node 1 and the combine inside
node 2, two autograd nodes in all, and x is saved as the (T, H) token rows (gathered again in the
backward), not as the K times larger (M, H) sorted copy. With `quantization` the quantized MLP's two nodes
take an `ExpertRoute` the same way (eager): node 1 quantizes the token rows and gathers the FP8 bytes, so
x is never gathered in its own dtype in the forward. Elsewhere (other backends, torch.compile) the
steps above compose row movements (`moekit.ops.rows.move_rows`) around `grouped_mlp`, whose saved sorted
input passes through saved-tensor hooks that replace it by a reference to x (gathered again in the
backward): no (M, H) tensor is held between forward and backward either way.

The layer's memory contract: between forward and backward it holds at most HELD_FRACTION_OF_PLAIN of what
the plain PyTorch layer holds, (4F + 3H) values per routed row. Where fc1's pre-activation h alone is over
that (F above about 3H, as Mixtral 8x7B's experts), the fused path holds h of the first `kept` sorted rows
only (`held_h_rows`: the most that fit, less a spare) and computes the other rows' h again in the backward
with the same kernel: the same bits, at (1 - kept/M) * 2/9 of the layer's forward+backward FLOPs. Under
no_grad nothing is held and h is never split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from moekit.ops import library
from moekit.ops.activations import activation_named
from moekit.ops.glu import check_interleave, glu_reference
from moekit.ops.grouped_linear import Weight, probe_weight, row_major, tensor_list
from moekit.ops.grouped_mlp import FusedSpec, check_mlp_params, fused_mlp, grouped_mlp, quantized_mlp_of_backends
from moekit.ops.quantize import QuantizedWeightCache, check_quantization
from moekit.ops.routing import check_expert_ids, sort_by_expert
from moekit.ops.rows import ExpertRoute, move_rows
from moekit.ops.runtime.backends import fused_mlp_of, select_backend, use_triton_rows
from moekit.ops.splits import GroupOffsets, resolve_splits
from moekit.validation import check_bool, check_float_tensor, check_same_device

# The layer's memory contract: what it holds between forward and backward is at most this fraction of
# what the plain PyTorch layer holds, (4F + 3H) values of x's dtype per routed row. h alone is 2F values
# a row, over the bar once F is above about 3H.
HELD_FRACTION_OF_PLAIN = 0.4

# Bytes of the bar the layer leaves unused where it holds part of h: the CUDA caching allocator may give a
# large tensor (the held rows of h) a cached block up to 1 MiB over its size (it splits a block only where
# more than 1 MiB would be left), and the layer holds a few tensors per layer rather than per row (offs
# (N+1,), the gradient slot of node 1, each rounded up to 512 bytes; a stacked fc2 bias (N, H) where the
# biases come per expert).
HELD_SPARE_BYTES = 2 * 2**20


def held_h_rows(rows: int, hidden: int, ffn: int, itemsize: int, meta_bytes_per_row: int) -> int:
    """How many of the layer's `rows` sorted rows keep their h (2F values of `itemsize` bytes) between
    forward and backward, with `meta_bytes_per_row` saved per row besides, under HELD_FRACTION_OF_PLAIN
    of the plain layer's (4F + 3H) values per row: all of them where they fit, else the most that fit in
    the bar less HELD_SPARE_BYTES (at least 0). From shapes alone: no host sync."""
    h_row_bytes = 2 * ffn * itemsize
    room = HELD_FRACTION_OF_PLAIN * rows * (4 * ffn + 3 * hidden) * itemsize - rows * meta_bytes_per_row
    if h_row_bytes == 0 or rows * h_row_bytes <= room:  # no h, or all of it fits
        return rows
    return max(0, math.floor((room - HELD_SPARE_BYTES) / h_row_bytes))


def storage_identity(t: torch.Tensor) -> tuple:
    """What identifies a tensor's memory and view without holding a reference to it."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


class _RegatherRows:
    """Packed form of the gathered rows: rebuilt from the token rows and the row -> token map. Checks, as
    autograd does for the tensors it saves, that x was not modified in place between the forward and the
    backward."""

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
            return library.gather_sum_rows(self.x_TH.detach(), self.token_of_row_M1, None, self.use_triton)


def _regathering_hooks(
    x_TH: torch.Tensor, x_sorted_MH: torch.Tensor, token_of_row_M1: torch.Tensor, use_triton: bool
) -> tuple[
    Callable[[torch.Tensor], _RegatherRows | torch.Tensor], Callable[[_RegatherRows | torch.Tensor], torch.Tensor]
]:
    """(pack, unpack) for saved_tensors_hooks. The hooks live as long as the autograd graph, so they refer
    to x_sorted only by its identity (a reference would keep it alive)."""
    identity = storage_identity(x_sorted_MH)
    regather = _RegatherRows(x_TH, token_of_row_M1, use_triton)

    def pack(t: torch.Tensor) -> _RegatherRows | torch.Tensor:
        # The shape first: most saved tensors (weights, offsets, h) differ there, and the full identity
        # (storage address) costs a few microseconds of host time per saved tensor.
        return regather if t.shape == identity[4] and storage_identity(t) == identity else t

    def unpack(packed: _RegatherRows | torch.Tensor) -> torch.Tensor:
        return packed.unpack() if isinstance(packed, _RegatherRows) else packed

    return pack, unpack


def _check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    check_float_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    check_expert_ids(topk_ids, num_experts, "topk_ids")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids must be (tokens, top_k) with tokens = {x.shape[0]} (x's rows), got shape {tuple(topk_ids.shape)}"
        )
    check_float_tensor("topk_weights", topk_weights)
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}"
        )
    check_same_device("topk_ids", topk_ids, "x", x)
    check_same_device("topk_weights", topk_weights, "x", x)
    top_k = topk_ids.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k (topk_ids.shape[1]) must be in [1, num_experts={num_experts}], got {top_k}")


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
    quantization: str | None = None,
    quantized_wgrad: bool = True,
    weight_caches: tuple[QuantizedWeightCache, QuantizedWeightCache] | None = None,
) -> torch.Tensor:
    """The routed experts of an MoE layer: each token's K expert outputs, weighted and summed.

    x: (T, H) tokens. topk_ids: (T, K) integer experts of each token. topk_weights: (T, K) float weight of
    each (scales the activation and the fc2 bias, as grouped_mlp's probs). fc1_weight: (N, 2F, H) or N x
    (2F, H); fc2_weight: (N, H, F) or N x (H, F); biases (N, out), N x (out,) or None. `backend` is the
    grouped GEMMs' ("auto", "loop", "torch", "triton"). Returns (T, H) in x's dtype. Differentiable with
    respect to x, topk_weights, weights and biases; no host sync on the way (forward and backward), so
    CUDA-graph capturable.

    quantization: None, "fp8_block", "fp8_rowwise" or "mxfp8": the experts' linears on quantized operands,
    as `grouped_mlp` computes them (`grouped_linear`'s FP8 kernels where the backend has them, else its
    reference path; the layer runs composed, never its fused kernels). quantized_wgrad: as `grouped_mlp`'s
    (False: the weight gradients from the unquantized operands in x's dtype). weight_caches: (fc1's, fc2's)
    `QuantizedWeightCache`, as modules pass them (weights quantized once per optimizer step).

    Memory held for the backward: at most HELD_FRACTION_OF_PLAIN of the plain PyTorch layer's (module
    docstring). On the composed path the grouped MLP runs under saved-tensor hooks that drop its sorted
    copy of x: activation checkpointing around the call works, but an outer `save_on_cpu` does not reach
    the tensors saved inside the MLP. Under torch.compile these hooks are not installed (a traced graph
    does not run them): what the compiled graph keeps is AOTAutograd's choice; the range check of topk_ids
    (a read of the ids on the CPU) runs in eager only.
    """
    w1s, w2s = tensor_list("fc1_weight", fc1_weight), tensor_list("fc2_weight", fc2_weight)
    b1s, b2s = tensor_list("fc1_bias", fc1_bias), tensor_list("fc2_bias", fc2_bias)
    if not w1s:
        raise ValueError("fc1_weight must be a (N, 2F, H) tensor or a non-empty list of N (2F, H) tensors")
    num_experts = w1s[0].shape[0] if len(w1s) == 1 and w1s[0].dim() == 3 else len(w1s)
    _check_routing(x, topk_ids, topk_weights, num_experts)
    _, ffn = check_mlp_params(x, w1s, w2s, b1s, b2s)
    activation_named(activation)
    check_interleave(ffn, glu_interleave_size)
    fc1_impl = select_backend(backend, x, probe_weight(w1s))
    fc2_impl = select_backend(backend, x.new_empty(0, ffn), probe_weight(w2s))
    quantization = check_quantization(quantization)
    quantized_wgrad = check_bool("quantized_wgrad", quantized_wgrad)
    use_triton = use_triton_rows(fc1_impl, x)
    compiling = torch.compiler.is_compiling()
    # The Triton counting sort wherever the row kernel runs (three launches instead of about nine); a
    # traced graph takes the torch ops, which torch.compile knows. The maps in int32 where the rows fit
    # (every consumer here reads them so): the layer holds two of them for the backward.
    index_dtype = torch.int32 if topk_ids.numel() < 2**31 else torch.int64
    order = sort_by_expert(topk_ids, num_experts, use_triton=use_triton and not compiling, index_dtype=index_dtype)
    fused = fc1_impl is fc2_impl and fused_mlp_of(fc1_impl) is not None
    if fused and not compiling and quantization is None:
        rows = order.token_of_row.shape[0]
        kept = rows
        if torch.is_grad_enabled():  # else nothing is held: h whole, one launch
            # Saved per routed row besides h: row_map (T, K) and token_of_row (M, 1), the probs (M,) in
            # topk_weights' dtype.
            meta_bytes_per_row = 2 * order.row_map.element_size() + topk_weights.element_size()
            kept = held_h_rows(rows, x.shape[1], ffn, x.element_size(), meta_bytes_per_row)
        spec = FusedSpec(fc1_impl.name, glu_interleave_size, activation, len(w1s), len(w2s))
        route = ExpertRoute.of(order, use_triton)
        return fused_mlp(spec, order.offs, route, kept, row_major(x), topk_weights, w1s, b1s, w2s, b2s)
    # The weights in sorted order: a permutation, so this gather's backward (index_add_) writes each
    # weight's gradient exactly once: exact and deterministic.
    probs_M = topk_weights.reshape(-1).index_select(0, order.copy_of_row.view(-1))
    mlp_kwargs: dict[str, Any] = dict(
        probs=probs_M,
        fc1_bias=fc1_bias,
        fc2_bias=fc2_bias,
        activation=activation,
        glu_interleave_size=glu_interleave_size,
        backend=backend,
        quantization=quantization,
        quantized_wgrad=quantized_wgrad,
        weight_caches=weight_caches,
    )
    if compiling:
        # The traced graph decides itself what to keep (AOTAutograd's partitioner may recompute the
        # gather in the backward); saved-tensor hooks are not traced.
        x_sorted_MH = move_rows(x, order.token_of_row, order.row_map, use_triton)
        y_sorted_MH = grouped_mlp(x_sorted_MH, fc1_weight, fc2_weight, order.counts(), **mlp_kwargs)
        return move_rows(y_sorted_MH, order.row_map, order.token_of_row, use_triton)
    rows = order.token_of_row.shape[0]
    # On an accelerator the offsets on the device; on the CPU from the counts, read on the host for free
    # (then the torch backend knows there are no padding rows to zero).
    offs = (
        resolve_splits(order.counts(), num_experts, rows, x.device)
        if order.offs.device.type == "cpu"
        else GroupOffsets(offs=order.offs, host=None, rows=rows)
    )
    if quantization is not None:
        # The quantized nodes move the rows themselves (an ExpertRoute): fc1's operand is quantized from the
        # token rows and its FP8 bytes gathered, so no (M, H) tensor of x's dtype is written in the forward.
        route = ExpertRoute.of(order, use_triton)
        caches = weight_caches if weight_caches is not None else (None, None)
        return quantized_mlp_of_backends(x, probs_M, offs, route, quantization, backend, fc1_impl, fc2_impl,
                                         (w1s, b1s, w2s, b2s), glu_interleave_size, activation,
                                         caches, quantized_wgrad)  # fmt: skip
    x_sorted_MH = move_rows(x, order.token_of_row, order.row_map, use_triton)
    pack, unpack = _regathering_hooks(x, x_sorted_MH, order.token_of_row, use_triton)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y_sorted_MH = grouped_mlp(x_sorted_MH, fc1_weight, fc2_weight, offs, **mlp_kwargs)
    del x_sorted_MH
    return move_rows(y_sorted_MH, order.row_map, order.token_of_row, use_triton)


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
    quantization: str | None = None,
    quantized_wgrad: bool = True,
    weight_caches: tuple[QuantizedWeightCache, QuantizedWeightCache] | None = None,
) -> torch.Tensor:
    """float64 reference of `moe_experts` (unquantized: the exact values quantized compute approximates): a
    loop over experts, each on the copies routed to it, weighted and added into the tokens' rows. Returns
    float64 (T, H), differentiable by autograd."""
    del backend, quantization, quantized_wgrad, weight_caches
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
        a = glu_reference(h, activation=activation, glu_interleave_size=glu_interleave_size)
        y = a @ w2[e].t()
        if b2:
            y = y + b2[e]
        out = out.index_add(0, tokens, y * w64[tokens, slots][:, None])
    return out


def _per_expert(t: Weight | None, stacked_dims: int) -> list[torch.Tensor]:
    """float64 per-expert tensors of a stacked (N, ...) tensor or a list; [] for None."""
    tensors = [v.double() for v in tensor_list("weight", t)]
    return list(tensors[0].unbind(0)) if len(tensors) == 1 and tensors[0].dim() == stacked_dims else tensors
