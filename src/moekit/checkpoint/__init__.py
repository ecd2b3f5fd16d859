"""Checkpoints: the one place that knows checkpoint formats.

- `files`: safetensors headers validated as strictly as the safetensors library does, streaming
  reads and writes, temporary outputs that are cleaned up, ordinary file modes;
- `metadata`: the one vocabulary of moekit's file metadata (expert-group records) and of a
  GroupedLinear's extra state;
- `layout`: the key patterns of every naming scheme (Hugging Face, Mixtral, TransformerEngine /
  moekit), the expert-group analysis, the GLU row-order conversion and GroupedLinear's state-dict
  loading;
- `convert`: `moekit convert` / `moekit inspect`;
- `modules`: `save_safetensors` / `read_safetensors` / `load_safetensors` for modules.
"""

from moekit.checkpoint.convert import ConvertResult, convert_checkpoint, format_inspection
from moekit.checkpoint.errors import CheckpointError
from moekit.checkpoint.files import Checkpoint
from moekit.checkpoint.layout import analyze
from moekit.checkpoint.modules import load_safetensors, read_safetensors, save_safetensors

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConvertResult",
    "analyze",
    "convert_checkpoint",
    "format_inspection",
    "load_safetensors",
    "read_safetensors",
    "save_safetensors",
]
