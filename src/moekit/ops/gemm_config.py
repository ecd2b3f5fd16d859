"""`GemmConfig`: one kernel configuration of moekit's Triton GEMMs (the plain grouped GEMM and the
fused MLP kernels). Its own module, free of triton, so that the host code of every op can name
configurations without importing triton."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration: the output tile (block_rows x block_cols), the reduction step, the
    swizzle band, pipelining depth, warps, whether the tile loop and the reduction loop are fused
    into one software pipeline (flatten), whether tiles leave through TMA stores (epi_tma) and how
    many programs of the persistent kernel share a multiprocessor (programs_per_sm).

    For the forward/dgrad kernel the tile is (rows of M, output columns) and the reduction runs over
    the input features; for the wgrad kernel the tile is (O, I) and the reduction runs over the
    group's rows.
    """

    block_rows: int
    block_cols: int
    block_red: int
    group_rows: int
    stages: int
    warps: int
    flatten: bool
    epi_tma: bool = False
    programs_per_sm: int = 1
