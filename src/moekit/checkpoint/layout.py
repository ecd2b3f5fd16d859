"""Expert layouts of checkpoints: the key patterns of every naming scheme, the analysis that finds a
checkpoint's expert groups (and everything that makes a conversion unsafe), and the GLU row-order
conversion that both `moekit convert` and `GroupedLinear.load_state_dict` use.

Legend: N experts, H hidden size, F expert ffn size; fc1 maps H -> 2F (gate and up), fc2 F -> H.

Expert groups recognised by key names (a "prefix" is everything before the expert part):
- Hugging Face per-expert: `{prefix}.{i}.gate_proj|up_proj|down_proj.weight|bias` (`prefix` ends in
  `experts`), or Mixtral's original `w1|w3|w2` for gate|up|down.
- Hugging Face grouped (transformers 5.x's fused tensors): `{prefix}.gate_up_proj [N, 2F, H]`,
  `{prefix}.down_proj [N, H, F]`, optional `{prefix}.gate_up_proj_bias [N, 2F]`, `{prefix}.down_proj_bias [N, H]`.
- TransformerEngine / moekit per-expert: `{prefix}.weight{i} [out, in]`, `{prefix}.bias{i} [out]`;
  grouped: `{prefix}.weight [N, out, in]`, `{prefix}.bias [N, out]` (recognised as grouped only where
  the file's moekit records say so, as a 3-D `weight` could be anything). The role (GLU fc1 or not)
  is the record's; without one, a prefix whose last part contains `fc1` is a GLU fc1.

Fused fc1 tensors (HF `gate_up_proj`, TE fc1) hold gate and up rows either concatenated
(`[gates; ups]`) or interleaved in blocks of `glu_interleave_size` rows. That order is not visible in
the tensors: it is read from the file's records, or given (`src_glu_interleave`), and a conversion
refuses where it is neither.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Final, Literal, TypeVar

import torch

from moekit.checkpoint.errors import CheckpointError
from moekit.checkpoint.files import DTYPE_BITS, Checkpoint
from moekit.checkpoint.metadata import join_key, read_records
from moekit.ops.glu import check_interleave, deinterleave_glu, interleave_glu

KEEP: Final = "keep"  # a GLU order argument that was not given
# A GLU row order: None (`[gates; ups]`), a block size, or KEEP (not given / not known).
GluOrder = int | None | Literal["keep"]

# An expert index in a key: whatever looks like one (digits, signed or not) is matched, then held to
# the one rule of `expert_index`, the same for `moekit convert` / `inspect` and for
# GroupedLinear.load_state_dict (`collect_grouped`).
INDEX_PATTERN = r"[+-]?\d+"
MAX_INDEX_DIGITS = 18  # far more experts than any checkpoint holds; keeps every index a machine int
_CANONICAL_INDEX = re.compile(rf"0|[1-9][0-9]{{0,{MAX_INDEX_DIGITS - 1}}}")
_HF_PER_EXPERT = re.compile(
    rf"^(?P<prefix>.*experts)\.(?P<index>{INDEX_PATTERN})\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<kind>weight|bias)$"
)
_HF_GROUPED = re.compile(r"^(?P<prefix>.*experts)\.(?P<name>gate_up_proj|down_proj)(?P<bias>_bias)?$")
_TE_PER_EXPERT = re.compile(rf"^(?:(?P<prefix>.+)\.)?(?P<kind>weight|bias)(?P<index>{INDEX_PATTERN})$")
_TE_GROUPED = re.compile(r"^(?:(?P<prefix>.+)\.)?(?P<kind>weight|bias)$")
_LOOKS_PER_EXPERT = re.compile(rf"experts\.{INDEX_PATTERN}\.")
_PROJ_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
PART_NAME = {
    "hf": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
}
HF_GROUPED_NAME = {
    "fc1_weight": "gate_up_proj",
    "fc2_weight": "down_proj",
    "fc1_bias": "gate_up_proj_bias",
    "fc2_bias": "down_proj_bias",
}


# ---- the GLU row order -----------------------------------------------------------------------


def reorder_glu_rows(t: torch.Tensor, src: int | None, dst: int | None, dim: int = 0) -> torch.Tensor:
    """Fused fc1 rows along `dim` from gate/up order `src` to `dst` (None = `[gates; ups]`, an int =
    interleaved in blocks of that many rows)."""
    if src == dst:
        return t
    if src is not None:
        t = deinterleave_glu(t, src, dim=dim)
    if dst is not None:
        t = interleave_glu(t, dst, dim=dim)
    return t


# ---- expert groups ---------------------------------------------------------------------------


@dataclasses.dataclass
class ExpertGroup:
    """One layer's experts (or one grouped linear) as found in a checkpoint.

    `parts` are the per-expert tensors in canonical form, name -> per-expert shape: for naming
    "hf"/"mixtral" `fc1_weight (2F, H)` (rows `[gates; ups]`), `fc2_weight (H, F)`, and with biases
    `fc1_bias (2F,)`, `fc2_bias (H,)`; for "te" `weight (out, in)` and maybe `bias (out,)`.
    `sources` locates them: hf/mixtral per-expert `(part, kind) -> {i: key}` (part gate/up/down),
    hf grouped `part -> key`, te `kind -> {i: key}` (per-expert) or `kind -> {0: key}` (grouped).
    """

    prefix: str
    naming: str  # "hf", "mixtral", "te"
    layout: str  # "per-expert" or "grouped"
    role: str  # "mlp" (hf/mixtral), "fc1", "fc2" or "linear" (te)
    num_experts: int
    dtype: str
    parts: dict[str, tuple[int, ...]]
    sources: dict
    glu_interleave_size: GluOrder = None  # of fused fc1 tensors; KEEP while not known

    @property
    def keys(self) -> list[str]:
        found = []
        for where in self.sources.values():
            found += list(where.values()) if isinstance(where, dict) else [where]
        return found

    @property
    def fused_fc1(self) -> bool:
        """The group's fc1 gate/up rows live in one tensor in this layout."""
        return self.role == "fc1" or (self.role == "mlp" and self.layout == "grouped")

    def is_fc1(self, part: str) -> bool:
        return self.role == "fc1" or part.startswith("fc1")

    @property
    def ffn_size(self) -> int:
        return self.parts["fc1_weight" if self.role == "mlp" else "weight"][0] // 2

    def bytes_per_expert(self, part: str) -> int:
        return math.prod(self.parts[part]) * DTYPE_BITS[self.dtype] // 8


