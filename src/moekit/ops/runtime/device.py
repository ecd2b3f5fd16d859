"""Facts about a CUDA device that the host asks on every launch, cached for the process (each
query costs microseconds of host time, and they never change)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device `index`."""
    return torch.cuda.get_device_capability(index)


@functools.cache
def multiprocessor_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index`: the programs of a persistent kernel."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """`capability` of a CUDA device (index None: the current one). Under torch.compile the query is
    traced directly: dynamo traces through caches anyway, and warns."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(device)
    return capability(device.index if device.index is not None else torch.cuda.current_device())
