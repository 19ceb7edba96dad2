"""The on-disk kernel cache: corrupt or truncated files, an unusable cache directory and concurrent
writers all end in an intact kernel file, never a crash."""

import os
import subprocess
import sys

import jinja2
import pytest
import torch

from flexlite import attention_reference, flex_attention
from flexlite.codegen import render
from flexlite.runtime import compile as compile_module
from flexlite.runtime import llvm_level
from helpers import TOLERANCES, assert_close, rand_qkv

SOURCE = "import triton\n\n\n@triton.jit\ndef k(X):\n    pass\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXLITE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("junk", [b"\xff\xfe\x00garbage", SOURCE[:20].encode(), b""], ids=["binary", "truncated",
                                                                                       "empty"])
def test_corrupt_kernel_file_is_rewritten(cache, junk):
    path = compile_module.write_source(SOURCE)
    path.write_bytes(junk)
    assert compile_module.write_source(SOURCE) == path and path.read_text() == SOURCE


def test_unusable_cache_dir_falls_back_to_temp(cache, monkeypatch):
    blocker = cache / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("FLEXLITE_CACHE_DIR", str(blocker))  # kernels/ cannot be created under a file
    path = compile_module.write_source(SOURCE)
    assert path.read_text() == SOURCE and not str(path).startswith(str(blocker))


@pytest.fixture
def fresh_templates():
    """Jinja environments made anew in the test (a cache dir of its own), and again after it."""
    render._environment.cache_clear()
    yield
    render._environment.cache_clear()


def test_the_templates_compiled_code_is_kept_for_later_processes(cache, fresh_templates, monkeypatch):
    source = render.load_template("fwd.py.jinja").render
    kept = list((cache / "templates").glob("__jinja2_*.cache"))
    assert len(kept) >= 1  # (the template and the ones it includes)
    render._environment.cache_clear()  # a later process: a new environment, the code on disk

    def no_compile(*args, **kwargs):
        raise AssertionError("a template kept on disk was compiled again")
    monkeypatch.setattr(jinja2.Environment, "compile", no_compile)
    assert render.load_template("fwd.py.jinja").render.__code__.co_code == source.__code__.co_code


def test_an_unwritable_cache_dir_leaves_the_templates_compiling_in_memory(cache, fresh_templates, monkeypatch):
    blocker = cache / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("FLEXLITE_CACHE_DIR", str(blocker))
    assert render._bytecode_cache() is None
    assert render.load_template("fwd.py.jinja") is not None


@pytest.mark.parametrize("variable, value, expected", [
    ("FLEXLITE_CACHE_DIR", "~/mine", "mine"), ("XDG_CACHE_HOME", "~/xdg", "xdg/flexlite"),
    ("FLEXLITE_CACHE_DIR", "{home}/abs", "abs")])
