"""Distributed checkpoints (`torch.distributed.checkpoint`, DCP) whose expert tensors do not depend
on the weight layout, the sharding or the expert-parallel degree that wrote them.

Legend: N experts in all, O/I a linear's out/in features.

What is stored, under the key `model` (and `optim` for an optimizer, torch's FQN-keyed
`get_optimizer_state_dict` form):
- every `GroupedLinear` at module path P: `P.weight` (N, O, I) and `P.bias` (N, O), the global
  tensors of all N experts, whether the module holds one grouped parameter or `weight0..weight{N-1}`,
  is sharded by FSDP2 along experts or through them, or holds N/EP experts per expert-parallel rank;
  and `P._extra_state` (the GLU interleave size of an fc1).
- the experts of another library's model run by one of moekit's integrations
  (`moekit.integrations.experts.IntegratedExperts` at path Q, e.g. after transformers'
  `apply_moekit`): the model's own names and layout (`Q.gate_up_proj`, `Q.down_proj`, gpt-oss's
  biases, transposed where the model stores them so), so the checkpoint loads into the model
  without moekit (`dcp.load({"model": model.state_dict()}, ...)`) and back. Kept in the model's
  layout (apply_moekit's default) they are the model's own parameters, stored as they are;
  converted to moekit's per-expert weights, they are translated back to the model's names.
- everything else as `model.state_dict()` gives it.
Optimizer state of an expert parameter follows its parameter (stacked, global, same key); a
per-parameter scalar (Adam's `step`) is stored once for a grouped key.

Each rank passes DCP global DTensors built on the local shards (`DTensor.from_local`: expert
parallelism is Shard(0) of the experts on the "ep" mesh dim, FSDP2's Shard(d) on "dp"), so DCP
reshards on load: any world size, EP degree or layout loads any other. Loading reads the
checkpoint's metadata first and refuses (ValueError, before any tensor is changed) a checkpoint
with missing keys, other global shapes or another GLU interleave size.

Usage (every rank): `save(path, model, optimizer)`, `load(path, model, optimizer)`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from moekit.checkpoint.metadata import join_key
from moekit.distributed.expert_parallel import ExpertParallelMoE
from moekit.integrations.experts import IntegratedExperts
from moekit.nn.grouped_linear import GroupedLinear


@dataclasses.dataclass
class _ExpertEntry:
    """One stored expert tensor and the parameters that hold it on this rank."""

    key: str  # stored key (canonical, layout-independent)
    param_names: list[str]  # FQNs of the parameters: one grouped, or N discrete members
    params: list[torch.Tensor]
    grouped: bool  # one (n, ...) parameter (True) or members stacked along a new dim 0
    transpose: bool  # stored as (N, I, O): a transformers model that keeps weights so
    ep: ExpertParallelMoE | None  # the module that spreads these experts over EP ranks


def _expert_entries(model: nn.Module) -> tuple[list[_ExpertEntry], dict[str, str]]:
    """The expert entries of `model`, and the model.state_dict() keys they replace (key -> why)."""
    modules = dict(model.named_modules())
    ep_prefixes = {name: m for name, m in modules.items() if isinstance(m, ExpertParallelMoE)}
    # An integration's experts converted to moekit's layout are stored in their model's names and layout
    # (kept in the model's layout, they are ordinary parameters of the model: nothing to translate).
    hf_prefixes = _converted_integrated_experts(modules)
    entries, replaced = [], {}
    for path, linear in modules.items():
        if not isinstance(linear, GroupedLinear):
            continue
        ep = next((m for p, m in ep_prefixes.items() if _inside(path, p)), None)
        hf_path = next((p for p in hf_prefixes if _inside(path, p)), None)
        for kind in ("weight", "bias"):
            params = linear.weights() if kind == "weight" else linear.biases()
            if params is None:
                continue
            grouped = isinstance(params, torch.Tensor)
            names = [f"{path}.{kind}"] if grouped else [f"{path}.{kind}{i}" for i in range(linear.num_gemms)]
            transpose = False
            if hf_path is not None:
                linear_name = path.rsplit(".", 1)[1]
                experts = hf_prefixes[hf_path]
                key = join_key(hf_path, experts.model_tensor_names[(linear_name, kind)])
                transpose = kind == "weight" and experts.stores_transposed
                replaced[key] = "experts"
            else:
                key = f"{path}.{kind}"
            replaced.update({n: "experts" for n in names})
            members = [params] if isinstance(params, torch.Tensor) else list(params)
            entries.append(_ExpertEntry(key, names, members, grouped, transpose, ep))
    for hf_path in hf_prefixes:
        replaced[join_key(hf_path, "grouped_mlp.")] = "prefix"
    return entries, replaced


def _converted_integrated_experts(modules: dict[str, nn.Module]) -> dict[str, IntegratedExperts]:
    """The integrations' experts modules (by path) whose tensors live in a moekit GroupedMLP."""
    return {
        name: m for name, m in modules.items() if isinstance(m, IntegratedExperts) and m.converted_mlp() is not None
    }


