"""GroupedMLP: the experts of an MoE layer.

Legend: M routed rows, N experts, H hidden size, F expert ffn size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moekit.nn.grouped_linear import GroupedLinear
from moekit.ops.activations import activation_named
from moekit.ops.glu import check_interleave
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.quantize import QuantizedWeightCache, check_quantization
from moekit.ops.splits import MSplits
from moekit.validation import check_bool, check_int, check_positive_int


class GroupedMLP(nn.Module):
    """Expert MLPs: fc1 (H -> 2F, gate and up), gated activation, fc2 (F -> H).

    forward(x (M, H) sorted by expert, m_splits (N,), probs (M,) optional) -> (M, H).
    `glu_interleave_size` is the order of fc1's output rows; it is recorded in fc1's state so that
    checkpoints with another order are converted on load.

    quantization: None, "fp8_block", "fp8_rowwise" or "mxfp8": both linears on quantized operands
    (`moekit.grouped_mlp`'s: FP8 kernels or the reference path, as `moekit.grouped_linear` says). Parameters and
    state dict stay in the module's dtype; fc1's and fc2's `weight_cache` hold the quantized weights,
    made again (in place) once per optimizer step. quantized_wgrad (with quantization): as
    `moekit.grouped_mlp`'s (False: the weight gradients from the unquantized operands in the module's dtype).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
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
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        self.ffn_hidden_size = check_positive_int("ffn_hidden_size", ffn_hidden_size)
        check_bool("bias", bias)
        check_bool("single_grouped_weight", single_grouped_weight)
        activation_named(activation)
        check_interleave(ffn_hidden_size, glu_interleave_size)
        self.activation = activation
        self.glu_interleave_size = glu_interleave_size
        self.backend = backend
        self.quantization = check_quantization(quantization)
        self.quantized_wgrad = check_bool("quantized_wgrad", quantized_wgrad)
        layout: dict[str, Any] = {
            "single_grouped_weight": single_grouped_weight,
            "single_grouped_bias": single_grouped_weight,
        }
        factory: dict[str, Any] = {
            "backend": backend,
            "device": device,
            "dtype": dtype,
            "quantization": self.quantization,
            "quantized_wgrad": self.quantized_wgrad,
        }
        self.fc1 = GroupedLinear(num_experts, hidden_size, 2 * ffn_hidden_size, bias=bias, **layout, **factory)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, bias=bias, **layout, **factory)
        self.fc1.is_glu = True
        self.fc1.glu_interleave_size = glu_interleave_size

    def options(self) -> dict[str, Any]:
        """The keyword arguments that build a GroupedMLP like this one (all but the sizes, device and
        dtype): the one list of them that the layers built on GroupedMLP reuse."""
        return {
            "bias": self.fc1.use_bias,
            "activation": self.activation,
            "glu_interleave_size": self.glu_interleave_size,
            "single_grouped_weight": self.fc1.single_grouped_weight,
            "backend": self.backend,
            "quantization": self.quantization,
            "quantized_wgrad": self.quantized_wgrad,
        }

    def select_experts(self, first: int, count: int) -> GroupedMLP:
        """A new GroupedMLP of experts first .. first+count-1 of this one (how expert parallelism takes
        its rank's experts), with its options, layout, device and dtype and copies of those experts'
        parameters (none on the meta device, where parameters hold no values)."""
        first = check_int("first", first, minimum=0)
        count = check_positive_int("count", count)
        if first + count > self.num_experts:
            raise ValueError(
                f"experts {first}..{first + count - 1} do not exist: this GroupedMLP has {self.num_experts}"
            )
        weight = self.fc1.weights()
        ref = weight if isinstance(weight, torch.Tensor) else weight[0]
        part = GroupedMLP(
            count, self.hidden_size, self.ffn_hidden_size, **self.options(), device=ref.device, dtype=ref.dtype
        )
        if ref.device.type != "meta":
            with torch.no_grad():
                for src, dst in ((self.fc1, part.fc1), (self.fc2, part.fc2)):
                    for src_params, dst_params in ((src.weights(), dst.weights()), (src.biases(), dst.biases())):
                        if src_params is None or dst_params is None:  # (both or neither: one config)
                            continue
                        src_all = src_params if isinstance(src_params, torch.Tensor) else torch.stack(src_params)
                        chosen = src_all[first : first + count]
                        if isinstance(dst_params, torch.Tensor):
                            dst_params.copy_(chosen)
                        else:
                            for p, value in zip(dst_params, chosen.unbind(0), strict=True):
                                p.copy_(value)
        return part

    def forward(self, x: torch.Tensor, m_splits: MSplits, probs: torch.Tensor | None = None) -> torch.Tensor:
        return grouped_mlp(
            x,
            self.fc1.weights(),
            self.fc2.weights(),
            m_splits,
            probs=probs,
            fc1_bias=self.fc1.biases(),
            fc2_bias=self.fc2.biases(),
            activation=self.activation,
            glu_interleave_size=self.glu_interleave_size,
            backend=self.backend,
            quantization=self.quantization,
            quantized_wgrad=self.quantized_wgrad,
            weight_caches=self.weight_caches(),
        )

    def weight_caches(self) -> tuple[QuantizedWeightCache, QuantizedWeightCache]:
        """fc1's and fc2's quantized-weight caches (what the ops' `weight_caches=` take)."""
        return self.fc1.weight_cache, self.fc2.weight_cache

    def extra_repr(self) -> str:
        quant = f", quantization={self.quantization!r}" if self.quantization is not None else ""
        return f"activation={self.activation!r}, glu_interleave_size={self.glu_interleave_size}{quant}"
