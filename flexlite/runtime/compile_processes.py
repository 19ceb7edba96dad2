"""Triton compiles of the first_calls worker in processes of their own (compile servers).

The worker thread of :mod:`flexlite.first_calls` compiles a mod's kernels while the calls go on. Triton's compile
holds the GIL through its C++ passes (MLIR, LLVM), 0.4-1 s at a time, and the calling thread's torch ops wait
for it (benchmarks/NOTES.md 79). :func:`run` takes those compiles out of the process: it runs the worker's
compile-only launches once with Triton's compiles recorded instead of run (:func:`capturing`: the JIT function and
Triton's specialization data of each, what ``knobs.runtime.jit_cache_hook`` is handed), has compile servers
(runtime/compile_server.py, ``JITFunction.preload``) compile them into Triton's cache directory, several at a time,
and then runs the launches again, each of which now finds its kernel there and only loads it. A kernel the servers
did not compile (an error, a server that could not start) compiles in the second pass as before, which raises
where a compile fails. A server exits once it has waited :data:`IDLE_SECONDS` for a request; the next compile
starts another.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, Optional

import triton
from triton._C.libtriton import get_cache_invalidating_env_vars

from .llvm_level import current_level

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_server.py")
# seconds a compile server waits for its next request before it exits, giving back its memory (~0.1-0.3 GB); the
# next compile starts one again (Triton's import before its first kernel, not timed on the GPU host: the compile waits
# for it, the calls beside do not). 0: the servers stay up as long as the process
IDLE_SECONDS = 120.0
_THREAD = threading.local()
_slots: list = []  # a compile server per slot (None until one is needed)
_busy: set = set()  # the slots a thread holds
_free = threading.Condition()  # a slot was released
_passes = threading.Lock()  # held by a thread running its compile-only launches (:func:`run`)
_previous_hook: list = [None]  # a jit_cache_hook that was installed before :func:`_hook`


def _hook(**kwargs):
    captured = getattr(_THREAD, "captured", None)
    if captured is None:
        previous = _previous_hook[0]
        return previous(**kwargs) if previous is not None else None
    captured.append((kwargs["fn"].jit_function, kwargs["compile"]["specialization_data"],
                     triton.runtime.driver.active.get_current_target(), current_level()))
    return True  # (Triton then compiles nothing: the launch returns None)


@contextlib.contextmanager
def capturing() -> Iterator[list]:
    """In this thread, while inside: each Triton compile recorded in the list yielded, as (JIT function,
    specialization data, target, LLVM level: llvm_level.llvm_opt_level's), instead of run (a compile-only launch then
    returns None). Other threads compile as before."""
    hooks = triton.knobs.runtime
    if hooks.jit_cache_hook is not _hook:
        _previous_hook[0] = hooks.jit_cache_hook
        hooks.jit_cache_hook = _hook
    _THREAD.captured, _THREAD.deferred = [], []
    try:
        yield _THREAD.captured
    finally:
        _THREAD.captured = None


def defer(action: Callable[[], None]) -> bool:
    """Inside :func:`capturing` (a capture pass, whose kernels are not compiled yet): keep ``action`` (saying that
    kernels are compiled, or queueing more compiles) for :func:`run`, and True; else False (do it now). :func:`run`
    does the kept actions where its capture pass captured nothing (so was the whole compile), and drops them where
    its second pass does them again."""
    if getattr(_THREAD, "captured", None) is None:
        return False
    _THREAD.deferred.append(action)
    return True


class _Server:
    """One compile server process (runtime/compile_server.py), spoken to in JSON lines."""

    def __init__(self):
        self.owner = os.getpid()  # (a forked child has the parent's servers in its memory, not its own)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.idle = float(IDLE_SECONDS)
        self.process = subprocess.Popen([sys.executable, _SCRIPT, repr(self.idle)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.last = time.monotonic()  # its last answer (its idle time counts from there)

    def alive(self) -> bool:
        """Whether it is this process's and running, and not so near its idle exit that a request could cross it."""
        near_exit = self.idle > 0 and time.monotonic() - self.last > 0.8 * self.idle
        return self.owner == os.getpid() and self.process.poll() is None and not near_exit

    def send(self, request: dict) -> None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the compile server exited")
        self.last = time.monotonic()
        return json.loads(line)

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=2)
        except Exception:  # noqa: BLE001 - at exit: whatever is left is killed
            self.process.kill()


