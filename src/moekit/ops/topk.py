"""The router's top-k + softmax (`topk_softmax`): each token's K largest logits, their experts, and the
softmax over those K logits, in one kernel each way.

Legend: T tokens, N experts, K experts chosen per token.

Why a kernel of its own: a softmax router written in torch (`logits.topk(K)` and a softmax over the K
values, or a softmax over N, topk and a renormalisation) is several launches (torch's radix select,
a sort of the chosen values, the softmax, the division), each reading or writing the (T, N) or (T, K)
tensors again, and its backward is as many more. Here a program holds its rows' N logits in registers
(read once), takes the K largest one after another, computes the K weights and writes (T, K) weights and
ids: one launch. The backward writes d logits (T, N) in one pass from the saved weights and ids.

The contract, the same on every path:

- ids: each row's K largest logits in descending order of value; among equal values the lower expert
  index comes first (torch.topk leaves the order of ties unspecified: this one is stated, and the
  kernel and the torch path both keep it). -0.0 equals +0.0. NaN counts as larger than every number
  (as torch.sort and torch.topk order it), so a row's NaNs are chosen first.
- weights: softmax over the K chosen logits, in fp32 (float64 for float64 logits) = the softmax over all
  N experts, its top K, renormalised to sum to 1. Where a chosen logit is NaN or +inf (or all K are
  -inf) the row's weights are NaN, as torch's softmax gives; its ids are still K distinct experts in
  [0, N).
- gradient: d logits (T, N) in logits' dtype, zero except at a row's chosen experts, where it is
  w * (dw - sum_k(dw * w)); the ids get none.
"""

from __future__ import annotations

from typing import Any

import torch

from moekit.ops import library
from moekit.ops.runtime.backends import topk_uses_triton
from moekit.validation import check_choice, check_float_tensor, check_int

IDS_DTYPES = (torch.int64, torch.int32)


class _TopKSoftmaxFn(torch.autograd.Function):
    """moekit's kernels both ways: the forward saves its weights and ids (T x K each), the backward
    writes d logits from them."""

    @staticmethod
    def forward(
        ctx: Any, logits_TN: torch.Tensor, top_k: int, ids_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights_TK, ids_TK = library.topk_softmax(logits_TN, top_k, ids_dtype)
        ctx.save_for_backward(weights_TK, ids_TK)
        ctx.num_experts, ctx.dtype = logits_TN.shape[1], logits_TN.dtype
        ctx.mark_non_differentiable(ids_TK)
        return weights_TK, ids_TK

    @staticmethod
    def backward(ctx: Any, d_weights_TK: torch.Tensor, d_ids: None) -> tuple[torch.Tensor, None, None]:
        weights_TK, ids_TK = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the backward itself differentiable, in torch ops
            g_TK = weights_TK * (d_weights_TK - (d_weights_TK * weights_TK).sum(-1, keepdim=True))
            d_logits = g_TK.new_zeros(weights_TK.shape[0], ctx.num_experts).scatter(1, ids_TK.long(), g_TK)
            return d_logits.to(ctx.dtype), None, None
        return library.topk_softmax_backward(weights_TK, ids_TK, d_weights_TK, ctx.num_experts, ctx.dtype), None, None


def _check_logits(logits: torch.Tensor, k: int) -> int:
    """k after checking logits (2-D floating, at least one column) and 1 <= k <= N."""
    check_float_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (tokens, experts), got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if num_experts == 0:
        raise ValueError("logits must have at least one column (expert), got shape (tokens, 0)")
    k = check_int("k", k)
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be an int in [1, {num_experts}] (logits' experts), got {k}")
    return k


def topk_softmax(
    logits: torch.Tensor, k: int, *, ids_dtype: torch.dtype = torch.int64, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's top-k + softmax: (weights (T, K), ids (T, K)) of logits (T, N), K = k.

    ids (in `ids_dtype`, int64 or int32): each row's k largest logits in descending order, the lower
    expert first among equal values, NaN above every number. weights: the softmax over those k logits
    in fp32 (= softmax over all N, top-k, renormalised), float32 for bf16/fp16/fp32 logits, float64
    for float64 ones; NaN in a row whose chosen logits hold a NaN or +inf. Differentiable with respect
    to logits: d logits (T, N) in logits' dtype, zero except at the chosen experts, where it is
    w * (dw - sum_k(dw * w)). The module docstring states the contract and why it is one kernel.

    backend: "auto" runs moekit's kernel on CUDA where it runs (fp32, bf16, fp16 logits, at most
    `moekit.ops.runtime.configs.TOPK_MAX_EXPERTS` = 1024 experts) and torch ops elsewhere (float64
    logits, the CPU, wider rows); "triton" the kernel wherever it runs (the CPU under
    TRITON_INTERPRET=1), ValueError where it cannot (N over 1024 among the reasons); "torch" / "loop"
    torch ops (a stable sort, a gather and a softmax). The paths give the same ids and the same weights
    up to fp32 rounding. No host sync on any path; the kernel path can be captured in a CUDA graph.
    T = 0 gives (0, k) outputs. Errors (one line each): logits not a 2-D floating tensor with at least
    one column, k not an int in [1, N], ids_dtype not int64/int32, an unknown backend.
    """
    k = _check_logits(logits, k)
    ids_dtype = check_choice("ids_dtype", ids_dtype, IDS_DTYPES)
    if topk_uses_triton(backend, logits):
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        return _TopKSoftmaxFn.apply(logits, k, ids_dtype)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    top = logits.gather(1, ids).to(torch.promote_types(logits.dtype, torch.float32))
    return top.softmax(-1), ids.to(ids_dtype)


def topk_softmax_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of `topk_softmax` (autograd through plain torch ops): (weights (T, k) float64,
    ids (T, k) int64). The order is a stable descending sort's of the float64 logits (exact copies of
    the inputs, so the order of the inputs themselves): equal values keep their column order, NaN
    first."""
    x = logits.double()
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    return x.gather(1, ids).softmax(-1), ids
