"""The backward's routed operands' quantization (`group_quantize_for_wgrad` with `index=`: rows gathered
from the token rows as they are loaded, the FP8 wgrad's segments written) under variants of its entry in
the slots kernel's configuration table (`configs.QUANTIZE_SLOTS[arch][(128, "segments-gathered")]`,
fp8_block), against the HBM copy of the same bytes and against gathering first.

Kinds, at each shape's routing (random router logits, top-k, rows sorted by expert with int32 maps, as
`moe_experts` sorts them), M = T * K routed rows of width H gathered from (T, H) token rows:
- dy: both forms (the fc2 dgrad's rowwise operand and the fc2 wgrad's columnwise one), as the layer's
  backward quantizes d out. Moves M*H*2 bytes read and M*H*2 written (the two FP8 forms), plus scales.
- x: the columnwise form alone (fc1's wgrad operand), as the layer's backward quantizes x: M*H*2 read,
  M*H written.
- w: fc1's (N, 2F, H) weight in 128 x 128 blocks (the rowwise form alone, as the layer refreshes it each
  optimizer step), under entries of the tiles kernel's table (`QUANTIZE_TILES[arch][(128, "tile")]`):
  N*2F*H*2 read, N*2F*H written.
- mx: mxfp8's rowwise + columnwise (M, X) forms of the sorted rows (`group_quantize`), under entries of
  the slots kernel's `(32, "rows")`: M*H*2 read, M*H*2 written.
- held: fc2's wgrad operand in the quantized MLP's backward, the activation (SwiGLU, probs) of h held in
  fp8_block's rowwise form (M, 2F), quantized columnwise into the wgrad's segments by the gated kernel
  (`group_quantize_held_columns`) under entries of `configs.HELD_COLUMNS[arch]`: M*2F read (FP8), M*F
  written. held_apart: the two launches it replaces (`held_gated_activation`, then
  `group_quantize_for_wgrad` of the (M, F) activation), timed as one call, counted on the same bytes.
- dy_gather_first, x_gather_first: the same with the rows gathered into an (M, H) tensor first
  (`index_select`) and the gathered tensor quantized without an index (on sm_90 the Gluon TMA kernel):
  the design before the kernels read through the index, timed as one call.
- copy: an (M, H) bf16 tensor copied by torch: the bandwidth the kinds can hope for, counted as the
  kind's own bytes (`vs_copy` 1.0 = the copy's bandwidth).

A variant runs the kinds of its table ("base" all). Every variant's bytes (both forms' data on the
segments in use, and every scale) must equal the base table's (`equal`). Times: CUDA events, the
median of `--reps` calls after a warm-up, the median over `--rounds` rounds in which the variants take
turns.

    python benchmarks/sweep_quantize.py --out results.json [--shapes qwen3-30b-a3b] [--variants base,s3]
    TRITON_INTERPRET=1 python benchmarks/sweep_quantize.py --smoke   # CPU: the plumbing
"""

from __future__ import annotations

import bench_moe_layer
import torch
import triton
from runner import (
    apply_tables,
    copy_relative_cells,
    event_median_ms,
    run_table_sweep,
    saved_tables,
    table_sweep_parser,
)

import moekit
from moekit.ops.glu import held_gated_activation
from moekit.ops.quantize import SegmentedColumns, group_quantize_for_wgrad, group_quantize_held_columns
from moekit.ops.routing import sort_by_expert
from moekit.ops.runtime import configs
from moekit.ops.runtime.launch import arch_of
from moekit.ops.splits import GroupOffsets