@dataclasses.dataclass
class Analysis:
    groups: list[ExpertGroup]
    other_keys: list[str]
    problems: list[str]


def shown(text: str, limit: int = 80) -> str:
    """`text` quoted for a one-line message, its middle elided past `limit` characters (a key can be
    as long as a 100 MB header)."""
    if len(text) <= limit:
        return repr(text)
    half = (limit - 5) // 2
    return f"{text[:half]!r}...{text[-half:]!r} ({len(text):,} characters)"


def expert_index(text: str, key: str) -> int:
    """The expert index `text` read from `key`, held to the one rule of every reader of expert keys: a
    canonical decimal (ASCII digits, no sign, no leading zero, at most MAX_INDEX_DIGITS digits), so
    that each expert has exactly one name. CheckpointError naming the key otherwise."""
    if _CANONICAL_INDEX.fullmatch(text):
        return int(text)
    digits = text.lstrip("+-")
    if text[:1] in "+-":
        why = "has a sign"
    elif not digits.isascii():
        why = "has digits other than 0-9"
    elif len(digits) > 1 and digits[0] == "0" and len(digits.lstrip("0")) <= MAX_INDEX_DIGITS:
        why = f"has a leading zero ('{int(digits)}' names that expert)"
    else:
        why = f"has {len(digits):,} digits (at most {MAX_INDEX_DIGITS})"
    raise CheckpointError(
        [
            f"key {shown(key)}: its expert index {shown(text, 40)} {why}; expected a canonical decimal "
            "index (digits 0-9, no sign, no leading zero)"
        ]
    )


SHOWN_INDICES = 6  # a list of missing indices names at most this many


