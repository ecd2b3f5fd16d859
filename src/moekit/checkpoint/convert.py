"""Converting the expert tensors of safetensors checkpoints between layouts (`moekit convert`) and
describing them (`moekit inspect`).

Conversion streams: tensors are read and written one expert at a time (non-expert tensors in
pieces of at most 64 MiB), header first, then the data in order, so memory stays around one
expert's tensors, far below one layer's. Output goes to a hidden temporary sibling of the
destination, is verified by converting it back in memory and comparing every source tensor bit for
bit, and only then renamed into place. The output records its expert groups in moekit's metadata
vocabulary (`moekit.checkpoint.metadata`), which `load_safetensors` reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from moekit.checkpoint.errors import CheckpointError
from moekit.checkpoint.files import (
    DTYPE_BITS,
    MAX_HEADER_BYTES,
    Checkpoint,
    OutputTensor,
    check_destination,
    human_bytes,
    remove_path,
    remove_stale_temps,
    temp_sibling,
    write_safetensors,
)
from moekit.checkpoint.layout import (
    HF_GROUPED_NAME,
    KEEP,
    MAX_INDEX_DIGITS,
    PART_NAME,
    Analysis,
    ExpertGroup,
    GluOrder,
    analyze,
    reorder_glu_rows,
    shown,
)
from moekit.checkpoint.metadata import file_metadata, group_record, join_key, other_extra_states

COPY_PIECE_BYTES = 64 << 20

# progress(phase, tensors done, tensors in all, bytes done, bytes in all)
ProgressFn = Callable[[str, int, int, int, int], None]


class VerificationError(RuntimeError):
    """The written output did not convert back to the source bit for bit (a moekit bug; nothing written)."""


class _Stats:
    def __init__(self) -> None:
        self.peak_bytes = 0  # the most bytes held from one read or one produced piece

    def note(self, nbytes: int) -> None:
        self.peak_bytes = max(self.peak_bytes, nbytes)


def _rows(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """bytes of a per-expert tensor -> uint8 (rows, bytes per row): reorders rows whatever the dtype.
    A tensor without elements (0 rows, or rows of 0 columns) is a valid expert: (rows, 0)."""
    if not data:
        return torch.empty(shape[0], 0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(shape[0], -1)


class _Reader:
    """Reads one expert's tensors of a group in canonical form (fc1 rows `[gates; ups]`)."""

    def __init__(self, ckpt: Checkpoint, stats: _Stats):
        self.ckpt, self.stats = ckpt, stats

    def _read(self, key: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        data = self.ckpt.read(key, offset, nbytes)
        self.stats.note(len(data))
        return data

    def canonical(self, g: ExpertGroup, part: str, i: int) -> torch.Tensor:
        shape, per = g.parts[part], g.bytes_per_expert(part)
        if g.naming == "te":
            key = g.sources[part][0 if g.layout == "grouped" else i]
            rows = _rows(self._read(key, i * per, per) if g.layout == "grouped" else self._read(key), shape)
        elif g.layout == "grouped":
            rows = _rows(self._read(g.sources[part], i * per, per), shape)
        else:
            fc, kind = part.split("_")
            if fc == "fc2":
                return _rows(self._read(g.sources[("down", kind)][i]), shape)
            half = (shape[0] // 2, *shape[1:])
            return torch.cat([_rows(self._read(g.sources[(which, kind)][i]), half) for which in ("gate", "up")])
        return reorder_glu_rows(rows, _known_order(g), None) if g.is_fc1(part) and g.fused_fc1 else rows


def _known_order(g: ExpertGroup) -> int | None:
    """The gate/up order of g's fused source fc1 tensors, which is known by now (`refusals` refuse a group
    whose order is not)."""
    order = g.glu_interleave_size
    assert order != KEEP, f"{g.prefix}: the gate/up order of fused fc1 tensors is not known"
    return order


def _plan_group(g: ExpertGroup, reader: _Reader, layout: str, naming: str, glu: int | None) -> list[OutputTensor]:
    """Output tensors of group g in `layout` / `naming`, fused fc1 rows in order `glu`."""
    outputs = []
    first_key = sorted(g.keys)[0]

    def piece(part: str, i: int, select: slice | None = None) -> Callable[[], Iterator[bytes]]:
        """One expert's tensor: canonical rows, then either the gate or up half (`select`), or
        the whole tensor with fused fc1 rows put in the target order."""

        def produce() -> Iterator[bytes]:
            rows = reader.canonical(g, part, i)
            if select is not None:
                rows = rows[select]
            elif g.is_fc1(part):
                rows = reorder_glu_rows(rows, None, glu)
            data = rows.contiguous().numpy().tobytes()
            reader.stats.note(len(data))
            yield data

        return produce

    def add(
        key: str, part: str, i: int | None = None, select: slice | None = None, shape: tuple[int, ...] | None = None
    ) -> None:
        shape = shape or g.parts[part]
        nbytes = math.prod(shape) * DTYPE_BITS[g.dtype] // 8
        if i is not None:
            outputs.append(OutputTensor(key, g.dtype, shape, nbytes, piece(part, i, select), first_key))
            return

        def stacked() -> Iterator[bytes]:
            for e in range(g.num_experts):
                yield from piece(part, e)()

        outputs.append(OutputTensor(key, g.dtype, (g.num_experts, *shape), g.num_experts * nbytes, stacked, first_key))

    for part, shape in g.parts.items():
        if layout == "grouped":
            add(join_key(g.prefix, part) if g.naming == "te" else f"{g.prefix}.{HF_GROUPED_NAME[part]}", part)
        elif g.naming == "te":
            for i in range(g.num_experts):
                add(f"{join_key(g.prefix, part)}{i}", part, i)
        else:
            fc, kind = part.split("_")
            names = PART_NAME[naming]
            for i in range(g.num_experts):
                if fc == "fc2":
                    add(f"{g.prefix}.{i}.{names['down']}.{kind}", part, i)
                    continue
                half = shape[0] // 2
                for which, rows in (("gate", slice(0, half)), ("up", slice(half, shape[0]))):
                    add(f"{g.prefix}.{i}.{names[which]}.{kind}", part, i, rows, (half, *shape[1:]))
    return outputs


def _copy_output(ckpt: Checkpoint, key: str, stats: _Stats) -> OutputTensor:
    t = ckpt.tensors[key]

    def produce() -> Iterator[bytes]:
        for offset in range(0, t.nbytes, COPY_PIECE_BYTES):
            data = ckpt.read(key, offset, min(COPY_PIECE_BYTES, t.nbytes - offset))
            stats.note(len(data))
            yield data

    return OutputTensor(key, t.dtype, t.shape, t.nbytes, produce, key)


def _plan(
    ckpt: Checkpoint, analysis: Analysis, targets: dict[str, tuple[str, str, int | None]], stats: _Stats
) -> list[OutputTensor]:
    """All output tensors: each group in its target (layout, naming, glu order); others copied."""
    reader = _Reader(ckpt, stats)
    outputs = [_copy_output(ckpt, key, stats) for key in analysis.other_keys]
    for g in analysis.groups:
        outputs += _plan_group(g, reader, *targets[g.prefix])
    return outputs


def _output_metadata(ckpt: Checkpoint, groups: list[ExpertGroup], targets: dict) -> dict[str, str]:
    records = []
    for g in groups:
        layout, naming, glu = targets[g.prefix]
        fused = dataclasses.replace(g, layout=layout).fused_fc1
        records.append(group_record(g.prefix, naming, layout, g.role, g.num_experts, glu if fused else None))
    return file_metadata(records, other_extra_states(ckpt.metadata, str(ckpt.path)), ckpt.metadata)


@dataclasses.dataclass
class ConvertResult:
    destination: Path
    files: list[Path]
    num_groups: int
    num_tensors: int
    total_bytes: int
    peak_bytes: int  # the largest piece of tensor data held at once (reads and produced pieces)
    removed_temps: list[Path]  # temporary outputs of killed earlier runs, found and removed


def parse_glu(value: int | str | None, flag: str = "--glu-interleave") -> GluOrder:
    """A GLU order argument: KEEP, None (`[gates; ups]`, also 'none'), or a positive int."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value  # (KEEP is returned below)
    text = str(value).strip().lower()
    if text in ("none", "concat", "concatenated"):
        return None
    if text == KEEP:
        return KEEP
    if text.isascii() and text.isdigit() and len(text) <= MAX_INDEX_DIGITS and int(text) >= 1:
        return int(text)
    raise CheckpointError(
        [f"{flag} must be 'none' ([gates; ups]) or a positive int (interleave block size), got {shown(str(value))}"]
    )


def refusals(ckpt: Checkpoint, analysis: Analysis) -> list[str]:
    """Everything that makes `convert` refuse a checkpoint whatever it is asked (`inspect` lists them)."""
    problems = list(analysis.problems)
    problems += [
        f"{g.prefix or 'root'}: the gate/up row order of its fused fc1 tensors is not recorded; pass "
        "--src-glu-interleave none (rows [gates; ups]) or a block size (rows interleaved in blocks of "
        "that many)"
        for g in analysis.groups
        if g.fused_fc1 and g.glu_interleave_size == KEEP
    ]
    if not analysis.groups and not problems:
        problems.append(f"{ckpt.path}: no expert tensors found (nothing to convert)")
    return problems


def _targets(
    analysis: Analysis, to: str, glu_interleave: GluOrder
) -> tuple[dict[str, tuple[str, str, int | None]], list[str]]:
    """prefix -> (layout, naming, fused fc1 order) of the output, and the problems of that request."""
    problems: list[str] = []
    targets: dict[str, tuple[str, str, int | None]] = {}
    for g in analysis.groups:
        glu = g.glu_interleave_size if glu_interleave == KEEP else glu_interleave
        glu = None if glu == KEEP else glu
        out_fused = dataclasses.replace(g, layout=to).fused_fc1
        if out_fused and glu is not None and g.ffn_size % glu:
            problems.append(f"{g.prefix or 'root'}: --glu-interleave {glu} does not divide F={g.ffn_size}")
        if to == "per-expert" and g.layout == "grouped":
            problems += _per_expert_problems(g)
        targets[g.prefix] = (to, g.naming, glu if out_fused else None)
    return targets, problems


# The fewest header bytes one tensor takes besides its key: {"dtype":"U8","shape":[],"data_offsets":[0,0]},
HEADER_BYTES_PER_TENSOR = 48


def _per_expert_problems(g: ExpertGroup) -> list[str]:
    """What the per-expert layout cannot hold of a grouped group: no experts (there would be no tensor
    to say the group exists), or so many that the header would pass the safetensors limit (checked
    before any of those tensors is planned: the count comes from a shape, not from the file's size)."""
    where = g.prefix or "root"
    if g.num_experts == 0:
        return [
            f"{where}: holds 0 experts; the per-expert layout has no tensor to record a group of none "
            "(keep it grouped, or remove it)"
        ]
    per_expert = sum(2 if g.naming != "te" and part.startswith("fc1") else 1 for part in g.parts)
    count = g.num_experts * per_expert
    if count * (HEADER_BYTES_PER_TENSOR + len(g.prefix)) > MAX_HEADER_BYTES:
        return [
            f"{where}: {g.num_experts:,} experts would be {count:,} per-expert tensors, more than a safetensors "
            f"header holds (at most {MAX_HEADER_BYTES:,} bytes); keep it grouped"
        ]
    return []


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    glu_interleave: int | None | str = KEEP,
    *,
    src_glu_interleave: int | None | str = KEEP,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Convert the expert tensors of a safetensors checkpoint to `to` ("grouped" or "per-expert").

    src: a `.safetensors` file, an `*.safetensors.index.json`, or a folder holding either. A single
    file converts to the file `dst`; a sharded checkpoint (or a folder) to the folder `dst` (same
    shard names, a new index, the folder's other files copied along).
    glu_interleave: order of fused fc1 tensors written: None (`[gates; ups]`), a block size, or "keep" (the
    source's; `[gates; ups]` where the source had gate and up apart).
    src_glu_interleave: order of the source's fused fc1 tensors where the file does not record it.
    Raises CheckpointError (nothing written) on malformed files, missing or misshapen experts, expert
    indices that are not canonical decimals, an ambiguous layout, a layout that cannot hold a group
    (no experts, or more per-expert tensors than a header holds), or a destination that exists or
    cannot be written.
    """
    if to not in ("grouped", "per-expert"):
        raise CheckpointError([f"--to must be 'grouped' or 'per-expert', got {to!r}"])
    glu_interleave = parse_glu(glu_interleave)
    src_glu_interleave = parse_glu(src_glu_interleave, "--src-glu-interleave")
    ckpt = Checkpoint(src)
    to_folder = ckpt.sharded or Path(src).is_dir()
    dst_path = check_destination(dst, directory=to_folder)
    analysis = analyze(ckpt, src_glu_interleave)
    targets, problems = _targets(analysis, to, glu_interleave)
    problems = refusals(ckpt, analysis) + problems
    if problems:
        raise CheckpointError(problems)

    removed = remove_stale_temps(dst_path)
    stats = _Stats()
    outputs = _plan(ckpt, analysis, targets, stats)
    metadata = _output_metadata(ckpt, analysis.groups, targets)
    total = sum(o.nbytes for o in outputs)
    done = [0, 0]

    def on_tensor(nbytes: int) -> None:
        done[0] += 1
        done[1] += nbytes
        if progress is not None:
            progress("writing", done[0], len(outputs), done[1], total)

    tmp = temp_sibling(dst_path, "convert")
    try:
        try:
            files = _write_outputs(ckpt, outputs, metadata, tmp, to_folder, on_tensor)
        except OSError as exc:
            raise CheckpointError([f"cannot write {tmp}: {exc.strerror or exc}"]) from None
        _verify_round_trip(ckpt, analysis, Checkpoint(tmp), stats, progress)
        os.replace(tmp, dst_path)
    except BaseException:
        remove_path(tmp)
        raise
    files = [dst_path / f.name for f in files] if to_folder else [dst_path]
    return ConvertResult(dst_path, files, len(analysis.groups), len(outputs), total, stats.peak_bytes, removed)


def _write_outputs(
    ckpt: Checkpoint,
    outputs: list[OutputTensor],
    metadata: dict,
    tmp: Path,
    to_folder: bool,
    on_tensor: Callable[[int], None],
) -> list[Path]:
    if not to_folder:
        write_safetensors(tmp, sorted(outputs, key=lambda o: o.key), metadata, on_tensor)
        return [tmp]
    tmp.mkdir()
    by_file: dict[str, list[OutputTensor]] = defaultdict(list)
    for out in outputs:
        by_file[ckpt.tensors[out.source_key].file.name].append(out)
    for name, file_outputs in sorted(by_file.items()):
        write_safetensors(tmp / name, sorted(file_outputs, key=lambda o: o.key), metadata, on_tensor)
    for other in sorted(ckpt.folder.iterdir()):
        if (
            other.is_file()
            and not other.name.endswith(".safetensors")
            and other != ckpt.index_path
            and not other.name.startswith(".")
        ):
            shutil.copy2(other, tmp / other.name)  # config.json and friends
    if ckpt.index_path is not None:
        index_meta = {key: value for key, value in ckpt.index_metadata.items() if not str(key).startswith("moekit.")}
        index_meta["total_size"] = sum(o.nbytes for o in outputs)
        weight_map = {o.key: name for name, file_outputs in by_file.items() for o in file_outputs}
        index = {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / ckpt.index_path.name).write_text(json.dumps(index, indent=2) + "\n")
    return [tmp / name for name in sorted(by_file)]


def _verify_round_trip(
    src: Checkpoint, src_analysis: Analysis, out: Checkpoint, stats: _Stats, progress: ProgressFn | None = None
) -> None:
    """Convert `out` back to the source's layout in memory and compare every tensor bit for bit."""
    out_analysis = analyze(out)
    problems = list(out_analysis.problems)
    by_prefix = {g.prefix: g for g in src_analysis.groups}
    if {g.prefix for g in out_analysis.groups} != set(by_prefix):
        problems.append("the output's expert groups differ from the source's")
    if problems:
        raise VerificationError("the output's expert groups do not match the source's: " + "; ".join(problems))
    targets = {p: (g.layout, g.naming, _known_order(g) if g.fused_fc1 else None) for p, g in by_prefix.items()}
    back = {o.key: o for o in _plan(out, out_analysis, targets, stats)}
    if back.keys() != src.tensors.keys():
        missing, extra = sorted(set(src.tensors) - set(back))[:5], sorted(set(back) - set(src.tensors))[:5]
        raise VerificationError(f"keys differ (missing {missing}, extra {extra})")
    total, done = sum(t.nbytes for t in src.tensors.values()), 0
    for count, (key, t) in enumerate(src.tensors.items(), 1):
        o = back[key]
        if o.dtype != t.dtype or tuple(o.shape) != t.shape:
            raise VerificationError(f"{key} is {o.dtype} {o.shape}, source {t.dtype} {t.shape}")
        offset = 0
        for piece in o.produce():
            if piece != src.read(key, offset, len(piece)):
                raise VerificationError(f"{key} differs after the round trip")
            offset += len(piece)
        if offset != t.nbytes:
            raise VerificationError(f"{key} has {offset} bytes, source {t.nbytes}")
        done += t.nbytes
        if progress is not None:
            progress("verified", count, len(src.tensors), done, total)


def iter_rows(rows: Sequence[tuple[str, ...]]) -> Iterator[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        yield "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()


def format_inspection(ckpt: Checkpoint, analysis: Analysis) -> str:
    """A text table of the layout found, and the problems that would make `convert` refuse."""
    rows = [
        ("expert group", "layout", "naming", "role", "experts", "per-expert shapes", "glu interleave", "dtype", "size")
    ]
    for g in analysis.groups:
        shapes = ", ".join(f"{part} {list(shape)}" for part, shape in g.parts.items())
        size = sum(g.bytes_per_expert(part) for part in g.parts) * g.num_experts
        glu = (
            "-"
            if not g.fused_fc1
            else "not recorded"
            if g.glu_interleave_size == KEEP
            else "none ([gates; ups])"
            if g.glu_interleave_size is None
            else str(g.glu_interleave_size)
        )
        rows.append(
            (
                g.prefix or "(root)",
                g.layout,
                g.naming,
                g.role,
                str(g.num_experts),
                shapes,
                glu,
                g.dtype,
                human_bytes(size),
            )
        )
    lines = [
        f"checkpoint: {ckpt.path} ({len(ckpt.files)} file{'s' if len(ckpt.files) > 1 else ''}"
        + (f", index {ckpt.index_path.name})" if ckpt.index_path else ")")
    ]
    total = sum(t.nbytes for t in ckpt.tensors.values())
    lines.append(
        f"tensors: {len(ckpt.tensors)} ({len(ckpt.tensors) - len(analysis.other_keys)} in "
        f"{len(analysis.groups)} expert groups, {len(analysis.other_keys)} others), {human_bytes(total)}"
    )
    recorded = sorted(key for key in ckpt.metadata if key.startswith("moekit."))
    lines.append("moekit metadata: " + (", ".join(recorded) if recorded else "none"))
    lines.append("")
    lines += list(iter_rows(rows))
    if analysis.problems:
        lines += ["", "problems (convert would refuse):"] + [f"  - {p}" for p in analysis.problems]
    return "\n".join(lines)
