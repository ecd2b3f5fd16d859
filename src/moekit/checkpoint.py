"""safetensors files for modules holding moekit layers, in any expert layout.

safetensors stores tensors only; moekit's per-module extra state (e.g. the GLU interleave size of an
fc1) travels as JSON in the file's metadata under `moekit.extra_state`, so that loading converts
between interleave sizes exactly as an in-memory `load_state_dict` does. Tensors that share storage
(discrete expert weights are views of one buffer) are written as separate tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

EXTRA_STATE_METADATA_KEY = "moekit.extra_state"


def save_safetensors(module_or_state: nn.Module | dict, path: str | os.PathLike) -> None:
    """Write a module's state_dict (or a state dict) to a safetensors file, atomically."""
    from safetensors.torch import save_file

    state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
    tensors, extra = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value.detach().contiguous().clone()
        elif key.endswith("_extra_state"):
            extra[key] = value
        else:
            raise TypeError(
                f"state entry {key!r} is a {type(value).__name__}; only tensors and extra states can be saved"
            )
    metadata = {"format": "pt", EXTRA_STATE_METADATA_KEY: json.dumps(extra)}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def read_safetensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """Read a safetensors file into a state dict, restoring moekit's extra states if recorded."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    state: dict = dict(load_file(str(path), device=str(device)))
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if EXTRA_STATE_METADATA_KEY in metadata:
        state.update(json.loads(metadata[EXTRA_STATE_METADATA_KEY]))
    return state


def load_safetensors(module: nn.Module, path: str | os.PathLike, *, strict: bool = True):
    """Load a safetensors file into `module` (layouts and interleave sizes are converted)."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return module.load_state_dict(read_safetensors(path, device=device), strict=strict)
