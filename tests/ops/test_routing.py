"""moekit.ops.routing.sort_by_expert against a plain Python rule: offsets, stable order, inverse, tokens; the
Triton path (three kernels; on CPU under the interpreter) against the same rule and, bit for bit,
against the torch path, on the chunk layouts of its counting sort and on undefined ids."""

from __future__ import annotations

import pytest
import torch

from moekit.ops.routing import ExpertOrder, sort_by_expert
from moekit.ops.runtime.configs import ROUTING_TILES
from moekit.ops.runtime.routing import chunk_rows

# The Triton path runs on CUDA, or on CPU under the interpreter (the root conftest sets it there).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PATHS = [pytest.param(False, id="torch"), pytest.param(True, id="triton")]

CASES = {
    "balanced": ([[0, 1], [1, 2], [2, 0]], 3),
    "empty-first-and-last": ([[1, 2], [2, 1], [1, 2]], 4),
    "one-token": ([[3, 0, 2]], 5),
    "all-on-one": ([[2], [2], [2], [2]], 3),
    "no-tokens": ([], 4),
}


def _route(ids: torch.Tensor, num_experts: int, use_triton: bool, index_dtype=torch.int64) -> ExpertOrder:
    if not use_triton:
        return sort_by_expert(ids, num_experts, index_dtype=index_dtype)
    routing = sort_by_expert(ids.to(TRITON_DEVICE), num_experts, use_triton=True, index_dtype=index_dtype)
    return ExpertOrder(*(t.cpu() for t in routing))


