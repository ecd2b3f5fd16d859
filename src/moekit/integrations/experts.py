"""The type by which moekit's own tools know an integration's experts module, with no import of the
integrated library.

`moekit.distributed` (FSDP2 units and their shard placement, DCP checkpoints) must recognise the
experts modules that an integration (`moekit.integrations.transformers`) puts into another
library's model, without importing that library: it asks `isinstance(module, IntegratedExperts)`
and reads the facts below, never a class name.

Legend: N experts, O a linear's out features.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from moekit.nn.grouped_mlp import GroupedMLP
from moekit.ops.quantize import QuantizedWeightCache


class IntegratedExperts(nn.Module):
    """Base class of the experts modules moekit's integrations put into other libraries' models.

    Such a module holds its expert tensors one of two ways:
    - under the model's own names and in its layout (`converted_mlp()` is None): they are
      ordinary parameters of the model to every tool that finds parameters by name; moekit's FSDP2
      placement cuts them by its experts rule (`expert_parameters`);
    - converted into a moekit `GroupedMLP` child named `grouped_mlp` (another layout, e.g. per-expert
      weights): state dicts and checkpoints still carry the model's names (`model_tensor_names`),
      transposed where the model stores its weights `[N, in, out]` (`stores_transposed`).

    Subclasses set `model_tensor_names` and `stores_transposed`; the module's own `__init__` is not
    relied on (an integration may turn an existing module into one).
    """

    # (GroupedMLP linear, parameter kind) -> that tensor's name in the model.
    model_tensor_names: ClassVar[dict[tuple[str, str], str]] = {}
    # Whether the model stores its expert weights [N, in, out] (transposed against moekit's [N, out, in]).
    stores_transposed: bool = False

    def converted_mlp(self) -> GroupedMLP | None:
        """The GroupedMLP these experts were converted into, or None where they run on the model's
        own parameters under its own names."""
        mlp = self._modules.get("grouped_mlp")
        return mlp if isinstance(mlp, GroupedMLP) else None

    def moekit_weight_caches(self) -> tuple[QuantizedWeightCache, ...]:
        """The quantized-weight caches these experts keep across calls on the model's own parameters
        (none here; an integration with quantized compute returns its own). A converted module's are its
        GroupedMLP's."""
        return ()

    def expert_parameters(self) -> list[tuple[nn.Parameter, int]]:
        """The expert parameters this module holds under the model's names (each (N, ...)), each with
        the dim of its out features (1, or 2 for a transposed weight); empty once converted."""
        out = []
        for (_, kind), name in self.model_tensor_names.items():
            param = self._parameters.get(name)
            if param is not None:
                out.append((param, 2 if kind == "weight" and self.stores_transposed else 1))
        return out


__all__ = ["IntegratedExperts"]
