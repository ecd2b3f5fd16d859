"""The one metadata vocabulary of moekit's checkpoints.

Every file moekit writes (`save_safetensors`, `moekit convert`) records its expert groups in the
safetensors metadata under `moekit.expert_groups`: a JSON list of records, one per expert group,

    {"prefix": "blocks.0.moe.experts.fc1", "naming": "te", "layout": "per-expert", "role": "fc1",
     "num_experts": 8, "glu_interleave_size": 2}

- `naming`: "te" (`{prefix}.weight{i}` / `{prefix}.weight`, moekit's and TransformerEngine's names),
  "hf" (`{prefix}.{i}.gate_proj.weight` / `{prefix}.gate_up_proj`) or "mixtral" (`w1|w3|w2`);
- `layout`: "per-expert" or "grouped";
- `role`: "mlp" (a whole hf/mixtral expert MLP), "fc1" (a GLU fc1: rows are gate and up), "fc2" or
  "linear" (plain grouped linears);
- `glu_interleave_size`: the gate/up row order of the group's fused fc1 tensors: null for
  `[gates; ups]`, an int for blocks of that many rows (see `moekit.interleave_glu`). Meaningful where the fc1 rows are
  fused (role "fc1", or role "mlp" in the grouped layout).

A moekit `GroupedLinear` carries the same fact in its module state (`get_extra_state`):
`{"format": "moekit.GroupedLinear/1", "glu": bool, "glu_interleave_size": int or None}`; `read_safetensors`
rebuilds it from the group records, and `save_safetensors` writes the records from it, so a file's
GLU order is stated in exactly one place. Other modules' extra states travel as JSON under
`moekit.extra_state`. Files written before the records existed (GroupedLinear extra states under
`moekit.extra_state`) are read as the equivalent records.
"""

from __future__ import annotations

import json
from typing import TypeVar

from moekit.checkpoint.errors import CheckpointError

FORMAT_VERSION = "2"
META_FORMAT = "moekit.format_version"
META_GROUPS = "moekit.expert_groups"
META_EXTRA_STATE = "moekit.extra_state"
EXTRA_STATE_FORMAT = "moekit.GroupedLinear/1"
EXTRA_STATE_SUFFIX = "_extra_state"

_T = TypeVar("_T")

NAMINGS = ("te", "hf", "mixtral")
LAYOUTS = ("per-expert", "grouped")
ROLES = ("mlp", "fc1", "fc2", "linear")


def join_key(prefix: str, name: str) -> str:
    """`prefix.name`, or `name` for a module at the root of a state dict (prefix "")."""
    return f"{prefix}.{name}" if prefix else name


def linear_extra_state(is_glu: bool, glu_interleave_size: int | None) -> dict:
    """A GroupedLinear's extra state: whether its output rows are GLU gate/up rows, in which order."""
    return {"format": EXTRA_STATE_FORMAT, "glu": bool(is_glu), "glu_interleave_size": glu_interleave_size}


def glu_order_of_extra_state(extra: object) -> tuple[bool, int | None]:
    """(recorded, order): the GLU row order a GroupedLinear extra state records, if it records one."""
    if isinstance(extra, dict) and extra.get("format") == EXTRA_STATE_FORMAT and extra.get("glu"):
        return True, extra.get("glu_interleave_size")
    return False, None


def group_record(
    prefix: str, naming: str, layout: str, role: str, num_experts: int | None, glu_interleave_size: int | None
) -> dict:
    return {
        "prefix": prefix,
        "naming": naming,
        "layout": layout,
        "role": role,
        "num_experts": num_experts,
        "glu_interleave_size": glu_interleave_size,
    }


