"""`moekit convert` / `moekit inspect`: expert-weight layouts of safetensors checkpoints.

Legend: N experts, H hidden size, F expert ffn size; fc1 maps H -> 2F (gate and up), fc2 F -> H.

Expert groups recognised by key names (a "prefix" is everything before the expert part):
- Hugging Face per-expert: `{prefix}.{i}.gate_proj|up_proj|down_proj.weight|bias` (`prefix` ends in
  `experts`), or Mixtral's original `w1|w3|w2` for gate|up|down.
- Hugging Face grouped (transformers 5.x's fused tensors): `{prefix}.gate_up_proj [N, 2F, H]`,
  `{prefix}.down_proj [N, H, F]`, optional `{prefix}.gate_up_proj_bias [N, 2F]`, `{prefix}.down_proj_bias [N, H]`.
- TransformerEngine per-expert: `{prefix}.weight{i} [out, in]`, `{prefix}.bias{i} [out]`; grouped:
  `{prefix}.weight [N, out, in]`, `{prefix}.bias [N, out]` (recognised as grouped only where moekit's
  metadata says so, as a 3-D `weight` could be anything). A prefix whose last part contains `fc1` is a
  GLU fc1 (rows gate and up), `fc2` an fc2; other TE prefixes are plain grouped linears.

Fused fc1 tensors (HF `gate_up_proj`, TE fc1) hold gate and up rows either concatenated
(`[gates; ups]`) or interleaved in blocks of k (`glu_interleave_size`, see design.md). That order is
not visible in the tensors: it is read from moekit's metadata, or given (`src_glu_interleave`), and
the conversion refuses where it is neither.

Conversion streams: tensors are read and written one expert at a time (non-expert tensors in
pieces of at most 64 MiB), and output files are written by this module directly (header first,
then the data in order), so memory stays around one expert's tensors, far below one layer's.
Output goes to a temporary sibling of the destination, is verified by converting it back in memory
and comparing every source tensor bit for bit, and only then renamed into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import struct
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from moekit.ops.swiglu import deinterleave_glu, interleave_glu

FORMAT_VERSION = "1"
META_LAYOUT = "moekit.layout"
META_GLU = "moekit.glu_interleave_size"
META_GROUPS = "moekit.expert_groups"
META_FORMAT = "moekit.format_version"
COPY_PIECE_BYTES = 64 << 20
KEEP = "keep"

_HF_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<kind>weight|bias)$"
)
_HF_GROUPED = re.compile(r"^(?P<prefix>.*experts)\.(?P<name>gate_up_proj|down_proj)(?P<bias>_bias)?$")
_TE_PER_EXPERT = re.compile(r"^(?P<prefix>.+)\.(?P<kind>weight|bias)(?P<index>\d+)$")
_LOOKS_PER_EXPERT = re.compile(r"experts\.\d+\.")
_PROJ_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PART_NAME = {"hf": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
              "mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}


class CheckpointError(ValueError):
    """A conversion refused (nothing was written); the message lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems) if len(self.problems) == 1
                         else "\n  - " + "\n  - ".join(self.problems))


# ---- reading safetensors ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tensor:
    key: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _read_header(path: Path) -> tuple[dict[str, _Tensor], dict[str, str]]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError([f"{path}: not a safetensors file (shorter than 8 bytes)"])
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError([f"{path}: unreadable safetensors header ({exc})"]) from None
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for key, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[key] = _Tensor(key, path, entry["dtype"], tuple(entry["shape"]), 8 + size + begin, end - begin)
    return tensors, metadata


