"""moekit: grouped linears, grouped MLPs and MoE layers for training Mixture-of-Experts models."""

from moekit import reference
from moekit.checkpoint import load_safetensors, read_safetensors, save_safetensors
from moekit.grouped_tensor import GroupedTensor
from moekit.nn import GroupedLinear, GroupedMLP, MoELayer, TopKRouter
from moekit.ops.grouped_linear import grouped_linear
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.moe_experts import moe_experts
from moekit.ops.permute import permute, unpermute
from moekit.ops.swiglu import deinterleave_glu, interleave_glu, swiglu

__version__ = "0.1.0"

__all__ = [
    "GroupedLinear",
    "GroupedMLP",
    "GroupedTensor",
    "MoELayer",
    "TopKRouter",
    "__version__",
    "deinterleave_glu",
    "grouped_linear",
    "grouped_mlp",
    "interleave_glu",
    "load_safetensors",
    "moe_experts",
    "permute",
    "read_safetensors",
    "reference",
    "save_safetensors",
    "swiglu",
    "unpermute",
]