def missing_indices(
    present: Iterable[int],
    stop: int,
    start: int = 0,
    *,
    what: str = "expert indices",
    name: Callable[[int], str] = str,
) -> str | None:
    """'missing expert indices [2, 5]' (at most SHOWN_INDICES of them) or 'missing 9,999,999 expert
    indices [1, 2, 3, ..., 9999999]': the indices of start..stop-1 not in `present`, each written by
    `name`, or None if none are missing. Time and memory in proportion to `present` (what a file
    holds), never to `stop` (an index or a count read from a file)."""
    present = set(present)
    count = stop - start - sum(1 for i in present if start <= i < stop)
    if count <= 0:
        return None
    first: list[int] = []
    i = start
    while len(first) < min(count, SHOWN_INDICES):  # at most len(present) + SHOWN_INDICES steps
        if i not in present:
            first.append(i)
        i += 1
    if count <= SHOWN_INDICES:
        return f"missing {what} [{', '.join(map(name, first))}]"
    last = stop - 1
    while last in present:
        last -= 1
    return f"missing {count:,} {what} [{', '.join(map(name, first[:3]))}, ..., {name(last)}]"


def _index_or_problem(index_text: str, key: str, problems: list[str]) -> int | None:
    try:
        return expert_index(index_text, key)
    except CheckpointError as exc:
        problems.extend(exc.problems)
        return None


def _check_indices(what: str, indices: dict[int, str], num: int, problems: list[str]) -> None:
    missing = missing_indices(indices, num)
    if missing:
        problems.append(f"{what}: {missing} (found {len(indices)} of 0..{num - 1})")


_V = TypeVar("_V", bound=tuple)


def _same(values: dict[str, _V], what: str, problems: list[str]) -> _V | None:
    """The one value all keys have, or None with a problem naming each distinct value (a few of them)
    with how many keys have it and one of those keys."""
    by_value: dict[_V, list[str]] = defaultdict(list)
    for key, value in sorted(values.items()):
        by_value[value].append(key)
    if len(by_value) == 1:
        return next(iter(by_value))
    ranked = sorted(by_value.items(), key=lambda item: (-len(item[1]), item[0]))
    described = [
        f"{value} in {len(keys)} tensor{'s' if len(keys) > 1 else ''} (e.g. {shown(keys[0])})"
        if len(keys) > 1
        else f"{value} in {shown(keys[0])}"
        for value, keys in ranked[:SHOWN_INDICES]
    ]
    more = f", and {len(ranked) - SHOWN_INDICES:,} other values" if len(ranked) > SHOWN_INDICES else ""
    problems.append(f"{what} disagree: " + ", ".join(described) + more)
    return None


def _dtype(ckpt: Checkpoint, keys: Iterable[str], prefix: str, problems: list[str]) -> str | None:
    dtype = _same({key: (ckpt.tensors[key].dtype,) for key in keys}, f"{prefix or 'root'}: dtypes", problems)
    if dtype is not None and DTYPE_BITS[dtype[0]] % 8:
        problems.append(
            f"{prefix or 'root'}: dtype {dtype[0]} packs several values per byte; moekit converts "
            "whole-byte dtypes only"
        )
        return None
    return dtype[0] if dtype else None