def _inside(path: str, prefix: str) -> bool:
    return prefix == "" or path.startswith(prefix + ".")


def _local_and_placement(
    tensors: list[torch.Tensor], grouped: bool
) -> tuple[torch.Tensor, Shard | None, DeviceMesh | None, tuple[int, ...]]:
    """(local (n, ...) tensor, FSDP placement on the dp mesh or None, that mesh or None, global shape)."""
    first = tensors[0]
    if isinstance(first, DTensor):
        if first.device_mesh.ndim != 1 or not isinstance(first.placements[0], Shard):
            raise ValueError(
                f"expert parameters sharded as {first.placements} on a {first.device_mesh.ndim}-D mesh are not "
                "supported; shard them with FSDP2 on a 1-D mesh (moekit.distributed.apply_fsdp)"
            )
        dim = first.placements[0].dim + (0 if grouped else 1)
        locals_ = [cast(DTensor, t).to_local() for t in tensors]  # FSDP2 shards every member alike
        mesh, placement = first.device_mesh, Shard(dim)
    else:
        locals_, mesh, placement = [t.detach() for t in tensors], None, None
    local = locals_[0] if grouped else torch.stack(locals_)
    global_shape = tuple(first.shape) if grouped else (len(tensors), *first.shape)
    return local, placement, mesh, global_shape


def _stored_tensor(entry: _ExpertEntry, tensors: list[torch.Tensor], *, fresh: bool) -> torch.Tensor:
    """The global tensor DCP stores for `entry`, built on this rank's shard of `tensors` (the
    parameters or one optimizer state of them). fresh=True gives a new buffer (to load into)."""
    local, placement, dp_mesh, global_shape = _local_and_placement(tensors, entry.grouped)
    placements: list[Placement] = [] if placement is None else [placement]
    mesh = dp_mesh
    if entry.ep is not None:
        ep = entry.ep
        global_shape = (global_shape[0] * ep.ep_size, *global_shape[1:])
        if ep.mesh.ndim == 2:
            if dp_mesh is not None and dp_mesh.mesh.tolist() != ep.mesh["dp"].mesh.tolist():
                raise ValueError("expert parameters of an ExpertParallelMoE must be sharded on its mesh's 'dp' dim")
            placements = [Shard(0), placement if placement is not None else Replicate()]
        elif dp_mesh is not None:
            raise ValueError("an ExpertParallelMoE with a 1-D mesh cannot have FSDP-sharded experts")
        else:
            placements = [Shard(0)]
        mesh = ep.mesh
    if entry.transpose:
        local = local.transpose(1, 2)
        global_shape = (global_shape[0], global_shape[2], global_shape[1], *global_shape[3:])
        placements = [Shard({1: 2, 2: 1}.get(p.dim, p.dim)) if isinstance(p, Shard) else p for p in placements]
    local = local.clone(memory_format=torch.contiguous_format) if fresh or entry.transpose else local.contiguous()
    if mesh is None:
        return local
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(global_shape), stride=stride)


