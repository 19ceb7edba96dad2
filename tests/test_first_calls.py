"""flexlite.first_calls: a new mask_mod's first calls run kernels that read its partial blocks' mask as bits (compiled
once for every mask_mod) while a worker thread compiles the mod's own kernels (launch.compile_only), which later
calls take. On CPU (the interpreter compiles nothing) the tests turn it on with ENABLED = "always"; on a GPU
(FLEXLITE_TEST_DEVICE=cuda) it is on by default."""

import threading

import pytest
import torch
from triton.runtime.jit import JITFunction

from flexlite import api, attention_reference, create_block_mask, create_mask, first_calls, flex_attention
from flexlite.masks import causal_mask, generate_doc_mask_mod, generate_prefix_lm_mask, generate_sliding_window
from flexlite.reference import reference_mask
from flexlite.runtime import launch

from helpers import DEVICE, TOLERANCES, assert_close, rand_qkv


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """first_calls on for this device, knowing no compiled kernels (nor any an earlier process marked)."""
    monkeypatch.setattr(first_calls, "ENABLED", "always")
    for name, empty in (("_ready", set()), ("_pending", {}), ("_failed", set())):
        monkeypatch.setattr(first_calls, name, empty)
    monkeypatch.setattr(first_calls, "_markers_dir", lambda: tmp_path)
    yield
    first_calls.wait()


def _per_head(b, h, q_idx, kv_idx):  # a mask of its own in every (b, h)
    return ((q_idx + b) % (h + 2)) != (kv_idx % 3)


def _document(L=111):
    ids = torch.arange(L, device=DEVICE, dtype=torch.int32) * 3 // L  # three documents
    return generate_doc_mask_mod(causal_mask, ids)


def _reads_b_and_h(b, h, q_idx, kv_idx):  # by a block mask of batch and heads None too: the kernels pass the real ones
    return ((q_idx + b + 2 * h) % 5) != (kv_idx % 3)


MASKS = {  # name -> (mask_mod, B and H of the mask, (Lq, Lkv), BLOCK_SIZE)
    "causal": (causal_mask, (None, None), (200, 200), 64),
    "sliding_window": (generate_sliding_window(70), (None, None), (256, 256), 128),
    "prefix_lm": (generate_prefix_lm_mask(50), (None, 2), (63, 63), (32, 64)),
    "document": (_document(), (None, None), (111, 111), 32),
    "per_head": (_per_head, (2, 3), (96, 96), 32),
    # blocks smaller than a kernel tile (which then asks about full and empty blocks too), lengths that differ
    "document_16": (_document(200), (None, None), (200, 137), 16),
    "reads_b_and_h": (_reads_b_and_h, (None, None), (80, 100), (16, 48)),  # 48: two words a row, one half used
}


def _block_mask(name):
    mod, (B, H), (Lq, Lkv), block = MASKS[name]
    return create_block_mask(mod, B, H, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block)


@pytest.mark.parametrize("name", list(MASKS))
def test_the_bits_are_the_kernels_mask_wherever_they_may_ask(name, monkeypatch):
    # partial blocks: the mask_mod's values; full blocks: True; empty ones: False (reference_mask's semantics)
    monkeypatch.setattr(first_calls, "_CHUNK_BLOCKS", 3)  # (the partial blocks evaluated in several chunks)
    _, (Bm, Hm), (Lq, Lkv), _ = MASKS[name]
    bm = _block_mask(name)
    B, H = Bm or 2, Hm or 3  # a mask of batch or heads None broadcasts to the call's
    bits = first_calls.bits_mask(bm, B, H, gathers=False)
    assert isinstance(bits, first_calls.BitsMask) and bits.original is bm
    # the same blocks, another mask_mod
    assert all(getattr(bits, n) is getattr(bm, n) for n in bm._TENSOR_ATTRS) and bits.mask_mod is not bm.mask_mod
    assert bm.dense_blocks(full=False).any()
    assert torch.equal(create_mask(bits.mask_mod, B, H, Lq, Lkv, device=DEVICE), reference_mask(bm, B, H, DEVICE))
    # kept on the block mask per call shape
    assert first_calls.bits_mask(bm, B, H, gathers=False) is bits
    assert first_calls.bits_mask(bm, B, H, gathers=True) is not bits


def _specialization(bits) -> list:
    """How Triton specializes the bits' captured tensors' sizes and strides (kernel arguments): == 1, % 16 == 0."""
    tensors = [c.cell_contents for c in bits.mask_mod.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    return [(n == 1, n % 16 == 0) for t in tensors for n in (*t.shape, *t.stride())]


@pytest.mark.parametrize("B, H, Bm, Hm", [(1, 1, None, None), (2, 3, None, None), (4, 2, 4, 2), (3, 5, None, 5)])
def test_every_mask_mod_gives_the_bits_kernels_the_same_specialization(B, H, Bm, Hm):
    # the bits' sizes padded to multiples of 16 and a broadcast batch or head a stride-0 view: what Triton
    # specializes a kernel on is the same for every mask_mod at a shape, so one compile serves them all
    L = 200
    mods = [causal_mask, generate_sliding_window(9), generate_prefix_lm_mask(150), _per_head]
    specs = [_specialization(first_calls.bits_mask(create_block_mask(mod, Bm, Hm, L, L, device=DEVICE,
                                                                     BLOCK_SIZE=64), B, H, gathers=False))
             for mod in mods]
    assert all(spec == specs[0] for spec in specs), specs


@pytest.mark.parametrize("name", ["document", "sliding_window", "document_16"])
def test_the_bits_kernels_give_the_mods_own_results(name, monkeypatch):
    # the same templates, tiles and walk (chosen for the original mask_mod: document's gathers), only the partial
    # blocks' mask read from the bits: outputs and gradients the same to the bit
    monkeypatch.setattr(first_calls, "ENABLED", False)
    bm = _block_mask(name)
    Lq, Lkv = MASKS[name][2]
    results = []
    for mask in (bm, first_calls.bits_mask(bm, 1, 2, gathers=name.startswith("document"))):
        q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, Lq, Lkv, 64, seed=3))
        out, lse = flex_attention(q, k, v, block_mask=mask, return_lse=True)
        (out * torch.linspace(-1, 1, 64, device=DEVICE)).sum().backward()
        results.append((out, lse, q.grad, k.grad, v.grad))
    for own, bits in zip(*results):
        assert not own.isnan().any() and torch.equal(own, bits)


