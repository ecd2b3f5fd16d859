"""MoELayer: router + the routed GroupedMLP experts (`moekit.moe_experts`: sort by expert, grouped
MLP, weighted combine).

Legend: T tokens, K experts per token (top-k), N experts, H hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.nn.grouped_mlp import GroupedMLP, check_sizes
from moekit.ops.moe_experts import moe_experts

SCORE_FUNCS = ("softmax", "sigmoid")


def run_experts(
    experts: GroupedMLP, x_TH: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """`moekit.moe_experts` with a GroupedMLP's parameters and settings: x_TH (T, H) in token order,
    topk_ids / topk_weights (T, K) -> (T, H), each token's K expert outputs weighted and summed."""
    return moe_experts(
        x_TH,
        topk_ids,
        topk_weights,
        experts.fc1.weights(),
        experts.fc2.weights(),
        fc1_bias=experts.fc1.biases(),
        fc2_bias=experts.fc2.biases(),
        activation=experts.activation,
        glu_interleave_size=experts.glu_interleave_size,
        backend=experts.backend,
    )


class _AuxLossInjector(torch.autograd.Function):
    """Identity on the output; its backward also starts the auxiliary loss's backward, so the loss
    trains the router without the caller adding it to theirs (Megatron-Core's approach)."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, d_output):
        (aux_loss,) = ctx.saved_tensors
        return d_output, torch.ones_like(aux_loss)


class MoELayer(nn.Module):
    """Top-k routed mixture of `GroupedMLP` experts.

    forward(x (..., H)) -> (..., H). The router is a bias-free linear gate; scores are
    softmax or sigmoid in fp32, the top-k of them (optionally renormalised) weight the experts'
    outputs: they enter the experts as `probs` (scaling the activation and fc2 bias).
    With `aux_loss_coef > 0`, the Switch-Transformer load-balancing loss
    `coef * N * sum_e f_e * P_e` (f_e: share of routed copies to e, P_e: mean score of e) is added
    to the gradient through the output and kept, detached, in `self.aux_loss` for logging.
    No step reads device values on the host.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        aux_loss_coef: float = 0.0,
        bias: bool = False,
        activation: str = "swiglu",
        glu_interleave_size: int | None = None,
        single_grouped_weight: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_sizes(num_experts=num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"unknown score_func {score_func!r}; expected one of {SCORE_FUNCS}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        if aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {aux_loss_coef}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = norm_topk_prob
        self.aux_loss_coef = aux_loss_coef
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = GroupedMLP(
            num_experts,
            hidden_size,
            ffn_hidden_size,
            bias=bias,
            activation=activation,
            glu_interleave_size=glu_interleave_size,
            single_grouped_weight=single_grouped_weight,
            backend=backend,
            device=device,
            dtype=dtype,
        )
        self.aux_loss: torch.Tensor | None = None

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k weights (T, K) fp32, expert ids (T, K), all scores (T, N) fp32)."""
        logits = self.router(x_TH)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return weights, ids, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"input's last dimension is {x.shape[-1] if x.dim() else None}; expected "
                f"hidden_size={self.hidden_size} (input shape {tuple(x.shape)})"
            )
        param_dtype = self.router.weight.dtype
        if x.dtype != param_dtype:
            raise TypeError(
                f"MoELayer's parameters are {param_dtype} but the input is {x.dtype}; cast the input "
                f"(x.to({param_dtype})) or the layer (layer.to({x.dtype}))"
            )
        x_TH = x.reshape(-1, self.hidden_size)
        weights, ids, scores = self.route(x_TH)
        y_TH = run_experts(self.experts, x_TH, ids, weights)
        if self.aux_loss_coef > 0 and self.training:
            # Copies routed to each expert, counted on the device (sums of ones: exact in any order).
            ones = scores.new_ones(ids.numel())
            routed_share = scores.new_zeros(self.num_experts).scatter_add_(0, ids.reshape(-1), ones) / ids.numel()
            aux = self.aux_loss_coef * self.num_experts * (routed_share * scores.mean(0)).sum()
            self.aux_loss = aux.detach()
            y_TH = _AuxLossInjector.apply(y_TH, aux)
        return y_TH.reshape(x.shape)