def test_a_cache_dir_variable_may_start_with_a_tilde(monkeypatch, tmp_path, variable, value, expected):
    """A "~" the shell did not expand (a quoted value, a Dockerfile's ENV) is the home folder, not a folder named ~
    under the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("FLEXLITE_CACHE_DIR", raising=False)
    monkeypatch.setenv(variable, value.format(home=tmp_path))
    assert compile_module.cache_dir() == tmp_path / expected


@pytest.mark.parametrize("planted", ["others_may_write", "symlink"])
def test_the_temp_fallback_refuses_a_folder_others_can_write(cache, monkeypatch, tmp_path, planted):
    """The fallback under the temp dir holds kernel files that are imported: a flexlite-<uid> folder made beforehand
    that others may write to (or a link to one) is refused, with the fix named, instead of importing from it; one
    flexlite makes is private (0o700)."""
    import tempfile

    blocker = cache / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("FLEXLITE_CACHE_DIR", str(blocker))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    path = compile_module.write_source(SOURCE)  # made here: private
    private = temp / f"flexlite-{os.getuid()}"
    assert path.parent.parent == private and (private.stat().st_mode & 0o777) == 0o700
    path.unlink()
    path.parent.rmdir()
    path.parent.parent.rmdir()
    if planted == "symlink":
        (temp / "elsewhere").mkdir()
        (temp / f"flexlite-{os.getuid()}").symlink_to(temp / "elsewhere")
    else:
        (temp / f"flexlite-{os.getuid()}").mkdir()
        (temp / f"flexlite-{os.getuid()}").chmod(0o777)
    with pytest.raises(OSError, match="no writable kernel cache directory; set FLEXLITE_CACHE_DIR"):
        compile_module.write_source(SOURCE)


def test_concurrent_writers_leave_an_intact_file(cache):
    code = ("import sys; from flexlite.runtime import compile as c\n"
            "for _ in range(50):\n    p = c.write_source(sys.argv[1])\n"
            "assert p.read_text() == sys.argv[1]\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, SOURCE], env=dict(os.environ)) for _ in range(3)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    files = list((cache / "kernels").glob("flexlite_*.py"))
    assert len(files) == 1 and files[0].read_text() == SOURCE
    assert not list((cache / "kernels").glob("*.tmp"))


def test_flex_attention_survives_a_corrupted_cache(cache):
    def mod(score, b, h, q_idx, kv_idx):
        return score * 1.5
    q, k, v = rand_qkv(1, 1, 1, 80, 80, 16)
    compile_module._MODULES.clear()  # as in a new process: the kernel file is written to this cache
    compile_module._BY_SOURCE.clear()
    out = flex_attention(q, k, v, score_mod=mod)
    for f in (cache / "kernels").glob("*.py"):
        f.write_bytes(b"\x00broken")
    compile_module._MODULES.clear()
    compile_module._BY_SOURCE.clear()
    again = flex_attention(q, k, v, score_mod=mod)
    assert torch.equal(out, again)
    assert_close(again, attention_reference(q, k, v, score_mod=mod)[0], *TOLERANCES[torch.float32])


def test_triton_cache_key_is_prewarmed_in_the_background(monkeypatch):
    """flexlite's import starts Triton's per-process cache key (a hash of Triton's installation) in a thread
    where torch is a CUDA build, so a process's first launch does not pay it; FLEXLITE_PREWARM=0 or a CPU build
    of torch: no thread."""
    import triton.runtime.cache

    from flexlite.runtime.compile import prewarm_triton_key

    calls = []
    monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: calls.append(True))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(compile_module, "_PREWARM", [])
    thread = prewarm_triton_key()
    thread.join(timeout=10)
    assert calls == [True] and thread.daemon and compile_module._PREWARM == [thread]  # joined at the first load
    monkeypatch.setenv("FLEXLITE_PREWARM", "0")
    assert prewarm_triton_key() is None
    monkeypatch.delenv("FLEXLITE_PREWARM")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert prewarm_triton_key() is None and calls == [True]


def test_llvm_opt_level_applies_to_the_compiles_of_the_thread_that_asked_for_it(monkeypatch):
    """llvm_level.llvm_opt_level: Triton's NVIDIA backend calls LLVM's optimizer at O3; inside the context the calling
    thread's compiles take the level asked for, other threads' and those after it Triton's own, and a nested None
    gives Triton's level back until it ends."""
    import threading

    from triton.backends.nvidia import compiler as nvidia
    from triton._C.libtriton import llvm

    levels = []
    with llvm_level.llvm_opt_level("O0"):  # installs the pass-through in front of the binding
        pass
    proxy = nvidia.llvm
    assert isinstance(proxy, llvm_level._LLVMAtLevel) and proxy.OPTIMIZE_O2 is llvm.OPTIMIZE_O2
    monkeypatch.setattr(proxy, "_llvm", type("Binding", (), {
        **{f"OPTIMIZE_{name}": name for name in ("O0", "O1", "O2", "O3")},
        "optimize_module": staticmethod(lambda module, level, *args: levels.append((module, level)))})())

    def optimize(module):  # what make_llir does
        nvidia.llvm.optimize_module(module, nvidia.llvm.OPTIMIZE_O3)

    with llvm_level.llvm_opt_level("O0"):
        optimize("this thread")
        other = threading.Thread(target=optimize, args=("another thread",))
        other.start()
        other.join()
        with llvm_level.llvm_opt_level(None):
            optimize("nested None")
        optimize("after the nested one")
    optimize("after")
    assert levels == [("this thread", "O0"), ("another thread", "O3"), ("nested None", "O3"),
                      ("after the nested one", "O0"), ("after", "O3")]


@pytest.mark.parametrize("level", ["O4", "-O0", 0])
def test_llvm_opt_level_names_its_levels(level):
    with pytest.raises(ValueError, match=r"level must be one of \('O0', 'O1', 'O2', 'O3'\) or None \(the values of "
                                         r"launch.WS_FWD_LLVM_OPT_LEVELS / WS_BWD_LLVM_OPT_LEVELS, per head dim\)"):
        llvm_level.llvm_opt_level(level)


@pytest.mark.parametrize("kernel, setting", [("forward_ws", "WS_FWD_LLVM_OPT_LEVELS"),
                                             ("backward_ws", "WS_BWD_LLVM_OPT_LEVELS")])
@pytest.mark.parametrize("levels", [{64: "O0", 128: "O0"}, {128: "O0"}, {}])
def test_the_gluon_kernels_sources_name_their_llvm_levels(monkeypatch, kernel, setting, levels):
    """launch.WS_FWD_LLVM_OPT_LEVELS / WS_BWD_LLVM_OPT_LEVELS (head dim -> level) is rendered into the Gluon kernel's
    source, as the module constant its launcher compiles at and inside the kernel's body, so that Triton's caches
    (keyed by the kernel's own text and its constexprs, the head dim among them) keep the builds apart; the Triton
    kernels do not carry it."""
    from flexlite import create_block_mask, kernel_source
    from flexlite.runtime import launch

    monkeypatch.setattr(launch, setting, levels)
    blocks = create_block_mask(lambda b, h, q, k: q >= k, None, None, 256, 256, device="cpu")
    source = kernel_source(None, blocks, device="cuda", kernel=kernel)
    assert f"\nLLVM_OPT_LEVELS = {levels!r}\n" in source
    body = source[source.index("_kernel(", source.index("@gluon.jit(do_not_specialize")):]
    assert f"# compiled with LLVM at {levels!r} by head dim (LLVM_OPT_LEVELS)" in body
    assert "LLVM_OPT_LEVELS" not in kernel_source(None, blocks, device="cuda", kernel=kernel.replace("_ws", ""))
    monkeypatch.setattr(launch, setting, {**levels, 64: "O1"})
    assert kernel_source(None, blocks, device="cuda", kernel=kernel) != source


@pytest.mark.parametrize("D, level", [(64, None), (128, "O0")])
def test_the_gluon_launchers_compile_at_their_head_dims_level(monkeypatch, D, level):
    """The Gluon forward's launcher compiles (if Triton compiles now) at the level its module names for the head dim,
    Triton's own for head dims it does not name."""
    from flexlite.api import _block_tensors
    from flexlite.runtime import launch

    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(llvm_level._LLVM_LEVEL.level)

    monkeypatch.setattr(launch, "_device_facts", lambda device: (5, 9))
    monkeypatch.setattr(launch, "_ensure_allocator", lambda: None)
    q, k, v = (torch.randn(1, 2, 256, D, dtype=torch.bfloat16) for _ in range(3))
    num, idx, full_num, full_idx, sparse = _block_tensors(None, 256, 256, torch.device("cpu"))
    module = type("Module", (), {"flex_fwd_ws_kernel": Kernel(), "LLVM_OPT_LEVELS": {128: "O0"}})
    launch.launch_forward_ws(module, [], q, k, v, num, idx, full_num, full_idx, sparse, 0.125, False, dense=True)
    assert seen == [level] and getattr(llvm_level._LLVM_LEVEL, "level", None) is None
    # a level that is none of LLVM's, set by hand: refused at the launch, before anything compiles
    module.LLVM_OPT_LEVELS = {D: "O9"}
    with pytest.raises(ValueError, match="launch.WS_FWD_LLVM_OPT_LEVELS / WS_BWD_LLVM_OPT_LEVELS"):
        launch.launch_forward_ws(module, [], q, k, v, num, idx, full_num, full_idx, sparse, 0.125, False, dense=True)
    assert len(seen) == 1


@pytest.mark.parametrize("setting", ["WS_FWD_LLVM_OPT_LEVELS", "WS_BWD_LLVM_OPT_LEVELS"])
def test_the_llvm_level_settings_must_map_head_dims(monkeypatch, setting):
    from flexlite import create_block_mask, kernel_source
    from flexlite.runtime import launch

    monkeypatch.setattr(launch, setting, "O0")
    blocks = create_block_mask(lambda b, h, q, k: q >= k, None, None, 256, 256, device="cpu")
    kernel = "forward_ws" if "FWD" in setting else "backward_ws"
    with pytest.raises(TypeError, match=r"must be a dict of head dim -> LLVM level .*e.g. \{128: 'O0'\}; got 'O0'"):
        kernel_source(None, blocks, device="cuda", kernel=kernel)


def test_the_forwards_source_names_its_llvm_levels(monkeypatch):
    """launch.WS_FWD_LLVM_OPT_LEVELS: the warp-specialized forward, with a block mask or without (the dense walk, at
    O3 at D64 until NOTES 108), with a score_mod or without, compiles at these levels per head dim, which its source
    names (so that Triton's caches keep builds at other levels apart); the dense walk at lengths not multiples of 128
    at launch.WS_FWD_DENSE_RAGGED_LLVM_OPT_LEVELS' (O3 at D64, as before)."""
    from flexlite import create_block_mask, kernel_source
    from flexlite.api import _generate
    from flexlite.runtime import launch

    blocks = create_block_mask(lambda b, h, q, k: q >= k, None, None, 256, 256, device="cpu")
    assert launch.WS_FWD_LLVM_OPT_LEVELS == {64: "O0", 128: "O0"}
    assert launch.WS_FWD_DENSE_RAGGED_LLVM_OPT_LEVELS == {128: "O0"}
    mods = (None, lambda s, b, h, q, k: s * 0.5)

    def sources():
        return [kernel_source(mod, mask, device="cuda", kernel="forward_ws") for mod in mods for mask in (None, blocks)]

    def dense(lengths):
        return [_generate(mod, None, torch.device("cuda"), "fwd_ws.py.jinja", lengths=lengths).source for mod in mods]
    assert all("\nLLVM_OPT_LEVELS = {64: 'O0', 128: 'O0'}\n" in source for source in sources() + dense((512, 256)))
    assert all("\nLLVM_OPT_LEVELS = {128: 'O0'}\n" in source for source in dense((512, 200)) + dense((200, 256)))
    monkeypatch.setattr(launch, "WS_FWD_LLVM_OPT_LEVELS", {64: "O1"})
    monkeypatch.setattr(launch, "WS_FWD_DENSE_RAGGED_LLVM_OPT_LEVELS", {64: "O2"})
    assert all("\nLLVM_OPT_LEVELS = {64: 'O1'}\n" in source for source in sources())
    assert all("\nLLVM_OPT_LEVELS = {64: 'O2'}\n" in source for source in dense((200, 200)))


def _prewarm_off():
    from flexlite.runtime.compile import prewarm_triton_key
    return prewarm_triton_key() is None


def _autotune_on():
    from flexlite.runtime.autotune import autotune_enabled
    return autotune_enabled({})


def _deterministic_on():
    from flexlite.api import _deterministic_captured_grads
    return _deterministic_captured_grads({})


def _show_kernels_on():
    return compile_module.env_flag("FLEXLITE_SHOW_KERNELS")


@pytest.mark.parametrize("name, reader, default", [
    ("FLEXLITE_AUTOTUNE", _autotune_on, False),
    ("FLEXLITE_DETERMINISTIC_CAPTURED_GRADS", _deterministic_on, False),
    ("FLEXLITE_SHOW_KERNELS", _show_kernels_on, False),
    ("FLEXLITE_PREWARM", _prewarm_off, False),  # read as "prewarm off": off by default
])
def test_environment_switches_read_their_values_or_name_a_bad_one(monkeypatch, name, reader, default):
    """flexlite's on / off environment variables: 1 / true / yes / on and 0 / false / no / off (any case) as they say,
    unset or empty the default; "false" is not on (it was, as every value but "0"), and "abc" or "2" is a ValueError
    naming the variable rather than a guess."""
    import triton.runtime.cache

    monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: None)  # (the prewarm's thread: nothing to hash)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(compile_module, "_PREWARM", [])
    monkeypatch.delenv(name, raising=False)
    assert reader() is default
    flip = name == "FLEXLITE_PREWARM"  # its variable says "on", the reader "off"
    for value, on in [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False),
                      ("No", False), ("off", False), ("", False)]:
        monkeypatch.setenv(name, value)
        assert reader() is ((not on if value else default) if flip else (on if value else default)), value
    for value in ["abc", "2", "-1"]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name}='{value}' is not an on / off switch: set it to 1"):
            reader()