def _python_rule(flat: list[int], num_experts: int, top_k: int) -> dict[str, list[int]]:
    """The documented routing of flat ids (copy t*K + k), undefined ids included: ids are read as
    int32 (wider ones wrap), sorted stably by value; offs[e] counts the ids below e, offs[0] = 0."""
    keys = [(e + 2**31) % 2**32 - 2**31 for e in flat]
    order = sorted(range(len(keys)), key=lambda c: (keys[c], c))
    inverse = [0] * len(keys)
    for row, copy in enumerate(order):
        inverse[copy] = row
    offs = [0] + [sum(1 for e in keys if e < j) for j in range(1, num_experts + 1)]
    return {"offs": offs, "order": order, "inverse": inverse, "token_of_row": [c // top_k for c in order]}


def _assert_routing(routing: ExpertOrder, ids: torch.Tensor, num_experts: int, index_dtype=torch.int64) -> None:
    expected = _python_rule(ids.reshape(-1).tolist(), num_experts, ids.shape[1])
    assert routing.offs.tolist() == expected["offs"]
    assert routing.copy_of_row.view(-1).tolist() == expected["order"]
    assert routing.row_map.reshape(-1).tolist() == expected["inverse"]
    assert routing.token_of_row.view(-1).tolist() == expected["token_of_row"]
    assert routing.offs.shape == (num_experts + 1,) and routing.row_map.shape == ids.shape
    assert routing.copy_of_row.shape == routing.token_of_row.shape == (ids.numel(), 1)
    assert routing.offs.dtype == torch.int64
    for t in routing[1:]:
        assert t.dtype == index_dtype


def _assert_paths_equal(ids: torch.Tensor, num_experts: int) -> None:
    """Both paths give the Python rule's routing, so they are equal element for element, with int64
    maps and with int32 ones (the same values)."""
    for index_dtype in (torch.int64, torch.int32):
        torch_path = _route(ids, num_experts, False, index_dtype)
        triton_path = _route(ids, num_experts, True, index_dtype)
        _assert_routing(torch_path, ids, num_experts, index_dtype)
        for name, ours, theirs in zip(ExpertOrder._fields, triton_path, torch_path, strict=True):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_route_matches_python_rule(case, use_triton, nan_poison):
    ids_list, num_experts = CASES[case]
    top_k = len(ids_list[0]) if ids_list else 2
    ids = torch.tensor(ids_list, dtype=torch.int64).reshape(-1, top_k)
    routing = _route(ids, num_experts, use_triton)
    flat = [e for row in ids_list for e in row]
    # Stable: copies sorted by expert, token order (then k) kept within an expert.
    order = sorted(range(len(flat)), key=lambda c: (flat[c], c))
    offs = [sum(1 for e in flat if e < j) for j in range(num_experts + 1)]
    assert routing.offs.tolist() == offs
    assert routing.counts().tolist() == [offs[e + 1] - offs[e] for e in range(num_experts)]
    assert routing.copy_of_row.view(-1).tolist() == order
    assert routing.token_of_row.view(-1).tolist() == [c // top_k for c in order]
    inverse = [0] * len(flat)
    for row, copy in enumerate(order):
        inverse[copy] = row
    assert routing.row_map.reshape(-1).tolist() == inverse
    assert routing.row_map.shape == ids.shape
    for t in (routing.offs, routing.copy_of_row, routing.row_map, routing.token_of_row):
        assert t.dtype == torch.int64


@pytest.mark.parametrize("use_triton", PATHS)
def test_route_ids_past_the_experts_are_padding_rows(use_triton):
    """Undefined input the host cannot check on an accelerator: ids >= N sort past offs[N] (in no
    expert's rows), negative ids fall in expert 0's rows."""
    routing = _route(torch.tensor([[5, 0], [1, -1]]), 2, use_triton)
    assert routing.offs.tolist() == [0, 2, 3]
    assert routing.copy_of_row.view(-1).tolist() == [3, 1, 2, 0]


# --------------------------------------------------------------------------------------------------
# The Triton path on the layouts of its counting sort: chunks of rows, 16-row sub-blocks (under the
# interpreter) and tiles of 128 buckets, so N = 257 and 1024 take several bucket tiles.
# --------------------------------------------------------------------------------------------------

LAYOUTS = ("inside-one-chunk", "one-full-chunk", "ragged-chunks")


def _tokens_for(layout: str, top_k: int) -> int:
    """A token count whose T*K rows fall in `layout` of the Triton path's chunking: fewer rows than
    one chunk, exactly one chunk, or three chunks or more of several sub-blocks with a ragged last."""
    config = ROUTING_TILES["interpreter"]
    for tokens in range(1, 1 << 17):
        rows = tokens * top_k
        chunk = chunk_rows(rows, config)
        chunks = -(-rows // chunk)
        if (
            (layout == "inside-one-chunk" and rows < chunk)
            or (layout == "one-full-chunk" and rows == chunk)
            or (layout == "ragged-chunks" and chunks >= 3 and rows % chunk and chunk > config.sub)
        ):
            return tokens
    raise AssertionError(f"no token count gives {layout} at top_k {top_k}")


# Every (layout, N, K) in int64; int32 too, short of N = 1024 and of N = 128 on whole chunks (the
# interpreter is slow; int32 and int64 ids differ only in the load).
RANDOM_CASES = [
    pytest.param(layout, num_experts, top_k, dtype, id=f"{layout}-N{num_experts}-K{top_k}-{str(dtype)[6:]}")
    for layout in LAYOUTS
    for num_experts in (1, 3, 128, 257, 1024)
    for top_k in (1, 8)
    for dtype in (torch.int64, torch.int32)
    if dtype == torch.int64 or (num_experts != 1024 and (layout == "ragged-chunks" or num_experts != 128))
]


@pytest.mark.parametrize(("layout", "num_experts", "top_k", "dtype"), RANDOM_CASES)
def test_triton_route_random_ids_equal_torch_path(layout, num_experts, top_k, dtype, nan_poison):
    tokens = _tokens_for(layout, top_k)
    for seed in range(1 if num_experts == 1024 else 2):
        gen = torch.Generator().manual_seed(1000 * seed + 7 * num_experts + top_k)
        ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen).to(dtype)
        _assert_paths_equal(ids, num_experts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_route_empty_experts_first_middle_last_and_all_on_one(layout, nan_poison):
    top_k = 4
    tokens = _tokens_for(layout, top_k)
    gen = torch.Generator().manual_seed(3)
    # Experts 0, 2 and 5 of 6 get no rows.
    choices = torch.tensor([1, 3, 4])
    ids = choices[torch.randint(0, 3, (tokens, top_k), generator=gen)]
    _assert_paths_equal(ids, 6)
    routing = _route(ids, 6, True)
    counts = routing.counts().tolist()
    assert counts[0] == counts[2] == counts[5] == 0 and sum(counts) == tokens * top_k
    for expert in (0, 3, 6):  # one expert of seven gets every row: the first, a middle, the last
        _assert_paths_equal(torch.full((tokens, top_k), expert), 7)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_route_undefined_ids_equal_torch_path(layout, nan_poison):
    """Negative ids and ids >= N (not checked on accelerators): one value per side (the common -1
    of dropped copies) and several values per side, which the torch path orders by value."""
    top_k = 8
    tokens = _tokens_for(layout, top_k)
    gen = torch.Generator().manual_seed(11)
    num_experts = 5
    valid = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    where = torch.randint(0, 4, (tokens, top_k), generator=gen)
    one_each = torch.where(where == 0, -1, torch.where(where == 1, num_experts, valid))
    _assert_paths_equal(one_each, num_experts)
    several = torch.where(where == 0, torch.randint(-4, 0, (tokens, top_k), generator=gen), valid)
    several = torch.where(
        where == 1, torch.randint(num_experts, num_experts + 4, (tokens, top_k), generator=gen), several
    )
    _assert_paths_equal(several, num_experts)
    _assert_paths_equal(several.to(torch.int32), num_experts)
    only_negative = torch.where(where < 2, torch.randint(-3, 0, (tokens, top_k), generator=gen), valid)
    _assert_paths_equal(only_negative, num_experts)


def test_triton_route_wide_ids_wrap_like_the_torch_path(nan_poison):
    """int64 ids are read as int32 by both paths: 2^32 + 1 is expert 1, -2^40 is 0, 2^31 and
    2^33 - 1 are negative, -2^31 - 1 is past the experts."""
    ids = torch.tensor([[2**32 + 1, -(2**40), 2], [2**31, 1, -(2**31) - 1], [0, 2**33 - 1, 1]])
    _assert_paths_equal(ids, 3)
    assert _route(ids, 3, True).offs.tolist() == [0, 4, 7, 8]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8])
def test_triton_route_narrow_ids_and_strided_ids(dtype, nan_poison):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 9, (40, 6), generator=gen).to(dtype)
    _assert_paths_equal(ids, 9)
    _assert_paths_equal(ids.t(), 9)  # (6, 40) view of a (40, 6) tensor: strides (1, 6)
    _assert_paths_equal(ids[::3, 1:5], 9)


def test_triton_route_no_experts_and_empty_top_k(nan_poison):
    _assert_paths_equal(torch.tensor([[0, -1], [3, 1]]), 0)  # every id is undefined
    _assert_paths_equal(torch.empty(3, 0, dtype=torch.int64), 4)


def test_triton_route_refuses_what_it_cannot_route():
    with pytest.raises(ValueError, match=r"\(tokens, top_k\)"):
        sort_by_expert(torch.zeros(6, dtype=torch.int64, device=TRITON_DEVICE), 3, use_triton=True)
    with pytest.raises(TypeError, match="topk_ids must be an integer tensor"):
        sort_by_expert(torch.zeros(2, 2, device=TRITON_DEVICE), 3, use_triton=True)
    with pytest.raises(ValueError, match="num_experts must be an int >= 0"):
        sort_by_expert(torch.zeros(2, 2, dtype=torch.int64, device=TRITON_DEVICE), -1, use_triton=True)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="unknown index_dtype torch.int16"):
            sort_by_expert(torch.zeros(2, 2, dtype=torch.int64), 3, use_triton=use_triton, index_dtype=torch.int16)
        # 2^31 routed rows (an expanded view: no memory) do not fit int32 maps; refused before any work.
        with pytest.raises(ValueError, match="index_dtype int32 holds fewer than 2\\^31 rows, got 2147483648"):
            wide = torch.zeros(1, 1, dtype=torch.int64).expand(2**31, 1)
            sort_by_expert(wide, 3, use_triton=use_triton, index_dtype=torch.int32)


