"""moekit: grouped linears, grouped MLPs and MoE layers for training Mixture-of-Experts models."""

from moekit import reference
from moekit.checkpoint import load_safetensors, read_safetensors, save_safetensors
from moekit.grouped_tensor import GroupedTensor
from moekit.nn import GroupedLinear, GroupedMLP, MoELayer, TopKRouter
from moekit.ops.activations import ACTIVATIONS
from moekit.ops.glu import deinterleave_glu, glu, interleave_glu, swiglu
from moekit.ops.grouped_linear import grouped_linear
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.moe_experts import moe_experts
from moekit.ops.rows import permute, unpermute
from moekit.ops.runtime.backends import set_autotune

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "GroupedLinear",
    "GroupedMLP",
    "GroupedTensor",
    "MoELayer",
    "TopKRouter",
    "__version__",
    "deinterleave_glu",
    "glu",
    "grouped_linear",
    "grouped_mlp",
    "interleave_glu",
    "load_safetensors",
    "moe_experts",
    "permute",
    "read_safetensors",
    "reference",
    "save_safetensors",
    "set_autotune",
    "swiglu",
    "unpermute",
]
