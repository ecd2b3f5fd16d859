"""Token permutation: T tokens with K expert choices each -> T*K rows sorted by expert, and back.

Legend: T tokens, K experts per token (top-k), N experts, H hidden size.

Everything stays on the device: the sort, the per-expert counts and the inverse map
(`moekit.ops.routing`, the routing every path of the package shares). Both directions are gathers
with deterministic backward passes: no floating-point atomics, so gradients are bit-identical run
after run.
"""

from __future__ import annotations

import torch

from moekit._splits import compute_dtype
from moekit.ops.routing import check_expert_ids, host_readable, route


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, token_of_row, row_map_TK):
        ctx.save_for_backward(row_map_TK)
        return x_TH[token_of_row]

    @staticmethod
    def backward(ctx, d_sorted):
        (row_map_TK,) = ctx.saved_tensors
        # Each token's K copies gathered and summed in a fixed order.
        return d_sorted[row_map_TK].sum(1, dtype=compute_dtype(d_sorted)).to(d_sorted.dtype), None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted, row_map_TK, weights_TK):
        y_TKH = y_sorted[row_map_TK]
        ctx.save_for_backward(y_sorted, row_map_TK, weights_TK)
        acc_t = compute_dtype(y_sorted, weights_TK)
        if weights_TK is None:
            return y_TKH.sum(1, dtype=acc_t).to(y_sorted.dtype)
        return torch.einsum("tkh,tk->th", y_TKH.to(acc_t), weights_TK.to(acc_t)).to(y_sorted.dtype)

    @staticmethod
    def backward(ctx, d_out_TH):
        y_sorted, row_map_TK, weights_TK = ctx.saved_tensors
        acc_t = compute_dtype(y_sorted, weights_TK, d_out_TH)
        d_TKH = d_out_TH.to(acc_t)[:, None, :].expand(*row_map_TK.shape, -1)
        if weights_TK is not None:
            d_TKH = d_TKH * weights_TK.to(acc_t)[..., None]
        # row_map is a permutation: every sorted row receives exactly one value.
        d_sorted = torch.empty_like(y_sorted)
        d_sorted[row_map_TK.reshape(-1)] = d_TKH.reshape(-1, y_sorted.shape[1]).to(y_sorted.dtype)
        d_weights = None
        if weights_TK is not None and ctx.needs_input_grad[2]:
            y_TKH = y_sorted[row_map_TK].to(acc_t)
            d_weights = torch.einsum("tkh,th->tk", y_TKH, d_out_TH.to(acc_t)).to(weights_TK.dtype)
        return d_sorted, None, d_weights


def permute(
    x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the routed copies of each token by expert (stable: token order within an expert).

    x: (T, H). expert_ids: (T, K) integer expert of each copy.
    Returns x_sorted (T*K, H), m_splits (N,) int64 on x's device, row_map (T, K) int64: the sorted
    row of copy (t, k), which `unpermute` uses to bring the copies back.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"expert_ids must be (tokens, top_k) with tokens={x.shape[0]}, got shape {tuple(expert_ids.shape)}"
        )
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise TypeError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if expert_ids.device != x.device:
        raise ValueError(f"expert_ids is on {expert_ids.device} but x is on {x.device}")
    check_expert_ids(expert_ids, num_experts, "expert_ids")
    routing = route(expert_ids, num_experts)
    x_sorted = _PermuteFn.apply(x, routing.token_of_row.view(-1), routing.inverse)
    return x_sorted, routing.counts(), routing.inverse


def unpermute(y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum each token's K expert outputs back, optionally weighted.

    y_sorted: (T*K, H). row_map: (T, K) from `permute`. weights: optional (T, K) floating.
    Returns (T, H) in y_sorted's dtype (sum in fp32).

    row_map must be a permutation of the T*K sorted rows, as `permute` returns it: every sorted row
    is the copy of exactly one (token, choice). On the CPU this is checked (integer values, in
    range, each row once). On an accelerator only its dtype, shape and device are checked: the
    values are not read, since that would sync with the host, and a map that is not a permutation
    there is undefined input (out-of-range values fault in the gather; a repeated row leaves the
    gradient of a missing row unwritten).
    """
    if y_sorted.dim() != 2:
        raise ValueError(f"y_sorted must be 2-D (tokens * top_k, hidden), got shape {tuple(y_sorted.shape)}")
    if row_map.dtype.is_floating_point or row_map.dtype.is_complex or row_map.dtype == torch.bool:
        raise TypeError(f"row_map must be an integer tensor (the int64 map permute returns), got {row_map.dtype}")
    if row_map.dim() != 2 or row_map.numel() != y_sorted.shape[0]:
        raise ValueError(
            f"row_map must be the (tokens, top_k) map from permute with tokens*top_k = {y_sorted.shape[0]} "
            f"rows; got shape {tuple(row_map.shape)}"
        )
    if row_map.device != y_sorted.device:
        raise ValueError(f"row_map is on {row_map.device} but y_sorted is on {y_sorted.device}")
    if weights is not None:
        if weights.shape != row_map.shape:
            raise ValueError(f"weights must have row_map's shape {tuple(row_map.shape)}, got {tuple(weights.shape)}")
        if not weights.dtype.is_floating_point:
            raise TypeError(f"weights must be floating point, got {weights.dtype}")
        if weights.device != y_sorted.device:
            raise ValueError(f"weights is on {weights.device} but y_sorted is on {y_sorted.device}")
    if host_readable(row_map):
        _check_permutation(row_map, y_sorted.shape[0])
    return _UnpermuteFn.apply(y_sorted, row_map, weights)


def _check_permutation(row_map: torch.Tensor, rows: int) -> None:
    flat = row_map.reshape(-1)
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= rows:
        raise ValueError(f"row_map values must lie in [0, {rows}), the rows of y_sorted; found values in [{lo}, {hi}]")
    counts = torch.bincount(flat.to(torch.int64), minlength=rows)
    if bool((counts != 1).any()):
        repeated = (counts > 1).nonzero().flatten()[:8].tolist()
        missing = (counts == 0).nonzero().flatten()[:8].tolist()
        raise ValueError(
            "row_map must be a permutation of the sorted rows, as permute returns it; rows "
            f"{repeated} appear more than once and rows {missing} never (first 8 of each shown)"
        )


def permute_reference(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """float64 reference of `permute` (a Python loop over experts)."""
    x64 = x.double()
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).tolist()
    rows, counts = [], []
    row_map = torch.empty(len(flat), dtype=torch.int64)
    for e in range(num_experts):
        members = [j for j, v in enumerate(flat) if v == e]
        counts.append(len(members))
        for j in members:
            row_map[j] = len(rows)
            rows.append(x64[j // top_k])
    x_sorted = torch.stack(rows) if rows else x64.new_zeros(0, x.shape[1])
    return x_sorted, torch.tensor(counts), row_map.view(expert_ids.shape)


def unpermute_reference(y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None = None):
    """float64 reference of `unpermute`."""
    y_TKH = y_sorted.double()[row_map.cpu()]
    if weights is not None:
        y_TKH = y_TKH * weights.double()[..., None]
    return y_TKH.sum(1)
