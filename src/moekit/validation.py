"""Argument checks shared by every public entry point of moekit.

Each check refuses a bad value with one line that names the argument and says what is expected, and
returns the value (normalised where that is free: a NumPy integer becomes an int). The rule: booleans
are booleans, counts are ints, coefficients are finite real numbers, tensors are torch tensors, and a
computation runs in a floating dtype the caller chose (never silently in an integer, boolean, complex
or float8 dtype, never silently cast).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# The floating dtypes moekit computes in. float8 types are storage formats (quantized experts), not
# compute dtypes: ops refuse them rather than run torch kernels that do not exist for them.
COMPUTE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def check_bool(name: str, value: Any) -> bool:
    """A Python bool (or a NumPy bool); not a truthy string or number."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {_describe(value)}")


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """An integer (a Python int or a NumPy integer; not a bool, a float or a string) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_describe(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_positive_int(name: str, value: Any) -> int:
    """An int >= 1."""
    return check_int(name, value, minimum=1)


def check_float(name: str, value: Any, *, minimum: float | None = None, positive: bool = False) -> float:
    """A finite real number (int or float, not a bool or a string), >= minimum, or > 0 with positive."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[T]) -> T:
    """One of `choices` (compared with ==; strings are not converted)."""
    choices = tuple(choices)
    if not isinstance(value, str) and any(isinstance(c, str) for c in choices):
        raise TypeError(f"{name} must be one of {choices}, got {_describe(value)}")
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {choices}")
    return value


def check_tensor(name: str, value: Any) -> torch.Tensor:
    """A torch.Tensor (lists and NumPy arrays are refused: convert them with torch.as_tensor)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__} (convert it with torch.as_tensor)")
    return value


def check_compute_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """A floating dtype moekit computes in (float64/32, bfloat16, float16)."""
    if dtype not in COMPUTE_DTYPES:
        kinds = "a float8 storage type" if "float8" in str(dtype) else "not a floating dtype moekit computes in"
        expected = ", ".join(str(d).removeprefix("torch.") for d in COMPUTE_DTYPES)
        raise TypeError(f"{name} is {dtype}, {kinds}; expected one of {expected}")
    return dtype


def check_float_tensor(name: str, value: Any) -> torch.Tensor:
    """A torch.Tensor of a compute dtype (`check_compute_dtype`)."""
    check_compute_dtype(name, check_tensor(name, value).dtype)
    return value


def check_index_tensor(name: str, value: Any) -> torch.Tensor:
    """A torch.Tensor of an integer dtype (not bool, float or complex): expert ids, row maps."""
    check_tensor(name, value)
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    return value


def check_same_device(name: str, value: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """`value` lives on `other`'s device."""
    if value.device != other.device:
        raise ValueError(f"{name} is on {value.device} but {other_name} is on {other.device}; pass both on one device")
