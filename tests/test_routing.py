"""moekit.ops.routing.route against a plain Python rule: offsets, stable order, inverse, tokens."""

from __future__ import annotations

import pytest
import torch

from moekit.ops.routing import route

CASES = {
    "balanced": ([[0, 1], [1, 2], [2, 0]], 3),
    "empty-first-and-last": ([[1, 2], [2, 1], [1, 2]], 4),
    "one-token": ([[3, 0, 2]], 5),
    "all-on-one": ([[2], [2], [2], [2]], 3),
    "no-tokens": ([], 4),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_route_matches_python_rule(case):
    ids_list, num_experts = CASES[case]
    top_k = len(ids_list[0]) if ids_list else 2
    ids = torch.tensor(ids_list, dtype=torch.int64).reshape(-1, top_k)
    routing = route(ids, num_experts)
    flat = [e for row in ids_list for e in row]
    # Stable: copies sorted by expert, token order (then k) kept within an expert.
    order = sorted(range(len(flat)), key=lambda c: (flat[c], c))
    offs = [sum(1 for e in flat if e < j) for j in range(num_experts + 1)]
    assert routing.offs.tolist() == offs
    assert routing.counts().tolist() == [offs[e + 1] - offs[e] for e in range(num_experts)]
    assert routing.order.view(-1).tolist() == order
    assert routing.token_of_row.view(-1).tolist() == [c // top_k for c in order]
    inverse = [0] * len(flat)
    for row, copy in enumerate(order):
        inverse[copy] = row
    assert routing.inverse.reshape(-1).tolist() == inverse
    assert routing.inverse.shape == ids.shape
    for t in (routing.offs, routing.order, routing.inverse, routing.token_of_row):
        assert t.dtype == torch.int64


def test_route_ids_past_the_experts_are_padding_rows():
    """Undefined input the host cannot check on an accelerator: ids >= N sort past offs[N] (in no
    expert's rows), negative ids fall in expert 0's rows."""
    routing = route(torch.tensor([[5, 0], [1, -1]]), 2)
    assert routing.offs.tolist() == [0, 2, 3]
    assert routing.order.view(-1).tolist() == [3, 1, 2, 0]