def records_from_state(state: dict, shapes: dict[str, tuple[int, ...]]) -> tuple[list[dict], dict]:
    """Group records for every GroupedLinear extra state of a state dict, and the other extra states.

    `shapes`: tensor name -> shape, from which each linear's layout and expert count are read (a
    record read from a pre-record file, without tensors, has `num_experts` None).
    """
    records, others = [], {}
    for key, value in state.items():
        if not key.endswith(EXTRA_STATE_SUFFIX):
            continue
        if not (isinstance(value, dict) and value.get("format") == EXTRA_STATE_FORMAT):
            others[key] = value
            continue
        prefix = key[: -len(EXTRA_STATE_SUFFIX)].rstrip(".")
        grouped = shapes.get(join_key(prefix, "weight"))
        num = 0
        while join_key(prefix, f"weight{num}") in shapes:
            num += 1
        glu = bool(value.get("glu"))
        records.append(
            group_record(
                prefix,
                "te",
                "grouped" if grouped else "per-expert",
                "fc1" if glu else "linear",
                grouped[0] if grouped else (num or None),
                value.get("glu_interleave_size") if glu else None,
            )
        )
    return records, others


def _check_record(record: object, where: str) -> dict:
    problems = []
    if not isinstance(record, dict) or not isinstance(record.get("prefix"), str):
        raise CheckpointError([f"{where}: {META_GROUPS} holds {record!r}; expected records with a 'prefix'"])
    prefix = record["prefix"]
    for field, allowed in (("naming", NAMINGS), ("role", ROLES)):
        if record.get(field) not in allowed:
            problems.append(
                f"{where}: {META_GROUPS} record {prefix!r} has {field}={record.get(field)!r}; expected one of {allowed}"
            )
    if record.get("layout", "per-expert") not in LAYOUTS:
        problems.append(
            f"{where}: {META_GROUPS} record {prefix!r} has layout={record.get('layout')!r}; expected one of {LAYOUTS}"
        )
    block = record.get("glu_interleave_size")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        problems.append(
            f"{where}: {META_GROUPS} record {prefix!r} has glu_interleave_size={block!r}; "
            "expected null or a positive int"
        )
    if problems:
        raise CheckpointError(problems)
    return record


def _json(metadata: dict, key: str, where: str, kind: type[_T]) -> _T:
    try:
        value = json.loads(metadata[key])
    except (TypeError, json.JSONDecodeError) as exc:
        raise CheckpointError([f"{where}: metadata {key} is not valid JSON ({exc})"]) from None
    if not isinstance(value, kind):
        raise CheckpointError([f"{where}: metadata {key} is a {type(value).__name__}; expected a {kind.__name__}"])
    return value


def read_records(metadata: dict, where: str) -> dict[str, dict]:
    """prefix -> group record, from a file's metadata (records, or a pre-record file's extra states)."""
    records: dict[str, dict] = {}
    if META_EXTRA_STATE in metadata:
        extra = _json(metadata, META_EXTRA_STATE, where, dict)
        legacy, _ = records_from_state(extra, {})
        records.update({r["prefix"]: r for r in legacy})
    if META_GROUPS in metadata:
        for record in _json(metadata, META_GROUPS, where, list):
            record = _check_record(record, where)
            records[record["prefix"]] = record
    return records


def other_extra_states(metadata: dict, where: str) -> dict:
    """The extra states of modules other than GroupedLinear recorded in a file's metadata."""
    if META_EXTRA_STATE not in metadata:
        return {}
    _, others = records_from_state(_json(metadata, META_EXTRA_STATE, where, dict), {})
    return others


def extra_states_from_records(records: dict[str, dict]) -> dict:
    """`{prefix}._extra_state` for every te-named group: what its GroupedLinear loads."""
    return {
        join_key(prefix, EXTRA_STATE_SUFFIX): linear_extra_state(r["role"] == "fc1", r.get("glu_interleave_size"))
        for prefix, r in records.items()
        if r["naming"] == "te"
    }


def file_metadata(records: list[dict], other_extra: dict, inherited: dict | None = None) -> dict[str, str]:
    """The safetensors metadata of a file moekit writes: `inherited` non-moekit entries, then ours."""
    meta = {key: value for key, value in (inherited or {}).items() if not key.startswith("moekit.")}
    meta.setdefault("format", "pt")
    meta[META_FORMAT] = FORMAT_VERSION
    meta[META_GROUPS] = json.dumps(sorted(records, key=lambda r: r["prefix"]))
    if other_extra:
        meta[META_EXTRA_STATE] = json.dumps(other_extra)
    return meta
