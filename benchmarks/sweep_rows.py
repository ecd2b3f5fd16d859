"""The row kernel (`gather_sum_rows`, the package's one row primitive) at a layer's routing, against the
HBM copy of the same bytes, under variants of its configuration table (`configs.ROWS`).

Kinds, at each shape's routing (router logits, top-k, rows sorted by expert with int32 maps, as
`moe_experts` sorts them):
- gather: x (T, H) -> (M, H), each routed row its token's row (J = 1: the plain copy path). The layer
  runs it for fc1's operand where fc1 does not read the token rows in its loads, and again for fc1's
  weight gradient.
- gather_fp8: the same on one-byte rows (the quantized layer gathers x's FP8 bytes for fc1).
- combine: y (M, H) -> (T, H), each token the sum of its K rows in k order (J = K). The layer runs it
  for its output and for dx.
- copy: an (M, H) tensor copied by torch (`Tensor.copy_`): the bandwidth the two can hope for. A
  gather writes (M, H) and reads each token row K times in expert order, mostly from HBM at real
  sizes (x larger than L2): counted as (M, H) read and written, as the copy. A combine reads (M, H)
  and writes (T, H). `vs_copy` is the kind's bandwidth so counted over the copy's: 1.0 is the
  copy's bandwidth.
- index_select: torch's gather of the same rows, the baseline a user has.

Every variant's output must equal the base table's bits (`equal`; the unrolled sum adds in the same
order). Times: CUDA events, the median of `--reps` calls after a warm-up, the median over `--rounds`
rounds in which the variants take turns.

    python benchmarks/sweep_rows.py --out results.json [--shapes qwen3-30b-a3b] [--variants base,unroll]
    TRITON_INTERPRET=1 python benchmarks/sweep_rows.py --smoke   # CPU: the plumbing
"""

from __future__ import annotations

import torch
from runner import (
    apply_tables,
    copy_relative_cells,
    event_median_ms,
    run_table_sweep,
    saved_tables,
    table_sweep_parser,
)

from moekit.ops.routing import sort_by_expert
from moekit.ops.runtime.rows import gather_sum_rows

# name: (tokens T, top-k K, experts N, hidden H)
SHAPES = {
    "qwen3-30b-a3b": (32768, 8, 128, 2048),
    "sonicmoe": (32768, 8, 128, 4096),
    "sonicmoe-e256-k16": (32768, 16, 256, 4096),
    "sonicmoe-e64-k4": (32768, 4, 64, 4096),
    "sonicmoe-7b": (24576, 8, 128, 1536),
}
SMOKE_SHAPES = {"smoke": (40, 3, 5, 48)}
KINDS = ("gather", "gather_fp8", "combine")

# Changes to `configs.ROWS`: a gather's tile in bytes ("copy_rows_512", "copy_rows_1k", "copy_rows_2k":
# rows cut at 512 bytes, 1 or 2 KiB, the tiles before; "copy_rows_128"; "copy_tile_4k",
# "copy_tile_16k": 4 or 16 KiB a program), a sum's ("sum_tile_4k": 4 rows of 1024, the tile before;
# "sum_tile_1k"), the sum's loop over the K source rows unrolled by 4 ("unroll4": every row's load in
# flight before its sum), 8 warps ("w8").
VARIANTS: dict[str, dict[str, dict[str, int]]] = {
    "base": {},
    "copy_rows_512": {"ROWS": dict(COPY_ROW_BYTES=512)},
    "copy_rows_1k": {"ROWS": dict(COPY_ROW_BYTES=1024)},
    "copy_rows_2k": {"ROWS": dict(COPY_ROW_BYTES=2048)},
    "copy_rows_128": {"ROWS": dict(COPY_ROW_BYTES=128)},
    "copy_tile_4k": {"ROWS": dict(COPY_TILE_BYTES=4096)},
    "copy_tile_16k": {"ROWS": dict(COPY_TILE_BYTES=16384)},
    "sum_tile_4k": {"ROWS": dict(SUM_TILE_ELEMENTS=4096)},
    "sum_tile_1k": {"ROWS": dict(SUM_TILE_ELEMENTS=1024)},
    "unroll4": {"ROWS": dict(UNROLL_J=4)},
    "w8": {"ROWS": dict(num_warps=8)},
}


def routing_of(T: int, K: int, N: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_of_row (M, 1), row_map (T, K)) int32 of a top-K routing of random logits."""
    ids = torch.randn(T, N, device=device, generator=gen).topk(K, dim=1).indices
    order = sort_by_expert(ids, N, use_triton=True, index_dtype=torch.int32)
    return order.token_of_row, order.row_map


def cells_of(name: str, shape: tuple[int, int, int, int], variants: list[str], reps: int, rounds: int, device: str):
    T, K, N, H = shape
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter: float32
    token_of_row, row_map = routing_of(T, K, N, device, gen)
    x = torch.randn(T, H, device=device, generator=gen).to(dtype)
    x8 = torch.randint(0, 256, (T, H), dtype=torch.uint8, device=device, generator=gen)
    y = torch.randn(T * K, H, device=device, generator=gen).to(dtype)
    copy_dst = torch.empty_like(y)
    calls = {
        "gather": lambda: gather_sum_rows(x, token_of_row),
        "gather_fp8": lambda: gather_sum_rows(x8, token_of_row),
        "combine": lambda: gather_sum_rows(y, row_map),
    }
    element = y.element_size()
    moved = {  # bytes each kind moves once: the written tensor plus the read one
        "gather": 2 * T * K * H * element,
        "gather_fp8": 2 * T * K * H,
        "combine": (T * K + T) * H * element,
        "copy": 2 * T * K * H * element,
    }
    saved = saved_tables(VARIANTS)
    reference = {kind: None for kind in KINDS}
    times: dict[tuple[str, str], list[float]] = {}
    equal: dict[tuple[str, str], bool] = {}
    try:
        for _ in range(rounds):
            times.setdefault(("copy", "torch"), []).append(event_median_ms(lambda: copy_dst.copy_(y), reps))
            times.setdefault(("gather", "index_select"), []).append(
                event_median_ms(lambda: x.index_select(0, token_of_row.view(-1)), reps)
            )
            for variant in variants:
                apply_tables(VARIANTS[variant], saved)
                for kind in KINDS:
                    out = calls[kind]()
                    if reference[kind] is None:
                        reference[kind] = out
                    equal[(kind, variant)] = equal.get((kind, variant), True) and torch.equal(out, reference[kind])
                    times.setdefault((kind, variant), []).append(event_median_ms(calls[kind], reps))
    finally:
        apply_tables(VARIANTS["base"], saved)
    return copy_relative_cells(name, times, equal, moved)


def main() -> None:
    args = table_sweep_parser(__doc__, list(SHAPES), VARIANTS).parse_args()
    run_table_sweep("sweep_rows.py", args, cells_of, (SHAPES, SMOKE_SHAPES), VARIANTS)


if __name__ == "__main__":
    main()