def _record(monkeypatch, name, at):
    """The kinds of block mask the calls of api.<name> get (argument ``at``), in order, but the worker's (its
    compile-only calls; a backward on a GPU runs in autograd's device thread)."""
    seen, real = [], getattr(api, name)

    def spy(*args, **kwargs):
        if not threading.current_thread().name.startswith("flexlite-compile"):
            seen.append(type(args[at]).__name__)
        return real(*args, **kwargs)
    monkeypatch.setattr(api, name, spy)
    return seen


def test_a_new_mask_mods_first_calls_run_the_bits_while_its_own_kernels_compile(fresh, monkeypatch):
    forwards, backwards = _record(monkeypatch, "_forward", 4), _record(monkeypatch, "_backward", 8)
    L = 200
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, L, L, 64, seed=5))

    def forward(mask, kinds):
        forwards.clear()
        out = flex_attention(q, k, v, block_mask=mask)
        assert forwards == kinds
        first_calls.wait()
        return out

    def backward(out, kinds):
        backwards.clear()
        out.sum().backward()
        assert backwards == kinds
        first_calls.wait()
        grads = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        return [out.detach()] + grads

    causal = create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=64)
    window = create_block_mask(generate_sliding_window(70), None, None, L, L, device=DEVICE, BLOCK_SIZE=64)
    bits_calls = first_calls.ran_bits()
    jobs, real = [], first_calls.compile_beside
    monkeypatch.setattr(first_calls, "compile_beside",
                        lambda key, *args, **kw: jobs.append(key) or real(key, *args, **kw))
    # the first mask_mod at a shape runs its own forward; the worker then compiles its backward (first: the call's
    # backward comes next, NOTES 66) and the bits' forward and backward
    out = forward(causal, ["BlockMask"])
    assert [job[0] for job in jobs] == ["bwd", "fwd"]
    ready = len(_attention_keys())
    causal_first = backward(out, ["BlockMask"])  # its own, compiled beside the forward
    assert len(_attention_keys()) == ready  # (the key the worker compiled is the backward's)
    # the next mask_mod's first call: the bits, and the worker compiles its own forward and backward
    window_first = backward(forward(window, ["BlockMask", "BitsMask"]), ["BlockMask"])
    # later calls: their own kernels, the same results to the bit
    for mask, first in ((causal, causal_first), (window, window_first)):
        later = backward(forward(mask, ["BlockMask"]), ["BlockMask"])
        for a, b in zip(first, later):
            assert not a.isnan().any() and torch.equal(a, b)
    assert not first_calls._failed and not first_calls._pending
    assert first_calls.ran_bits() == bits_calls + 1  # the window's first forward


def _attention_keys() -> set:
    """The attention kernels' keys known compiled (not create_block_mask's: on CUDA it has a key per kernel too)."""
    return {key for key in first_calls._ready if key[0] != "mask"}


def _second_mask_mod(monkeypatch, seed: int):
    """After a first mask_mod's call at length 128 (the worker then compiled the bits' kernels): the recorder of
    api._forward's block masks, q, k, v, and a second mask_mod's block mask."""
    forwards = _record(monkeypatch, "_forward", 4)
    L = 128
    q, k, v = rand_qkv(1, 2, 2, L, L, 64, seed=seed)
    flex_attention(q, k, v, block_mask=create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=64))
    first_calls.wait()
    forwards.clear()
    return forwards, (q, k, v), create_block_mask(generate_sliding_window(20), None, None, L, L, device=DEVICE,
                                                  BLOCK_SIZE=64)


def test_a_worker_compile_that_fails_leaves_the_calls_to_compile_their_own(fresh, monkeypatch):
    forwards, (q, k, v), window = _second_mask_mod(monkeypatch, seed=6)
    monkeypatch.setattr(api, "_compile_call", lambda *args: 1 / 0)
    first = flex_attention(q, k, v, block_mask=window)  # the bits, and a worker that raises
    first_calls.wait()
    assert forwards == ["BlockMask", "BitsMask"] and len(first_calls._failed) == 1
    forwards.clear()
    assert torch.equal(flex_attention(q, k, v, block_mask=window), first)  # its own, in the call
    assert forwards == ["BlockMask"]


@pytest.mark.parametrize("why", ["kernel_options", "off", "autotune", "cpu by default"])
def test_where_first_calls_do_not_apply(why, monkeypatch):
    monkeypatch.setattr(first_calls, "ENABLED", "always")
    q = torch.zeros(1, 1, 8, 8, device=DEVICE)
    bm = create_block_mask(causal_mask, None, None, 8, 8, device=DEVICE)
    assert first_calls.applies(q, bm, None) and first_calls.applies(q, None, None)  # (without a mask_mod: no bits)
    options = None
    if why == "kernel_options":
        options = {"BLOCK_M": 64}
    elif why == "off":
        monkeypatch.setattr(first_calls, "ENABLED", False)
    elif why == "autotune":
        monkeypatch.setenv("FLEXLITE_AUTOTUNE", "1")
    else:
        monkeypatch.setattr(first_calls, "ENABLED", True)
        q = q.cpu()
    assert not first_calls.applies(q, bm, options)


