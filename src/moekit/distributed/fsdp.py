"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for models with moekit experts, the way torchtitan
applies it: under expert parallelism the experts first, as their own FSDP unit on the expert mesh's
"dp" dim; then every MoE module, each given block, and the root on the data-parallel mesh.

Mixed precision: bf16 compute with fp32 parameters and fp32 gradient reductions by default; each
rank holds its shard of the fp32 parameters and so of the optimizer state. The experts' unit does
not cast its inputs: the router weights reach the experts as `probs` in fp32, as in `MoELayer`.

Legend: N experts (of a module, local ones under expert parallelism), O/I a linear's out/in features.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moekit.distributed.expert_parallel import ExpertParallelMoE
from moekit.integrations.experts import IntegratedExperts
from moekit.nn.grouped_linear import GroupedLinear
from moekit.nn.grouped_mlp import GroupedMLP
from moekit.nn.moe_layer import MoELayer
from moekit.ops.quantize import QuantizedWeightCache

BF16_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def is_moe_module(module: nn.Module) -> bool:
    """Whether `module` is one of moekit's MoE modules, each an FSDP2 unit of its own: MoELayer,
    ExpertParallelMoE, or an integration's experts (`moekit.integrations.experts.IntegratedExperts`,
    such as a transformers model's experts after `apply_moekit`)."""
    return isinstance(module, (MoELayer, ExpertParallelMoE, IntegratedExperts))


def experts_of(module: nn.Module) -> GroupedMLP | None:
    """The `GroupedMLP` holding the experts of a moekit MoE module (MoELayer, ExpertParallelMoE,
    an integration's experts converted to moekit's layout), or None for any other module (an
    integration's experts kept in the model's own layout included: they hold no GroupedMLP)."""
    if isinstance(module, (MoELayer, ExpertParallelMoE)):
        return module.experts
    if isinstance(module, IntegratedExperts):
        return module.converted_mlp()
    return None


def _expert_tensors(module: nn.Module) -> list[tuple[nn.Parameter, int, int, int]]:
    """(parameter, number of experts, out features, dim of the out features) of every grouped expert
    tensor in `module`: GroupedLinear's single grouped weight (N, O, I) and bias (N, O), and an
    integration's expert tensors kept in the model's layout ((N, O, I), (N, I, O) or (N, O))."""
    out = []
    for sub in module.modules():
        if isinstance(sub, GroupedLinear):
            if sub.single_grouped_weight:
                out.append((sub.weight, sub.num_gemms, sub.out_features, 1))
            if sub.use_bias and sub.single_grouped_bias:
                out.append((sub.bias, sub.num_gemms, sub.out_features, 1))
        elif isinstance(sub, IntegratedExperts):
            out.extend((p, p.shape[0], p.shape[out_dim], out_dim) for p, out_dim in sub.expert_parameters())
    return out


def expert_shard_placement(
    module: nn.Module, mesh_size: int, shard_dim: int | None = None
) -> Callable[[nn.Parameter], Shard]:
    """FSDP2 `shard_placement_fn` for the expert tensors in `module`: a grouped tensor (N, ...) (a
    GroupedLinear's single grouped weight (N, O, I) or bias (N, O), or an integration's expert
    tensor kept in its model's layout) is cut along the experts (dim 0) when every rank gets the
    same whole number of experts, else along its out features O (through every expert; FSDP2 needs
    O divisible by the mesh size there, else dim 0 with uneven shards), torchtitan's rule;
    `shard_dim` forces one (0: experts, 1: out features, whichever dim holds them). The discrete
    layout's (O, I) / (O,) members, and every other parameter, are cut along dim 0 (for the
    members: through the expert)."""
    if shard_dim not in (None, 0, 1):
        raise ValueError(f"expert shard_dim must be None, 0 (experts) or 1 (out features), got {shard_dim!r}")
    dims = {}
    for param, num_experts, out_features, out_dim in _expert_tensors(module):
        out_divisible = out_features % mesh_size == 0
        if shard_dim == 1 and not out_divisible:
            raise ValueError(
                f"expert shard_dim=1 cuts out_features={out_features} into {mesh_size} shards; FSDP2 needs "
                "them equal (a multiple of the mesh size): use shard_dim=0 or None"
            )
        along_experts = num_experts % mesh_size == 0 or not out_divisible if shard_dim is None else shard_dim == 0
        dims[id(param)] = 0 if along_experts else out_dim

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
    every MoE module (MoELayer, ExpertParallelMoE's router, an integration's experts such as a
    transformers MoekitExperts) on `mesh`;
    then `blocks`, then the root.
    blocks: modules to wrap as units between the experts and the root (e.g. transformer blocks).
    mp_policy: default bf16 compute, fp32 parameters and reductions.
    expert_shard_dim: see `expert_shard_placement`.
    Quantized experts: every quantized-weight cache in the model stops trusting version counters
    (`QuantizedWeightCache.track_versions`): FSDP2 rewrites the unsharded weights for every forward
    without bumping them, so the weights are quantized at every forward.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError("mesh must be a 1-D DeviceMesh over the data-parallel ranks of the dense parameters")

    def shard(module: nn.Module, unit_mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> FSDPModule:
        return fully_shard(
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
    for module in [m for m in model.modules() if is_moe_module(m)]:
        if isinstance(module, ExpertParallelMoE):
            if module.mesh.ndim != 2:
                raise ValueError(
                    "apply_fsdp needs the ExpertParallelMoE's mesh to be 2-D with dims ('ep', 'dp'), so that its "
                    "experts have a data-parallel dim to be sharded over (dp may be 1)"
                )
            experts = shard(module.experts, module.mesh["dp"], experts_policy)
            experts.set_gradient_divide_factor(float(module.mesh.size()))
            if module.mesh["dp"].size() > 1 and dist.get_backend(module.mesh["dp"].get_group()) == "gloo":
                # FSDP2 scales by a custom factor with ReduceOp.PREMUL_SUM, which gloo lacks: sum, then divide.
                experts.set_force_sum_reduction_for_comms(True)
        if module is not model:
            shard(module, mesh, mp_policy)
    for block in (*blocks, model):
        shard(block, mesh, mp_policy)
    for cache in quantized_weight_caches(model):
        # FSDP2 all-gathers the weights anew for every forward without bumping their versions.
        cache.track_versions = False
    return model


def quantized_weight_caches(model: nn.Module) -> list[QuantizedWeightCache]:
    """Every quantized-weight cache of moekit's modules in `model` (GroupedLinear's, an integration's)."""
    caches: list[QuantizedWeightCache] = []
    for module in model.modules():
        if isinstance(module, GroupedLinear):
            caches.append(module.weight_cache)
        elif isinstance(module, IntegratedExperts):
            caches.extend(module.moekit_weight_caches())
    return caches
