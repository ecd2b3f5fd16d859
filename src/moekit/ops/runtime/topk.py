"""Host side of the router's top-k + softmax (`moekit.ops.kernels.topk`), planned and launched by the recipe
of `moekit.ops.runtime.launch`: one launch for the forward, one for the backward, no host read.

Legend: T tokens, N experts, K experts chosen per token.
"""

from __future__ import annotations

import torch
import triton

from moekit.ops.kernels.topk import topk_softmax_backward_kernel, topk_softmax_kernel
from moekit.ops.runtime.configs import TOPK_PACKED_KEYS, topk_tiles
from moekit.ops.runtime.launch import (
    Launcher,
    LaunchPlan,
    arch_of,
    device_ctx,
    empty,
    next_power_of_2,
    plan_launch,
    tensor_key,
)

_FORWARD = Launcher(topk_softmax_kernel)
_BACKWARD = Launcher(topk_softmax_backward_kernel)

# The low bits of a logit's fp32 key that its dtype leaves constant (bf16 keeps 8 of fp32's 24 significand
# bits, fp16 11, its subnormals fewer): the forward kernel's FREE_BITS, which carry the column there.
_FREE_KEY_BITS: dict[torch.dtype, int] = {torch.bfloat16: 16, torch.float16: 13}


def _blocks(
    device: torch.device, num_tokens: int, num_experts: int, top_k: int, backward: bool
) -> tuple[tuple[int], dict]:
    """(grid, constexprs) of either kernel: BLOCK_T rows a program, a row padded to BLOCK_N columns, the
    chosen experts to BLOCK_K (`configs.topk_tiles`)."""
    block_n = next_power_of_2(num_experts)
    fwd_rows, fwd_warps, bwd_rows, bwd_warps = topk_tiles(arch_of(device), block_n)
    block_t, warps = (bwd_rows, bwd_warps) if backward else (fwd_rows, fwd_warps)
    constexprs = dict(BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=next_power_of_2(top_k), num_warps=warps)
    return (triton.cdiv(num_tokens, block_t),), constexprs


def _plan_forward(logits_TN: torch.Tensor, top_k: int) -> LaunchPlan:
    num_tokens, num_experts = logits_TN.shape
    grid, constexprs = _blocks(logits_TN.device, num_tokens, num_experts, top_k, backward=False)
    free_bits = _FREE_KEY_BITS.get(logits_TN.dtype, 0) if TOPK_PACKED_KEYS["ON"] else 0
    assert constexprs["BLOCK_N"] <= 1 << free_bits or free_bits == 0  # TOPK_MAX_EXPERTS is 1024
    constexprs["FREE_BITS"] = free_bits
    return LaunchPlan(_FORWARD, grid, (num_tokens, num_experts, top_k, logits_TN.stride(0)), constexprs)


def topk_softmax(logits_TN: torch.Tensor, top_k: int, ids_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, K) fp32, ids (T, K) in ids_dtype): the K largest logits of each row in descending order
    (lowest expert first among equal values; NaN above every number) and the softmax over them in fp32.
    logits (T, N) fp32/bf16/fp16 with unit column stride, N <= `configs.TOPK_MAX_EXPERTS`, 1 <= K <= N
    (checked by the caller)."""
    num_tokens = logits_TN.shape[0]
    weights = empty((num_tokens, top_k), logits_TN.device, torch.float32)
    ids = empty((num_tokens, top_k), logits_TN.device, ids_dtype)
    if num_tokens == 0:
        return weights, ids
    key = (tensor_key(logits_TN), top_k, ids_dtype)
    plan = plan_launch("topk_softmax", key, lambda: _plan_forward(logits_TN, top_k))
    with device_ctx(logits_TN.device):
        plan(logits_TN, weights, ids)
    return weights, ids


def _plan_backward(d_weights_TK: torch.Tensor, num_experts: int) -> LaunchPlan:
    num_tokens, top_k = d_weights_TK.shape
    grid, constexprs = _blocks(d_weights_TK.device, num_tokens, num_experts, top_k, backward=True)
    ints = (num_tokens, num_experts, top_k, *d_weights_TK.stride(), num_experts)
    return LaunchPlan(_BACKWARD, grid, ints, constexprs)


def topk_softmax_backward(
    weights_TK: torch.Tensor, ids_TK: torch.Tensor, d_weights_TK: torch.Tensor, num_experts: int, dtype: torch.dtype
) -> torch.Tensor:
    """d logits (T, N) in `dtype`: zeros except at each row's chosen experts, where it is
    w * (dw - sum_k(dw * w)) in fp32, rounded once. weights and ids as `topk_softmax` returned them
    (contiguous), d weights (T, K) floating with any strides."""
    num_tokens = weights_TK.shape[0]
    d_logits = empty((num_tokens, num_experts), weights_TK.device, dtype)
    if num_tokens == 0:
        return d_logits
    key = (tensor_key(weights_TK), tensor_key(ids_TK), tensor_key(d_weights_TK), num_experts, dtype)
    plan = plan_launch("topk_softmax_backward", key, lambda: _plan_backward(d_weights_TK, num_experts))
    with device_ctx(weights_TK.device):
        plan(weights_TK, ids_TK, d_weights_TK, d_logits)
    return d_logits