def test_masks_whose_bits_cannot_be_made_compile_their_own(fresh, monkeypatch):
    bm = _block_mask("causal")
    monkeypatch.setattr(first_calls, "MAX_BITS_BYTES", 1024)
    assert first_calls.bits_mask(bm, 1, 1, gathers=False) is None  # past the bytes allowed
    monkeypatch.setattr(first_calls, "MAX_BITS_BYTES", 1 << 30)
    bm.mask_mod = lambda b, h, q_idx, kv_idx: torch.tensor(q_idx.item() >= 0)  # torch cannot vmap .item()
    assert first_calls.bits_mask(bm, 1, 1, gathers=False) is None


class _Kernel(JITFunction):
    """A compiled kernel's stand-in: records its runs."""

    def __init__(self):
        self.runs = []

    def run(self, *args, grid, warmup, **kwargs):
        self.runs.append((args, grid, warmup, kwargs))
        return self  # (as Triton's warmup returns the compiled kernel)

    src, metadata = "the kernel's source", "its metadata"


def test_compile_only_launches_compile_and_run_nothing(monkeypatch):
    import triton

    class Driver:  # Triton's active driver, for its launcher builds
        launcher_cls = staticmethod(lambda src, metadata: launchers.append((src, metadata)))
    launchers = []
    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())
    kernel = _Kernel()
    compiled = launch.CompiledLaunch(kernel, {"BLOCK": 64})
    with launch.compile_only():
        assert launch.compiling_only()
        compiled((2, 1), (torch.zeros(4), 3))
        launch._launch(object(), (1,), (), {})  # the interpreter's kernels: nothing at all
    assert not launch.compiling_only() and not compiled.compiled
    (args, grid, warmup, kwargs), = kernel.runs
    assert grid == (2, 1) and warmup is True and kwargs == {"BLOCK": 64} and args[1] == 3
    # the compiled kernel's C launcher built beside too (its first launch then finds it in Triton's cache)
    assert launchers == [(kernel.src, kernel.metadata)]
    monkeypatch.setattr(Driver, "launcher_cls", staticmethod(lambda src, metadata: 1 / 0))
    with launch.compile_only():
        compiled((2, 1), (torch.zeros(4), 3))  # a launcher that fails to build: left to the first launch
    assert len(kernel.runs) == 2
    # another thread's launches are not compile-only
    seen = []
    with launch.compile_only():
        thread = threading.Thread(target=lambda: seen.append(launch.compiling_only()))
        thread.start()
        thread.join()
    assert seen == [False]


def test_wait_for_the_worker(fresh):
    release = threading.Event()
    first_calls.compile_beside(("test", 1), release.wait)
    first_calls.compile_beside(("test", 1), release.wait)  # asked twice: compiled once
    assert ("test", 1) in first_calls._pending and len(first_calls._pending) == 1
    with pytest.raises(TimeoutError, match="still running"):
        first_calls.wait(timeout=0.05)
    release.set()
    first_calls.wait()
    assert first_calls.ready(("test", 1)) and ("test", 1) not in first_calls._pending


def test_the_worker_compiles_from_the_calling_threads_traces(fresh):
    # torch.fx patches torch.nn.Module's methods process-wide while it traces: a trace in the worker would break a
    # torch.compile running in the caller's thread, so the worker refuses to trace and its job fails instead
    def fresh_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    bm = create_block_mask(causal_mask, None, None, 64, 64, device=DEVICE)
    bm.mask_mod = fresh_mask  # never traced
    q, k, v = rand_qkv(1, 1, 1, 64, 64, 16, seed=4)
    assert first_calls.compile_beside(("test", 2), lambda: api._forward(q, k, v, None, bm, 0.25, None))
    first_calls.wait()
    assert ("test", 2) in first_calls._failed and not first_calls.ready(("test", 2))
    assert not first_calls.compile_beside(("test", 2), lambda: None)  # failed: left to the call


def test_a_new_length_is_no_new_first_call(fresh, monkeypatch):
    # the kernels take lengths as arguments (one compile serves every length): a new length, a decoding step's for
    # one, neither runs the bits nor asks the worker for anything
    forwards = _record(monkeypatch, "_forward", 4)
    for mod in (causal_mask, generate_sliding_window(30)):
        for L in (200, 190):
            q, k, v = rand_qkv(1, 2, 2, L, L, 64, seed=L)
            bm = create_block_mask(mod, None, None, L, L, device=DEVICE, BLOCK_SIZE=64)
            out = flex_attention(q, k, v, block_mask=bm)
            assert_close(out, attention_reference(q, k, v, block_mask=bm)[0], *TOLERANCES[torch.float32])
            first_calls.wait()
    # causal: its own at both lengths; the window: the bits at the first length, its own after
    assert forwards == ["BlockMask", "BlockMask", "BlockMask", "BitsMask", "BlockMask"]
    assert len(_attention_keys()) == 3  # causal's, the bits', the window's


def test_bits_that_fail_to_build_leave_the_call_its_own_kernels(fresh, monkeypatch):
    forwards, (q, k, v), window = _second_mask_mod(monkeypatch, seed=8)
    monkeypatch.setattr(first_calls, "_make_bits_mask", lambda *args: 1 / 0)
    out = flex_attention(q, k, v, block_mask=window)
    assert forwards == ["BlockMask"]
    assert_close(out, attention_reference(q, k, v, block_mask=window)[0], *TOLERANCES[torch.float32])


