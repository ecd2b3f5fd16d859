"""safetensors files for modules holding moekit layers, in any expert layout.

safetensors stores tensors only; the GLU row order of each GroupedLinear travels as a group record in
the file's metadata (`moekit.checkpoint.metadata`), the same records `moekit convert` writes and
reads, so that loading converts between layouts and interleave sizes exactly as an in-memory
`load_state_dict` does. Tensors that share storage (discrete expert weights are views of one buffer)
are written as separate tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moekit.checkpoint.errors import CheckpointError
from moekit.checkpoint.files import (
    Checkpoint,
    remove_path,
    remove_stale_temps,
    temp_sibling,
    tensor_output,
    write_safetensors,
)
from moekit.checkpoint.metadata import (
    EXTRA_STATE_SUFFIX,
    extra_states_from_records,
    file_metadata,
    other_extra_states,
    read_records,
    records_from_state,
)

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys  # what Module.load_state_dict returns


def save_safetensors(module_or_state: nn.Module | dict, path: str | os.PathLike) -> None:
    """Write a module's state_dict (or a state dict) to a safetensors file, atomically.

    The file gets the ordinary mode of a new file (0644 under umask 022) and replaces `path` if it
    exists; a temporary file left by a killed earlier save to the same path is removed."""
    state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
    tensors, extra = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif key.endswith(EXTRA_STATE_SUFFIX):
            extra[key] = value
        else:
            raise TypeError(
                f"state entry {key!r} is a {type(value).__name__}; only tensors and extra states can be saved"
            )
    records, others = records_from_state(extra, {key: tuple(t.shape) for key, t in tensors.items()})
    try:
        json.dumps(others)
    except TypeError as exc:
        raise TypeError(
            f"extra states {sorted(others)} must be JSON-serialisable to go into a safetensors file ({exc})"
        ) from None
    path = Path(path)
    if not path.parent.is_dir():
        raise CheckpointError([f"the folder {path.parent} does not exist; create it first"])
    remove_stale_temps(path)
    tmp = temp_sibling(path, "save")
    outputs = [tensor_output(key, t) for key, t in sorted(tensors.items())]
    try:
        write_safetensors(tmp, outputs, file_metadata(records, others))
        os.replace(tmp, path)
    except BaseException:
        remove_path(tmp)
        raise


def read_safetensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """Read a safetensors checkpoint (a file, an index JSON or a folder) into a state dict, with the
    extra states of its GroupedLinears rebuilt from the file's records. Headers are validated
    (CheckpointError, a ValueError, for a malformed file)."""
    ckpt = Checkpoint(path)  # validates every header (and says how to install safetensors if missing)
    from safetensors import safe_open

    state: dict = {}
    for file in ckpt.files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            state.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 (safe_open is no dict)
    state.update(extra_states_from_records(read_records(ckpt.metadata, str(ckpt.path))))
    state.update(other_extra_states(ckpt.metadata, str(ckpt.path)))
    return state


def load_safetensors(module: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> _IncompatibleKeys:
    """Load a safetensors checkpoint into `module` (layouts and interleave sizes are converted)."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return module.load_state_dict(read_safetensors(path, device=device), strict=strict)
