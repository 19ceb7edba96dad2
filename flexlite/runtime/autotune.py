"""Autotuning of tile configs, with the choices cached on disk.

Opt-in (``kernel_options={"AUTOTUNE": True}`` or ``FLEXLITE_AUTOTUNE=1``): the heuristic defaults of
:mod:`flexlite.runtime.launch` are good, tuning finds the last few percent per mod. A choice is keyed
by the kernel's source hash, its compile-time constants, a bucket of the sequence lengths, and the
GPU; it is stored in ``<cache dir>/autotune/<gpu>.json`` (atomic replace, the read-merge-write under a lock
file so that processes tuning at once keep each other's entries; a corrupt or unwritable file, or an entry that is
none of the candidates, is ignored, never fatal), so a later process pays nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable, Optional

from .compile import cache_dir, env_flag

_LOCK = threading.Lock()
_MEMORY: dict = {}  # (gpu, key) -> config dict


def autotune_enabled(kernel_options: dict) -> bool:
    if "AUTOTUNE" in kernel_options:
        return bool(kernel_options["AUTOTUNE"])
    return env_flag("FLEXLITE_AUTOTUNE")


def length_bucket(n: int) -> int:
    """Lengths tune alike within a power of two (and below 128 all alike)."""
    return 1 << max(7, math.ceil(math.log2(max(n, 1))))


def _cache_file(gpu: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu)
    return cache_dir() / "autotune" / f"{safe}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock between processes on ``path`` (created), where the OS has ``fcntl`` (else none)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _write(path: Path, key: str, value: dict) -> None:
    """Merge one entry into the file: read, update, write a temp file, rename over (atomic); the three under a
    lock, so that another process's entry written meanwhile is not lost."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(path.with_suffix(".lock")):
            data = _read(path)
            data[key] = value
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
    except OSError as e:  # read-only cache dir etc.: keep the choice in memory only
        print(f"[flexlite] autotune: could not save to {path}: {e}", file=sys.stderr)


def lookup(gpu: str, key: str) -> Optional[dict]:
    with _LOCK:
        if (gpu, key) not in _MEMORY:
            found = _read(_cache_file(gpu)).get(key)
            if isinstance(found, dict):
                _MEMORY[(gpu, key)] = found
        return _MEMORY.get((gpu, key))


def tune(gpu: str, key: str, candidates: Iterable[dict], measure: Callable[[dict], float], label: str = "") -> dict:
    """The candidate with the smallest ``measure`` (ms; ``inf`` = does not run), remembered for ``key``. A
    remembered choice that is none of ``candidates`` (a file of another version, edited by hand) is tuned anew."""
    candidates = list(candidates)
    cached = lookup(gpu, key)
    if cached is not None and cached in candidates:
        return cached
    print(f"[flexlite] autotuning {label} over {len(candidates)} configs ...", file=sys.stderr, flush=True)
    best, best_ms = None, math.inf
    for i, cfg in enumerate(candidates):
        ms = measure(cfg)
        print(f"[flexlite]   {i + 1}/{len(candidates)} {cfg}: {ms:.3f} ms", file=sys.stderr, flush=True)
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"flexlite autotune: no config of {label} could run: {candidates}")
    with _LOCK:
        _MEMORY[(gpu, key)] = best
        _write(_cache_file(gpu), key, best)
    return best