def _request(function, specialization: str, target, llvm_level: Optional[str]) -> dict:
    module = sys.modules[function.fn.__module__]
    return dict(path=module.__file__, module=module.__name__, function=function.fn.__qualname__,
                specialization=specialization, target=[target.backend, target.arch, target.warp_size],
                llvm_level=llvm_level, cache_dir=triton.knobs.cache.dir, env=get_cache_invalidating_env_vars())


def _acquire(wanted: int, processes: int) -> list:
    """Up to ``wanted`` of the first ``processes`` server slots for this thread (at least one: waits for a free one)."""
    with _free:
        while len(_slots) < processes:
            _slots.append(None)
        while True:
            free = [i for i in range(processes) if i not in _busy]
            if free:
                _busy.update(free[:wanted])
                return free[:wanted]
            _free.wait()


def _release(slots: list) -> None:
    with _free:
        _busy.difference_update(slots)
        _free.notify_all()


def _server(slot: int) -> Optional[_Server]:
    """The server of ``slot`` (held by this thread), started if it has none or it exited; None if it cannot start."""
    server = _slots[slot]
    if server is None or not server.alive():
        if server is not None and server.owner == os.getpid():
            server.close()  # (near its idle exit, or exited: reaped)
        try:
            server = _slots[slot] = _Server()
        except OSError:
            return None
    return server


def compile_in_processes(captured: list, processes: int) -> int:
    """Compile each of ``captured`` (:func:`capturing`'s) into Triton's cache in compile servers, as many at once as
    there are free ones of ``processes`` (threads compiling beside each other share them); returns how many compiled.
    The others are left to the caller's own compile (a compile error, a server that could not start or died: it is
    started again next time)."""
    if not captured or processes < 1:
        return 0
    requests = [_request(*entry) for entry in captured]
    slots = _acquire(len(requests), processes)
    try:
        servers = [server for server in map(_server, slots) if server is not None]
        compiled = 0
        for k, server in enumerate(servers):
            share = requests[k::len(servers)]
            try:
                for request in share:
                    server.send(request)
                compiled += sum(server.receive()["ok"] for _ in share)
            except (OSError, RuntimeError, ValueError):
                server.process.kill()
        return compiled
    finally:
        _release(slots)


def run(compile_: Callable[[], None], processes: int) -> Optional[int]:
    """``compile_()`` (compile-only launches) with its Triton compiles in compile servers: once captured, compiled by
    up to ``processes`` servers, then run again here, where each launch loads what the servers compiled (or compiles
    what they did not); where nothing was captured (every kernel loaded already, or the interpreter's), the first
    pass was the whole of it. Threads calling this at once take turns for their passes, which are Python (the calls
    beside wait for the GIL as long as any of them runs one), and wait for the servers together. Returns how many
    kernels the servers compiled (None: ``processes`` is 0 or the capture raised, and everything compiled here)."""
    compiled = None
    if processes > 0:
        try:
            with _passes, capturing() as captured:
                compile_()
            if not captured:
                for action in _THREAD.deferred:
                    action()
                return 0
            compiled = compile_in_processes(captured, processes)
        except Exception:  # noqa: BLE001 - the second pass compiles everything itself, and raises what is wrong
            compiled = None
    with _passes:
        compile_()
    return compiled


@atexit.register
def _close() -> None:
    for server in _slots:
        if server is not None and server.owner == os.getpid():
            server.close()
