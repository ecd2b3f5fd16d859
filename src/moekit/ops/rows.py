"""Rows between token order and expert order: the one row primitive (`move_rows`) and the public
`permute` / `unpermute` over it.

Legend: T tokens, K experts per token (top-k), M = T*K routed rows, N experts, H hidden size, D features
of a moved row, J rows summed into one.

The primitive: out[r] = sum over j of (weight[r, j] *) src[index[r, j]], summed in fixed j order in fp32
with one rounding; the gather is its J = 1 case, the combine of a token's K expert outputs its J = K
case. Each direction's backward is the other one along the transposed map, so no step sums rows with
atomics and results are bit-identical run to run. On CUDA (and wherever the Triton backend runs) it is
one Triton kernel; elsewhere plain torch (`moekit.ops.runtime.backends.gather_sum_rows`). `moe_experts`,
expert parallelism's dispatch and `permute`/`unpermute` all move rows with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moekit.ops import library
from moekit.ops.routing import ExpertOrder, check_expert_ids, check_num_experts, host_readable, sort_by_expert
from moekit.ops.runtime.backends import triton_unavailable_reason
from moekit.ops.splits import compute_dtype
from moekit.validation import check_float_tensor, check_index_tensor, check_same_device, check_tensor


class _MoveRowsFn(torch.autograd.Function):
    """out[r] = sum_j (w_fwd[r, j] *) src[index_fwd[r, j]]; d src[s] = sum_j (w_bwd[s, j] *) d out[index_bwd[s, j]].

    index_bwd (with w_bwd) is index_fwd's transpose: every pair (r, j) of the forward appears once as a pair
    (s, j') of the backward with index_fwd[r, j] = s, index_bwd[s, j'] = r and w_bwd[s, j'] = w_fwd[r, j];
    a pair may be left out only where its gradient is exactly zero (a padding row's). d w_fwd[r, j] =
    <d out[r], src[index_fwd[r, j]]>, in fp32."""

    @staticmethod
    def forward(
        ctx: Any,
        src: torch.Tensor,
        index_fwd: torch.Tensor,
        weight_fwd: torch.Tensor | None,
        index_bwd: torch.Tensor,
        weight_bwd: torch.Tensor | None,
        use_triton: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(src if weight_fwd is not None else None, index_fwd, weight_fwd, index_bwd, weight_bwd)
        ctx.use_triton = use_triton
        return library.gather_sum_rows(src, index_fwd, weight_fwd, use_triton)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None, None, None, None]:
        src, index_fwd, weight_fwd, index_bwd, weight_bwd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the backward itself is differentiable
            d_src = _MoveRowsFn.apply(d_out, index_bwd, weight_bwd, index_fwd, weight_fwd, ctx.use_triton)
        else:  # the usual backward: the kernel alone, without a node's host cost
            d_src = library.gather_sum_rows(d_out, index_bwd, weight_bwd, ctx.use_triton)
        d_weight = None
        if weight_fwd is not None and ctx.needs_input_grad[2]:
            acc_t = compute_dtype(d_out, src)
            rows = src.index_select(0, index_fwd.reshape(-1)).view(*index_fwd.shape, -1)
            d_weight = (rows.to(acc_t) * d_out.to(acc_t)[:, None, :]).sum(-1).to(weight_fwd.dtype)
        return d_src, None, d_weight, None, None, None


@dataclass(frozen=True)
class ExpertRoute:
    """The rows of a layer between token order and expert order (`moekit.ops.moe_experts`): node 1 gathers x's tokens
    into expert order and the router weights into sorted order; node 2 sums each token's K rows back.
    Every move is the row primitive (`library.gather_sum_rows`), each backward the other direction.
    token_of_row (M, 1), row_map (T, K), copy_of_row (M, 1): as `ExpertOrder`'s (copy_of_row, needed by
    the forward only, is not kept for the backward)."""

    token_of_row: torch.Tensor
    row_map: torch.Tensor
    copy_of_row: torch.Tensor | None
    use_triton: bool

    @staticmethod
    def of(order: ExpertOrder, use_triton: bool) -> ExpertRoute:
        return ExpertRoute(order.token_of_row, order.row_map, order.copy_of_row, use_triton)

    def to_rows(self, t_TX: torch.Tensor) -> torch.Tensor:
        """(M, X): the token rows of each sorted row (x in the forward, d out in the backward)."""
        return library.gather_sum_rows(t_TX, self.token_of_row, None, self.use_triton)

    def to_tokens(self, t_MX: torch.Tensor) -> torch.Tensor:
        """(T, X): each token's K sorted rows summed, in k order (y in the forward, dx in the backward)."""
        return library.gather_sum_rows(t_MX, self.row_map, None, self.use_triton)

    def sorted_weights(self, weights_TK: torch.Tensor) -> torch.Tensor:
        """(M,): the router weight of each sorted row."""
        assert self.copy_of_row is not None, "a route rebuilt for the backward has no copy_of_row"
        return weights_TK.reshape(-1).index_select(0, self.copy_of_row.view(-1))

    def weight_grads(self, d_probs_M: torch.Tensor) -> torch.Tensor:
        """(T, K): each copy's weight gradient, read once at its row (a permutation: no scatter)."""
        return d_probs_M.index_select(0, self.row_map.view(-1)).view(self.row_map.shape)

    @staticmethod
    def to_save(route: ExpertRoute | None) -> tuple[bool | None, tuple[torch.Tensor, ...]]:
        """What a node keeps of its route for the backward: (use_triton for its ctx, the tensors for its
        save_for_backward, freed with the graph); (None, ()) without a route."""
        return (None, ()) if route is None else (route.use_triton, (route.token_of_row, route.row_map))

    @staticmethod
    def from_saved(
        saved: Sequence[torch.Tensor], use_triton: bool | None
    ) -> tuple[ExpertRoute | None, list[torch.Tensor]]:
        """The route `to_save` kept at the head of a node's saved tensors (use_triton None: no route), and
        the saved tensors after it."""
        if use_triton is None:
            return None, list(saved)
        return ExpertRoute(saved[0], saved[1], None, use_triton), list(saved[2:])


def move_rows(
    src: torch.Tensor,
    index_fwd: torch.Tensor,
    index_bwd: torch.Tensor,
    use_triton: bool,
    weight_fwd: torch.Tensor | None = None,
    weight_bwd: torch.Tensor | None = None,
) -> torch.Tensor:
    """out (rows of index_fwd, D) = sum over j of (weight_fwd[r, j] *) src[index_fwd[r, j]], differentiable
    (with respect to src and weight_fwd); its backward moves the gradient along index_bwd (and weight_bwd),
    which must be index_fwd's transpose (see `_MoveRowsFn`). use_triton: moekit's row kernel
    (`moekit.ops.runtime.backends.use_triton_rows` says where it runs)."""
    return _MoveRowsFn.apply(src, index_fwd, weight_fwd, index_bwd, weight_bwd, use_triton)


def _triton_rows_here(x: torch.Tensor) -> bool:
    """permute/unpermute take no backend: moekit's row kernel on CUDA where it runs, torch elsewhere."""
    return x.device.type == "cuda" and triton_unavailable_reason(x.device, x.dtype) is None


def permute(
    x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the routed copies of each token by expert (stable: token order within an expert).

    x: (T, H). expert_ids: (T, K) integer expert of each copy, in [0, num_experts).
    Returns x_sorted (T*K, H), m_splits (N,) int64 on x's device, row_map (T, K) int64: the sorted row of
    copy (t, k), which `unpermute` uses to bring the copies back. No host sync (on an accelerator the ids'
    range is not checked: that would read them).
    """
    check_float_tensor("x", x)
    num_experts = check_num_experts(num_experts)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    check_expert_ids(expert_ids, num_experts, "expert_ids")
    if expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"expert_ids must be (tokens, top_k) with tokens={x.shape[0]}, got shape {tuple(expert_ids.shape)}"
        )
    check_same_device("expert_ids", expert_ids, "x", x)
    order: ExpertOrder = sort_by_expert(expert_ids, num_experts)
    x_sorted = move_rows(x, order.token_of_row, order.row_map, _triton_rows_here(x))
    return x_sorted, order.counts(), order.row_map


def unpermute(y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum each token's K expert outputs back, optionally weighted.

    y_sorted: (T*K, H). row_map: (T, K) from `permute`. weights: optional (T, K) floating.
    Returns (T, H) in y_sorted's dtype (sums in fp32, one rounding).

    row_map must be a permutation of the T*K sorted rows, as `permute` returns it: every sorted row is the
    copy of exactly one (token, choice). On the CPU this is checked (integer values, in range, each row
    once). On an accelerator only its dtype, shape and device are checked: the values are not read, since
    that would sync with the host, and a map that is not a permutation there is undefined input.
    """
    check_float_tensor("y_sorted", y_sorted)
    check_index_tensor("row_map", row_map)
    if y_sorted.dim() != 2:
        raise ValueError(f"y_sorted must be 2-D (tokens * top_k, hidden), got shape {tuple(y_sorted.shape)}")
    if row_map.dim() != 2 or row_map.numel() != y_sorted.shape[0]:
        raise ValueError(
            f"row_map must be the (tokens, top_k) map from permute with tokens*top_k = {y_sorted.shape[0]} "
            f"rows; got shape {tuple(row_map.shape)}"
        )
    check_same_device("row_map", row_map, "y_sorted", y_sorted)
    if weights is not None:
        check_float_tensor("weights", weights)
        if weights.shape != row_map.shape:
            raise ValueError(f"weights must have row_map's shape {tuple(row_map.shape)}, got {tuple(weights.shape)}")
        check_same_device("weights", weights, "y_sorted", y_sorted)
    if host_readable(row_map):
        _check_permutation(row_map, y_sorted.shape[0])
    row_map = row_map.to(torch.int64)
    num_tokens, top_k = row_map.shape
    # The transposed map: sorted row -> its copy t*K + k (the inverse permutation) -> its token.
    copy_of_row = torch.empty_like(row_map.reshape(-1)).scatter_(
        0, row_map.reshape(-1), torch.arange(row_map.numel(), device=row_map.device)
    )
    token_of_row = torch.div(copy_of_row, max(top_k, 1), rounding_mode="floor")[:, None]
    weight_bwd = None if weights is None else weights.reshape(-1).index_select(0, copy_of_row)[:, None]
    return move_rows(y_sorted, row_map, token_of_row, _triton_rows_here(y_sorted), weights, weight_bwd)


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


def permute_reference(
    x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 reference of `permute` (a Python loop over experts)."""
    check_tensor("x", x)
    x64 = x.double()
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).tolist()
    rows: list[torch.Tensor] = []
    counts: list[int] = []
    row_map = torch.empty(len(flat), dtype=torch.int64)
    for e in range(num_experts):
        members = [j for j, v in enumerate(flat) if v == e]
        counts.append(len(members))
        for j in members:
            row_map[j] = len(rows)
            rows.append(x64[j // top_k])
    x_sorted = torch.stack(rows) if rows else x64.new_zeros(0, x.shape[1])
    return x_sorted, torch.tensor(counts), row_map.view(expert_ids.shape)


def unpermute_reference(
    y_sorted: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 reference of `unpermute`."""
    y_TKH = y_sorted.double()[row_map.cpu()]
    if weights is not None:
        y_TKH = y_TKH * weights.double()[..., None]
    return y_TKH.sum(1)
