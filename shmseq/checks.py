"""Argument checks shared by the front ends: each error names the argument, the value given,
and what would do instead. A value of the wrong type is a ``TypeError``, one out of range a
``ValueError``, as Python's own functions have it."""
from __future__ import annotations

import math
import numbers
from typing import Collection

import numpy as np

from .engine import OUT_TYPES

MAX_TIMEOUT = 2_147_483  # seconds: the most select() takes (a 32-bit count of milliseconds)


def _given(value: object) -> str:
    """The value as an error shows it, with its type's name (a "64" that is a string)."""
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value: object, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    wanted = f"{name} must be an integer >= {minimum}{' or None' if optional else ''}"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{wanted}, got {_given(value)}")
    if value < minimum:
        raise ValueError(f"{wanted}, got {value!r}")


def check_bool(name: str, value: object, *, optional: bool = False) -> None:
    """A flag: True or False (numpy's too), not a value that is merely truthy ('no' is)."""
    if not (isinstance(value, (bool, np.bool_)) or (optional and value is None)):
        raise TypeError(f"{name} must be True or False{' or None' if optional else ''}, "
                        f"got {_given(value)}")


def check_choice(name: str, value: object, choices: Collection[object]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_out_type(out_type: object) -> None:
    if not isinstance(out_type, str) or not (
            out_type in OUT_TYPES or (out_type.startswith("cuda:") and out_type[5:].isdigit())):
        raise ValueError(f"out_type must be 'null' (numpy), 'cpu' (torch), 'cuda' or 'cuda:N', "
                         f"got {out_type!r}")


def check_timeout(timeout: object) -> float | None:
    """Seconds to wait for a batch; None (given as None or inf): as long as it takes."""
    if timeout is None or (isinstance(timeout, numbers.Real) and timeout == math.inf):
        return None
    wanted = (f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:,}], or None (or inf) "
              "to wait as long as it takes")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{wanted}, got {_given(timeout)}")
    if timeout <= 0 or not timeout <= MAX_TIMEOUT:  # numbers.Real declares only < and <=; NaN fails
        raise ValueError(f"{wanted}, got {timeout!r}")
    return float(timeout)


def check_worker(worker: object) -> None:
    if not (hasattr(worker, "__getitem__") or hasattr(worker, "fill_batch")):
        raise TypeError(f"worker must be a class or an object with __getitem__(indices) "
                        f"(or fill_batch(indices, out)), got {worker!r}")


def check_num_workers(num_workers: object, minimum: int = 0) -> None:
    """An integer of workers, or ``'auto'`` (tuned as the loader runs)."""
    if num_workers == "auto" and isinstance(num_workers, str):
        return
    wanted = (f"num_workers must be an integer >= {minimum} or 'auto' (chosen and adjusted "
              "as the loader runs)")
    if not isinstance(num_workers, numbers.Integral) or isinstance(num_workers, bool):
        raise TypeError(f"{wanted}, got {_given(num_workers)}")
    if num_workers < minimum:
        raise ValueError(f"{wanted}, got {num_workers!r}")


def check_auto_bounds(num_workers: object, max_workers: object, cpu_budget: object,
                      memory_budget: object, buffer: object) -> None:
    """``max_workers`` and ``cpu_budget`` bound ``num_workers='auto'``; ``memory_budget`` a
    ring whose slots shmseq counts (no ``buffer`` given), and with ``'auto'`` the workers."""
    check_int("max_workers", max_workers, 1, optional=True)
    check_int("memory_budget", memory_budget, 1, optional=True)
    if cpu_budget is not None and (isinstance(cpu_budget, bool)
                                   or not isinstance(cpu_budget, numbers.Real)):
        raise TypeError(f"cpu_budget must be a number of cores > 0 or None, got "
                        f"{_given(cpu_budget)}")
    if cpu_budget is not None and not float(cpu_budget) > 0:
        raise ValueError(f"cpu_budget must be a number of cores > 0 or None, got {cpu_budget!r}")
    if num_workers != "auto":
        for name, value in (("max_workers", max_workers), ("cpu_budget", cpu_budget)):
            if value is not None:
                raise ValueError(f"{name}={value!r} bounds num_workers='auto', but "
                                 f"num_workers={num_workers!r} was given: pass "
                                 f"num_workers='auto', or leave {name} out")
    if memory_budget is not None and buffer is not None:
        raise ValueError(f"memory_budget={memory_budget!r} bounds a ring whose slots shmseq "
                         f"counts, but buffer={buffer!r} fixes them: leave one of them out")