# name: (tokens T, top-k K, experts N, hidden H, ffn F), the layer benchmark's shapes (SonicMoE's included).
SHAPES = {
    s.name: (s.tokens, s.top_k, s.experts, s.hidden, s.ffn)
    for s in bench_moe_layer.SHAPES + bench_moe_layer.SONICMOE_SHAPES
}
SMOKE_SHAPES = {"smoke": (60, 3, 4, 256, 128)}
KEY = (128, "segments-gathered")
TILE_KEY = (128, "tile")
KINDS = ("dy", "x")
# (BLOCK_C, CHUNK, warps, STAGES, BAND, MAXNREG) of the entry; None: the table as committed. "r96",
# "r80", "r96_s3": the registers capped so that 5 or 6 programs of 4 warps share an SM (ptxas spills
# the rest); "s3"/"s4": a deeper pipeline of the first walk (each chunk's index load, then its rows:
# two dependent loads); "c16_s4" smaller chunks, deeper; "c64", "w8", "c64_w8": more rows or warps a
# program; "b256": 256-column strips with 8 warps; "band1", "band2", "band4", "band8": 1-D launch,
# bands of 1-8 slots, their column strips fastest (a band's programs read the same token rows' other
# columns and write the same rows' other row scales close in time, where slots fastest reads each row's
# 256-byte pieces and writes its 4-byte scales far apart); "c128_w8", "c128": the whole slot one chunk,
# which the kernel walks once (held in registers: its rows read once). (Strips narrower than the
# 128-column rowwise block do not fit dy's rowwise form.) A variant the GPU cannot hold (OutOfResources)
# is reported and left out.
VARIANTS: dict[str, tuple[int, ...] | None] = {
    "base": None,
    "r96": (128, 32, 4, 2, 0, 96),
    "r80": (128, 32, 4, 2, 0, 80),
    "r96_s3": (128, 32, 4, 3, 0, 96),
    "s3": (128, 32, 4, 3, 0, 0),
    "s4": (128, 32, 4, 4, 0, 0),
    "c16_s4": (128, 16, 4, 4, 0, 0),
    "c64": (128, 64, 4, 2, 0, 0),
    "w8": (128, 32, 8, 2, 0, 0),
    "c64_w8": (128, 64, 8, 2, 0, 0),
    "b256": (256, 32, 8, 2, 0, 0),
    "band1": (128, 32, 4, 2, 1, 0),
    "band2": (128, 32, 4, 2, 2, 0),
    "band4": (128, 32, 4, 2, 4, 0),
    "band8": (128, 32, 4, 2, 8, 0),
    "s3_w8": (128, 32, 8, 3, 0, 0),
    "c128_w8": (128, 128, 8, 1, 0, 0),
    "c128": (128, 128, 4, 1, 0, 0),
}
# The weights' 128 x 128 blocks (kind "w": fc1's (N, 2F, H) weight, rowwise form alone, as the layer
# refreshes it each optimizer step) under entries of `configs.QUANTIZE_TILES[arch][(128, "tile")]`,
# (BLOCK_R, BLOCK_C, warps, STEPS, STAGES, MAXNREG) with BLOCK_R = BLOCK_C = 128: no register cap
# ("t_r0"), fewer warps a tile ("t_w4", "t_w8"), or several tiles a program in a pipelined loop
# ("t_w8_steps2", "t_w8_steps4", "t_w16_steps2").
TILE_VARIANTS: dict[str, tuple[int, int, int, int, int, int]] = {
    "t_r0": (128, 128, 16, 1, 1, 0),
    "t_w4": (128, 128, 4, 1, 1, 0),
    "t_w8": (128, 128, 8, 1, 1, 0),
    "t_w8_steps2": (128, 128, 8, 2, 2, 0),
    "t_w8_steps4": (128, 128, 8, 4, 3, 0),
    "t_w16_steps2": (128, 128, 16, 2, 2, 0),
}
# mxfp8's two forms of sorted rows (kind "mx": rowwise + columnwise (M, X), as `group_quantize` gives
# them) under entries of the slots kernel's `(32, "rows")` (BLOCK_C, CHUNK, warps, STAGES, BAND, MAXNREG): the
# 32-row slot one chunk, walked once ("mx_c32", with 8 warps "mx_c32_w8", 256 or 64 columns
# "mx_b256_c32", "mx_b64_c32").
MX_KEY = (32, "rows")
MX_VARIANTS: dict[str, tuple[int, int, int, int, int, int]] = {
    "mx_c32": (128, 32, 4, 1, 1, 0),
    "mx_c32_w8": (128, 32, 8, 1, 1, 0),
    "mx_b256_c32": (256, 32, 8, 1, 1, 0),
    "mx_b64_c32": (64, 32, 4, 1, 1, 0),
}
# fc2's wgrad operand from the held h (kind "held") under entries of `configs.HELD_COLUMNS[arch]`
# (BLOCK_C, warps): a program one 128-row slot by BLOCK_C activation columns.
HELD_VARIANTS: dict[str, tuple[int, int]] = {
    "hc_b32_w4": (32, 4),
    "hc_b32_w8": (32, 8),
    "hc_b64_w4": (64, 4),
    "hc_b64_w8": (64, 8),
    "hc_b128_w8": (128, 8),
    "hc_b128_w16": (128, 16),
}
# Entries added to the Gluon kernel's table `configs.QUANTIZE_SLOTS_TMA[arch]`, (CHUNK, warps, STAGES,
# programs an SM, slots fastest, MAXNREG) per (block, form). The routed operands (kinds "dy", "x") by its
# GATHER form (rows copied by cp.async through the index), which runs where the table has "-gathered"
# entries (none committed: slower than the Triton kernel on the H200 at 4ae2cc2; these variants time it
# again beside the base): "tma_g" gives them the entries of the forms they gather ("segments" for dy's
# both forms, "segments-columnwise" for x's), "tma_g6" six programs an SM of 2 warps a strip. mxfp8's
# (M, X) forms (kind "mx") by the Gluon kernel, which runs where the table has (32, "rows"): a strip is
# 32 x 128 (8 KiB of bf16), so the bytes in flight an SM are strips a program x programs an SM x 8 KiB:
# "mx_tma" 3 x 8 (192 KiB), "mx_tma_s2" 2 x 8, "mx_tma_s4p6" 4 x 6, "mx_tma_c32w4" 32-row chunks of 4
# warps, 4 x 4; "mx_tma_slots" mx_tma with slots fastest; the "v_" ones (the H100 run at 43453a9 that chose
# the committed entry, v_s1p8): one stage ("v_s1p8"), 2 x 6 ("v_s2p6"), one-warp programs ("v_w1s1p16",
# "v_w1s2p12"), 10 programs under a 96-register cap ("v_s2p10r96"), 4 warps a 16-row chunk ("v_w4s2p4").
TMA_VARIANTS: dict[str, dict[tuple[int, str], tuple[int, int, int, int, bool, int]]] = {
    "tma_g": {
        (128, "segments-gathered"): (32, 4, 1, 4, False, 128),
        (128, "segments-columnwise-gathered"): (32, 4, 2, 3, True, 0),
    },
    "tma_g6": {
        (128, "segments-gathered"): (32, 4, 1, 6, False, 80),
        (128, "segments-columnwise-gathered"): (32, 4, 1, 6, True, 80),
    },
    "mx_tma": {(32, "rows"): (16, 2, 3, 8, False, 0)},
    "mx_tma_s2": {(32, "rows"): (16, 2, 2, 8, False, 0)},
    "mx_tma_s4p6": {(32, "rows"): (16, 2, 4, 6, False, 0)},
    "mx_tma_c32w4": {(32, "rows"): (32, 4, 4, 4, False, 0)},
    "mx_tma_slots": {(32, "rows"): (16, 2, 3, 8, True, 0)},
    "v_s1p8": {(32, "rows"): (16, 2, 1, 8, False, 0)},
    "v_s2p6": {(32, "rows"): (16, 2, 2, 6, False, 0)},
    "v_w1s1p16": {(32, "rows"): (16, 1, 1, 16, False, 0)},
    "v_w1s2p12": {(32, "rows"): (16, 1, 2, 12, False, 0)},
    "v_s2p10r96": {(32, "rows"): (16, 2, 2, 10, False, 96)},
    "v_w4s2p4": {(32, "rows"): (16, 4, 2, 4, False, 0)},
}
VARIANTS.update(TILE_VARIANTS)
VARIANTS.update(MX_VARIANTS)
VARIANTS.update(HELD_VARIANTS)
# A Gluon table variant's entries, as the results record them: ("block/form", entry) pairs.
VARIANTS.update(
    {
        name: tuple((f"{block}/{form}", entry) for (block, form), entry in added.items())
        for name, added in TMA_VARIANTS.items()
    }
)