@pytest.mark.parametrize("same, other", [
    ((1, 2, 2), (1, 16, 16)),  # 2 heads compile apart from 16 (Triton: a multiple of 16 or not)
    ((1, 16, 16), (1, 16, 1)),  # one kv head (Triton: an integer 1)
    ((1, 4, 4, 256, 64), (1, 4, 4, 256, 24)),  # strides (L * 24 and 24 against L * 64 and 64)
])
def test_kernels_compiled_for_other_integer_classes_are_not_taken_as_compiled(same, other):
    # Triton compiles a kernel again where an integer argument (head counts, strides) changes class: 1, a multiple of
    # 16, or neither; a first call that took those kernels as compiled would compile in the call (benchmarks/NOTES.md
    # 83: markers from a test run at 2 heads sent the harness's 16-head calls there, 4-5 s)
    def sig(B, H, Hkv, L=256, D=64):
        q, k, v = rand_qkv(B, H, Hkv, L, L, D, device="cpu")
        return first_calls.signature(q, k, v, None)

    assert sig(*same) != sig(*other)
    assert sig(1, 16, 16) == sig(2, 32, 32)  # the same classes
    assert sig(1, 4, 4, 256) == sig(1, 4, 4, 384)  # a new length is no new first call


def test_a_grad_out_of_other_stride_classes_runs_the_kernels_of_outs_layout(fresh, monkeypatch):
    # the backward kernels take grad_out's strides, which Triton specializes (first_calls.int_classes): a grad_out of
    # other classes (an expanded one, rows 17 apart) is copied as out is laid out, so that the backward compiled
    # beside the forward for that layout serves it; the key (and the gradients) as for a contiguous grad_out
    extras = []  # what a backward call's first_calls key has besides the sources and the inputs'
    real = api._first_call
    monkeypatch.setattr(api, "_first_call", lambda kind, *args, **kw: (
        extras.append(args[9:]) if kind == "bwd" else None) or real(kind, *args, **kw))
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 32, 32, 16))
    out = flex_attention(q, k, v)
    dense = torch.randn_like(out)
    grads = [dense, torch.ones(1, 1, 1, 1, device=out.device).expand_as(out),
             torch.randn(1, 2, 32, 17, device=out.device)[..., :16].copy_(dense)]
    assert len({first_calls.int_classes(*g.stride()) for g in grads}) == 3
    results = []
    for grad in grads:
        extras.clear()
        results.append(torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
        assert extras
        if grad is dense:
            first = extras[0]
        assert all(extra == first for extra in extras)
    # (on a GPU a first call may run in torch ops while the kernels compile: to the tolerances, not to the bit)
    for a, b in zip(results[0], results[2]):
        assert_close(a, b, *TOLERANCES[torch.float32])
    expected = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), retain_graph=True)
    for a, b in zip(results[1], expected):
        assert_close(a, b, *TOLERANCES[torch.float32])


def test_the_bits_kernels_are_known_to_later_processes(fresh, monkeypatch, tmp_path):
    # a marker file per CUDA key of the bits' kernels (Triton's disk cache has them): a later process's first
    # mask_mod of that kind runs them too, while its own compile
    monkeypatch.setattr(first_calls, "_gpu_name", lambda device: "a GPU")
    key = ("fwd", ("source", None), (torch.device("cuda", 0), torch.bfloat16, 64, True))
    other = ("fwd", ("another source", None), key[2])
    first_calls.mark_ready(key, persist=True)
    first_calls.mark_ready(other)  # (a mod's own kernels: not for later processes)
    assert len(list(tmp_path.iterdir())) == 1
    first_calls._ready.clear()  # a later process
    assert not first_calls.ready(key) and first_calls.ready(key, on_disk=True) and first_calls.ready(key)
    assert not first_calls.ready(other, on_disk=True)
    monkeypatch.setattr(first_calls, "_gpu_name", lambda device: "another GPU")
    first_calls._ready.clear()
    assert not first_calls.ready(key, on_disk=True)  # compiled for another GPU
    assert first_calls._marker(("fwd", ("source", None), (torch.device("cpu"), torch.float32))) is None


def test_the_bits_kernels_are_marked_for_later_processes_and_a_mods_own_are_not(fresh, monkeypatch):
    marked, real = [], first_calls.mark_ready

    def mark_ready(key, persist=False):
        if key[0] != "mask":  # (create_block_mask's kernels: on CUDA)
            marked.append((key[1], persist))
        real(key, persist)
    monkeypatch.setattr(first_calls, "mark_ready", mark_ready)
    L = 128
    q, k, v = rand_qkv(1, 2, 2, L, L, 64, seed=9)
    for mod in (causal_mask, generate_sliding_window(20)):  # its own; the bits, its own beside
        flex_attention(q, k, v, block_mask=create_block_mask(mod, None, None, L, L, device=DEVICE, BLOCK_SIZE=64))
        first_calls.wait()
    persisted = {sources for sources, persist in marked if persist}
    own = {sources for sources, persist in marked if not persist}
    assert len(persisted) == 1 and len(own) == 2 and not persisted & own, marked


