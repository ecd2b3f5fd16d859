"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for models with moekit experts, the way torchtitan
applies it: under expert parallelism the experts first, as their own FSDP unit on the expert mesh's
"dp" dim; then every MoE module, each given block, and the root on the data-parallel mesh.

Mixed precision: bf16 compute with fp32 parameters and fp32 gradient reductions by default; each
rank holds its shard of the fp32 parameters and so of the optimizer state. The experts' unit does
not cast its inputs: the router weights reach the experts as `probs` in fp32, as in `MoELayer`.

Legend: N experts (of a module, local ones under expert parallelism), O/I a linear's out/in features.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moekit.distributed.expert_parallel import ExpertParallelMoE
from moekit.nn.grouped_linear import GroupedLinear
from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.moe_layer import MoELayer

BF16_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def experts_of(module: nn.Module) -> GroupedMLP | None:
    """The `GroupedMLP` holding the experts of a moekit MoE module (MoELayer, ExpertParallelMoE,
    a transformers `MoekitExperts`), or None for any other module."""
    if isinstance(module, (MoELayer, ExpertParallelMoE)):
        return module.experts
    if type(module).__name__ == "MoekitExperts" and isinstance(getattr(module, "grouped_mlp", None), GroupedMLP):
        return module.grouped_mlp
    return None


def expert_shard_placement(module: nn.Module, mesh_size: int, shard_dim: int | None = None):
    """FSDP2 `shard_placement_fn` for the `GroupedLinear`s in `module`: a single grouped weight
    (N, O, I) or bias (N, O) is cut along the experts (dim 0) when every rank gets the same whole
    number of experts, else along O (dim 1, through every expert; FSDP2 needs O divisible by the
    mesh size there, else dim 0 with uneven shards), torchtitan's rule; `shard_dim` forces one. The
    discrete layout's (O, I) / (O,) members, and every other parameter, are cut along dim 0 (for
    the members: through the expert)."""
    if shard_dim not in (None, 0, 1):
        raise ValueError(f"expert shard_dim must be None, 0 (experts) or 1 (out features), got {shard_dim!r}")
    dims = {}
    for linear in module.modules():
        if not isinstance(linear, GroupedLinear):
            continue
        out_divisible = linear.out_features % mesh_size == 0
        if shard_dim == 1 and not out_divisible:
            raise ValueError(
                f"expert shard_dim=1 cuts out_features={linear.out_features} into {mesh_size} shards; FSDP2 needs "
                "them equal (a multiple of the mesh size): use shard_dim=0 or None"
            )
        dim = (
            shard_dim if shard_dim is not None else (0 if linear.num_gemms % mesh_size == 0 or not out_divisible else 1)
        )
        if linear.single_grouped_weight:
            dims[id(linear.weight)] = dim
        if linear.use_bias and linear.single_grouped_bias:
            dims[id(linear.bias)] = dim

    def placement(param: nn.Parameter) -> Shard:
        return Shard(dims.get(id(param), 0))

    return placement


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Iterable[nn.Module] = (),
    mp_policy: MixedPrecisionPolicy = BF16_COMPUTE,
    reshard_after_forward: bool = True,
    expert_shard_dim: int | None = None,
) -> nn.Module:
    """Shard `model` with FSDP2 in place and return it.

    mesh: the 1-D data-parallel DeviceMesh over which the non-expert parameters are replicated
    (every rank, under expert parallelism too). Units, innermost first: the experts of every
    `ExpertParallelMoE`, on its mesh's "dp" dim (the mesh must be 2-D, (ep, dp); dp may be 1), with
    the gradient divided by EP x DP (every rank's loss counts once, as for the other parameters);
    every MoE module (MoELayer, ExpertParallelMoE's router, transformers MoekitExperts) on `mesh`;
    then `blocks`, then the root.
    blocks: modules to wrap as units between the experts and the root (e.g. transformer blocks).
    mp_policy: default bf16 compute, fp32 parameters and reductions.
    expert_shard_dim: see `expert_shard_placement`.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError("mesh must be a 1-D DeviceMesh over the data-parallel ranks of the dense parameters")

    def shard(module: nn.Module, unit_mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
        fully_shard(
            module,
            mesh=unit_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            shard_placement_fn=expert_shard_placement(module, unit_mesh.size(), expert_shard_dim),
        )

    experts_policy = MixedPrecisionPolicy(
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
        output_dtype=mp_policy.output_dtype,
        cast_forward_inputs=False,
    )
    for module in [m for m in model.modules() if experts_of(m) is not None]:
        if isinstance(module, ExpertParallelMoE):
            if module.mesh.ndim != 2:
                raise ValueError(
                    "apply_fsdp needs the ExpertParallelMoE's mesh to be 2-D with dims ('ep', 'dp'), so that its "
                    "experts have a data-parallel dim to be sharded over (dp may be 1)"
                )
            experts = experts_of(module)
            shard(experts, module.mesh["dp"], experts_policy)
            experts.set_gradient_divide_factor(float(module.mesh.size()))
            if module.mesh["dp"].size() > 1 and dist.get_backend(module.mesh["dp"].get_group()) == "gloo":
                # FSDP2 scales by a custom factor with ReduceOp.PREMUL_SUM, which gloo lacks: sum, then divide.
                experts.set_force_sum_reduction_for_comms(True)
        if module is not model:
            shard(module, mesh, mp_policy)
    for block in (*blocks, model):
        shard(block, mesh, mp_policy)
    return model