def table_of(variant: str) -> tuple[str, tuple[int, str] | None, tuple[str, ...]]:
    """The table, key (None: the table's entry is the arch's value itself) and kinds that `variant` changes."""
    if variant in HELD_VARIANTS:
        return "HELD_COLUMNS", None, ("held",)
    if variant in TMA_VARIANTS:
        mx = any(block == 32 for block, _ in TMA_VARIANTS[variant])
        return "QUANTIZE_SLOTS_TMA", None, ("mx",) if mx else KINDS
    if variant in TILE_VARIANTS:
        return "QUANTIZE_TILES", TILE_KEY, ("w",)
    if variant in MX_VARIANTS:
        return "QUANTIZE_SLOTS", MX_KEY, ("mx",)
    return "QUANTIZE_SLOTS", KEY, KINDS


def table_changes(variant: str, arch: str) -> dict[str, dict]:
    """`apply_tables`' changes for `variant` on `arch`: a new copy of the arch's table with the entry
    replaced (the saved tables keep the committed one)."""
    entry = VARIANTS[variant]
    if entry is None:
        return {}
    if variant in TMA_VARIANTS:  # entries added to the arch's Gluon table
        return {"QUANTIZE_SLOTS_TMA": {arch: {**configs.QUANTIZE_SLOTS_TMA.get(arch, {}), **TMA_VARIANTS[variant]}}}
    table, key, _ = table_of(variant)
    if key is None:
        return {table: {arch: entry}}
    return {table: {arch: {**getattr(configs, table)[arch], key: entry}}}


