"""The first_calls worker's compiles in compile servers (flexlite/runtime/compile_processes.py), without a GPU.

Each check compiles real kernels for Hopper (sm_90a) through the launch path with benchmarks/offline_compile.py's
stand-in driver, in a fresh Python process of its own (as test_gpu_compile's: the interpreter's patches of
triton.language must not be in place) with an empty Triton cache directory: the compile captured on the calling
thread, compiled by a server process into that cache, and the second pass finding it there (no new cache entry)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

L = 256


def _child(case: str, cache: str) -> dict:
    """Runs in the fresh process: ``case``'s compiles into the Triton cache directory ``cache``; what the test
    checks."""
    import importlib.util
    import threading

    import triton

    from flexlite import create_block_mask
    from flexlite.masks import causal_mask
    from flexlite.mods import generate_alibi_bias, generate_tanh_softcap
    from flexlite.runtime import compile_processes

    spec = importlib.util.spec_from_file_location(
        "offline_compile", Path(__file__).resolve().parent.parent / "benchmarks" / "offline_compile.py")
    offline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(offline)
    causal = create_block_mask(causal_mask, None, None, L, L, device="cpu")
    entries = lambda: sorted(os.listdir(cache)) if os.path.isdir(cache) else []  # noqa: E731

    def forward(score_mod=None):
        return offline.compile_forward(score_mod, causal, 64, (128, 64, 4, 2), False, L=L)

    def forward_ws():
        return offline.compile_forward_ws(generate_tanh_softcap(30.0, approx=True), causal, 64, L=L)

    kernels, seen = [], []
    facts = {}
    if case in ("triton", "gluon"):
        compile_ = (lambda: kernels.append(forward())) if case == "triton" else (lambda: kernels.append(forward_ws()))
        with compile_processes.capturing() as captured:
            compile_()
        facts.update(captured=len(captured), after_capture=entries())
        facts["servers_compiled"] = compile_processes.compile_in_processes(captured, 2)
        facts["after_servers"] = entries()
        compile_()
        facts.update(after_second=entries(), levels=[entry[3] for entry in captured])
        # the same kernel compiled in this thread (another cache): the server's build is the very same
        captured[0][0].device_caches.clear()
        triton.knobs.cache.dir = cache + "-in-thread"
        compile_()
        facts.update(same_cubin=kernels[-1].asm["cubin"] == kernels[1].asm["cubin"],
                     kernels=[k is not None for k in kernels])
    elif case == "run":
        facts["servers_compiled"] = compile_processes.run(lambda: kernels.append(forward()), 2)
        facts.update(kernels=[k is not None for k in kernels], entries=entries())
    elif case == "two threads":  # two kernel sets at once over one server: the second waits for it
        results = []

        def one(score_mod):
            results.append(compile_processes.run(lambda: kernels.append(forward(score_mod)), 1))
        threads = [threading.Thread(target=one, args=(mod,)) for mod in (None, generate_alibi_bias(2))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        facts.update(servers_compiled=results, kernels=sorted(k is not None for k in kernels), entries=entries(),
                     servers=sum(server is not None for server in compile_processes._slots))
    elif case == "environment":  # a variable in Triton's cache keys set after the server started
        facts["servers_compiled"] = [compile_processes.run(lambda: kernels.append(forward()), 1)]
        os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
        facts["servers_compiled"].append(
            compile_processes.run(lambda: kernels.append(forward(generate_alibi_bias(2))), 1))
        facts.update(kernels=[k is not None for k in kernels], entries=entries())
    elif case == "fallback":  # a server that cannot compile what it is asked: the second pass compiles it here
        request = compile_processes._request
        compile_processes._request = lambda *entry: dict(request(*entry), function="no_such_kernel")
        facts["servers_compiled"] = compile_processes.run(lambda: kernels.append(forward()), 1)
        facts.update(kernels=[k is not None for k in kernels], entries=entries())
    elif case == "in thread":
        facts["servers_compiled"] = compile_processes.run(lambda: kernels.append(forward()), 0)
        facts.update(kernels=[k is not None for k in kernels], entries=entries())
    elif case == "other threads":  # a hook installed before; another thread's compile while this one captures
        triton.knobs.runtime.jit_cache_hook = lambda **kwargs: seen.append(kwargs["fn"].name) and None
        with compile_processes.capturing() as captured:
            other = threading.Thread(target=lambda: kernels.append(forward(generate_alibi_bias(2))))
            other.start()
            other.join()
            forward()
        facts.update(captured=len(captured), kernels=[k is not None for k in kernels], hooked=seen)
    return facts


def _in_fresh_process(case: str, tmp_path) -> dict:
    cache = str(tmp_path / "triton")
    code = (f"import json, sys; sys.path[:0] = [{str(Path(__file__).parent)!r}]; "
            f"import test_compile_processes as t; print('FACTS ' + json.dumps(t._child({case!r}, {cache!r})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": cache})
    assert run.returncode == 0, f"{case}:\n{run.stderr[-4000:]}"
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("FACTS "))[6:])


@pytest.mark.parametrize("case", ["triton", "gluon"])
def test_capture_compile_in_server_and_load(case, tmp_path):
    facts = _in_fresh_process(case, tmp_path)
    assert facts["captured"] == 1 and facts["after_capture"] == []  # recorded, nothing compiled here
    assert facts["servers_compiled"] == 1 and len(facts["after_servers"]) == 1
    # the second pass loads the server's kernel: the same cache entry, no compile of its own
    assert facts["after_second"] == facts["after_servers"]
    assert facts["kernels"] == [False, True, True]  # (the captured launch returned nothing)
    # compiled as in the thread: at the LLVM level the Gluon launcher asks for (llvm_level.llvm_opt_level) too
    assert facts["levels"] == [None if case == "triton" else "O0"] and facts["same_cubin"]


def test_run_compiles_in_servers(tmp_path):
    facts = _in_fresh_process("run", tmp_path)
    assert facts["servers_compiled"] == 1 and len(facts["entries"]) == 1 and facts["kernels"] == [False, True]


def test_threads_share_the_servers(tmp_path):
    facts = _in_fresh_process("two threads", tmp_path)
    assert facts["servers_compiled"] == [1, 1] and facts["servers"] == 1 and len(facts["entries"]) == 2
    assert facts["kernels"] == [False, False, True, True]


def test_the_servers_compile_in_the_callers_environment(tmp_path):
    facts = _in_fresh_process("environment", tmp_path)
    # the second kernel compiled by the server under the caller's new variable: its second pass compiled nothing
    assert facts["servers_compiled"] == [1, 1] and len(facts["entries"]) == 2
    assert facts["kernels"] == [False, True, False, True]


def test_a_server_that_fails_leaves_the_compile_to_the_caller(tmp_path):
    facts = _in_fresh_process("fallback", tmp_path)
    assert facts["servers_compiled"] == 0 and len(facts["entries"]) == 1 and facts["kernels"] == [False, True]


def test_no_processes_compiles_in_the_thread(tmp_path):
    facts = _in_fresh_process("in thread", tmp_path)
    assert facts["servers_compiled"] is None and len(facts["entries"]) == 1 and facts["kernels"] == [True]


def test_only_the_capturing_thread_is_captured(tmp_path):
    facts = _in_fresh_process("other threads", tmp_path)
    # the other thread compiled (through the hook installed before), this one's compile was captured
    assert facts["captured"] == 1 and facts["kernels"] == [True] and facts["hooked"] == ["flex_fwd_kernel"]


def test_nothing_captured_runs_once_and_starts_no_server():
    # the interpreter's launches (the suite's) compile nothing: the capture pass was the whole compile
    from flexlite.runtime import compile_processes, launch

    calls = []
    with launch.compile_only():
        assert compile_processes.run(lambda: calls.append(launch.compiling_only()), 2) == 0
    assert calls == [True] and not any(compile_processes._slots)


@pytest.mark.parametrize("captures", [False, True])
def test_the_capture_pass_says_nothing_is_compiled(monkeypatch, captures):
    """first_calls' marks (and queued compiles) made in a capture pass wait: dropped where a second pass follows (it
    makes them again, once the servers compiled), made after it where it captured nothing (it was the whole compile)."""
    import torch

    from flexlite import first_calls
    from flexlite.runtime import compile_processes

    key = ("test", ("capture pass",), (torch.device("cpu"), captures))
    seen = []

    def compile_():
        if captures and compile_processes._THREAD.captured is not None:
            compile_processes._THREAD.captured.append("a kernel")  # (as the hook records one)
        first_calls.mark_ready(key)
        seen.append(first_calls.ready(key))
    monkeypatch.setattr(compile_processes, "compile_in_processes", lambda captured, processes: len(captured))
    monkeypatch.setattr(first_calls, "_ready", set())
    assert compile_processes.run(compile_, 2) == (1 if captures else 0)
    assert seen == ([False, True] if captures else [False]) and first_calls.ready(key)


def test_a_forked_process_starts_its_own_servers(monkeypatch):
    """A child forked after servers started (a data-loader worker) holds the parent's in its memory: it neither
    speaks to them nor closes them at exit."""
    import os

    from flexlite.runtime import compile_processes

    server = compile_processes._Server()
    try:
        assert server.alive()
        closed = []
        monkeypatch.setattr(compile_processes, "_slots", [server])
        monkeypatch.setattr(server, "close", lambda: closed.append(True))
        monkeypatch.setattr(os, "getpid", lambda: server.owner + 1)
        assert not server.alive()
        compile_processes._close()
        assert closed == []
    finally:
        server.process.kill()
        server.process.wait()


def _wait_for_exit(process, seconds: float = 120.0) -> int:
    import time

    deadline = time.monotonic() + seconds
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return process.poll()


def test_a_server_answers_each_line_and_exits_when_idle():
    """Two requests in one write get two answers (the server's own line reading); then, with nothing more to read
    for its idle seconds, it exits by itself."""
    from flexlite.runtime import compile_processes

    server = subprocess.Popen([sys.executable, compile_processes._SCRIPT, "1.0"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        server.stdin.write('{"path": "/no/such/module.py"}\n[]\n')
        server.stdin.flush()
        answers = [json.loads(server.stdout.readline()) for _ in range(2)]
        assert [a["ok"] for a in answers] == [False, False] and "Error" in answers[0]["error"]
        assert _wait_for_exit(server) == 0
    finally:
        server.kill()
        server.wait()


def test_an_idle_server_is_replaced_by_the_next_compile(monkeypatch):
    """A server that exited idle, or is near its idle exit (a request then could cross it), is not used: the next
    compile starts another (and closes the old one)."""
    import time

    from flexlite.runtime import compile_processes

    monkeypatch.setattr(compile_processes, "IDLE_SECONDS", 1.0)
    monkeypatch.setattr(compile_processes, "_slots", [])
    started = []
    try:
        first = compile_processes._Server()
        started.append(first)
        assert first.alive()
        assert _wait_for_exit(first.process) == 0 and not first.alive()
        compile_processes._slots.append(first)
        second = compile_processes._server(0)
        started.append(second)
        assert second is not first and second.alive() and compile_processes._slots == [second]
        second.last = time.monotonic() - 0.9  # (0.9 of its idle second gone: too near its exit)
        assert not second.alive()
        third = compile_processes._server(0)
        started.append(third)
        assert third is not second and second.process.poll() is not None and third.alive()
        monkeypatch.setattr(compile_processes, "IDLE_SECONDS", 0.0)  # never idle out
        fourth = compile_processes._Server()
        started.append(fourth)
        fourth.last = time.monotonic() - 1e6
        assert fourth.alive()
    finally:
        for server in started:
            server.process.kill()
            server.process.wait()