def _write_back(entry: _ExpertEntry, stored: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy this rank's part of a loaded stored tensor into `tensors` (parameters or states)."""
    local = stored.to_local() if isinstance(stored, DTensor) else stored
    if entry.transpose:
        local = local.transpose(1, 2)
    targets = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    with torch.no_grad():
        if entry.grouped:
            targets[0].copy_(local)
        else:
            for target, member in zip(targets, local.unbind(0), strict=True):
                target.copy_(member)


def _is_replaced(key: str, replaced: dict[str, str]) -> bool:
    if key in replaced:
        return True
    return any(why == "prefix" and key.startswith(k) for k, why in replaced.items())


def _model_state(
    model: nn.Module, entries: list[_ExpertEntry], replaced: dict[str, str], *, fresh: bool
) -> dict[str, Any]:
    state = {k: v for k, v in model.state_dict().items() if not _is_replaced(k, replaced)}
    for entry in entries:
        state[entry.key] = _stored_tensor(entry, entry.params, fresh=fresh)
    return state


def _optim_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, entries: list[_ExpertEntry], *, fresh: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(stored optimizer state, torch's FQN-keyed optimizer state dict it came from)."""
    osd: dict[str, Any] = get_optimizer_state_dict(model, optimizer)  # (its values' types vary by key)
    state = dict(osd["state"])
    to_key = {}
    for entry in entries:
        per_param = [state.pop(name) for name in entry.param_names if name in state]
        for name in entry.param_names:
            to_key[name] = entry.key
        if not per_param:
            continue
        stored = {}
        for state_name, value in per_param[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                stored[state_name] = _stored_tensor(entry, [s[state_name] for s in per_param], fresh=fresh)
            else:
                # Per-parameter scalars (Adam's step) are equal across one layer's experts.
                stored[state_name] = value.clone() if isinstance(value, torch.Tensor) else value
        state[entry.key] = stored
    groups = []
    for group in osd["param_groups"]:
        params = list(dict.fromkeys(to_key.get(name, name) for name in group["params"]))
        groups.append({**group, "params": params})
    return {"state": state, "param_groups": groups}, osd


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """The state DCP saves: {"model": ..., "optim": ...} with layout-independent expert tensors
    (see the module docstring). Tensors are views of this rank's shards where the layout allows."""
    entries, replaced = _expert_entries(model)
    out = {"model": _model_state(model, entries, replaced, fresh=False)}
    if optimizer is not None:
        out["optim"] = _optim_state(model, optimizer, entries, fresh=False)[0]
    return out


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Save `model` (and `optimizer`) to the DCP checkpoint directory `path` (every rank calls it)."""
    dcp.save(state_dict(model, optimizer), checkpoint_id=path, process_group=process_group)


def check_checkpoint_exists(path: str | os.PathLike) -> None:
    """Refuse, in one line, a `path` that holds no DCP checkpoint (no `.metadata` file): checked on
    each rank by itself, before any collective, so every rank raises rather than some waiting."""
    metadata = os.path.join(os.fspath(path), ".metadata")
    if not os.path.isfile(metadata):
        what = "does not exist" if not os.path.exists(path) else "holds no .metadata file"
        raise FileNotFoundError(
            f"checkpoint path {os.fspath(path)!r} {what}; expected a directory written by "
            "moekit.distributed.checkpoint.save"
        )


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def _check_fits(target: dict[str, Any], path: str | os.PathLike) -> None:
    """Refuse a checkpoint that does not fit `target`'s tensors: missing keys, other global shapes."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    flat: dict[str, object] = {}
    _flatten("", target, flat)
    missing, shapes = [], []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue  # hyperparameters, extra states: DCP loads them as it finds them
        if key not in metadata:
            missing.append(key)
        else:
            stored = metadata[key]
            if not isinstance(stored, TensorStorageMetadata):
                shapes.append(f"{key}: checkpoint holds a non-tensor, the model a tensor {tuple(value.shape)}")
            elif tuple(stored.size) != tuple(value.shape):
                shapes.append(f"{key}: checkpoint {tuple(stored.size)}, model {tuple(value.shape)}")
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if shapes:
        problems.append(f"global shapes differ: {shapes}")
    if problems:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} does not fit the model, nothing loaded: " + "; ".join(problems)
        )


def _check_interleave(model: nn.Module, path: str | os.PathLike, process_group: dist.ProcessGroup | None) -> None:
    """Refuse a checkpoint whose fc1 GLU interleave sizes differ from the model's."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    modules = dict(model.named_modules())
    # An integration's experts are stored in their model's own row order (fixed by its type).
    hf_paths = list(_converted_integrated_experts(modules))
    linears = {
        name: m
        for name, m in modules.items()
        if isinstance(m, GroupedLinear) and m.is_glu and not any(_inside(name, p) for p in hf_paths)
    }
    wanted = {f"model.{name}._extra_state": m for name, m in linears.items()}
    present = {key: m for key, m in wanted.items() if any(k == key or k.startswith(key + ".") for k in metadata)}
    stored = {"model": {key[len("model.") :]: m.get_extra_state() for key, m in present.items()}}
    if present:
        dcp.load(stored, checkpoint_id=path, process_group=process_group)
    bad = []
    for key, module in wanted.items():
        ours = module.glu_interleave_size
        if key in present:
            theirs = stored["model"][key[len("model.") :]].get("glu_interleave_size")
            if theirs != ours:
                bad.append(f"{key[len('model.') : -len('._extra_state')]}: checkpoint {theirs}, model {ours}")
        elif ours is not None:
            bad.append(f"{key[len('model.') : -len('._extra_state')]}: checkpoint does not record it, model {ours}")
    if bad:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} has fc1 rows in another GLU interleave order, nothing loaded: {bad}. "
            "Load it into modules with the checkpoint's glu_interleave_size, or convert the rows first "
            "(moekit.interleave_glu / moekit.deinterleave_glu on the full tensors)"
        )


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load a checkpoint written by `save` (any world size, EP degree, layout) into `model` (and
    `optimizer`), in place; every rank calls it. Raises FileNotFoundError (on every rank, before
    any collective) when `path` holds no DCP checkpoint, and ValueError before changing any tensor
    when the checkpoint does not fit."""
    check_checkpoint_exists(path)
    entries, replaced = _expert_entries(model)
    target = {"model": _model_state(model, entries, replaced, fresh=True)}
    # The GLU interleave sizes are compared (and a checkpoint without them judged) by _check_interleave.
    glu = {f"{name}._extra_state" for name, m in model.named_modules() if isinstance(m, GroupedLinear)}
    target["model"] = {k: v for k, v in target["model"].items() if k not in glu}
    osd = None
    # The model is checked before the optimizer state is read: reading it builds an empty state.
    _check_fits(target, path)
    _check_interleave(model, path, process_group)
    if optimizer is not None:
        target["optim"], osd = _optim_state(model, optimizer, entries, fresh=True)
        _check_fits({"optim": target["optim"]}, path)
    dcp.load(target, checkpoint_id=path, process_group=process_group)
    for entry in entries:
        _write_back(entry, target["model"][entry.key], entry.params)
    if optimizer is None or osd is None:  # (osd is read with the optimizer)
        return
    loaded = target["optim"]
    state = dict(osd["state"])
    for entry in entries:
        if entry.key not in loaded["state"]:
            continue
        stored = loaded["state"][entry.key]
        for state_name, value in stored.items():
            members = [state[name] for name in entry.param_names if name in state]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                _write_back(entry, value, [m[state_name] for m in members])
            else:
                for m in members:
                    m[state_name] = value.clone() if isinstance(value, torch.Tensor) else value
    groups = [
        {**g_loaded, "params": g_own["params"]}
        for g_loaded, g_own in zip(loaded["param_groups"], osd["param_groups"], strict=True)
    ]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups})