def kinds_of(variant: str) -> tuple[str, ...]:
    """The kinds a variant changes ("base": all of them)."""
    if variant == "base":
        return (*KINDS, "w", "mx", "held")
    return table_of(variant)[2]


def bytes_of(outs, in_use: int) -> list[torch.Tensor]:
    """The bytes a variant must reproduce: every tensor of the rowwise GroupedTensor (if any) and of the
    SegmentedColumns (if any), its data on the columns in use (past them unspecified)."""
    row, cols = outs
    tensors = []
    if cols is not None:
        assert isinstance(cols, SegmentedColumns)
        tensors += [cols.data[:, :in_use], cols.scale_inv]
    if row is not None:
        tensors += [t for t in row.storage()[2:6] if t is not None]
    return [t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) for t in tensors]


def cells_of(
    name: str, shape: tuple[int, int, int, int, int], variants: list[str], reps: int, rounds: int, device: str
):
    T, K, N, H, F = shape
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter: no bf16 conversions
    ids = torch.randn(T, N, device=device, generator=gen).topk(K, dim=1).indices
    order = sort_by_expert(ids, N, use_triton=True, index_dtype=torch.int32)
    M = T * K
    offsets = GroupOffsets(offs=order.offs, host=None, rows=M)
    index = order.token_of_row
    tokens = torch.randn(T, H, device=device, generator=gen).to(dtype)
    counts = order.offs.diff().tolist()  # setup only: the columns in use, for the bytes check
    in_use = sum(-(-n // 128) * 128 for n in counts)

    def quantize(rowwise: bool, gather_first: bool):
        """d out's both forms (rowwise) or x's columnwise form, through the index or gathered first."""
        if gather_first:
            rows = tokens.index_select(0, index.view(-1))
            return group_quantize_for_wgrad(rows, offsets, "fp8_block", rowwise=rowwise, backend="triton")
        return group_quantize_for_wgrad(tokens, offsets, "fp8_block", rowwise=rowwise, index=index, backend="triton")

    weight = torch.randn(N, 2 * F, H, device=device, generator=gen).to(dtype)

    def quantize_weight():
        return moekit.group_quantize(weight, None, "fp8_block", backend="triton"), None

    sorted_rows = tokens.index_select(0, index.view(-1))
    splits = order.offs.diff()  # on the device, as grouped_linear takes them

    def quantize_mx():
        return moekit.group_quantize(sorted_rows, splits, "mxfp8", columnwise=True, backend="triton"), None

    h = torch.randn(M, 2 * F, device=device, generator=gen).to(dtype)
    h_q = moekit.group_quantize(h, splits, "fp8_block", backend="triton")
    probs = torch.rand(M, device=device, generator=gen).to(dtype)

    def quantize_held(apart: bool):
        """fc2's wgrad operand from the held h: by the gated kernel, or recomputed and quantized apart."""
        if apart:
            a = held_gated_activation(h_q, probs, None, "swiglu")
            return None, group_quantize_for_wgrad(a, offsets, "fp8_block", backend="triton")[1]
        return None, group_quantize_held_columns(h_q, offsets, probs, F, "swiglu", 0.0, 0.0)

    calls = {
        "dy": lambda: quantize(True, False),
        "x": lambda: quantize(False, False),
        "w": quantize_weight,
        "mx": quantize_mx,
        "held": lambda: quantize_held(False),
    }
    first = {
        "dy_gather_first": lambda: quantize(True, True),
        "x_gather_first": lambda: quantize(False, True),
        "held_apart": lambda: quantize_held(True),
    }
    same_as = {"dy_gather_first": "dy", "x_gather_first": "x", "held_apart": "held"}
    element = tokens.element_size()
    moved = {  # bytes each kind moves once: what it reads plus what it writes (scales left out)
        "dy": M * H * element + 2 * M * H,
        "x": M * H * element + M * H,
        "w": N * 2 * F * H * (element + 1),
        "mx": M * H * (element + 2),
        "held": M * 2 * F + M * F,
        "copy": 2 * M * H * element,
    }
    moved.update({kind: moved[of] for kind, of in same_as.items()})
    copy_src = torch.empty(M, H, device=device, dtype=dtype)
    copy_dst = torch.empty_like(copy_src)
    arch = arch_of(tokens.device)
    saved = saved_tables({v: table_changes(v, arch) for v in variants})
    reference: dict[str, list[torch.Tensor]] = {}
    times: dict[tuple[str, str], list[float]] = {}
    equal: dict[tuple[str, str], bool] = {}
    failed: set[str] = set()

    def same(kind: str, outs) -> bool:
        got = bytes_of(outs, in_use)
        want = reference.setdefault(kind, got)
        return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    try:
        for _ in range(rounds):
            times.setdefault(("copy", "torch"), []).append(event_median_ms(lambda: copy_dst.copy_(copy_src), reps))
            for variant in variants:
                if variant in failed:
                    continue
                apply_tables(table_changes(variant, arch), saved)
                try:
                    for kind in kinds_of(variant):
                        equal[(kind, variant)] = equal.get((kind, variant), True) and same(kind, calls[kind]())
                        times.setdefault((kind, variant), []).append(event_median_ms(calls[kind], reps))
                except triton.runtime.errors.OutOfResources as error:  # an entry the GPU cannot hold
                    if variant == "base":
                        raise
                    failed.add(variant)
                    print(f"{name}: variant {variant} does not run: {error}", flush=True)
                    for kind in kinds_of(variant):
                        times.pop((kind, variant), None)
                        equal.pop((kind, variant), None)
            apply_tables({}, saved)
            for kind, call in first.items():
                equal[(kind, "-")] = equal.get((kind, "-"), True) and same(same_as[kind], call())
                times.setdefault((kind, "-"), []).append(event_median_ms(call, reps))
    finally:
        apply_tables({}, saved)
    return copy_relative_cells(name, times, equal, moved)


def main() -> None:
    parser = table_sweep_parser(__doc__, ["deepseek-v3-ep8", "qwen3-30b-a3b"], VARIANTS)
    parser.set_defaults(shapes="deepseek-v3-ep8,qwen3-30b-a3b")  # any of SHAPES by name
    parser.add_argument(
        "--entry",
        default=None,
        help="one more variant, 'custom': BLOCK_C,CHUNK,warps,STAGES,BAND,MAXNREG (six integers)",
    )
    args = parser.parse_args()
    if args.entry is not None:
        fields = args.entry.split(",")
        if len(fields) != 6 or not all(f.strip().isdigit() for f in fields):
            raise SystemExit(
                "--entry must be six comma-separated integers BLOCK_C,CHUNK,warps,STAGES,BAND,MAXNREG, "
                f"got {args.entry!r}"
            )
        b, c, w, st, band, regs = (int(f) for f in fields)
        VARIANTS["custom"] = (b, c, w, st, band, regs)
        args.variants += ",custom"
    entry = {"table": "QUANTIZE_SLOTS", "key": list(KEY), "fields": "BLOCK_C, CHUNK, warps, STAGES, BAND, MAXNREG"}
    run_table_sweep("sweep_quantize.py", args, cells_of, (SHAPES, SMOKE_SHAPES), VARIANTS, {"entry": entry})


if __name__ == "__main__":
    main()
