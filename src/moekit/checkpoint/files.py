"""safetensors files: strict header validation, raw reads, streaming writes, atomic replacement.

A safetensors file is an 8-byte little-endian header length, a JSON header (`{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`), then the tensor data. Headers
are checked by the rules of the safetensors library (header at most 100 MB and inside the file, a
JSON object, every entry with a known dtype, a shape of non-negative ints and offsets that match
them, the entries tiling the data exactly to the end of the file), with a message that names the
problem, and then opened with the library itself (`safe_open`), so that no file it would reject is
read. A key defined twice in a header is refused too (the library keeps the last definition).

Files are written to a hidden sibling named `.{name}.moekit-{tool}-tmp-{pid}` and renamed into
place; a run finds and removes such siblings left by a process that no longer exists (a SIGKILL).
Written files get the ordinary mode of a new file (0644 under umask 022).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from moekit.checkpoint.errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit

# bits per element of every dtype the safetensors format defines
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
_TORCH_DTYPE = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _TORCH_DTYPE[getattr(torch, _name)] = _code


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, located but not read."""

    key: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise CheckpointError([f"key {key!r} is defined twice in the header; which definition is meant is unknown"])
        seen[key] = value
    return seen


def _entry_problem(key: str, entry: object) -> str | None:
    """Why one header entry is not a tensor entry the safetensors library accepts, or None."""
    if not isinstance(entry, dict):
        return f"header entry {key!r} is a {type(entry).__name__}; expected an object with dtype, shape, data_offsets"
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            return f"header entry {key!r} has no {field!r}"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        return f"tensor {key!r} has unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BITS)}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return f"tensor {key!r} has shape {shape!r}; expected a list of non-negative ints"
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
    ):
        return f"tensor {key!r} has data_offsets {offsets!r}; expected [begin, end] (non-negative ints)"
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if offsets[1] < offsets[0] or bits % 8 or offsets[1] - offsets[0] != bits // 8:
        return (
            f"tensor {key!r}: {dtype} {shape} needs {bits / 8:g} bytes, but its data_offsets {offsets} "
            f"span {offsets[1] - offsets[0]}"
        )
    return None


def read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors and metadata of one safetensors file; CheckpointError on any malformed header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    [f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)"]
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise CheckpointError(
                    [
                        f"{path}: not a safetensors file or truncated: its header claims "
                        f"{human_bytes(header_len)} ({header_len} bytes), the file holds {size}"
                    ]
                )
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    [f"{path}: header of {header_len} bytes exceeds safetensors' limit of {MAX_HEADER_BYTES}"]
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError([f"{path}: cannot read ({exc.strerror or exc})"]) from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except CheckpointError as exc:
        raise CheckpointError([f"{path}: {p}" for p in exc.problems]) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError([f"{path}: not a safetensors file: its header is not JSON ({exc})"]) from None
    if not isinstance(header, dict):
        raise CheckpointError([f"{path}: safetensors header is a JSON {type(header).__name__}; expected an object"])
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError([f"{path}: __metadata__ must map strings to strings, got {metadata!r:.200}"])
    problems = [p for key, entry in header.items() if (p := _entry_problem(key, entry))]
    if problems:
        raise CheckpointError([f"{path}: {p}" for p in problems])
    data_len = size - 8 - header_len
    expected = 0
    for key, entry in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = entry["data_offsets"]
        if begin != expected:
            problems.append(
                f"tensor {key!r} starts at data byte {begin}, expected {expected} (tensors overlap or leave a gap)"
            )
        expected = max(expected, end)
    if expected != data_len:
        problems.append(
            f"the tensors cover {expected} data bytes, the file holds {data_len} "
            + ("(truncated)" if expected > data_len else "(trailing bytes)")
        )
    if problems:
        raise CheckpointError([f"{path}: {p}" for p in problems])
    _open_with_library(path)
    tensors = {
        key: TensorEntry(
            key,
            path,
            e["dtype"],
            tuple(e["shape"]),
            8 + header_len + e["data_offsets"][0],
            e["data_offsets"][1] - e["data_offsets"][0],
        )
        for key, e in header.items()
    }
    return tensors, metadata


