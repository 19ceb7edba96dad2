"""Argument checks shared by the mask and score-mod factories: typed errors that name the argument."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch


def check_int(caller: str, name: str, value, minimum: Optional[int] = 0) -> int:
    """``value`` as an int; TypeError unless it is an int (not a bool), ValueError if below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{caller}: {name} must be an int; got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{caller}: {name} must be >= {minimum}; got {value}")
    return int(value)


def check_float(caller: str, name: str, value, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{caller}: {name} must be a number; got {type(value).__name__} {value!r}")
    if positive and not 0 < value < math.inf:
        raise ValueError(f"{caller}: {name} must be a finite number > 0; got {value}")
    return float(value)


def check_device_arg(caller: str, device):
    """A factory's ``device`` argument: None (its inputs' device) or a device flexlite runs on (a typed error naming
    ``device`` else, not torch's from deep inside)."""
    if device is None:
        return None
    from ..block_mask import check_device
    return check_device(caller, device, any_type=True)  # ("meta" too, as torch's factories)


def check_callable(caller: str, name: str, fn) -> None:
    from ..codegen.trace import check_arity
    check_arity(fn, "mask_mod", argname=name, caller=caller)


def check_has_values(caller: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, whose values the factory reads: a meta tensor (which has none) is a ValueError naming ``name``, not
    torch's error from the read."""
    if t.device.type == "meta":
        raise ValueError(f"{caller}: {name} is a meta tensor, which holds no values, and the mask is computed from "
                         f"them; pass it on a real device such as 'cpu'")
    return t


def check_lengths(caller: str, name: str, lengths, minimum: int = 1) -> list[int]:
    """A 1-D sequence (or tensor) of ints >= ``minimum``, as a Python list."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise TypeError(f"{caller}: {name} must be a 1-D integer tensor or a sequence of ints; got "
                            f"a {lengths.dtype} tensor of shape {tuple(lengths.shape)}")
        lengths = check_has_values(caller, name, lengths).tolist()
    if not isinstance(lengths, Sequence) or isinstance(lengths, str):
        raise TypeError(f"{caller}: {name} must be a sequence of ints; got {type(lengths).__name__}")
    if not lengths:
        raise ValueError(f"{caller}: {name} must not be empty")
    return [check_int(caller, f"{name}[{i}]", x, minimum) for i, x in enumerate(lengths)]


def check_index_tensor(caller: str, name: str, t, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: {name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{caller}: {name} must be an integer tensor; got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{caller}: {name} must be {dim}-D; got shape {tuple(t.shape)}")
    return check_has_values(caller, name, t)


def pairs_tensor(caller: str, name: str, pairs) -> torch.Tensor:
    """``pairs`` (a tensor, or a sequence of (a, b) int pairs, maybe empty) as a tensor: a list that is no [N, 2]
    table of ints gets an error naming ``name``, not torch's."""
    if isinstance(pairs, torch.Tensor):
        return pairs
    try:
        return torch.tensor(pairs, dtype=torch.int32) if len(pairs) else torch.zeros((0, 2), dtype=torch.int32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{caller}: {name} must be a [N, 2] table of ints (a pair per row); got {pairs!r}") from e


def check_float_tensor(caller: str, name: str, t, dims: tuple) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: {name} must be a torch.Tensor; got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{caller}: {name} must be a floating-point tensor; got {t.dtype}")
    if t.dim() not in dims:
        raise ValueError(f"{caller}: {name} must be {' or '.join(f'{d}-D' for d in dims)}; "
                         f"got shape {tuple(t.shape)}")
    return t