def test_triton_route_is_three_launches_and_allocations_only(monkeypatch):
    """The host side of the Triton path: its three kernel launches and torch.empty, no other torch op
    (each costs host time, and none may read a device value)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moekit.ops.runtime import routing

    launched = []

    class CountingKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(self.name)

    class CountingLauncher:  # what routing's launch plans use of a Launcher
        direct = False

        def __init__(self, name):
            self.kernel = CountingKernel(name)

    class RecordOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    counting = routing.RoutingLaunchers(
        CountingLauncher("histogram"), CountingLauncher("scan"), CountingLauncher("scatter")
    )
    monkeypatch.setattr(routing, "LAUNCHERS", counting)
    ids = torch.randint(0, 8, (64, 4), device=TRITON_DEVICE)
    ops = []
    with RecordOps():
        sort_by_expert(ids, 8, use_triton=True)
    assert launched == ["histogram", "scan", "scatter"]
    assert ops and set(ops) == {"empty.memory_format"}, ops


# --------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu): real sizes, no host sync, CUDA graph replay with new ids
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("tokens", "top_k", "num_experts"),
    [(256, 8, 128), (4096, 8, 128), (32768, 8, 128), (20011, 4, 32), (50000, 1, 257), (9000, 6, 1024)],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_triton_route_on_gpu_equals_torch_path(tokens, top_k, num_experts, dtype):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    # Skewed: experts drawn with random weights, so some are empty and some are crowded.
    weights = torch.rand(num_experts, device="cuda", generator=gen) ** 4
    ids = torch.multinomial(weights, tokens * top_k, replacement=True, generator=gen).view(tokens, top_k).to(dtype)
    expected = sort_by_expert(ids, num_experts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = sort_by_expert(ids, num_experts, use_triton=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, a, b in zip(ExpertOrder._fields, ours, expected, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_route_on_gpu_undefined_ids_equal_torch_path():
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, top_k, num_experts = 8192, 8, 64
    ids = torch.randint(-3, num_experts + 3, (tokens, top_k), device="cuda", generator=gen)
    for candidate in (ids, torch.where(ids < 0, -1, torch.where(ids >= num_experts, num_experts, ids))):
        expected = sort_by_expert(candidate, num_experts)
        for name, a, b in zip(
            ExpertOrder._fields, sort_by_expert(candidate, num_experts, use_triton=True), expected, strict=True
        ):
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16], ids=str)
def test_triton_route_on_gpu_narrow_and_strided_ids(dtype):
    gen = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, 100, (3000, 6), device="cuda", generator=gen).to(dtype)
    for view in (ids, ids.t(), ids[::3, 1:5]):
        expected = sort_by_expert(view, 100)
        for name, a, b in zip(ExpertOrder._fields, sort_by_expert(view, 100, use_triton=True), expected, strict=True):
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_route_cuda_graph_replays_with_new_ids():
    tokens, top_k, num_experts = 1024, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    static_ids = torch.randint(0, num_experts, (tokens, top_k), device="cuda", generator=gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sort_by_expert(static_ids, num_experts, use_triton=True)  # compiles and warms the launchers
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sort_by_expert(static_ids, num_experts, use_triton=True)
    for seed in range(3):
        new_ids = torch.randint(
            0,
            num_experts,
            (tokens, top_k),
            device="cuda",
            generator=torch.Generator(device="cuda").manual_seed(100 + seed),
        )
        static_ids.copy_(new_ids)
        graph.replay()
        for name, a, b in zip(ExpertOrder._fields, static_out, sort_by_expert(new_ids, num_experts), strict=True):
            assert torch.equal(a, b), name
