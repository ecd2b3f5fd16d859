"""moekit: grouped linears, grouped MLPs and MoE layers for training Mixture-of-Experts models.

The public names below are imported on first use (PEP 562 `__getattr__`): `import moekit` does not
import torch, so the `moekit` command can install its Ctrl-C handling before anything heavy loads,
and `moekit --version` answers at once. `from moekit import GroupedLinear` works as ever.
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# THE table of moekit's public names: name -> the module that defines it (a module's own name for a
# public submodule). Add an export here, and only here.
_EXPORTS = {
    "ACTIVATIONS": "moekit.ops.activations",
    "GroupedLinear": "moekit.nn",
    "GroupedMLP": "moekit.nn",
    "GroupedTensor": "moekit.grouped_tensor",
    "MoELayer": "moekit.nn",
    "QuantizedWeightCache": "moekit.ops.quantize",
    "TopKRouter": "moekit.nn",
    "deinterleave_glu": "moekit.ops.glu",
    "glu": "moekit.ops.glu",
    "group_dequantize": "moekit.ops.quantize",
    "group_quantize": "moekit.ops.quantize",
    "grouped_linear": "moekit.ops.grouped_linear",
    "grouped_mlp": "moekit.ops.grouped_mlp",
    "interleave_glu": "moekit.ops.glu",
    "load_safetensors": "moekit.checkpoint",
    "moe_experts": "moekit.ops.moe_experts",
    "permute": "moekit.ops.rows",
    "read_safetensors": "moekit.checkpoint",
    "reference": "moekit.reference",
    "save_safetensors": "moekit.checkpoint",
    "set_autotune": "moekit.ops.runtime.backends",
    "swiglu": "moekit.ops.glu",
    "topk_softmax": "moekit.ops.topk",
    "unpermute": "moekit.ops.rows",
}

__all__ = sorted(["__version__", *_EXPORTS])


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if _EXPORTS[name] == f"{__name__}.{name}" else getattr(module, name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # moekit.nn, moekit.ops, ...: as when eager
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
