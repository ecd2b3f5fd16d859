"""moekit over torch.distributed: FSDP2, expert parallelism, layout-independent DCP checkpoints.

- `apply_fsdp(model, mesh, ...)`: FSDP2 (`fully_shard`) on a model's MoE experts, blocks and root,
  bf16 compute with fp32 parameters and reductions by default.
- `ExpertParallelMoE(layer, mesh, mode="dropless" | "capacity")`: a `MoELayer`'s router with N/EP
  of its experts per rank, token copies moved with `all_to_all_single`, any token count on each rank;
  composes with FSDP2 over a 2-D (ep, dp) mesh.
- `moekit.distributed.checkpoint.save/load`: `torch.distributed.checkpoint` with expert tensors
  stored globally, independent of layout, sharding and EP degree.

Imported explicitly (`import moekit.distributed`), as torch.distributed is.
"""

from moekit.distributed import checkpoint
from moekit.distributed.expert_parallel import ExpertParallelMoE, all_to_all_rows
from moekit.distributed.fsdp import BF16_COMPUTE, apply_fsdp, expert_shard_placement, experts_of, is_moe_module

__all__ = [
    "BF16_COMPUTE",
    "ExpertParallelMoE",
    "all_to_all_rows",
    "apply_fsdp",
    "checkpoint",
    "expert_shard_placement",
    "experts_of",
    "is_moe_module",
]
