"""nn.Modules built on moekit's ops."""

from moekit.nn.grouped_linear import GroupedLinear
from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.moe_layer import MoELayer
from moekit.nn.router import LoadBalancingStats, TopKRouter, TopKRouting, inject_aux_loss

__all__ = [
    "GroupedLinear",
    "GroupedMLP",
    "LoadBalancingStats",
    "MoELayer",
    "TopKRouter",
    "TopKRouting",
    "inject_aux_loss",
]
