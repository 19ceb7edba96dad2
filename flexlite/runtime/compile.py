"""Kernel source -> importable module of ``@triton.jit`` functions, cached by content hash.

Triton reads a jit function's source from its file, so each rendered kernel is written to
``<cache dir>/kernels/flexlite_<hash>.py`` (atomically) and imported with importlib, as inductor
does. That file is also what users open to read a generated kernel.

CPU tensors run the same kernels through Triton's interpreter: a module is imported with
``TRITON_INTERPRET=1`` for CPU launches and without it for GPU launches, so one process can use both.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import stat
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import triton

_LOCK = threading.Lock()
_MODULES: dict = {}
_BY_SOURCE: dict = {}  # (source text, interpret) -> module: the same modules as _MODULES


_ENV_TRUE = ("1", "true", "yes", "on")
_ENV_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """The on / off environment variable ``name``: unset or empty is ``default``; ``1``/``true``/``yes``/``on`` and
    ``0``/``false``/``no``/``off`` (any case) as they say; another value is a ValueError that names it (so that
    ``=false`` does not read as on)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ENV_TRUE or value in _ENV_FALSE:
        return value in _ENV_TRUE
    raise ValueError(f"flexlite: environment variable {name}={os.environ[name]!r} is not an on / off switch: set it "
                     f"to 1 (or true, yes, on) or 0 (or false, no, off), or unset it")


def prewarm_triton_key() -> "threading.Thread | None":
    """Start computing Triton's own cache key in a background thread; returns the thread (None where there is
    nothing to do).

    Triton keys every compiled kernel on a hash of its own installation (``triton_key``: a SHA-256 of
    libtriton and its compiler sources, ~0.35 s on the H200's host, once per process, cached). A process's first
    kernel launch pays it even when every kernel is in the on-disk cache. Hashed while the caller is still
    importing and building inputs, part of it is done by then and the first kernel load waits for the rest
    instead of hashing again: the first call took 0.38-0.44 s instead of 0.58 s (benchmarks/NOTES.md 21; the
    hash needs the GIL between its chunks, so a busy main thread slows it). Only with a CUDA build of torch (the
    interpreter does not compile), and not with ``FLEXLITE_PREWARM=0``."""
    if not env_flag("FLEXLITE_PREWARM", True):
        return None
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton: nothing to warm
        return None
    import torch
    if torch.version.cuda is None:  # a CPU build of torch (no device query here: that would initialize CUDA)
        return None
    thread = threading.Thread(target=triton_key, name="flexlite-prewarm", daemon=True)
    thread.start()
    _PREWARM.append(thread)
    return thread


_PREWARM: list = []  # the running prewarm thread: the first CUDA kernel load waits for it rather than hash again


def cache_dir() -> Path:
    """``$FLEXLITE_CACHE_DIR``, else ``$XDG_CACHE_HOME/flexlite``, else ``~/.cache/flexlite`` (a leading ``~`` of
    either variable is the home folder, as a shell would expand it: a Dockerfile's ENV or a quoted value is not)."""
    root = os.environ.get("FLEXLITE_CACHE_DIR")
    if root:
        return Path(os.path.expanduser(root))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(os.path.expanduser(base)) / "flexlite"


def _private_temp_dir() -> Path:
    """``<temp dir>/flexlite-<uid>``, made ``0o700``: the kernel files there are imported, so a folder of that name
    made beforehand by another user, or that others may write to, is refused (OSError)."""
    d = Path(tempfile.gettempdir()) / f"flexlite-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"flexlite: {d} is not a folder of this user's that only it can write to")
    return d


def _writable_kernel_dir() -> Path:
    for where in (lambda: cache_dir() / "kernels", lambda: _private_temp_dir() / "kernels"):
        try:
            d = where()
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("flexlite: no writable kernel cache directory; set FLEXLITE_CACHE_DIR to a writable folder")


def source_hash(source: str) -> str:
    return hashlib.sha256(f"{triton.__version__}\n{source}".encode()).hexdigest()[:24]


