"""The on-disk kernel cache: corrupt or truncated files, an unusable cache directory and concurrent
writers all end in an intact kernel file, never a crash."""

import os
import subprocess
import sys

import pytest
import torch

from flexlite import attention_reference, flex_attention
from flexlite.runtime import compile as compile_module
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