def test_the_bits_backward_compiles_both_grids_of_the_warp_specialized_backward(fresh, monkeypatch):
    # the warp-specialized backward picks its grid by the block mask's mean walk (api._ws_backward_persistent): the
    # bits' kernels, compiled for the first mask_mod, serve later ones of either walk, so the worker compiles both
    bm = _block_mask("causal")
    bits = first_calls.bits_mask(bm, 1, 2, gathers=False)
    monkeypatch.setattr(api, "_mean_walk", lambda *args: (100.0, 100.0))  # (a short walk: the persistent grid)
    assert api._ws_backward_grids(bits, 200, 200) == (True,)  # a call that runs
    assert api._ws_backward_grids(bm, 200, 200) == (True,)
    with launch.compile_only():
        assert api._ws_backward_grids(bits, 200, 200) == (False, True)  # the worker compiling the bits
        assert api._ws_backward_grids(bm, 200, 200) == (True,)  # a mod's own: its walk's
        monkeypatch.setattr(launch, "WS_BWD_PERSISTENT", False)  # set: the one grid
        assert api._ws_backward_grids(bits, 200, 200) == (False,)


def _compiles_in_the_calls(monkeypatch) -> list:
    """The names of the kernels Triton compiles from now on in any thread but the first_calls worker's."""
    compiled, real = [], JITFunction._do_compile

    def spy(self, *args, **kwargs):
        if not threading.current_thread().name.startswith("flexlite-compile"):
            compiled.append(self.fn.__name__)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(JITFunction, "_do_compile", spy)
    return compiled