def write_source(source: str) -> Path:
    """Write ``source`` under its hash (atomic rename; an existing intact file is reused)."""
    path = _writable_kernel_dir() / f"flexlite_{source_hash(source)}.py"
    try:
        if path.read_text() == source:
            return path
    except (OSError, ValueError):  # missing, unreadable, or corrupt (not even UTF-8): write it anew
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def _interpret_env(interpret: bool):
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


_LANG_SWAP: list = []  # (module, name, jit fn, interpreted fn), built once


def _lang_swaps() -> list:
    if not _LANG_SWAP:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        _import_gluon()  # the launcher imports gluon lazily, which insists on un-swapped helpers: import it now
        modules = {tl, tl.core, tl.standard, tl.math}
        for mod in modules:
            for name, value in list(vars(mod).items()):
                if isinstance(value, JITFunction):
                    _LANG_SWAP.append((mod, name, value, InterpretedFunction(value.fn)))
    return _LANG_SWAP


def _interpreter_numpy_compat() -> None:
    """Triton 3.6's interpreter reads a scalar (a 1-element array in its tensors' handles) as an index with
    ``int(array)``, which numpy 2.4 refuses for arrays that are not 0-d ("only 0-dimensional arrays can be converted
    to Python scalars": every kernel with a ``range`` over a runtime bound failed). Its tensors' ``__index__`` reads
    the element with ``.item()`` instead (the same value under any numpy). Set once, where the interpreter patches
    triton.language for a launch; a Triton without that hook is left as it is."""
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "flexlite_item_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    patch_lang_tensor.flexlite_item_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


@contextlib.contextmanager
def interpreter_scope(interpret: bool):
    """Context for a launch. For the interpreter, triton.language's own ``@jit`` helpers (``tl.zeros``,
    ``tl.sum``, ...) must be interpreted too; if triton was imported without ``TRITON_INTERPRET=1``
    they are compiled-kernel objects, so swap in interpreted twins for the launch."""
    if not interpret:
        yield
        return
    with _LOCK:
        _interpreter_numpy_compat()
        swaps = _lang_swaps()
        for mod, name, _, interp in swaps:
            setattr(mod, name, interp)
        try:
            yield
        finally:
            for mod, name, jit_fn, _ in swaps:
                setattr(mod, name, jit_fn)


def import_kernel_file(path: Path, name: str, interpret: bool) -> ModuleType:
    """Import the ``@triton.jit`` functions in ``path`` as module ``name`` (``_interp`` appended for the
    interpreter: the two builds of one file are different modules)."""
    name = f"{name}{'_interp' if interpret else ''}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with _interpret_env(interpret):
        spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _import_gluon():
    """Import Triton's Gluon packages in the environment Triton itself was imported in: Gluon wraps
    triton.language's helpers at import and asserts that they match TRITON_INTERPRET, which a kernel file's import
    (under :func:`_interpret_env`) may have switched."""
    try:
        import triton.experimental.gluon.language  # noqa: F401
        import triton.experimental.gluon.nvidia.hopper  # noqa: F401
    except ImportError:  # the warp-specialized kernels then do not run (launch._ws_unmet)
        pass


def load_module(source: str, interpret: bool) -> ModuleType:
    """Import the kernel module for ``source`` (cached); ``interpret`` selects Triton's interpreter."""
    module = _BY_SOURCE.get((source, interpret))  # the steady state: no hashing of the text (str caches its hash)
    if module is not None:
        return module
    if _PREWARM and not interpret:
        try:  # another thread may have taken it already
            _PREWARM.pop().join()
        except IndexError:
            pass
    key = (source_hash(source), interpret)
    with _LOCK:
        module = _MODULES.get(key)
        if module is not None:
            _BY_SOURCE[(source, interpret)] = module
            return module
        path = write_source(source)
        if "triton.experimental.gluon" in source:
            _import_gluon()
        module = _MODULES[key] = _BY_SOURCE[(source, interpret)] = import_kernel_file(
            path, f"flexlite_kernels.{path.stem}", interpret)
        if env_flag("FLEXLITE_SHOW_KERNELS"):
            print(f"[flexlite] kernel {path}\n{source}", file=sys.stderr)
        return module