def analyze(ckpt: Checkpoint, src_glu_interleave: GluOrder = KEEP) -> Analysis:
    """Find the expert groups of a checkpoint and every problem that would make a conversion unsafe.

    `src_glu_interleave`: the fc1 gate/up order of fused source tensors that the file's records do
    not state (None = `[gates; ups]`, an int = interleaved in blocks of that many rows); KEEP = not given.
    """
    problems: list[str] = []
    try:
        records = read_records(ckpt.metadata, str(ckpt.path))
    except CheckpointError as exc:
        return Analysis([], sorted(ckpt.tensors), exc.problems)
    hf_per: dict[str, dict[tuple[str, str], dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    hf_naming: dict[str, set[str]] = defaultdict(set)
    hf_grouped: dict[str, dict[str, str]] = defaultdict(dict)
    te_per: dict[str, dict[str, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    te_grouped: dict[str, dict[str, dict[int, str]]] = defaultdict(dict)
    claimed: set[str] = set()
    for key in sorted(ckpt.tensors):
        # Canonical indices give one key per index, so an index never appears twice in a group.
        if m := _HF_PER_EXPERT.match(key):
            if (i := _index_or_problem(m["index"], key, problems)) is not None:
                hf_naming[m["prefix"]].add("mixtral" if m["proj"].startswith("w") else "hf")
                hf_per[m["prefix"]][(_PROJ_PART[m["proj"]], m["kind"])][i] = key
        elif m := _HF_GROUPED.match(key):
            part = ("fc1_" if m["name"] == "gate_up_proj" else "fc2_") + ("bias" if m["bias"] else "weight")
            hf_grouped[m["prefix"]][part] = key
        elif m := _TE_PER_EXPERT.match(key):
            if (i := _index_or_problem(m["index"], key, problems)) is not None:
                te_per[m["prefix"] or ""][m["kind"]][i] = key
        elif (m := _TE_GROUPED.match(key)) and records.get(m["prefix"] or "", {}).get("naming") == "te":
            te_grouped[m["prefix"] or ""][m["kind"]] = {0: key}
        else:
            if _LOOKS_PER_EXPERT.search(key):
                problems.append(f"unrecognised per-expert tensor {shown(key)}; refusing rather than copying it as is")
            continue
        claimed.add(key)

    groups: list[ExpertGroup | None] = []
    for prefix in sorted(set(hf_per) & set(hf_grouped)) + sorted(set(te_per) & set(te_grouped)):
        problems.append(f"{prefix or 'root'}: both per-expert and grouped tensors; the layout is ambiguous")
    for prefix, by_part in hf_per.items():
        if prefix in hf_grouped:
            continue
        if len(hf_naming[prefix]) > 1:
            problems.append(f"{prefix}: mixes gate_proj/up_proj/down_proj and w1/w3/w2 names; ambiguous")
            continue
        groups.append(_hf_per_expert_group(ckpt, prefix, hf_naming[prefix].pop(), by_part, problems))
    for prefix, parts in hf_grouped.items():
        if prefix not in hf_per:
            groups.append(_hf_grouped_group(ckpt, prefix, parts, records.get(prefix), problems))
    for layout, found in (("per-expert", te_per), ("grouped", te_grouped)):
        for prefix, by_kind in found.items():
            if prefix not in (te_grouped if layout == "per-expert" else te_per):
                groups.append(_te_group(ckpt, prefix, layout, by_kind, records.get(prefix), problems))
    kept = sorted((g for g in groups if g is not None), key=lambda g: g.prefix)
    for g in kept:
        _settle_glu_order(g, records.get(g.prefix), src_glu_interleave, problems)
    _check_expert_counts(ckpt, kept, records, problems)
    missing_records = sorted(set(records) - set(hf_per) - set(hf_grouped) - set(te_per) - set(te_grouped))
    if missing_records:
        problems.append(f"the file's records list expert groups {missing_records} that it does not hold")
    other = sorted(set(ckpt.tensors) - claimed)
    return Analysis(kept, other, problems)


def _check_expert_counts(ckpt: Checkpoint, groups: list[ExpertGroup], records: dict, problems: list[str]) -> None:
    """A missing last expert leaves no gap in the indices: compare with what else says how many."""
    try:
        configured = ckpt.configured_num_experts()
    except CheckpointError as exc:  # listed with the other problems, then refused together
        problems.extend(exc.problems)
        configured = None
    most = max((g.num_experts for g in groups), default=0)
    for g in groups:
        recorded = (records.get(g.prefix) or {}).get("num_experts")
        if configured is not None and g.num_experts < configured[0]:
            problems.append(
                f"{g.prefix}: holds experts 0..{g.num_experts - 1}, but {configured[1]} says "
                f"{configured[0]}: {missing_indices((), configured[0], start=g.num_experts)}"
            )
        elif isinstance(recorded, int) and g.num_experts < recorded:
            problems.append(f"{g.prefix}: holds experts 0..{g.num_experts - 1}, but the file records {recorded}")
        elif configured is None and g.num_experts < most:
            problems.append(
                f"{g.prefix}: holds {g.num_experts} experts, other groups of this checkpoint hold {most}:"
                f" {missing_indices((), most, start=g.num_experts)}"
            )


def _hf_per_expert_group(
    ckpt: Checkpoint, prefix: str, naming: str, by_part: dict[tuple[str, str], dict[int, str]], problems: list[str]
) -> ExpertGroup | None:
    n_before = len(problems)
    num = 1 + max(max(indices) for indices in by_part.values())
    has_bias = any(kind == "bias" for _, kind in by_part)
    for kind in ("weight", "bias") if has_bias else ("weight",):
        for part in ("gate", "up", "down"):
            _check_indices(f"{prefix}.*.{PART_NAME[naming][part]}.{kind}", by_part.get((part, kind), {}), num, problems)
    keys = [key for indices in by_part.values() for key in indices.values()]
    dtype = _dtype(ckpt, keys, prefix, problems)

    def shape_of(part: str, kind: str) -> tuple[int, ...] | None:
        return _same(
            {key: ckpt.tensors[key].shape for key in by_part.get((part, kind), {}).values()},
            f"{prefix}: shapes of {PART_NAME[naming][part]}.{kind}",
            problems,
        )

    gate, up, down = shape_of("gate", "weight"), shape_of("up", "weight"), shape_of("down", "weight")
    if gate and up and down:
        if len(gate) != 2 or gate != up or down != (gate[1], gate[0]):
            problems.append(f"{prefix}: gate {gate}, up {up}, down {down} are not [F, H], [F, H], [H, F]")
    if has_bias and gate and down and len(gate) == 2:
        ffn, hidden = gate
        for part, want in (("gate", (ffn,)), ("up", (ffn,)), ("down", (hidden,))):
            got = shape_of(part, "bias")
            if got is not None and got != want:
                problems.append(f"{prefix}: {PART_NAME[naming][part]}.bias has shape {got}, expected {want}")
    if len(problems) > n_before or dtype is None or gate is None:  # (None: a problem was listed)
        return None
    ffn, hidden = gate
    parts: dict[str, tuple[int, ...]] = {"fc1_weight": (2 * ffn, hidden), "fc2_weight": (hidden, ffn)}
    if has_bias:
        parts.update({"fc1_bias": (2 * ffn,), "fc2_bias": (hidden,)})
    return ExpertGroup(prefix, naming, "per-expert", "mlp", num, dtype, parts, dict(by_part))


def _hf_grouped_group(
    ckpt: Checkpoint, prefix: str, found: dict[str, str], record: dict | None, problems: list[str]
) -> ExpertGroup | None:
    n_before = len(problems)
    for part in ("fc1_weight", "fc2_weight"):
        if part not in found:
            problems.append(f"{prefix}: has {sorted(HF_GROUPED_NAME[p] for p in found)} but no {HF_GROUPED_NAME[part]}")
    if ("fc1_bias" in found) != ("fc2_bias" in found):
        problems.append(f"{prefix}: only one of gate_up_proj_bias / down_proj_bias")
    if len(problems) > n_before:
        return None
    t = {part: ckpt.tensors[key] for part, key in found.items()}
    gate_up, down = t["fc1_weight"].shape, t["fc2_weight"].shape
    if len(gate_up) != 3 or len(down) != 3 or gate_up[0] != down[0]:
        problems.append(f"{prefix}: gate_up_proj {gate_up} and down_proj {down} are not [N, 2F, H] and [N, H, F]")
        return None
    num, hidden, ffn = down  # if stored [N, out, in]
    if gate_up[1:] != (2 * ffn, hidden) and gate_up[1:] == (ffn, 2 * hidden):
        # down [N, F, H] and gate_up [N, H, 2F]: the shapes tell the orientation apart, always.
        problems.append(
            f"{prefix}: gate_up_proj {gate_up} / down_proj {down} are stored [N, in, out] "
            "(gpt-oss style); moekit convert handles [N, out, in] only"
        )
        return None
    if gate_up[1:] != (2 * ffn, hidden):
        problems.append(f"{prefix}: gate_up_proj {gate_up} does not match down_proj {down} ([N, 2F, H] vs [N, H, F])")
        return None
    parts: dict[str, tuple[int, ...]] = {"fc1_weight": (2 * ffn, hidden), "fc2_weight": (hidden, ffn)}
    if "fc1_bias" in t:
        for part, want in (("fc1_bias", (num, 2 * ffn)), ("fc2_bias", (num, hidden))):
            if t[part].shape != want:
                problems.append(f"{prefix}: {HF_GROUPED_NAME[part]} has shape {t[part].shape}, expected {want}")
        parts.update({"fc1_bias": (2 * ffn,), "fc2_bias": (hidden,)})
    dtype = _dtype(ckpt, found.values(), prefix, problems)
    if len(problems) > n_before or dtype is None:  # (None: a problem was listed)
        return None
    naming = (record or {}).get("naming", "hf")
    return ExpertGroup(prefix, naming if naming in PART_NAME else "hf", "grouped", "mlp", num, dtype, parts, found)


def _te_group(
    ckpt: Checkpoint,
    prefix: str,
    layout: str,
    by_kind: dict[str, dict[int, str]],
    record: dict | None,
    problems: list[str],
) -> ExpertGroup | None:
    n_before = len(problems)
    where = prefix or "root"
    if record is not None and record.get("role") in ("fc1", "fc2", "linear"):
        role = record["role"]
    else:
        last = prefix.rsplit(".", 1)[-1]
        role = "fc1" if "fc1" in last else "fc2" if "fc2" in last else "linear"
    if "weight" not in by_kind:
        problems.append(f"{where}: bias tensors without weight tensors")
        return None
    dtype = _dtype(ckpt, [key for indices in by_kind.values() for key in indices.values()], prefix, problems)
    if layout == "per-expert":
        num = 1 + max(max(indices) for indices in by_kind.values())
        for kind, indices in by_kind.items():
            _check_indices(f"{join_key(prefix, kind)}{{i}}", indices, num, problems)
        shapes = {
            kind: _same(
                {key: ckpt.tensors[key].shape for key in indices.values()}, f"{where}: shapes of {kind}{{i}}", problems
            )
            for kind, indices in by_kind.items()
        }
    else:
        full = {kind: ckpt.tensors[indices[0]].shape for kind, indices in by_kind.items()}
        num = full["weight"][0] if full["weight"] else 0
        shapes = {kind: shape[1:] for kind, shape in full.items()}
        if any(not shape or shape[0] != num for shape in full.values()):
            problems.append(f"{where}: weight {full['weight']} and bias {full.get('bias')} disagree on N")
    weight = shapes["weight"]
    if len(problems) > n_before or weight is None:  # (None: a problem was listed)
        return None
    if len(weight) != 2:
        problems.append(f"{where}: weight has per-expert shape {weight}, expected [out, in]")
    elif "bias" in shapes and shapes["bias"] != (weight[0],):
        problems.append(f"{where}: bias has per-expert shape {shapes['bias']}, expected ({weight[0]},)")
    elif role == "fc1" and weight[0] % 2:
        problems.append(f"{where}: a GLU fc1 needs an even number of output rows (2F), got {weight[0]}")
    if len(problems) > n_before or dtype is None:
        return None
    parts = {kind: shape for kind, shape in shapes.items() if shape is not None}  # all: no problem was listed
    return ExpertGroup(prefix, "te", layout, role, num, dtype, parts, dict(by_kind))


def _settle_glu_order(group: ExpertGroup, record: dict | None, given: GluOrder, problems: list[str]) -> None:
    """Set the fc1 gate/up order of the group's fused source tensors, or leave it KEEP (unknown)."""
    if not group.fused_fc1:
        group.glu_interleave_size = None
        return
    recorded: GluOrder = (
        record.get("glu_interleave_size") if record is not None and "glu_interleave_size" in record else KEEP
    )
    if recorded != KEEP and given != KEEP and recorded != given:
        problems.append(
            f"{group.prefix or 'root'}: the file records glu_interleave_size={recorded}, "
            f"but --src-glu-interleave says {given}"
        )
    order = recorded if recorded != KEEP else given
    if order != KEEP and order is not None and group.ffn_size % order:
        problems.append(f"{group.prefix or 'root'}: glu_interleave_size {order} does not divide F={group.ffn_size}")
    group.glu_interleave_size = order


# ---- GroupedLinear state dicts ---------------------------------------------------------------


def collect_grouped(
    state_dict: dict, prefix: str, name: str, num: int, member_shape: tuple[int, ...]
) -> torch.Tensor | None:
    """Read `name` (grouped, or packed (N*O, ...)) or `name{i}` (discrete) from a module's state dict
    and return one (N, *member_shape) tensor, or None if neither is present. Removes the keys read.
    `prefix` is the module's state-dict prefix (ends in "." or is "")."""
    pattern = re.compile(re.escape(prefix + name) + f"({INDEX_PATTERN})$")
    indexed = {expert_index(m.group(1), key): key for key in state_dict if (m := pattern.match(key))}
    grouped_key = prefix + name
    has_grouped = grouped_key in state_dict and state_dict[grouped_key] is not None
    if has_grouped and indexed:
        raise CheckpointError(
            [
                f"checkpoint has both {grouped_key!r} and per-expert keys "
                f"({len(indexed)}, e.g. {shown(indexed[min(indexed)])}); the layout is ambiguous"
            ]
        )
    if has_grouped:
        t = state_dict.pop(grouped_key)
        full = (num, *member_shape)
        packed = (num * member_shape[0], *member_shape[1:])
        if tuple(t.shape) == full:
            return t
        if tuple(t.shape) == packed:
            return t.reshape(full)
        raise CheckpointError([f"{grouped_key!r} has shape {tuple(t.shape)}; expected {full} or packed {packed}"])
    if not indexed:
        return None
    missing = missing_indices(indexed, num, what="keys", name=lambda i: repr(f"{prefix}{name}{i}"))
    extra = sorted(i for i in indexed if i >= num)
    if missing or extra:
        found = [missing] if missing else []
        if extra:
            found.append(
                f"{len(extra):,} key{'s' if len(extra) > 1 else ''} beyond them, e.g. {shown(indexed[extra[0]])}"
            )
        raise CheckpointError(
            [
                f"checkpoint's per-expert {prefix}{name}{{i}} keys do not cover experts 0..{num - 1} exactly: "
                + "; ".join(found)
            ]
        )
    bad = [
        f"{indexed[i]} {tuple(state_dict[indexed[i]].shape)}"
        for i in range(num)
        if tuple(state_dict[indexed[i]].shape) != member_shape
    ]
    if bad:
        more = f" and {len(bad) - SHOWN_INDICES:,} more" if len(bad) > SHOWN_INDICES else ""
        raise CheckpointError(
            [f"per-expert {name} tensors must have shape {member_shape}; got {bad[:SHOWN_INDICES]}{more}"]
        )
    return torch.stack([state_dict.pop(indexed[i]) for i in range(num)])


def place_grouped(state_dict: dict, prefix: str, name: str, full: torch.Tensor, single: bool) -> None:
    """Put an (N, ...) tensor back under the module's own names: `name`, or `name0..name{N-1}`."""
    if single:
        state_dict[prefix + name] = full
    else:
        for i, member in enumerate(full.unbind(0)):
            state_dict[f"{prefix}{name}{i}"] = member


def convert_glu_on_load(
    tensors: list[torch.Tensor | None],
    recorded: bool,
    ckpt_block: int | None,
    module_block: int | None,
    ffn: int,
    where: str,
) -> list[torch.Tensor | None]:
    """An fc1's grouped (N, 2F, ...) tensors from the checkpoint's GLU order to the module's.

    A checkpoint that does not record its order is taken as `[gates; ups]` (TransformerEngine's and
    Hugging Face's) by a module with order None, and refused by one with an interleave size."""
    if not recorded:
        if module_block is None:
            return tensors
        raise CheckpointError(
            [
                f"{where}: this module expects fc1 rows interleaved with glu_interleave_size={module_block}, but the "
                "checkpoint does not record its interleave size (no moekit extra state or file records). Load it "
                "into a module with glu_interleave_size=None if it is [gates; ups], or convert it first "
                "(moekit.interleave_glu / `moekit convert --src-glu-interleave`)."
            ]
        )
    if ckpt_block == module_block:
        return tensors
    try:
        check_interleave(ffn, ckpt_block)
    except ValueError as exc:
        raise CheckpointError([f"{where}: the checkpoint records glu_interleave_size={ckpt_block}: {exc}"]) from None
    return [None if t is None else reorder_glu_rows(t, ckpt_block, module_block, dim=1) for t in tensors]