@pytest.mark.skipif(not (DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the warp-specialized backward runs on Hopper GPUs")
def test_a_second_mask_mods_first_backward_compiles_nothing_whatever_its_walk(fresh, monkeypatch):
    # causal walks long (the backward's grid: a program per key block), the window short (persistent); the window's
    # first forward and backward, right after each other, run the bits' kernels and compile nothing in the call
    monkeypatch.setattr(launch, "WS_BWD_PERSISTENT_MAX_WALK", 256)  # kv blocks walk 320 queries (causal), 224 (window)
    compiled = _compiles_in_the_calls(monkeypatch)
    from test_backward import check_backward

    L = 512
    q, k, v = rand_qkv(1, 2, 2, L, L, 64, dtype=torch.bfloat16, seed=10)
    for mod in (causal_mask, generate_sliding_window(100)):
        bm = create_block_mask(mod, None, None, L, L, device=DEVICE)
        assert api._ws_backward_persistent(bm, L, L) == (mod is not causal_mask)
        bits_calls, compiled[:] = first_calls.ran_bits(), []
        check_backward(q, k, v, block_mask=bm, name="first calls")  # (the forward, then the backward at once)
        if mod is not causal_mask:
            assert first_calls.ran_bits() == bits_calls + 2 and compiled == []
        first_calls.wait()


def test_where_the_walk_picks_the_forward_the_other_forwards_bits_compile_too(fresh, monkeypatch):
    # lengths not multiples of 128 at D128 on Hopper: the Gluon forward on long walks, the Triton one on short; the
    # first mask_mod's bits are compiled for its walk's forward and the other's, whichever a later mask_mod's walk
    # takes (on CPU: the forward's choice made to go by the walk, every walk short; what the worker is asked for)
    monkeypatch.setattr(api, "_warp_specialize_fixed", lambda *args: args[-1].get("WARP_SPECIALIZE"))
    monkeypatch.setattr(api, "WS_MIN_WALK_KEYS", 10 ** 9)
    jobs, real = [], first_calls.compile_beside
    monkeypatch.setattr(first_calls, "compile_beside",
                        lambda key, *args, **kw: jobs.append(key) or real(key, *args, **kw))
    q, k, v = rand_qkv(1, 2, 2, 200, 200, 32, seed=12)
    flex_attention(q, k, v, block_mask=create_block_mask(causal_mask, None, None, 200, 200, device=DEVICE))
    first_calls.wait()
    forwards = [key for key in jobs if key[0] == "fwd"]
    assert len(forwards) == 2 and forwards[0][2] == forwards[1][2]  # the bits' two forwards, one kind of input
    assert ["warp_specialize" in key[1][0] for key in forwards] == [False, True]
    assert forwards[0] in first_calls._ready  # (the Gluon forward cannot compile for the interpreter)
    monkeypatch.setattr(api, "_warp_specialize_fixed", lambda *args: False)  # no choice by the walk: no other
    jobs.clear()
    flex_attention(q, k, v, block_mask=create_block_mask(generate_sliding_window(9), None, None, 200, 200,
                                                         device=DEVICE))
    first_calls.wait()
    forwards_now = [key for key in jobs if key[0] == "fwd"]  # (on CUDA the block mask's kernel is a job too)
    assert len(forwards_now) == 1 and forwards_now[0] not in forwards  # its own only: the bits' ran its first call


@pytest.mark.skipif(not (DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the warp-specialized forward runs on Hopper GPUs")
def test_a_second_mask_mods_first_forward_compiles_nothing_whichever_forward_its_walk_takes(fresh, monkeypatch):
    # at L 200 (not a multiple of 128: descriptors per program) the walk picks the forward: causal's q blocks walk
    # 192 keys on average, a prefix of 64 keys' 128; with the line at 150 causal takes the Gluon forward, the prefix
    # the Triton one, and its first call runs the bits' Triton forward, compiled beside causal's
    monkeypatch.setattr(api, "WS_MIN_WALK_KEYS", 150)
    compiled = _compiles_in_the_calls(monkeypatch)
    L = 200
    q, k, v = rand_qkv(1, 2, 2, L, L, 128, dtype=torch.bfloat16, seed=13)

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < 64
    for mod in (causal_mask, prefix):
        bm = create_block_mask(mod, None, None, L, L, device=DEVICE)
        num, _, _, _, sparse = api._block_tensors(bm, L, L, q.device)
        assert api._warp_specialize(q, k, v, bm, num, sparse, {}) == (mod is causal_mask)
        first_calls.wait()
        bits_calls, compiled[:] = first_calls.ran_bits(), []
        out = flex_attention(q, k, v, block_mask=bm)  # (outputs poisoned: conftest)
        assert_close(out, attention_reference(q, k, v, block_mask=bm)[0], *TOLERANCES[torch.bfloat16],
                     name=mod.__name__)
        if mod is prefix:
            assert first_calls.ran_bits() == bits_calls + 1 and compiled == []
        first_calls.wait()


def test_a_new_mask_mods_block_mask_is_evaluated_in_torch_while_its_kernel_compiles(fresh, monkeypatch):
    # (create_block_mask asks this on CUDA only; the decision and the worker's compile-only job, on any device)
    compiles = []

    def compile_():
        compiles.append(launch.compiling_only())
    key = first_calls.block_mask_key("source", 1, 200, 256, torch.device(DEVICE), (128, 128))
    assert first_calls.block_flags_in_torch(key, compile_, 200 * 256)  # new: in torch, the kernel compiled beside
    first_calls.wait()
    assert compiles == [True] and first_calls.ready(key)
    assert not first_calls.block_flags_in_torch(key, compile_, 200 * 256)  # known: the kernel
    # what Triton compiles the kernel for: the lengths as whole blocks or not, 1, multiples of 16 or neither
    assert len({first_calls.block_mask_key("source", h, q, 256, torch.device(DEVICE), (128, 128))
                for h, q in ((1, 200), (2, 200), (16, 200), (1, 256), (1, 208))}) == 5
    other = first_calls.block_mask_key("another source", 1, 200, 256, torch.device(DEVICE), (128, 128))
    too_many = first_calls.MAX_TORCH_POSITIONS + 1
    assert not first_calls.block_flags_in_torch(other, compile_, too_many)  # too large for torch: the kernel
    monkeypatch.setattr(first_calls, "ENABLED", False)
    assert not first_calls.block_flags_in_torch(other, compile_, 200 * 256)
    monkeypatch.setattr(first_calls, "ENABLED", "always")
    first_calls.block_flags_in_torch(other, lambda: 1 / 0, 200 * 256)
    first_calls.wait()
    assert not first_calls.block_flags_in_torch(other, compile_, 200 * 256)  # its compile failed: the call's
    assert compiles == [True]


@pytest.mark.skipif(DEVICE != "cuda", reason="create_block_mask runs a kernel on CUDA only")
def test_a_new_mask_mods_create_block_mask_compiles_nothing_in_the_call(fresh, monkeypatch):
    compiled = _compiles_in_the_calls(monkeypatch)
    import flexlite.block_mask as bm_module

    in_torch, real_vmap = [], bm_module._block_flags_vmap
    monkeypatch.setattr(bm_module, "_block_flags_vmap", lambda *a: in_torch.append(1) or real_vmap(*a))
    offset = torch.tensor(7, device=DEVICE)

    def new_mask(b, h, q_idx, kv_idx):  # a mask_mod no test has compiled: its kernel compiles in the worker
        return ((q_idx + offset) % 11 <= kv_idx % 13) | (q_idx >= kv_idx + 300)
    for B, H, Lq, Lkv, block in ((1, 1, 1000, 777, 128), (2, 3, 256, 256, (32, 64))):
        first = create_block_mask(new_mask, B, H, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block)
        assert compiled == [] and len(in_torch) == 1
        first_calls.wait()
        later = create_block_mask(new_mask, B, H, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block)  # the kernel
        assert len(in_torch) == 1
        for a, b in zip(first.as_tuple(), later.as_tuple()):  # torch's evaluation, the kernel's: the same blocks
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        in_torch.clear()
    # where torch's evaluation fails, the kernel decides (what it returns or raises), as without first_calls
    monkeypatch.setattr(bm_module, "_block_flags_vmap", lambda *a: 1 / 0)
    fallback = create_block_mask(new_mask, 1, 1, 300, 300, device=DEVICE)
    first_calls.wait()
    any_, all_ = real_vmap(new_mask, 1, 1, 300, 300, torch.device(DEVICE), (128, 128))
    want = bm_module.BlockMask._from_block_flags(any_ & ~all_, all_, (300, 300), (128, 128), new_mask)
    for a, b in zip(fallback.as_tuple(), want.as_tuple()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("with_mask", [False, True], ids=["no block mask", "a block mask without mask_mod"])
def test_a_new_score_mods_backward_compiles_beside_its_first_forward(fresh, monkeypatch, with_mask):
    # no mask_mod, so no bits; but a first forward whose inputs require grad asks the worker for its backward's
    # kernels before it compiles its own, and the first backward takes them
    from test_backward import check_backward

    jobs, real = [], first_calls.compile_beside
    monkeypatch.setattr(first_calls, "compile_beside",
                        lambda key, *args, **kw: jobs.append(key) or real(key, *args, **kw))
    L = 96
    bm = None
    if with_mask:
        bm = create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=32)
        bm.mask_mod = None
        first_calls.wait()
        jobs.clear()  # on CUDA the new mask_mod's block-mask kernel compiled in the worker (NOTES 74): not this test's

    def bias(score, b, h, q_idx, kv_idx):
        return score - 0.05 * (q_idx - kv_idx).abs()
    q, k, v = rand_qkv(1, 2, 2, L, L, 32, seed=11)
    bits_calls = first_calls.ran_bits()
    check_backward(q, k, v, score_mod=bias, block_mask=bm, name="first calls of a new score_mod")
    first_calls.wait()
    assert [job[0] for job in jobs] == ["bwd"] and jobs[0] in first_calls._ready
    assert {key[0] for key in _attention_keys()} == {"fwd", "bwd"} and len(_attention_keys()) == 2
    assert first_calls.ran_bits() == bits_calls and not first_calls._failed
    check_backward(q, k, v, score_mod=bias, block_mask=bm, name="later calls")  # known: nothing asked of the worker
    assert len(jobs) == 1 and len(_attention_keys()) == 2


@pytest.mark.parametrize("with_mask", [False, True], ids=["no block mask", "causal"])
def test_a_first_forward_whose_backward_cannot_be_generated_runs(fresh, monkeypatch, with_mask):
    # the backward beside the forward is generated in the forward's thread: a mod without a derivative rule must not
    # fail the forward (its backward raises when it is called, as without first_calls)
    from flexlite.codegen import grad
    from flexlite.codegen.trace import UntraceableModError

    monkeypatch.delitem(grad.RULES, "erf")

    def erf_mod(score, b, h, q_idx, kv_idx):
        return torch.erf(score)
    L = 64
    bm = create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=32) if with_mask else None
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 1, 1, L, L, 16, seed=12))
    out = flex_attention(q, k, v, score_mod=erf_mod, block_mask=bm)
    assert_close(out, attention_reference(q, k, v, score_mod=erf_mod, block_mask=bm)[0], *TOLERANCES[torch.float32])
    with pytest.raises(UntraceableModError, match="backward pass is not supported for `erf`"):
        out.sum().backward()


@pytest.fixture
def held_worker(monkeypatch):
    """The first_calls worker holds every compile back until the test sets the event returned (or the test ends)."""
    release, real = threading.Event(), first_calls._compile

    def held(*args):
        release.wait(120)
        real(*args)
    monkeypatch.setattr(first_calls, "_compile", held)
    yield release
    release.set()


def _softcap(score, b, h, q_idx, kv_idx):
    return 15.0 * torch.tanh(score / 15.0)


def _launches(monkeypatch) -> list:
    """The kernels launched by the calling thread (forwards, backwards), not the worker's compile-only calls."""
    seen = []
    for name in ("_run_forward", "launch_backward"):
        real = getattr(api, name)

        def spy(*args, real=real, name=name, **kwargs):
            if not threading.current_thread().name.startswith("flexlite-compile"):
                seen.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(api, name, spy)
    return seen


@pytest.mark.parametrize("with_mask", [False, True], ids=["a new score_mod without a block mask",
                                                          "the first mask_mod of a kind"])
def test_first_calls_run_in_torch_ops_while_their_kernels_compile(fresh, held_worker, monkeypatch, with_mask):
    from test_backward import check_backward

    monkeypatch.setattr(first_calls, "EAGER", True)
    launches = _launches(monkeypatch)
    L = 96
    bm = create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=32) if with_mask else None
    q, k, v = rand_qkv(1, 4, 2, L, L, 32, seed=13)
    lse_weight = torch.randn(1, 4, L, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    eager_calls = first_calls.ran_eager()
    # the first training steps: forward and backward in torch ops while the worker (held) has the kernels queued
    first = check_backward(q, k, v, score_mod=_softcap, block_mask=bm, enable_gqa=True, lse_weight=lse_weight,
                           name="first step")
    check_backward(q, k, v, score_mod=_softcap, block_mask=bm, enable_gqa=True, name="second step")
    assert launches == [] and first_calls.ran_eager() == eager_calls + 4
    assert {key[0] for key in first_calls._pending} - {"mask"} == {"fwd", "bwd"}  # (CUDA: the block mask's, NOTES 74)
    held_worker.set()
    first_calls.wait()
    # compiled: later calls launch them; their results are the kernels' (within tolerance of the torch ops')
    later = check_backward(q, k, v, score_mod=_softcap, block_mask=bm, enable_gqa=True, lse_weight=lse_weight,
                           name="later step")
    assert launches == ["_run_forward", "launch_backward"] and first_calls.ran_eager() == eager_calls + 4
    for a, b in zip(first, later):
        assert_close(a, b, *TOLERANCES[torch.float32])
    assert not first_calls._failed
    if with_mask:  # the worker compiled the bits' kernels too: the next mask_mod's first call runs them
        bits_calls = first_calls.ran_bits()
        window = create_block_mask(generate_sliding_window(20), None, None, L, L, device=DEVICE, BLOCK_SIZE=32)
        flex_attention(q, k, v, score_mod=_softcap, block_mask=window, enable_gqa=True)
        assert first_calls.ran_bits() == bits_calls + 1 and first_calls.ran_eager() == eager_calls + 4


def test_first_calls_whose_torch_ops_raise_run_their_kernels(fresh, monkeypatch):
    from flexlite import eager

    monkeypatch.setattr(first_calls, "EAGER", True)
    monkeypatch.setattr(eager, "forward", lambda *args: 1 / 0)
    launches = _launches(monkeypatch)
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16, seed=14)
    eager_calls = first_calls.ran_eager()
    out = flex_attention(q, k, v, score_mod=_softcap)
    assert launches == ["_run_forward"] and first_calls.ran_eager() == eager_calls
    assert_close(out, attention_reference(q, k, v, score_mod=_softcap)[0], *TOLERANCES[torch.float32])


