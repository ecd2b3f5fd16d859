"""Triton kernels of the router's top-k + softmax (jit code only; host code in `moekit.ops.runtime.topk`).

Legend: T tokens, N experts (a row's logits), K experts chosen per token.

    topk_softmax_kernel           the K largest logits of each row (descending, lowest expert first
                                  among equal values) and the softmax over them in fp32
    topk_softmax_backward_kernel  d logits (T, N): zeros, and at the chosen experts
                                  w * (dw - sum_k(dw * w))

The order is exact and total. Each logit becomes an int32 key whose signed order is the values' order
(`_order_key`): NaN takes the largest key (above +inf, as torch.sort and torch.topk order NaN), -0.0 the
key of +0.0 (equal values), the padding columns past N the smallest of all (below -inf), so a row's real
columns always come first. Round j takes the row's largest key (one max reduction), then the lowest
column holding it (one min reduction), and retires that column: two 32-bit reductions a round, cheaper
than one int64 max over (key, column) packed together (notes/moe_experts.md has the comparison).
Logits of a 16-bit dtype leave the low bits of their fp32 keys constant (FREE_BITS: 16 for bf16, 13 for
fp16), so there the column rides in those bits, inverted, and one 32-bit max a round gives the largest
value and, among equal ones, the lowest column: the same choices from one reduction instead of two.
"""

import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    """int32 keys of fp32 values whose signed order is the values' order: x's bits for x >= 0, the bits
    with the 31 value bits flipped for x < 0 (a larger magnitude is a smaller key); -0.0 as +0.0, every
    NaN (either sign, any payload) as 2^31 - 1, above +inf's key."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(bits == -2147483648, 0, key)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFFFFFF, key)


@triton.jit
def _value_of_key(key):
    """The fp32 value of an `_order_key` key (a NaN for the NaN key)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    top_k,
    stride_logits,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FREE_BITS: tl.constexpr = 0,
):
    """weights (T, K) fp32 and ids (T, K) of logits (T, N), unit column stride; weights and ids
    contiguous. One program owns BLOCK_T rows, each read once into registers (BLOCK_N >= N columns).
    Round j takes the row's largest remaining key, the lowest column holding it, and retires that
    column; the K values so chosen, in descending order, go through a softmax in fp32 (minus the first,
    the largest). k rounds over the whole row: the work is T * N * K compares, and no program waits on
    memory after its one load. A row with a NaN chooses its NaNs first, so its weights are NaN;
    its ids are still K distinct columns in [0, N). FREE_BITS > 0 (at most 16, 2^FREE_BITS >= BLOCK_N):
    the low FREE_BITS bits of every key are the same within each sign (the logits' dtype has no more
    precision), and they carry the column instead (module docstring)."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t = offs_t < num_tokens
    mask_n = offs_n < num_experts
    # int64 row offsets: T x N passes 2^31 elements at real sizes.
    offs_t64 = offs_t.to(tl.int64)
    x = tl.load(
        logits_ptr + offs_t64[:, None] * stride_logits + offs_n[None, :],
        mask=mask_t[:, None] & mask_n[None, :],
        other=0.0,
    ).to(tl.float32)
    retired = -2147483648  # the key of padding and of chosen columns: below every logit's key

    # With FREE_BITS, (the key's high bits | LOW - column): distinct within a row, ordered by value, then
    # by the lowest column.
    LOW: tl.constexpr = (1 << FREE_BITS) - 1
    key = _order_key(x)
    if FREE_BITS > 0:
        key = (key & ~LOW) | (LOW - offs_n[None, :])
    key = tl.where(mask_n[None, :], key, retired)

    vals = tl.full((BLOCK_T, BLOCK_K), float("-inf"), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in range(0, top_k):
        best = tl.max(key, axis=1)
        if FREE_BITS > 0:
            key = tl.where(key == best[:, None], retired, key)
            col = LOW - (best & LOW)
            # The key's low bits as the dtype leaves them: all ones below zero (flipped), zeros above.
            high = best & ~LOW
            best = tl.where(high < 0, high | LOW, high)
        else:
            col = tl.min(tl.where(key == best[:, None], offs_n[None, :], BLOCK_N), axis=1)
            key = tl.where(offs_n[None, :] == col[:, None], retired, key)
        vals = tl.where(offs_k[None, :] == j, _value_of_key(best)[:, None], vals)
        ids = tl.where(offs_k[None, :] == j, col[:, None], ids)

    # The first value is the row's largest (NaN where the row has one): the softmax's shift.
    top = tl.sum(tl.where(offs_k[None, :] == 0, vals, 0.0), axis=1)
    mask_k = offs_k < top_k
    e = tl.where(mask_k[None, :], tl.exp(vals - top[:, None]), 0.0)
    w = e / tl.sum(e, axis=1)[:, None]
    out_offs = offs_t64[:, None] * top_k + offs_k[None, :]
    mask_tk = mask_t[:, None] & mask_k[None, :]
    tl.store(weights_ptr + out_offs, w, mask=mask_tk)
    tl.store(ids_ptr + out_offs, ids.to(ids_ptr.dtype.element_ty), mask=mask_tk)


@triton.jit
def topk_softmax_backward_kernel(
    weights_ptr,
    ids_ptr,
    d_weights_ptr,
    d_logits_ptr,
    num_tokens,
    num_experts,
    top_k,
    stride_dw_t,
    stride_dw_k,
    stride_d_logits,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """d logits (T, N) in its dtype: w_j * (dw_j - sum_k(dw_k * w_k)) at column ids[t, j], in fp32 with one
    rounding, and zeros elsewhere. weights and ids (T, K) contiguous, as `topk_softmax_kernel` wrote them
    (the ids distinct within a row, in [0, N)); d weights (T, K) with any strides (autograd may hand an
    expanded one). The program stores its rows' zeros, then, after a barrier of its threads (which
    orders their stores), the K values at the chosen columns: the bytes of one pass over d logits, not
    T * N * K selects to build the rows in registers; every element's last writer is this program, so
    nothing races and no atomics."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_t = offs_t < num_tokens
    offs_t64 = offs_t.to(tl.int64)
    mask_tk = mask_t[:, None] & (offs_k < top_k)[None, :]
    offs_tk = offs_t64[:, None] * top_k + offs_k[None, :]
    w = tl.load(weights_ptr + offs_tk, mask=mask_tk, other=0.0)
    dw = tl.load(
        d_weights_ptr + offs_t64[:, None] * stride_dw_t + offs_k[None, :] * stride_dw_k, mask=mask_tk, other=0.0
    ).to(tl.float32)
    ids = tl.load(ids_ptr + offs_tk, mask=mask_tk, other=0)
    g = w * (dw - tl.sum(w * dw, axis=1)[:, None])

    row_ptrs = d_logits_ptr + offs_t64[:, None] * stride_d_logits
    zeros = tl.zeros((BLOCK_T, BLOCK_N), dtype=d_logits_ptr.dtype.element_ty)
    tl.store(row_ptrs + offs_n[None, :], zeros, mask=mask_t[:, None] & (offs_n < num_experts)[None, :])
    tl.debug_barrier()
    tl.store(row_ptrs + ids, g.to(d_logits_ptr.dtype.element_ty), mask=mask_tk)
