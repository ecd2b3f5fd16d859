"""float64 pure-PyTorch references of every op, with the ops' own arguments.

Each returns float64 and is differentiable by plain autograd; tests compare the ops' outputs and
gradients against these.
"""

from moekit.ops.glu import glu_reference
from moekit.ops.grouped_linear import grouped_linear_reference
from moekit.ops.grouped_mlp import grouped_mlp_reference
from moekit.ops.moe_experts import moe_experts_reference
from moekit.ops.quantize import group_quantize_reference
from moekit.ops.rows import permute_reference, unpermute_reference
from moekit.ops.topk import topk_softmax_reference

__all__ = [
    "glu_reference",
    "group_quantize_reference",
    "grouped_linear_reference",
    "grouped_mlp_reference",
    "moe_experts_reference",
    "permute_reference",
    "topk_softmax_reference",
    "unpermute_reference",
]