@pytest.mark.parametrize("why", ["EAGER off", "too large for a chunk", "too many scores", "kernel_options",
                                 "deterministic algorithms"])
def test_where_first_calls_do_not_run_in_torch_ops(fresh, monkeypatch, why):
    from flexlite import eager

    monkeypatch.setattr(first_calls, "EAGER", why != "EAGER off")
    if why == "deterministic algorithms":  # (every call the kernels' results, to the bit)
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    if why == "too large for a chunk":
        monkeypatch.setattr(eager, "CHUNK_SCORES", 2 * 64 - 1)  # a query row of 2 heads x 64 keys is 128 scores
    if why == "too many scores":  # (eager.TooLarge: the call waits for the kernels the worker compiles)
        monkeypatch.setattr(eager, "MAX_SCORES", 2 * 64 * 64 - 1)
    launches = _launches(monkeypatch)
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16, seed=15)
    eager_calls = first_calls.ran_eager()
    options = {"BLOCK_M": 32, "BLOCK_N": 32} if why == "kernel_options" else None
    out = flex_attention(q, k, v, score_mod=_softcap, kernel_options=options)
    assert launches == ["_run_forward"] and first_calls.ran_eager() == eager_calls
    assert_close(out, attention_reference(q, k, v, score_mod=_softcap)[0], *TOLERANCES[torch.float32])