def _open_with_library(path: Path) -> None:
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError(
            ["reading safetensors files needs the safetensors package: pip install 'moekit[io]'"]
        ) from None
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as exc:  # the library's SafetensorError and the errors of opening a file
        raise CheckpointError([f"{path}: the safetensors library refuses it: {exc}"]) from None


def read_bytes(t: TensorEntry, offset: int = 0, nbytes: int | None = None) -> bytes:
    nbytes = t.nbytes - offset if nbytes is None else nbytes
    with open(t.file, "rb") as f:
        f.seek(t.start + offset)
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise CheckpointError([f"{t.file}: tensor {t.key!r} is truncated (the file changed while being read)"])
    return data


def safetensors_dtype(dtype: torch.dtype) -> str:
    if dtype not in _TORCH_DTYPE:
        raise TypeError(f"dtype {dtype} cannot be stored in a safetensors file")
    return _TORCH_DTYPE[dtype]


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---- writing ---------------------------------------------------------------------------------


@dataclasses.dataclass
class OutputTensor:
    """A tensor to write: its bytes come from `produce`, piece by piece, when the file is written."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    produce: Callable[[], Iterator[bytes]]
    source_key: str = ""  # for conversions: the source tensor whose shard this one goes to


def write_safetensors(
    path: Path, outputs: list[OutputTensor], metadata: dict[str, str], on_tensor: Callable[[int], None] | None = None
) -> None:
    """Write `outputs` in order to a new file `path` (header first, then the data, streamed).

    on_tensor(nbytes) is called after each tensor is written (progress reports)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for out in outputs:
        header[out.key] = {"dtype": out.dtype, "shape": list(out.shape), "data_offsets": [offset, offset + out.nbytes]}
        offset += out.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data start to 8 bytes
    if len(blob) > MAX_HEADER_BYTES:
        raise CheckpointError(
            [
                f"{path}: its header would take {len(blob):,} bytes ({len(outputs):,} tensors), more than "
                f"safetensors reads (at most {MAX_HEADER_BYTES:,})"
            ]
        )
    with open(path, "xb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for out in outputs:
            written = 0
            for piece in out.produce():
                f.write(piece)
                written += len(piece)
            if written != out.nbytes:
                raise RuntimeError(f"internal error: {out.key} produced {written} bytes, expected {out.nbytes}")
            if on_tensor is not None:
                on_tensor(out.nbytes)
        f.flush()
        os.fsync(f.fileno())


def tensor_output(key: str, t: torch.Tensor) -> OutputTensor:
    t = t.detach()
    return OutputTensor(
        key,
        safetensors_dtype(t.dtype),
        tuple(t.shape),
        t.numel() * t.element_size(),
        lambda: iter([tensor_bytes(t)]),
        key,
    )


# ---- temporary siblings and modes ------------------------------------------------------------

_TEMP = re.compile(r"^\.(?P<name>.+)\.moekit-(?P<tool>[a-z]+)-tmp-(?P<pid>[1-9][0-9]*)$")


def temp_sibling(dst: Path, tool: str) -> Path:
    """The hidden temporary path a run of `tool` writes before renaming onto `dst`."""
    return dst.with_name(f".{dst.name}.moekit-{tool}-tmp-{os.getpid()}")


def _process_exists(pid: int) -> bool:
    """Whether process `pid` runs; True (leave its file alone) where no process can have that id."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_temps(dst: Path) -> list[Path]:
    """Remove temporary siblings of `dst` left by moekit runs whose process is gone; return them."""
    removed: list[Path] = []
    try:
        siblings = list(dst.parent.iterdir())
    except OSError:
        return removed
    for p in siblings:
        m = _TEMP.match(p.name)
        if not m or m["name"] != dst.name or int(m["pid"]) == os.getpid() or _process_exists(int(m["pid"])):
            continue
        remove_path(p)
        removed.append(p)
    return removed


def remove_path(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink(missing_ok=True)


def check_destination(dst: str | os.PathLike, *, directory: bool) -> Path:
    """Refuse a destination that exists or cannot be created, before anything is written.

    dst: as the user gave it (a trailing slash asks for a folder, which a single file cannot be)."""
    text = os.fspath(dst)
    path = Path(text)
    if not directory and text.endswith(("/", os.sep)):
        raise CheckpointError(
            [
                f"{text} names a folder, but this source converts to a single file; give a file "
                f"name (e.g. {path / 'model.safetensors'}, with the folder created first)"
            ]
        )
    if path.exists() or path.is_symlink():
        raise CheckpointError([f"{path} exists; moekit does not overwrite (remove it or choose another name)"])
    if not path.parent.is_dir():
        raise CheckpointError(
            [f"the folder {path.parent} does not exist; create it first or choose another destination"]
        )
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise CheckpointError([f"the folder {path.parent} is not writable; choose a destination you can write to"])
    return path


# ---- checkpoints of one file or many ---------------------------------------------------------

EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_moe_experts")


class Checkpoint:
    """A safetensors checkpoint: one file, or shards listed by an index JSON (`weight_map`), or a
    folder holding either. Every header is validated; nothing is read beyond the headers here."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.path = path
        self.index_path: Path | None = None
        if path.is_dir():
            indexes = sorted(path.glob("*.safetensors.index.json"))
            singles = sorted(path.glob("*.safetensors"))
            if len(indexes) > 1:
                raise CheckpointError([f"{path}: more than one index file: {[p.name for p in indexes]}"])
            if indexes:
                self.index_path = indexes[0]
            elif len(singles) == 1:
                path = singles[0]
            else:
                raise CheckpointError(
                    [
                        f"{path}: a folder without *.safetensors.index.json must hold exactly one "
                        f"*.safetensors file; it holds {len(singles)}"
                    ]
                )
        elif not path.exists():
            raise CheckpointError([f"{path}: no such file or folder"])
        elif path.name.endswith(".json"):
            self.index_path = path
        self.tensors: dict[str, TensorEntry] = {}
        self.metadata: dict[str, str] = {}
        self.index_metadata: dict = {}
        if self.index_path is None:
            self.files = [path]
            self.tensors, self.metadata = read_header(path)
        else:
            self._read_index()

    def _read_index(self) -> None:
        assert self.index_path is not None
        try:
            index = json.loads(self.index_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError([f"{self.index_path}: not a readable index JSON ({exc})"]) from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                [
                    f"{self.index_path}: an index must be a JSON object whose 'weight_map' maps "
                    "tensor names to shard file names"
                ]
            )
        self.index_metadata = index.get("metadata") or {}
        self.files = [self.index_path.parent / name for name in sorted(set(weight_map.values()))]
        problems: list[str] = []
        for file in self.files:
            if not file.is_file():
                problems.append(f"index lists {file.name}, which does not exist")
                continue
            try:
                tensors, metadata = read_header(file)
            except CheckpointError as exc:
                problems += exc.problems
                continue
            self.metadata = self.metadata or metadata
            for key, t in tensors.items():
                if key in self.tensors:
                    problems.append(f"tensor {key!r} is in both {self.tensors[key].file.name} and {file.name}")
                elif weight_map.get(key) != file.name:
                    problems.append(f"{file.name} holds {key!r}, which the index maps to {weight_map.get(key)}")
                self.tensors.setdefault(key, t)
        problems += [
            f"index lists {key!r} in {name}, which does not hold it"
            for key, name in weight_map.items()
            if key not in self.tensors and (self.index_path.parent / name).is_file()
        ]
        if problems:
            raise CheckpointError(problems)

    @property
    def sharded(self) -> bool:
        return self.index_path is not None

    @property
    def folder(self) -> Path:
        return self.index_path.parent if self.index_path is not None else self.files[0].parent

    def read(self, key: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        return read_bytes(self.tensors[key], offset, nbytes)

    def configured_num_experts(self) -> tuple[int, str] | None:
        """(experts per layer, where it is said) from a config.json beside the checkpoint, if any.

        A config.json that is there but cannot be read as JSON is refused (CheckpointError), not
        skipped: it is what says how many experts a complete checkpoint holds."""
        config = self.folder / "config.json"
        if not config.exists():
            return None
        try:
            data = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(
                [
                    f"{config}: cannot be read as JSON ({exc}); moekit reads it for the number "
                    "of experts: fix it or move it away"
                ]
            ) from exc
        pending = [data]
        while pending:
            node = pending.pop(0)
            if not isinstance(node, dict):
                continue
            for field in EXPERT_COUNT_FIELDS:
                value = node.get(field)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value, f"{config} ({field}={value})"
            pending += [v for v in node.values() if isinstance(v, dict)]  # e.g. text_config
        return None
