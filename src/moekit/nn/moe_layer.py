"""MoELayer: a `TopKRouter` and its routed `GroupedMLP` experts (`moekit.moe_experts`: sort by
expert, grouped MLP, weighted combine).

Legend: T tokens, K experts per token (top-k), N experts, H hidden size.

The layer's input contract (`layer_input`) and output (`layer_output`) are shared with
`moekit.distributed.ExpertParallelMoE`, which composes the same router with its rank's experts.
"""

from __future__ import annotations

from typing import Generic, TypeVar, overload

import torch
from torch import nn

from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.router import TopKRouter, TopKRouting, inject_aux_loss
from moekit.nn.shapes import check_last_dim, rows_as
from moekit.ops.moe_experts import moe_experts
from moekit.validation import COMPUTE_DTYPES


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
        quantization=experts.quantization,
        quantized_wgrad=experts.quantized_wgrad,
        weight_caches=experts.weight_caches(),
    )


def layer_input(module: str, router: TopKRouter, x: torch.Tensor) -> torch.Tensor:
    """An MoE layer's input x (..., H) as tokens (T, H); refused in one line, naming `module`, when
    its last dimension is not the router's hidden size or its dtype not the router's parameters'."""
    check_last_dim(x, "hidden_size", router.hidden_size)
    param_dtype = router.weight.dtype
    if x.dtype != param_dtype:
        # The layer can take the input's dtype only if that is one moekit computes in.
        layer_cast = f" or the layer (layer.to({x.dtype}))" if x.dtype in COMPUTE_DTYPES else ""
        raise TypeError(
            f"{module}'s parameters are {param_dtype} but the input is {x.dtype}; cast the input "
            f"(x.to({param_dtype})){layer_cast}"
        )
    return x.reshape(-1, router.hidden_size)


def layer_output(y_TH: torch.Tensor, shape: torch.Size, aux_loss: torch.Tensor | None) -> torch.Tensor:
    """An MoE layer's result (T, H) in the input's shape, never a view (FSDP2 warns about views);
    with `aux_loss`, its backward also backpropagates the load-balancing loss (`inject_aux_loss`)."""
    y = rows_as(y_TH, shape)
    return y if aux_loss is None else inject_aux_loss(y, aux_loss)


_T = TypeVar("_T")


class _RouterSetting(Generic[_T]):
    """A MoELayer attribute that is its router's: read (and, unless a size, set) there, so that each
    setting has one copy."""

    def __init__(self, *, writable: bool = True) -> None:
        self.writable = writable

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, layer: None, owner: type | None = None) -> _RouterSetting[_T]: ...
    @overload
    def __get__(self, layer: MoELayer, owner: type | None = None) -> _T: ...
    def __get__(self, layer: MoELayer | None, owner: type | None = None) -> _RouterSetting[_T] | _T:
        return self if layer is None else getattr(layer.router, self.name)

    def __set__(self, layer: MoELayer, value: _T) -> None:
        if not self.writable:
            raise AttributeError(f"MoELayer's {self.name} is fixed at construction")
        setattr(layer.router, self.name, value)


class MoELayer(nn.Module):
    """Top-k routed mixture of `GroupedMLP` experts: `router` (a `TopKRouter`) + `experts`.

    forward(x (..., H)) -> (..., H). The router is a bias-free linear gate; scores are
    softmax or sigmoid in fp32, the top-k of them (optionally renormalised) weight the experts'
    outputs: they enter the experts as `probs` (scaling the activation and fc2 bias).
    With `aux_loss_coef > 0`, in training, the Switch-Transformer load-balancing loss
    `coef * N * sum_e f_e * P_e` (f_e: share of routed copies to e, P_e: mean score of e) is added
    to the gradient through the output and kept, detached, in `self.aux_loss` for logging (0, with
    a zero gradient, for 0 tokens). No step reads device values on the host.

    The router's settings (`top_k`, `score_func`, `norm_topk_prob`, `aux_loss_coef`; the sizes
    `hidden_size`, `num_experts` read-only) read and write `self.router`'s. State dict keys: `router.weight`,
    `experts.fc1.*`, `experts.fc2.*`.

    quantization: None, "fp8_block", "fp8_rowwise" or "mxfp8": the experts' linears on quantized operands
    (`GroupedMLP`'s: FP8 kernels or the reference path, as `moekit.grouped_linear` says); the router stays in
    the layer's dtype. quantized_wgrad (with quantization): as `GroupedMLP`'s (False: the experts' weight
    gradients from the unquantized operands in the layer's dtype).
    """

    hidden_size: _RouterSetting[int] = _RouterSetting(writable=False)
    num_experts: _RouterSetting[int] = _RouterSetting(writable=False)
    top_k: _RouterSetting[int] = _RouterSetting()
    score_func: _RouterSetting[str] = _RouterSetting()
    norm_topk_prob: _RouterSetting[bool] = _RouterSetting()
    aux_loss_coef: _RouterSetting[float] = _RouterSetting()

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
        quantization: str | None = None,
        quantized_wgrad: bool = True,
    ) -> None:
        super().__init__()
        self.router = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            score_func=score_func,
            norm_topk_prob=norm_topk_prob,
            aux_loss_coef=aux_loss_coef,
            device=device,
            dtype=dtype,
        )
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
            quantization=quantization,
            quantized_wgrad=quantized_wgrad,
        )
        self.aux_loss: torch.Tensor | None = None

    def route(self, x_TH: torch.Tensor) -> TopKRouting:
        """The router's decision for x_TH (T, H): (top-k weights (T, K) fp32, expert ids (T, K),
        all scores (T, N) fp32)."""
        return self.router(x_TH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TH = layer_input("MoELayer", self.router, x)
        routing = self.router(x_TH)
        y_TH = run_experts(self.experts, x_TH, routing.ids, routing.weights)
        aux = None
        if self.router.aux_loss_coef > 0 and self.training:
            aux = self.router.load_balancing_loss(self.router.load_balancing_stats(routing))
            self.aux_loss = aux.detach()
        return layer_output(y_TH, x.shape, aux)