def test_the_harness_checks_the_kernels_not_a_first_calls_torch_ops(fresh, monkeypatch):
    from flexlite import bench

    monkeypatch.setattr(first_calls, "EAGER", True)
    eager_calls = first_calls.ran_eager()
    errors = bench.check_against_reference(bench.mask_cases(128, 2, DEVICE)["softcap30_causal"], 16, DEVICE,
                                           torch.float32, backward=True, S=128)
    assert first_calls.ran_eager() == eager_calls and first_calls.EAGER is True
    assert max(errors.values()) < 1e-4 and set(errors) == {"max_err_vs_fp64", "max_dq_err_vs_fp64",
                                                           "max_dk_err_vs_fp64", "max_dv_err_vs_fp64"}


def test_a_first_backward_into_captured_tensors_runs_in_torch_ops(fresh, held_worker, monkeypatch):
    # a learnable bias table and slopes: the first step's gradients reach them from the torch ops, the later steps'
    # from the kernels that add them up (compiled meanwhile)
    from test_backward import check_backward

    monkeypatch.setattr(first_calls, "EAGER", True)
    launches = _launches(monkeypatch)
    L = 64
    g = torch.Generator().manual_seed(4)
    table = torch.randn(2, L, L, generator=g).to(DEVICE).requires_grad_()
    slopes = torch.tensor([0.5, -0.25], device=DEVICE, requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score * slopes[h] + table[h, q_idx, kv_idx]
    bm = create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=32)
    q, k, v = rand_qkv(1, 2, 2, L, L, 16, seed=16)
    eager_calls = first_calls.ran_eager()
    first = check_backward(q, k, v, score_mod=learned, block_mask=bm, captured=(table, slopes), name="first step")
    assert launches == [] and first_calls.ran_eager() == eager_calls + 2
    held_worker.set()
    first_calls.wait()
    later = check_backward(q, k, v, score_mod=learned, block_mask=bm, captured=(table, slopes), name="later step")
    assert launches == ["_run_forward", "launch_backward"] and first_calls.ran_eager() == eager_calls + 2
    for a, b in zip(first, later):
        assert_close(a, b, *TOLERANCES[torch.float32])


@pytest.mark.parametrize("eager", [False, True], ids=["bits", "torch ops"])
def test_a_first_backward_runs_the_forwards_mask_mod(fresh, monkeypatch, eager):
    """A new mask_mod's first backward (its partial blocks' bits, or torch ops while its kernels compile) evaluates
    the forward's trace of the mask_mod, not the block mask's mask_mod as it is at the backward: one reassigned in
    between keeps the forward's gradients."""
    monkeypatch.setattr(first_calls, "EAGER", eager)
    if eager:  # (no bits, which a call prefers where their kernels are compiled)
        monkeypatch.setattr(first_calls, "bits_mask", lambda *args: None)
    ids = torch.arange(96, device=DEVICE) // 30

    def documents(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    bm = create_block_mask(documents, None, None, 96, 96, device=DEVICE, BLOCK_SIZE=16)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 96, 96, 16, seed=21))
    if not eager:  # a first mask_mod at this shape: its own kernels, and the worker compiles the bits' (NOTES 72)
        flex_attention(q, k, v, block_mask=create_block_mask(causal_mask, None, None, 96, 96, device=DEVICE,
                                                             BLOCK_SIZE=16)).sum().backward()
        first_calls.wait()
    known = set(first_calls._ready)
    made, make = [], first_calls._make_bits_mask
    monkeypatch.setattr(first_calls, "_make_bits_mask", lambda *args: made.append(1) or make(*args))
    ref = attention_reference(q, k, v, block_mask=bm)[0]
    out = flex_attention(q, k, v, block_mask=bm)
    first_calls.wait()  # (its own backward, which the worker compiled beside it, taken back: one still to compile)
    first_calls._ready.difference_update({key for key in first_calls._ready - known if key[0] == "bwd"})
    bm.mask_mod = causal_mask
    calls = first_calls.ran_bits(), first_calls.ran_eager()
    grad = torch.randn_like(out)
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad),
                          torch.autograd.grad(ref, (q, k, v), grad)):
        assert_close(g, w, *TOLERANCES[torch.float32], name=name)
    assert (first_calls.ran_bits(), first_calls.ran_eager()) == ((calls[0], calls[1] + 1) if eager else
                                                                 (calls[0] + 1, calls[1]))
    assert len(made) == (0 if eager else 1)  # (the backward's bits are the forward's, made once)
