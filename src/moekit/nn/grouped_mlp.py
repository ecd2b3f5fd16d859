"""GroupedMLP: the experts of an MoE layer.

Legend: M routed rows, N experts, H hidden size, F expert ffn size.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.nn.grouped_linear import GroupedLinear
from moekit.ops.activations import activation_named
from moekit.ops.glu import check_interleave
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.splits import MSplits


def check_sizes(**sizes: int) -> None:
    """Raise a ValueError naming the constructor argument that is not a positive int."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class GroupedMLP(nn.Module):
    """Expert MLPs: fc1 (H -> 2F, gate and up), gated activation, fc2 (F -> H).

    forward(x (M, H) sorted by expert, m_splits (N,), probs (M,) optional) -> (M, H).
    `glu_interleave_size` is the order of fc1's output rows; it is recorded in fc1's state so that
    checkpoints with another order are converted on load.
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
    ) -> None:
        super().__init__()
        check_sizes(num_experts=num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        activation_named(activation)
        check_interleave(ffn_hidden_size, glu_interleave_size)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.glu_interleave_size = glu_interleave_size
        self.backend = backend
        layout = {"single_grouped_weight": single_grouped_weight, "single_grouped_bias": single_grouped_weight}
        factory = {"backend": backend, "device": device, "dtype": dtype}
        self.fc1 = GroupedLinear(num_experts, hidden_size, 2 * ffn_hidden_size, bias=bias, **layout, **factory)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, bias=bias, **layout, **factory)
        self.fc1.is_glu = True
        self.fc1.glu_interleave_size = glu_interleave_size

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
        )

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, glu_interleave_size={self.glu_interleave_size}"
