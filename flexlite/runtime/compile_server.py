"""A compile server: Triton compiles of flexlite's kernels in a process of their own (runtime/compile_processes.py).

Run by path (``python .../compile_server.py``), so that it imports Triton alone, not flexlite and torch. It reads one
JSON request a line from stdin — a kernel module's file and name, a ``@jit`` function's qualified name, Triton's
specialization data for it (what ``knobs.runtime.jit_cache_hook`` is handed: the signature, constexprs, attributes
and options of one compile), the target, the LLVM level the capturing thread compiled at (llvm_level.py, loaded here
by path), Triton's cache directory and the environment variables that are part of Triton's cache keys (as the
capturing process had them then) — compiles it into that cache with ``JITFunction.preload`` and answers one
JSON line (``{"ok": true}`` or ``{"ok": false, "error": ...}``). No GPU is touched: a stand-in driver names the
target, as for an offline compile. It exits at the end of its input, or once it has waited its first argument's
seconds (if above 0) for a request.
"""

import importlib.util
import json
import os
import select
import sys
import traceback


class TargetDriver:
    """What a compile asks Triton's active driver: the target; device 0 and stream 0 (nothing runs). Also
    benchmarks/offline_compile.py's, for compiles on a machine without a GPU."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _module(name: str, path: str):
    """The module at ``path``, imported as ``name`` (once)."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return module


def _compile(request: dict) -> None:
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget

    for name in get_cache_invalidating_env_vars():  # (the capturing process's: its cache keys are this compile's)
        if name not in request["env"]:
            del os.environ[name]
    os.environ.update(request["env"])
    triton.knobs.cache.dir = request["cache_dir"]
    triton.runtime.driver.set_active(TargetDriver(GPUTarget(*request["target"])))
    fn = _module(request["module"], request["path"])
    for part in request["function"].split("."):
        fn = getattr(fn, part)
    llvm_level = _module("flexlite_llvm_level", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                             "llvm_level.py"))
    with llvm_level.llvm_opt_level(request["llvm_level"]):
        fn.preload(request["specialization"])


def _requests(idle: float):
    """stdin's lines (bytes), until its end or, with ``idle`` above 0, until no line came for ``idle`` seconds."""
    pending = b""
    while True:
        while b"\n" not in pending:
            if idle > 0 and not select.select([0], [], [], idle)[0]:
                return
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        yield line


def main(idle: float) -> None:
    import triton  # noqa: F401 - before the first request: what every compile needs
    try:  # (Gluon's packages, as flexlite imports them before a Gluon kernel's module)
        import triton.experimental.gluon.language  # noqa: F401
        import triton.experimental.gluon.nvidia.hopper  # noqa: F401
    except ImportError:
        pass
    for line in _requests(idle):
        try:
            _compile(json.loads(line))
            answer = {"ok": True}
        except Exception:  # noqa: BLE001 - reported to the caller, which compiles the kernel itself
            answer = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # (this file's directory: its modules are flexlite's, not for importing bare)
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 0.0)