class Checkpoint:
    """A safetensors checkpoint: one file, or shards listed by an index JSON (`weight_map`)."""

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
                raise CheckpointError([f"{path}: no *.safetensors.index.json and not exactly one *.safetensors file"])
        elif path.name.endswith(".index.json"):
            self.index_path = path
        elif not path.is_file():
            raise CheckpointError([f"{path}: no such file or directory"])
        self.tensors: dict[str, _Tensor] = {}
        self.index_metadata: dict = {}
        problems: list[str] = []
        if self.index_path is None:
            self.files = [path]
            self.tensors, self.metadata = _read_header(path)
        else:
            index = json.loads(self.index_path.read_text())
            weight_map: dict[str, str] = index.get("weight_map", {})
            self.index_metadata = index.get("metadata", {}) or {}
            self.files = [self.index_path.parent / name for name in sorted(set(weight_map.values()))]
            self.metadata = {}
            for file in self.files:
                if not file.is_file():
                    problems.append(f"index lists {file.name}, which does not exist")
                    continue
                tensors, metadata = _read_header(file)
                self.metadata = self.metadata or metadata
                for key, t in tensors.items():
                    if key in self.tensors:
                        problems.append(f"duplicate tensor {key!r} in {self.tensors[key].file.name} and {file.name}")
                    elif weight_map.get(key) != file.name:
                        problems.append(f"{file.name} holds {key!r}, which the index maps to {weight_map.get(key)}")
                    self.tensors.setdefault(key, t)
            problems += [f"index lists {key!r} in {name}, which does not hold it"
                         for key, name in weight_map.items() if key not in self.tensors]
        if problems:
            raise CheckpointError(problems)

    @property
    def sharded(self) -> bool:
        return self.index_path is not None

    def read(self, key: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        t = self.tensors[key]
        nbytes = t.nbytes - offset if nbytes is None else nbytes
        with open(t.file, "rb") as f:
            f.seek(t.start + offset)
            data = f.read(nbytes)
        if len(data) != nbytes:
            raise CheckpointError([f"{t.file.name}: {key!r} is truncated"])
        return data


# ---- expert groups ---------------------------------------------------------------------------


@dataclasses.dataclass
class ExpertGroup:
    """One layer's experts (or one TE grouped linear) as found in a checkpoint.

    `parts` are the per-expert tensors in canonical form, name -> per-expert shape: for naming
    "hf"/"mixtral" `fc1_weight (2F, H)` (rows `[gates; ups]`), `fc2_weight (H, F)`, and with biases
    `fc1_bias (2F,)`, `fc2_bias (H,)`; for "te" `weight (out, in)` and maybe `bias (out,)`.
    """

    prefix: str
    naming: str  # "hf", "mixtral" (per-expert w1/w2/w3), "te"
    layout: str  # "per-expert" or "grouped"
    role: str  # "mlp" (hf/mixtral), "fc1", "fc2" or "linear" (te)
    num_experts: int
    dtype: str
    parts: dict[str, tuple[int, ...]]
    keys: list[str]  # the source tensors this group covers
    glu_interleave_size: int | None | str = None  # of fused fc1 tensors; "unknown" if not known

    @property
    def is_glu(self) -> bool:
        return self.role in ("mlp", "fc1")

    @property
    def fused_fc1(self) -> bool:
        """The group's fc1 gate/up rows live in one tensor in this layout."""
        return self.role == "fc1" or (self.role == "mlp" and self.layout == "grouped")

    def bytes_per_expert(self, part: str) -> int:
        numel = 1
        for d in self.parts[part]:
            numel *= d
        return numel * _itemsize(self.dtype)

    def describe(self) -> dict:
        return {"prefix": self.prefix, "naming": self.naming, "role": self.role, "num_experts": self.num_experts,
                "glu_interleave_size": self.glu_interleave_size if self.fused_fc1 else None}


_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def _itemsize(dtype: str) -> int:
    if dtype not in _ITEMSIZE:
        raise CheckpointError([f"dtype {dtype} is not supported by moekit convert"])
    return _ITEMSIZE[dtype]


@dataclasses.dataclass
class Analysis:
    groups: list[ExpertGroup]
    other_keys: list[str]
    problems: list[str]


def _index_of(indices: dict[int, str], index_text: str, key: str, problems: list[str], what: str) -> None:
    i = int(index_text)
    if i in indices:
        problems.append(f"{what}: expert index {i} appears twice ({indices[i]!r} and {key!r})")
    else:
        indices[i] = key


def _check_indices(what: str, indices: dict[int, str], num: int, problems: list[str]) -> None:
    missing = sorted(set(range(num)) - set(indices))
    if missing:
        problems.append(f"{what}: missing expert indices {missing} (found {len(indices)} of 0..{num - 1})")


def analyze(ckpt: Checkpoint, src_glu_interleave: int | None | str = KEEP) -> Analysis:
    """Find the expert groups of a checkpoint and every problem that would make a conversion unsafe.

    `src_glu_interleave`: the fc1 gate/up order of fused source tensors that moekit's metadata does
    not record (None = `[gates; ups]`, k = interleaved); KEEP = not given.
    """
    problems: list[str] = []
    meta_groups = {g["prefix"]: g for g in json.loads(ckpt.metadata.get(META_GROUPS, "[]"))}
    hf_per: dict[str, dict[tuple[str, str], dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    hf_naming: dict[str, set[str]] = defaultdict(set)
    hf_grouped: dict[str, dict[str, str]] = defaultdict(dict)
    te_per: dict[str, dict[str, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    te_grouped: dict[str, dict[str, str]] = defaultdict(dict)
    claimed: set[str] = set()
    for key in sorted(ckpt.tensors):
        if m := _HF_PER_EXPERT.match(key):
            part = _PROJ_PART[m["proj"]]
            hf_naming[m["prefix"]].add("mixtral" if m["proj"].startswith("w") else "hf")
            _index_of(hf_per[m["prefix"]][(part, m["kind"])], m["index"], key, problems, m["prefix"])
        elif m := _HF_GROUPED.match(key):
            hf_grouped[m["prefix"]][m["name"] + (m["bias"] or "")] = key
        elif m := _TE_PER_EXPERT.match(key):
            _index_of(te_per[m["prefix"]][m["kind"]], m["index"], key, problems, m["prefix"])
        elif (key.endswith(".weight") or key.endswith(".bias")) and \
                meta_groups.get(key.rsplit(".", 1)[0], {}).get("naming") == "te":
            te_grouped[key.rsplit(".", 1)[0]][key.rsplit(".", 1)[1]] = key
        else:
            if _LOOKS_PER_EXPERT.search(key):
                problems.append(f"unrecognised per-expert tensor {key!r}; refusing rather than copying it as is")
            continue
        claimed.add(key)

    groups: list[ExpertGroup] = []
    for prefix in sorted(set(hf_per) & set(hf_grouped)) + sorted(set(te_per) & set(te_grouped)):
        problems.append(f"{prefix}: both per-expert and grouped tensors; the layout is ambiguous")
    for prefix, by_part in hf_per.items():
        if prefix in hf_grouped:
            continue
        if len(hf_naming[prefix]) > 1:
            problems.append(f"{prefix}: mixes gate_proj/up_proj/down_proj and w1/w3/w2 names; ambiguous")
            continue
        groups.append(_hf_per_expert_group(ckpt, prefix, hf_naming[prefix].pop(), by_part, problems))
    for prefix, names in hf_grouped.items():
        if prefix not in hf_per:
            groups.append(_hf_grouped_group(ckpt, prefix, names, meta_groups.get(prefix), problems))
    for prefix, by_kind in te_per.items():
        if prefix not in te_grouped:
            groups.append(_te_group(ckpt, prefix, "per-expert", by_kind, meta_groups.get(prefix), problems))
    for prefix, names in te_grouped.items():
        if prefix not in te_per:
            by_kind = {kind: {0: key} for kind, key in names.items()}
            groups.append(_te_group(ckpt, prefix, "grouped", by_kind, meta_groups.get(prefix), problems))
    groups = [g for g in groups if g is not None]
    for g in groups:
        _settle_glu_order(g, meta_groups.get(g.prefix), src_glu_interleave, problems)
    missing_meta = sorted(set(meta_groups) - {g.prefix for g in groups})
    if missing_meta:
        problems.append(f"metadata lists expert groups {missing_meta} that the checkpoint does not hold")
    groups.sort(key=lambda g: g.prefix)
    other = sorted(set(ckpt.tensors) - claimed)
    return Analysis(groups, other, problems)


def _same(values: dict[str, tuple], what: str, problems: list[str]) -> tuple | None:
    distinct = sorted(set(values.values()))
    if len(distinct) == 1:
        return distinct[0]
    problems.append(f"{what} disagree: " + ", ".join(f"{k} {v}" for k, v in sorted(values.items())))
    return None


def _hf_per_expert_group(ckpt, prefix, naming, by_part, problems) -> ExpertGroup | None:
    n_before = len(problems)
    num = 1 + max(max(indices) for indices in by_part.values())
    has_bias = any(kind == "bias" for _, kind in by_part)
    needed = [(p, k) for k in (("weight", "bias") if has_bias else ("weight",)) for p in ("gate", "up", "down")]
    for part_kind in needed:
        name = f"{prefix}.*.{_PART_NAME[naming][part_kind[0]]}.{part_kind[1]}"
        _check_indices(name, by_part.get(part_kind, {}), num, problems)
    keys = [key for indices in by_part.values() for key in indices.values()]
    shapes = {key: ckpt.tensors[key].shape for key in keys}
    dtype = _same({key: (ckpt.tensors[key].dtype,) for key in keys}, f"{prefix}: dtypes", problems)

    def shape_of(part, kind):
        return _same({key: shapes[key] for key in by_part.get((part, kind), {}).values()},
                     f"{prefix}: shapes of {_PART_NAME[naming][part]}.{kind}", problems)

    gate, up, down = shape_of("gate", "weight"), shape_of("up", "weight"), shape_of("down", "weight")
    if gate and up and down:
        if len(gate) != 2 or gate != up or down != (gate[1], gate[0]):
            problems.append(f"{prefix}: gate {gate}, up {up}, down {down} are not [F, H], [F, H], [H, F]")
    if has_bias and gate and down:
        ffn, hidden = gate
        for part, want in (("gate", (ffn,)), ("up", (ffn,)), ("down", (hidden,))):
            got = shape_of(part, "bias")
            if got is not None and got != want:
                problems.append(f"{prefix}: {_PART_NAME[naming][part]}.bias has shape {got}, expected {want}")
    if len(problems) > n_before:
        return None
    ffn, hidden = gate
    parts = {"fc1_weight": (2 * ffn, hidden), "fc2_weight": (hidden, ffn)}
    if has_bias:
        parts.update({"fc1_bias": (2 * ffn,), "fc2_bias": (hidden,)})
    group = ExpertGroup(prefix, naming, "per-expert", "mlp", num, dtype[0], parts, keys)
    group._per_expert = by_part  # (part, kind) -> {index: key}
    return group


def _hf_grouped_group(ckpt, prefix, names, meta, problems) -> ExpertGroup | None:
    for name in ("gate_up_proj", "down_proj"):
        if name not in names:
            problems.append(f"{prefix}: has {sorted(names)} but no {name}")
    if "gate_up_proj_bias" in names and "down_proj_bias" not in names or \
            "down_proj_bias" in names and "gate_up_proj_bias" not in names:
        problems.append(f"{prefix}: only one of gate_up_proj_bias / down_proj_bias")
    if any(f"{prefix}: " in p for p in problems):
        return None
    t = {name: ckpt.tensors[key] for name, key in names.items()}
    gate_up, down = t["gate_up_proj"].shape, t["down_proj"].shape
    if len(gate_up) != 3 or len(down) != 3 or gate_up[0] != down[0]:
        problems.append(f"{prefix}: gate_up_proj {gate_up} and down_proj {down} are not [N, 2F, H] and [N, H, F]")
        return None
    num, hidden, ffn = down  # if stored [N, out, in]
    if gate_up[1:] != (2 * ffn, hidden) and gate_up[1:] == (ffn, 2 * hidden):
        # down [N, F, H] and gate_up [N, H, 2F]: the shapes tell the orientation apart, always.
        problems.append(f"{prefix}: gate_up_proj {gate_up} / down_proj {down} are stored [N, in, out] "
                        "(gpt-oss style); moekit convert handles [N, out, in] only")
        return None
    if gate_up[1:] != (2 * ffn, hidden):
        problems.append(f"{prefix}: gate_up_proj {gate_up} does not match down_proj {down} ([N, 2F, H] vs [N, H, F])")
        return None
    parts = {"fc1_weight": (2 * ffn, hidden), "fc2_weight": (hidden, ffn)}
    if "gate_up_proj_bias" in t:
        for name, want in (("gate_up_proj_bias", (num, 2 * ffn)), ("down_proj_bias", (num, hidden))):
            if t[name].shape != want:
                problems.append(f"{prefix}: {name} has shape {t[name].shape}, expected {want}")
        parts.update({"fc1_bias": (2 * ffn,), "fc2_bias": (hidden,)})
    dtype = _same({name: (x.dtype,) for name, x in t.items()}, f"{prefix}: dtypes", problems)
    if dtype is None:
        return None
    naming = (meta or {}).get("naming", "hf")
    group = ExpertGroup(prefix, naming if naming in _PART_NAME else "hf", "grouped", "mlp", num, dtype[0], parts,
                        list(names.values()))
    group._grouped = names
    return group


def _te_group(ckpt, prefix, layout, by_kind, meta, problems) -> ExpertGroup | None:
    n_before = len(problems)
    last = prefix.rsplit(".", 1)[-1]
    role = "fc1" if "fc1" in last else "fc2" if "fc2" in last else "linear"
    keys = [key for indices in by_kind.values() for key in indices.values()]
    if "weight" not in by_kind:
        problems.append(f"{prefix}: bias tensors without weight tensors")
        return None
    dtype = _same({key: (ckpt.tensors[key].dtype,) for key in keys}, f"{prefix}: dtypes", problems)
    if layout == "per-expert":
        num = 1 + max(max(indices) for indices in by_kind.values())
        for kind, indices in by_kind.items():
            _check_indices(f"{prefix}.{kind}{{i}}", indices, num, problems)
        shapes = {kind: _same({key: ckpt.tensors[key].shape for key in indices.values()},
                              f"{prefix}: shapes of {kind}{{i}}", problems) for kind, indices in by_kind.items()}
    else:
        full = {kind: ckpt.tensors[indices[0]].shape for kind, indices in by_kind.items()}
        num = full["weight"][0]
        shapes = {kind: shape[1:] for kind, shape in full.items()}
        if any(shape[0] != num for shape in full.values()):
            problems.append(f"{prefix}: weight {full['weight']} and bias {full.get('bias')} disagree on N")
    if len(problems) > n_before:
        return None
    weight = shapes["weight"]
    if len(weight) != 2:
        problems.append(f"{prefix}: weight{{i}} has shape {weight}, expected [out, in]")
    elif "bias" in shapes and shapes["bias"] != (weight[0],):
        problems.append(f"{prefix}: bias has shape {shapes['bias']}, expected ({weight[0]},)")
    elif role == "fc1" and weight[0] % 2:
        problems.append(f"{prefix}: a GLU fc1 needs an even number of output rows (2F), got {weight[0]}")
    if len(problems) > n_before:
        return None
    group = ExpertGroup(prefix, "te", layout, role, num, dtype[0], dict(shapes), keys)
    group._te = by_kind
    return group


def _settle_glu_order(group: ExpertGroup, meta: dict | None, given, problems: list[str]) -> None:
    """Set the fc1 gate/up order of the group's fused source tensors, or record why it is unknown."""
    if not group.fused_fc1:
        group.glu_interleave_size = None
        return
    recorded = (meta or {}).get("glu_interleave_size", KEEP) if meta else KEEP
    if recorded != KEEP and given != KEEP and recorded != given:
        problems.append(f"{group.prefix}: metadata records glu_interleave_size={recorded}, "
                        f"but --src-glu-interleave says {given}")
    order = recorded if recorded != KEEP else given
    if order == KEEP:
        group.glu_interleave_size = "unknown"
        return
    ffn = group.parts["fc1_weight" if group.role == "mlp" else "weight"][0] // 2
    if order is not None and ffn % order:
        problems.append(f"{group.prefix}: glu_interleave_size {order} does not divide F={ffn}")
    group.glu_interleave_size = order


# ---- canonical per-expert reads and the output plan ------------------------------------------


class _Stats:
    def __init__(self) -> None:
        self.peak_bytes = 0  # the most bytes this module held from one read or one produced piece

    def note(self, nbytes: int) -> None:
        self.peak_bytes = max(self.peak_bytes, nbytes)


def _rows(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """bytes of a per-expert tensor -> uint8 (rows, bytes per row): reorders rows whatever the dtype."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(shape[0], -1)


def _reorder_fc1(rows: torch.Tensor, src: int | None, dst: int | None) -> torch.Tensor:
    if src == dst:
        return rows
    if src is not None:
        rows = deinterleave_glu(rows, src, dim=0)
    if dst is not None:
        rows = interleave_glu(rows, dst, dim=0)
    return rows


class _Reader:
    """Reads one expert's tensors of a group in canonical form (fc1 rows `[gates; ups]`)."""

    def __init__(self, ckpt: Checkpoint, stats: _Stats):
        self.ckpt, self.stats = ckpt, stats

    def _read(self, key, offset=0, nbytes=None) -> bytes:
        data = self.ckpt.read(key, offset, nbytes)
        self.stats.note(len(data))
        return data

    def canonical(self, g: ExpertGroup, part: str, i: int) -> torch.Tensor:
        shape = g.parts[part]
        per = g.bytes_per_expert(part)
        if g.naming == "te":
            if g.layout == "per-expert":
                data = self._read(g._te[part][i])
            else:
                data = self._read(g._te[part][0], i * per, per)
            rows = _rows(data, shape)
            return _reorder_fc1(rows, g.glu_interleave_size, None) if g.role == "fc1" else rows
        fc, kind = part.split("_")
        if g.layout == "grouped":
            name = {"fc1": "gate_up_proj", "fc2": "down_proj"}[fc] + ("_bias" if kind == "bias" else "")
            rows = _rows(self._read(g._grouped[name], i * per, per), shape)
            return _reorder_fc1(rows, g.glu_interleave_size, None) if fc == "fc1" else rows
        if fc == "fc2":
            return _rows(self._read(g._per_expert[("down", kind)][i]), shape)
        gate = _rows(self._read(g._per_expert[("gate", kind)][i]), (shape[0] // 2, *shape[1:]))
        up = _rows(self._read(g._per_expert[("up", kind)][i]), (shape[0] // 2, *shape[1:]))
        return torch.cat([gate, up])


@dataclasses.dataclass
class _Output:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    produce: Callable[[], Iterator[bytes]]
    source_key: str  # decides the output shard: the one holding this source tensor


def _plan_group(g: ExpertGroup, reader: _Reader, layout: str, naming: str, glu: int | None) -> list[_Output]:
    """Output tensors of group g in `layout` / `naming`, fused fc1 rows in order `glu`."""
    outputs = []
    first_key = sorted(g.keys)[0]

    def per_expert_piece(part, i, select=None):
        """One expert's tensor: canonical rows, then either the gate or up half (`select`), or
        the whole tensor with fused fc1 rows put in the target order."""
        def produce():
            rows = reader.canonical(g, part, i)
            if select is not None:
                rows = rows[select]
            elif _is_fc1(g, part):
                rows = _reorder_fc1(rows, None, glu)
            data = rows.contiguous().numpy().tobytes()
            reader.stats.note(len(data))
            yield data
        return produce

    def stacked(key, part, shape):
        def produce():
            for i in range(g.num_experts):
                yield from per_expert_piece(part, i)()
        outputs.append(_Output(key, g.dtype, (g.num_experts, *shape), g.num_experts * g.bytes_per_expert(part),
                               produce, first_key))

    if g.naming == "te":
        for part, shape in g.parts.items():
            if layout == "grouped":
                stacked(f"{g.prefix}.{part}", part, shape)
            else:
                for i in range(g.num_experts):
                    outputs.append(_Output(f"{g.prefix}.{part}{i}", g.dtype, shape, g.bytes_per_expert(part),
                                           per_expert_piece(part, i), first_key))
        return outputs
    for part, shape in g.parts.items():
        fc, kind = part.split("_")
        if layout == "grouped":
            name = {"fc1": "gate_up_proj", "fc2": "down_proj"}[fc] + ("_bias" if kind == "bias" else "")
            stacked(f"{g.prefix}.{name}", part, shape)
            continue
        names = _PART_NAME[naming]
        for i in range(g.num_experts):
            if fc == "fc2":
                outputs.append(_Output(f"{g.prefix}.{i}.{names['down']}.{kind}", g.dtype, shape,
                                       g.bytes_per_expert(part), per_expert_piece(part, i), first_key))
                continue
            half = (shape[0] // 2, *shape[1:])
            for which, rows in (("gate", slice(0, half[0])), ("up", slice(half[0], shape[0]))):
                outputs.append(_Output(f"{g.prefix}.{i}.{names[which]}.{kind}", g.dtype, half,
                                       g.bytes_per_expert(part) // 2, per_expert_piece(part, i, rows), first_key))
    return outputs


def _is_fc1(g: ExpertGroup, part: str) -> bool:
    return g.role == "fc1" or part.startswith("fc1")


def _copy_output(ckpt: Checkpoint, key: str, stats: _Stats) -> _Output:
    t = ckpt.tensors[key]

    def produce():
        for offset in range(0, t.nbytes, COPY_PIECE_BYTES):
            data = ckpt.read(key, offset, min(COPY_PIECE_BYTES, t.nbytes - offset))
            stats.note(len(data))
            yield data
    return _Output(key, t.dtype, t.shape, t.nbytes, produce, key)


def _target_glu(g: ExpertGroup, requested) -> int | None:
    if requested == KEEP:
        return g.glu_interleave_size if g.fused_fc1 else None
    return requested


def _plan(ckpt: Checkpoint, analysis: Analysis, targets: dict[str, tuple[str, str, int | None]],
          stats: _Stats) -> list[_Output]:
    """All output tensors: each group in its target (layout, naming, glu order); others copied."""
    reader = _Reader(ckpt, stats)
    outputs = [_copy_output(ckpt, key, stats) for key in analysis.other_keys]
    for g in analysis.groups:
        outputs += _plan_group(g, reader, *targets[g.prefix])
    return outputs


# ---- writing ---------------------------------------------------------------------------------


def _write_safetensors(path: Path, outputs: list[_Output], metadata: dict[str, str]) -> None:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for out in outputs:
        header[out.key] = {"dtype": out.dtype, "shape": list(out.shape), "data_offsets": [offset, offset + out.nbytes]}
        offset += out.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data start to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for out in outputs:
            written = 0
            for piece in out.produce():
                f.write(piece)
                written += len(piece)
            if written != out.nbytes:
                raise RuntimeError(f"internal error: {out.key} produced {written} bytes, expected {out.nbytes}")
        f.flush()
        os.fsync(f.fileno())


def _output_metadata(ckpt: Checkpoint, groups: list[ExpertGroup], targets: dict, layout: str) -> dict[str, str]:
    meta = {k: v for k, v in ckpt.metadata.items() if not k.startswith("moekit.")}
    meta.setdefault("format", "pt")
    written = []
    for g in groups:
        t_layout, t_naming, t_glu = targets[g.prefix]
        written.append(dataclasses.replace(g, layout=t_layout, naming=t_naming, glu_interleave_size=t_glu))
    # One file-level value for readers that look no further; per group in META_GROUPS.
    glus = {g.glu_interleave_size for g in written if g.fused_fc1}
    meta.update({
        META_FORMAT: FORMAT_VERSION,
        META_LAYOUT: layout,
        META_GLU: "mixed" if len(glus) > 1 else "none" if glus in (set(), {None}) else str(glus.pop()),
        META_GROUPS: json.dumps([g.describe() for g in written]),
    })
    return meta


def _group_by_file(ckpt: Checkpoint, outputs: list[_Output]) -> dict[str, list[_Output]]:
    by_file: dict[str, list[_Output]] = defaultdict(list)
    for out in outputs:
        by_file[ckpt.tensors[out.source_key].file.name].append(out)
    return by_file


@dataclasses.dataclass
class ConvertResult:
    destination: Path
    files: list[Path]
    num_groups: int
    num_tensors: int
    total_bytes: int
    peak_bytes: int  # the largest piece of tensor data held at once (reads and produced pieces)


def _parse_glu(value) -> int | None | str:
    if value in (KEEP, None) or isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text in ("none", "0", "concat", "concatenated"):
        return None
    if text == KEEP:
        return KEEP
    try:
        k = int(text)
    except ValueError:
        raise CheckpointError([f"glu interleave must be 'none' or a positive int, got {value!r}"]) from None
    if k < 1:
        raise CheckpointError([f"glu interleave must be 'none' or a positive int, got {value!r}"])
    return k


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    glu_interleave: int | None | str = KEEP,
    *,
    src_glu_interleave: int | None | str = KEEP,
) -> ConvertResult:
    """Convert the expert tensors of a safetensors checkpoint to `to` ("grouped" or "per-expert").

    src: a `.safetensors` file, an `*.safetensors.index.json`, or a directory holding either. A
    single file converts to the file `dst`; a sharded checkpoint (or a directory) to the directory
    `dst` (same shard names, a new index, the directory's other files copied along).
    glu_interleave: order of fused fc1 tensors written: None (`[gates; ups]`), k, or "keep" (the
    source's, `[gates; ups]` where the source had gate and up apart).
    src_glu_interleave: order of the source's fused fc1 tensors where moekit's metadata does not say.
    Refuses (CheckpointError, nothing written) on missing, duplicated or misshapen experts, an
    ambiguous layout, or an existing `dst`. The output is verified by an exact round trip first.
    """
    if to not in ("grouped", "per-expert"):
        raise CheckpointError([f"--to must be 'grouped' or 'per-expert', got {to!r}"])
    glu_interleave, src_glu_interleave = _parse_glu(glu_interleave), _parse_glu(src_glu_interleave)
    src, dst = Path(src), Path(dst)
    ckpt = Checkpoint(src)
    if dst.exists():
        raise CheckpointError([f"{dst} exists; moekit convert does not overwrite"])
    analysis = analyze(ckpt, src_glu_interleave)
    problems = list(analysis.problems)
    targets = {}
    for g in analysis.groups:
        glu = _target_glu(g, glu_interleave)
        if g.fused_fc1 and g.glu_interleave_size == "unknown":
            problems.append(
                f"{g.prefix}: the gate/up row order of its fused fc1 tensors is not recorded; pass "
                "--src-glu-interleave none (rows [gates; ups]) or K (interleaved in blocks of K)")
        if glu == "unknown":
            glu = None
        targets[g.prefix] = (to, g.naming, glu)
        out_fused = dataclasses.replace(g, layout=to).fused_fc1
        if out_fused and glu is not None:
            ffn = g.parts["fc1_weight" if g.role == "mlp" else "weight"][0] // 2
            if ffn % glu:
                problems.append(f"{g.prefix}: --glu-interleave {glu} does not divide F={ffn}")
    if not analysis.groups and not problems:
        problems.append(f"{src}: no expert tensors found (nothing to convert)")
    if problems:
        raise CheckpointError(problems)

    stats = _Stats()
    outputs = _plan(ckpt, analysis, targets, stats)
    metadata = _output_metadata(ckpt, analysis.groups, targets, to)
    tmp = dst.with_name(f".{dst.name}.moekit-tmp-{os.getpid()}")
    try:
        if ckpt.sharded or src.is_dir():
            tmp.mkdir(parents=False)
            by_file = _group_by_file(ckpt, outputs)
            for name, file_outputs in sorted(by_file.items()):
                _write_safetensors(tmp / name, sorted(file_outputs, key=lambda o: o.key), metadata)
            base = ckpt.index_path.parent if ckpt.index_path else ckpt.files[0].parent
            for other in sorted(base.iterdir()):
                if other.is_file() and not other.name.endswith(".safetensors") and other != ckpt.index_path:
                    shutil.copy2(other, tmp / other.name)  # config.json and friends
            if ckpt.index_path is not None:
                index_meta = {k: v for k, v in ckpt.index_metadata.items() if not str(k).startswith("moekit.")}
                index_meta["total_size"] = sum(o.nbytes for o in outputs)
                index_meta.update({k: v for k, v in metadata.items() if k.startswith("moekit.")})
                weight_map = {o.key: name for name, file_outputs in by_file.items() for o in file_outputs}
                index = {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}
                (tmp / ckpt.index_path.name).write_text(json.dumps(index, indent=2) + "\n")
            files = [tmp / name for name in sorted(by_file)]
        else:
            _write_safetensors(tmp, sorted(outputs, key=lambda o: o.key), metadata)
            files = [tmp]
        _verify_round_trip(ckpt, analysis, Checkpoint(tmp), stats)
        os.replace(tmp, dst) if tmp.is_file() else os.rename(tmp, dst)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise
    files = [dst / f.name for f in files] if dst.is_dir() else [dst]
    return ConvertResult(dst, files, len(analysis.groups), len(outputs), sum(o.nbytes for o in outputs),
                         stats.peak_bytes)


def _verify_round_trip(src: Checkpoint, src_analysis: Analysis, out: Checkpoint, stats: _Stats) -> None:
    """Convert `out` back to the source's layout in memory and compare every tensor bit for bit."""
    out_analysis = analyze(out)
    problems = list(out_analysis.problems)
    by_prefix = {g.prefix: g for g in src_analysis.groups}
    if {g.prefix for g in out_analysis.groups} != set(by_prefix):
        problems.append("verification: the output's expert groups differ from the source's")
    if problems:
        raise RuntimeError("moekit convert: the output failed verification (nothing was written):\n"
                           + "\n".join(problems))
    targets = {p: (g.layout, g.naming, g.glu_interleave_size if g.fused_fc1 else None) for p, g in by_prefix.items()}
    back = {o.key: o for o in _plan(out, out_analysis, targets, stats)}
    if back.keys() != src.tensors.keys():
        missing, extra = sorted(set(src.tensors) - set(back))[:5], sorted(set(back) - set(src.tensors))[:5]
        raise RuntimeError(f"moekit convert: verification failed: keys differ (missing {missing}, extra {extra})")
    for key, t in src.tensors.items():
        o = back[key]
        if o.dtype != t.dtype or tuple(o.shape) != t.shape:
            raise RuntimeError(f"moekit convert: verification failed: {key} is {o.dtype} {o.shape}, "
                               f"source {t.dtype} {t.shape}")
        offset = 0
        for piece in o.produce():
            if piece != src.read(key, offset, len(piece)):
                raise RuntimeError(f"moekit convert: verification failed: {key} differs after the round trip")
            offset += len(piece)
        if offset != t.nbytes:
            raise RuntimeError(f"moekit convert: verification failed: {key} has {offset} bytes, source {t.nbytes}")


# ---- inspect ---------------------------------------------------------------------------------


def inspect_checkpoint(path: str | os.PathLike, src_glu_interleave: int | None | str = KEEP) -> Analysis:
    """The expert groups of a checkpoint, plus anything that would make `convert` refuse."""
    return analyze(Checkpoint(path), _parse_glu(src_glu_interleave))


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def format_inspection(ckpt: Checkpoint, analysis: Analysis) -> str:
    """A text table of the layout found."""
    rows = [("expert group", "layout", "naming", "role", "experts", "per-expert shapes", "glu interleave", "dtype",
             "size")]
    for g in analysis.groups:
        shapes = ", ".join(f"{part} {list(shape)}" for part, shape in g.parts.items())
        size = sum(g.bytes_per_expert(part) for part in g.parts) * g.num_experts
        glu = ("-" if not g.fused_fc1 else "none ([gates; ups])" if g.glu_interleave_size is None
               else str(g.glu_interleave_size))
        rows.append((g.prefix, g.layout, g.naming, g.role, str(g.num_experts), shapes, glu, g.dtype, _human(size)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"checkpoint: {ckpt.path} ({len(ckpt.files)} file{'s' if len(ckpt.files) > 1 else ''}"
             + (f", index {ckpt.index_path.name})" if ckpt.index_path else ")")]
    total = sum(t.nbytes for t in ckpt.tensors.values())
    lines.append(f"tensors: {len(ckpt.tensors)} ({len(ckpt.tensors) - len(analysis.other_keys)} in "
                 f"{len(analysis.groups)} expert groups, {len(analysis.other_keys)} others), {_human(total)}")
    recorded = {k: v for k, v in ckpt.metadata.items() if k in (META_LAYOUT, META_GLU)}
    lines.append("moekit metadata: " + (", ".join(f"{k}={v}" for k, v in recorded.items()) if recorded else "none"))
    lines.append("")
    for r in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if analysis.problems:
        lines.append("")
        lines.append("problems (convert would refuse):")
        lines += [f"  - {p}" for p in analysis.problems]
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------


def _run_convert(args: argparse.Namespace) -> int:
    try:
        result = convert_checkpoint(args.src, args.dst, args.to, args.glu_interleave,
                                    src_glu_interleave=args.src_glu_interleave)
    except CheckpointError as exc:
        print(f"moekit convert: refused, nothing written: {exc}", file=sys.stderr)
        return 2
    print(f"moekit convert: wrote {result.destination} ({len(result.files)} file(s), {result.num_groups} expert "
          f"groups, {result.num_tensors} tensors, {_human(result.total_bytes)}); verified by an exact round trip")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    try:
        ckpt = Checkpoint(args.ckpt)
        analysis = analyze(ckpt, _parse_glu(args.src_glu_interleave))
    except CheckpointError as exc:
        print(f"moekit inspect: {exc}", file=sys.stderr)
        return 2
    print(format_inspection(ckpt, analysis))
    return 0


def add_convert_subcommands(subparsers) -> None:
    """Register `convert` and `inspect` on an argparse subparsers object (each sets `func`)."""
    glu_help = "'none' ([gates; ups]) or K (gate and up interleaved in blocks of K; 1 = gpt-oss's alternating rows)"
    p = subparsers.add_parser("convert", help="convert expert weights between per-expert and grouped layouts",
                              description=convert_checkpoint.__doc__)
    p.add_argument("src", help="a .safetensors file, an *.safetensors.index.json, or a directory")
    p.add_argument("dst", help="output file (single-file source) or directory (sharded source); must not exist")
    p.add_argument("--to", required=True, choices=("grouped", "per-expert"))
    p.add_argument("--glu-interleave", default=KEEP, metavar="K",
                   help=f"order of fused gate/up tensors written: {glu_help}; default: keep the source's")
    p.add_argument("--src-glu-interleave", default=KEEP, metavar="K",
                   help=f"order of the source's fused gate/up tensors where its metadata does not say: {glu_help}")
    p.set_defaults(func=_run_convert)
    q = subparsers.add_parser("inspect", help="print the expert-weight layout of a safetensors checkpoint")
    q.add_argument("ckpt", help="a .safetensors file, an *.safetensors.index.json, or a directory")
    q.add_argument("--src-glu-interleave", default=KEEP, metavar="K", help=f"as for convert: {glu_help}")
    q.set_defaults(func=_run_inspect)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m moekit.convert convert|inspect ...`) until the CLI wires it."""
    parser = argparse.ArgumentParser(prog="moekit")
    add_convert_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
