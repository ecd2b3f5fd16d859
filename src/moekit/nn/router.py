"""TopKRouter: the token-choice router of an MoE layer, and its load-balancing loss.

Legend: T tokens, K experts per token (top-k), N experts, H hidden size.

The router is one part of `MoELayer` (router + experts) and, the same module, of
`moekit.distributed.ExpertParallelMoE` (router + local experts + dispatch). The load-balancing loss
is split into its statistics (sums over tokens, which expert parallelism all-reduces over its ranks)
and the loss computed from them, so both layers share one formula.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from moekit.ops.topk import topk_softmax
from moekit.validation import check_bool, check_choice, check_compute_dtype, check_float, check_int, check_positive_int

SCORE_FUNCS = ("softmax", "sigmoid")


class TopKRouting(NamedTuple):
    """What the router decides for T tokens: weights (T, K) the top-k weights in fp32 (or wider),
    ids (T, K) int64 their experts, scores (T, N) every expert's score, fp32 (or wider)."""

    weights: torch.Tensor
    ids: torch.Tensor
    scores: torch.Tensor


class LoadBalancingStats(NamedTuple):
    """The sums over tokens the Switch-Transformer loss needs; sums of several token sets (ranks)
    add up entry by entry. copies (N,) float64: routed copies per expert (integer-valued, no
    gradient); score_sum (N,): scores summed over the tokens, in the scores' dtype, differentiable;
    tokens () float64: the token count."""

    copies: torch.Tensor
    score_sum: torch.Tensor
    tokens: torch.Tensor


class _AuxLossInjector(torch.autograd.Function):
    """Identity on `output`; its backward also starts `aux_loss`'s backward with gradient 1."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        # A tensor of its own sharing output's storage and version counter, not a view of it:
        # FSDP2 warns about modules that return views (in-place ops on them lose its hooks).
        return output.detach()

    @staticmethod
    def backward(ctx: Any, d_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return d_output, torch.ones_like(aux_loss)


def inject_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`output`'s values (not a view of it), whose backward also backpropagates `aux_loss` (a scalar)
    with gradient 1: the loss trains what it depends on (the router) without the caller adding it
    to their own loss (Megatron-Core's approach). The injection runs whenever the backward reaches
    `output`, 0 rows included."""
    return _AuxLossInjector.apply(output, aux_loss)


class TopKRouter(nn.Module):
    """Token-choice top-k router: a bias-free linear gate `weight (N, H)`, softmax or sigmoid scores
    computed in fp32 (float64 for float64 parameters), the top-k of them per token, optionally
    renormalised to sum to 1. Softmax scores renormalised (the default) take their weights and ids from
    `moekit.topk_softmax` on the fp32 logits (one kernel each way on CUDA), whose ties go to the lower
    expert; the other settings use torch.topk on the scores.

    forward(x (T, H)) -> TopKRouting(weights (T, K), ids (T, K), scores (T, N)).

    With `aux_loss_coef > 0` the owning layer adds the Switch-Transformer load-balancing loss
    `coef * N * sum_e f_e * P_e` (f_e: share of the routed copies that go to expert e, P_e: mean
    score of e over the tokens), from `load_balancing_stats` and `load_balancing_loss`, through
    `inject_aux_loss`. The router itself computes no loss in its forward: the tokens the loss
    averages over (one rank's, or every rank's) are the layer's choice.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        aux_loss_coef: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        self.num_experts = check_positive_int("num_experts", num_experts)
        top_k = check_int("top_k", top_k)
        if not 1 <= top_k <= self.num_experts:
            raise ValueError(f"top_k must be an int in [1, num_experts={self.num_experts}], got {top_k}")
        self.top_k = top_k
        self.score_func = check_choice("score_func", score_func, SCORE_FUNCS)
        self.norm_topk_prob = check_bool("norm_topk_prob", norm_topk_prob)
        self.aux_loss_coef = check_float("aux_loss_coef", aux_loss_coef, minimum=0)
        dtype = check_compute_dtype("dtype", dtype if dtype is not None else torch.get_default_dtype())
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # nn.Linear's initialisation (and its draws from the generator): MoELayer's router was one.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x_TH: torch.Tensor) -> TopKRouting:
        logits = nn.functional.linear(x_TH, self.weight)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.score_func == "softmax" and self.norm_topk_prob:
            # The softmax over all N, top-k and renormalised is the softmax over the top-k logits:
            # moekit's fused op (one kernel each way on CUDA; float64 logits and the CPU take torch
            # ops). Ties go to the lower expert. The scores are still every expert's, for the loss.
            weights, ids = topk_softmax(logits, self.top_k)
            return TopKRouting(weights, ids, logits.softmax(-1))
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return TopKRouting(weights, ids, scores)

    def load_balancing_stats(self, routing: TopKRouting) -> LoadBalancingStats:
        """The loss's sums over `routing`'s tokens (device only; copies counted as sums of ones, exact
        in any order)."""
        ids, scores = routing.ids, routing.scores
        copies = torch.zeros(self.num_experts, dtype=torch.float64, device=ids.device)
        copies.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.float64, device=ids.device))
        return LoadBalancingStats(copies, scores.sum(0), copies.new_full((), ids.shape[0]))

    def load_balancing_loss(self, stats: LoadBalancingStats, totals: LoadBalancingStats | None = None) -> torch.Tensor:
        """`coef * N * sum_e f_e * stats.score_sum_e / tokens`, with f_e and tokens from `totals`
        (default: `stats`), in the scores' dtype. With totals = stats it is the loss over stats'
        tokens; with totals the sums over a larger token set (every rank's), it is the part of that
        set's loss whose gradient flows into stats' own scores. No tokens at all: the loss is 0 and
        its gradient 0."""
        totals = stats if totals is None else totals
        dtype = stats.score_sum.dtype
        tokens = totals.tokens.clamp_min(1)
        share = (totals.copies / (tokens * self.top_k)).to(dtype)
        return self.aux_loss_coef * self.num_experts * (share * stats.score_sum).sum() / tokens.to(dtype)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_func={self.score_func!r}, norm_topk_prob={self.norm_topk_prob}, "
            f"aux_loss_coef={self.aux_loss_coef}"
        )
