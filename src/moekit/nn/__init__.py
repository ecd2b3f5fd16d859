"""nn.Modules built on moekit's ops."""

from moekit.nn.grouped_linear import GroupedLinear
from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.moe_layer import MoELayer

__all__ = ["GroupedLinear", "GroupedMLP", "MoELayer"]
