"""The warp-specialized forward (fwd_ws.py.jinja) and dK / dV kernel (bwd_ws.py.jinja): Triton's Gluon dialect,
Hopper only.

Everywhere: its options and requirements give typed errors that say what to change, and flex_attention takes it
only where it can run. Its CUDA source compiles for sm_90a without a GPU in tests/test_gpu_compile.py. On a GPU
(``FLEXLITE_TEST_DEVICE=cuda`` on a Hopper), forced with ``kernel_options={"WARP_SPECIALIZE": True}``, every
catalog mod at even, ragged, cross-length and GQA shapes, non-contiguous inputs and a backward through it are
checked against the fp64 reference; those tests are defined only where a Hopper GPU is present (the interpreter
cannot run Gluon), and the rest of the GPU suite runs through it wherever flex_attention picks it. The dK / dV
kernel likewise: its requirements and when the backward takes it everywhere, and on a Hopper GPU the catalog's
gradients through it with every output poisoned (NaN) before the run."""

import types

import pytest
import torch

from catalog import CATALOG, USES_BH
from flexlite import attention_reference, create_block_mask, first_calls, flex_attention, kernel_source
from flexlite.runtime import launch
from helpers import DEVICE, TOLERANCES, assert_close, assert_grad_close, drop_plans, rand_qkv

ON_HOPPER = DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_warp_specialize_option_is_a_bool():
    q, k, v = rand_qkv(1, 1, 1, 16, 16, 16)
    with pytest.raises(TypeError, match="WARP_SPECIALIZE must be a bool"):
        flex_attention(q, k, v, kernel_options={"WARP_SPECIALIZE": 1})


@pytest.mark.parametrize("other", [{"BLOCK_M": 64}, {"AUTOTUNE": True}, {"DECODE": True}], ids=str)
def test_warp_specialize_conflicts_with_tile_choices(other):
    q, k, v = rand_qkv(1, 1, 1, 16, 16, 16)
    with pytest.raises(ValueError, match="WARP_SPECIALIZE=True .* cannot be combined"):
        flex_attention(q, k, v, kernel_options={"WARP_SPECIALIZE": True, **other})


def test_forcing_it_where_it_cannot_run_says_what_is_missing():
    if ON_HOPPER:  # fp32 is what the kernel lacks there
        q, k, v = rand_qkv(1, 1, 1, 128, 128, 64, dtype=torch.float32)
        match = "WARP_SPECIALIZE=True needs bfloat16 or float16"
    else:
        q, k, v = rand_qkv(1, 1, 1, 128, 128, 64, dtype=torch.bfloat16)
        match = "WARP_SPECIALIZE=True needs a Hopper GPU"
    with pytest.raises(NotImplementedError, match=match):
        flex_attention(q, k, v, kernel_options={"WARP_SPECIALIZE": True})


def _spec(shape, dtype=torch.bfloat16, stride=None):
    """A stand-in CUDA tensor for ws_forward_unmet (which reads shape, dtype, strides and the address)."""
    stride = stride or torch.empty(shape, device="meta").stride()
    contiguous = tuple(stride) == torch.empty(shape, device="meta").stride()
    return types.SimpleNamespace(shape=shape, dtype=dtype, is_cuda=True, device=torch.device("cuda", 0),
                                 stride=lambda *i: stride[i[0]] if i else stride, data_ptr=lambda: 1 << 20,
                                 element_size=lambda: 2 if dtype != torch.float32 else 4,
                                 is_contiguous=lambda: contiguous)


@pytest.mark.parametrize("q, k, v, sparse, reason", [
    (_spec((1, 2, 256, 128)), _spec((1, 2, 256, 128)), _spec((1, 2, 256, 128)), (128, 128), None),
    (_spec((1, 4, 200, 64)), _spec((1, 2, 333, 64)), _spec((1, 2, 333, 64)), (256, 128), None),
    (_spec((1, 2, 256, 128), torch.float32), _spec((1, 2, 256, 128), torch.float32),
     _spec((1, 2, 256, 128), torch.float32), (128, 128), "bfloat16 or float16"),
    (_spec((1, 2, 256, 96)), _spec((1, 2, 256, 96)), _spec((1, 2, 256, 96)), (128, 128), "head dims"),
    (_spec((1, 2, 256, 128)), _spec((1, 2, 256, 128)), _spec((1, 2, 256, 64)), (128, 128), "head dims"),
    (_spec((1, 2, 256, 64)), _spec((1, 2, 256, 64)), _spec((1, 2, 256, 64)), (64, 128), "BLOCK_SIZE"),
    (_spec((1, 2, 256, 64)), _spec((1, 2, 256, 64)), _spec((1, 2, 256, 64)), (128, 64), "BLOCK_SIZE"),
    (_spec((1, 2, 256, 64), stride=(32768, 16384, 64, 2)), _spec((1, 2, 256, 64)), _spec((1, 2, 256, 64)),
     (128, 128), "unit last stride"),
], ids=["even", "gqa-ragged", "fp32", "D96", "Dv-differs", "q-block-64", "kv-block-64", "strided-head-dim"])
def test_requirements(monkeypatch, q, k, v, sparse, reason):
    monkeypatch.setattr(launch, "_device_facts", lambda device: (132, 9))
    monkeypatch.setattr(launch, "_gluon_available", lambda: True)
    unmet = launch.ws_forward_unmet(q, k, v, sparse)
    assert unmet is None if reason is None else reason in unmet
    monkeypatch.setattr(launch, "_device_facts", lambda device: (108, 8))  # an A100: not Hopper
    assert "Hopper" in launch.ws_forward_unmet(q, k, v, sparse)


def test_gluon_is_looked_for_name_by_name(monkeypatch):
    """A Triton without the Gluon names the kernel uses (older, or renamed in a newer one) means the Triton forward."""
    assert launch._gluon_available.__wrapped__()  # Triton 3.6, as pinned
    monkeypatch.setattr(launch, "_GLUON_NEEDS", launch._GLUON_NEEDS + (("triton.experimental.gluon", ("gone",)),))
    assert not launch._gluon_available.__wrapped__()
    monkeypatch.setattr(launch, "_GLUON_NEEDS", (("triton.experimental.no_such_module", ("jit",)),))
    assert not launch._gluon_available.__wrapped__()


@pytest.mark.parametrize("Lq, Lkv, sparse, contiguous, host", [
    (256, 384, (128, 128), True, True),
    (256, 384, (128, 256), True, False),  # the walk's last block would reach into the next head's keys
    (200, 384, (128, 128), True, False),  # the last program's rows would
    (256, 320, (128, 128), True, False),  # the last key tile would
    (256, 384, (128, 128), False, False),  # not one [Z * H * LEN, D] view
])
def test_descriptors_are_made_on_the_host_only_where_no_tile_leaves_its_head(Lq, Lkv, sparse, contiguous, host):
    stride = None if contiguous else (384 * 2 * 128, 128, 2 * 128, 1)  # [Z, L, H, D] storage
    q = _spec((1, 2, Lq, 128))
    k = _spec((1, 2, Lkv, 128), stride=stride)
    assert launch.ws_host_descriptors(q, k, k, sparse) == host


def test_flex_attention_picks_it_only_where_it_can_run_measured_faster_and_was_not_told_otherwise(monkeypatch):
    import flexlite.api as api

    monkeypatch.setattr(launch, "_device_facts", lambda device: (132, 9))
    monkeypatch.setattr(api, "ws_forward_unmet", lambda q, k, v, sparse: None if q.shape[-1] % 64 == 0 else "x")
    num = torch.zeros(1, 1, 2, dtype=torch.int32)

    def pick(Lq=4096, Lkv=4096, D=128, block_mask=None, **options):
        q, kv = _spec((1, 2, Lq, D)), _spec((1, 2, Lkv, D))
        return api._warp_specialize(q, kv, kv, block_mask, num, (128, 128), options)
    assert pick()
    assert not pick(D=96)  # the requirements are not met
    # D64: with descriptors made on the host (measured faster there since NOTES 57), not with per-program ones
    assert pick(D=64) and not pick(D=64, Lkv=launch.WS_MIN_WALK_KEYS + 100)
    assert pick(D=64, Lkv=launch.WS_MIN_WALK_KEYS + 100, WARP_SPECIALIZE=True)
    assert not pick(WARP_SPECIALIZE=False) and not pick(BLOCK_M=64) and not pick(AUTOTUNE=True)
    assert not pick(Lq=16) and pick(Lq=16, DECODE=False)  # few queries: the decode kernel, unless DECODE=False
    assert pick(Lq=16, WARP_SPECIALIZE=True)
    # descriptors made on the host (contiguous, lengths multiples of 128): any walk; else only long walks, which
    # amortize the per-program set-up
    assert pick(Lkv=1024) and not pick(Lkv=1000) and pick(Lkv=launch.WS_MIN_WALK_KEYS + 100)
    L = 8000
    causal = create_block_mask(CATALOG["causal"](1, 1, L, L, DEVICE).mask_mod, None, None, L, L, device=DEVICE)
    window = create_block_mask(CATALOG["sliding_window"](1, 1, L, L, DEVICE, window=1000).mask_mod, None, None, L,
                               L, device=DEVICE)
    assert pick(Lq=L, Lkv=L, block_mask=causal) and not pick(Lq=L, Lkv=L, block_mask=window)
    assert pick(Lq=8192, Lkv=8192, block_mask=window)  # with host descriptors
    with pytest.raises(NotImplementedError, match="needs x"):
        pick(D=96, WARP_SPECIALIZE=True)


def test_mean_walk_is_counted_once_per_block_mask_and_again_when_its_counts_change():
    from flexlite.api import _mean_walk

    assert _mean_walk(None, 222, 333) == (333.0, 222.0)
    bm = create_block_mask(CATALOG["causal"](1, 1, 512, 512, DEVICE).mask_mod, None, None, 512, 512, device=DEVICE)
    walk = (1 + 2 + 3 + 4) / 4 * 128  # partial (diagonal) and full blocks, along either side
    assert _mean_walk(bm, 512, 512) == (walk, walk)
    kept = bm._block_count
    bm._block_count = (kept[0], 4)  # a second call reads the kept count, it does not count again
    assert _mean_walk(bm, 512, 512) == (128.0, 128.0)
    bm.full_kv_num_blocks.zero_()  # modified in place: counted again
    assert _mean_walk(bm, 512, 512) == (128.0, 128.0) and bm._block_count[1] == 4
    # 2 q blocks of 64 over 4 kv blocks of 128, all partial: 4 keys blocks per q block, 2 q blocks per kv block
    wide = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, 2, 3, 128, 512, device=DEVICE,
                             BLOCK_SIZE=(64, 128))
    assert _mean_walk(wide, 128, 512) == (512.0, 128.0)


def test_a_forward_that_will_have_a_backward_starts_counting_its_block_mask():
    """The backward's grid policy reads the block mask's walk: the forward starts the count (on a GPU without
    waiting for it: a pinned copy behind an event), and the backward's read finds it; an inference call counts
    nothing."""
    import flexlite.api as api

    def causal_mask():
        return create_block_mask(CATALOG["causal"](1, 1, 256, 256, DEVICE).mask_mod, None, None, 256, 256,
                                 device=DEVICE)
    q, k, v = rand_qkv(1, 1, 1, 256, 256, 16)
    unused = causal_mask()
    flex_attention(q, k, v, block_mask=unused)
    assert getattr(unused, "_block_count", None) is None
    bm = causal_mask()
    flex_attention(q.requires_grad_(), k, v, block_mask=bm)
    assert isinstance(bm._block_count[1], api._PendingCount)
    assert api._mean_walk(bm, 256, 256) == (192.0, 192.0)  # (1 + 2) blocks over 2 rows of 128
    assert bm._block_count[1] == 3


@pytest.mark.parametrize("setting", [None, True, False])
def test_the_backward_takes_its_persistent_grid_on_short_walks(monkeypatch, setting):
    """launch.WS_BWD_PERSISTENT: forced on or off, or (None) where kv blocks walk at most
    launch.WS_BWD_PERSISTENT_MAX_WALK queries on average."""
    from flexlite.api import _ws_backward_persistent

    monkeypatch.setattr(launch, "WS_BWD_PERSISTENT", setting)
    L = 4 * launch.WS_BWD_PERSISTENT_MAX_WALK
    window = create_block_mask(CATALOG["sliding_window"](1, 1, L, L, DEVICE, window=1024).mask_mod, None, None, L, L,
                               device=DEVICE)
    causal = create_block_mask(CATALOG["causal"](1, 1, L, L, DEVICE).mask_mod, None, None, L, L, device=DEVICE)
    picks = [_ws_backward_persistent(bm, L, L) for bm in (window, causal, None)]
    assert picks == ([True, False, False] if setting is None else [setting] * 3)
    assert _ws_backward_persistent(None, launch.WS_BWD_PERSISTENT_MAX_WALK, L) == (setting is not False)


def test_a_walk_not_yet_counted_while_a_cuda_graph_is_captured_takes_the_default_kernels(monkeypatch):
    """Counting a block mask's walk reads it on the host, which a CUDA graph capture forbids: until it has been
    counted outside a capture, the forward keeps the Triton kernel where it needs the count, and the backward the
    grid of a program per key block."""
    import flexlite.api as api

    bm = create_block_mask(CATALOG["causal"](1, 1, 512, 512, DEVICE).mask_mod, None, None, 512, 512, device=DEVICE)
    monkeypatch.setattr(api, "_capturing", lambda t: True)
    assert api._mean_walk(bm, 512, 512) is None and not api._ws_backward_persistent(bm, 512, 512)
    assert api._mean_walk(None, 512, 512) == (512.0, 512.0)  # nothing to count
    monkeypatch.undo()
    assert api._mean_walk(bm, 512, 512) == (320.0, 320.0) and api._ws_backward_persistent(bm, 512, 512)
    monkeypatch.setattr(api, "_capturing", lambda t: True)  # counted: the count is kept, even in a capture
    assert api._mean_walk(bm, 512, 512) == (320.0, 320.0)


@pytest.mark.parametrize("failure", ["PassManager::run failed", "out of resource: shared memory"])
def test_a_compiler_failure_falls_back_to_the_triton_forward_for_good(monkeypatch, failure):
    """Triton 3.6's Gluon compiler fails on some mods (a score_mod gathering a whole tile from a captured tensor),
    and a GPU with less shared memory than an H100 would not fit the kernel: flex_attention then runs those mods
    through the Triton forward, and does not try them again; forced with WARP_SPECIALIZE=True it says so."""
    import flexlite.api as api
    from triton.runtime.errors import OutOfResources

    calls = []

    def failing_launch(*args, **kwargs):
        calls.append(1)
        raise RuntimeError(failure) if "PassManager" in failure else OutOfResources(232448 + 1, 232448, "shared memory")
    monkeypatch.setattr(api, "launch_forward_ws", failing_launch)
    monkeypatch.setattr(api, "ws_forward_unmet", lambda *args: None)
    monkeypatch.setattr(api, "_mean_walk", lambda *args: (float(launch.WS_MIN_WALK_KEYS),) * 2)
    monkeypatch.setattr(api, "WS_DEFAULT_HEAD_DIMS", {64})
    monkeypatch.setattr(api, "_WS_UNCOMPILABLE", set())
    case = CATALOG["captured_bias"](1, 2, 128, 128, DEVICE)
    q, k, v = rand_qkv(1, 2, 2, 128, 128, 64, dtype=torch.float16, seed=5)
    ref = attention_reference(q, k, v, score_mod=case.score_mod)[0]
    for _ in range(2):
        assert_close(flex_attention(q, k, v, score_mod=case.score_mod), ref, *TOLERANCES[torch.float16])
    assert len(calls) == 1
    with pytest.raises(NotImplementedError, match="cannot compile or fit .*(PassManager::run failed|shared memory)"):
        flex_attention(q, k, v, score_mod=CATALOG["alibi_causal"](1, 2, 128, 128, DEVICE).score_mod,
                       kernel_options={"WARP_SPECIALIZE": True})
    monkeypatch.setattr(api, "launch_forward_ws", lambda *args, **kwargs: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(ValueError, match="x"):  # anything but a compiler failure is the caller's to see
        flex_attention(q, k, v, kernel_options={"WARP_SPECIALIZE": True})


# ---------------------------------------------------------------------------------------------------------------
# the warp-specialized dK / dV kernel

@pytest.mark.parametrize("q, kv, sparse, reason", [
    (_spec((1, 2, 256, 128)), _spec((1, 2, 256, 128)), (128, 128), None),
    (_spec((2, 4, 384, 64)), _spec((2, 2, 256, 64)), (128, 256), None),
    (_spec((1, 2, 256, 64)), _spec((1, 2, 256, 64)), (64, 128), None),  # the forward's q block would be 128
    (_spec((1, 2, 256, 128), torch.float32), _spec((1, 2, 256, 128), torch.float32), (128, 128),
     "bfloat16 or float16"),
    (_spec((1, 2, 256, 96)), _spec((1, 2, 256, 96)), (128, 128), "head dims"),
    (_spec((1, 2, 256, 64)), _spec((1, 2, 256, 64)), (32, 128), "BLOCK_SIZE"),
    (_spec((1, 2, 256, 64)), _spec((1, 2, 256, 64)), (128, 64), "BLOCK_SIZE"),
    (_spec((1, 2, 200, 64)), _spec((1, 2, 256, 64)), (128, 128), "query length that is a multiple"),
    (_spec((1, 2, 256, 64)), _spec((1, 2, 320, 64)), (128, 128), "key length that is a multiple"),
    (_spec((1, 2, 256, 64)), _spec((1, 2, 256, 64), stride=(32768, 64, 128, 1)), (128, 128), "contiguous"),
], ids=["even", "gqa-kv-block-256", "q-block-64", "fp32", "D96", "q-block-32", "kv-block-64", "ragged-q", "ragged-kv",
        "non-contiguous"])
def test_backward_requirements(monkeypatch, q, kv, sparse, reason):
    monkeypatch.setattr(launch, "_device_facts", lambda device: (132, 9))
    monkeypatch.setattr(launch, "_gluon_available", lambda: True)
    unmet = launch.ws_backward_unmet(q, kv, kv, sparse)
    assert unmet is None if reason is None else reason in unmet
    monkeypatch.setattr(launch, "_device_facts", lambda device: (108, 8))
    assert "Hopper" in launch.ws_backward_unmet(q, kv, kv, sparse)


def test_the_backward_takes_it_where_it_can_run_and_was_measured_faster(monkeypatch):
    import flexlite.api as api

    monkeypatch.setattr(api, "ws_backward_unmet", lambda q, k, v, sparse: None if q.shape[-1] % 64 == 0 else "x")

    def pick(D=128, **options):
        q = _spec((1, 2, 256, D))
        return api._warp_specialize_backward(q, q, q, (128, 128), options)
    assert pick() and pick(D=64)  # measured faster at both, mods that gather (document ids, ALiBi slopes) included
    assert not pick(D=192) and pick(D=192, WARP_SPECIALIZE=True)  # runs (here), not measured: only when asked
    assert not pick(D=96) and not pick(D=96, WARP_SPECIALIZE=True)  # cannot run: the Triton dK / dV kernel
    assert not pick(WARP_SPECIALIZE=False) and not pick(AUTOTUNE=True) and not pick(BLOCK_M1=32)


def test_a_backward_compiler_failure_falls_back_to_the_triton_kernel_for_good(monkeypatch):
    """As the forward's: a mod the Gluon compiler rejects runs the Triton dK / dV kernel from then on."""
    import flexlite.api as api
    from test_backward import check_backward

    calls = []
    launch_backward, load_module = api.launch_backward, api.load_module

    def failing(*args, ws_module=None, **kwargs):
        if ws_module is not None:
            calls.append(1)
            raise RuntimeError("PassManager::run failed")
        return launch_backward(*args, **kwargs)
    monkeypatch.setattr(api, "launch_backward", failing)
    monkeypatch.setattr(api, "_warp_specialize_backward", lambda *args, **kwargs: True)
    # the interpreter cannot import a Gluon kernel: the launch above fails before it would run
    monkeypatch.setattr(api, "load_module", lambda source, interpret: types.SimpleNamespace()
                        if "flex_bwd_ws_dkdv_kernel" in source else load_module(source, interpret))
    monkeypatch.setattr(api, "_WS_UNCOMPILABLE", set())
    monkeypatch.setattr(first_calls, "ENABLED", False)  # (this call's own launches, not the worker's beside it)
    q, k, v = rand_qkv(1, 2, 2, 128, 128, 64, dtype=torch.float16, seed=3)
    for _ in range(2):
        check_backward(q, k, v, name="fallback")
    assert len(calls) == 1


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_the_gluon_launch_gets_a_zeroed_fp32_dq_buffer_unless_sums_must_be_reproducible(monkeypatch, deterministic):
    """launch_backward's side of the fused dQ (the kernel's is checked on a Hopper GPU): the Gluon launch (here a
    stand-in writing the fp64 reference's gradients) gets a zeroed fp32 buffer shaped as q, whose cast is dq, and the
    dQ kernel does not run; under torch.use_deterministic_algorithms(True) it gets none and the dQ kernel runs. The
    Triton kernels' tiles (backward_config) are made only where one of them runs."""
    import flexlite.api as api
    from test_backward import check_backward

    buffers, kernels, configs = [], [], []
    backward_config = api.backward_config
    monkeypatch.setattr(api, "backward_config", lambda *a, **kw: configs.append(1) or backward_config(*a, **kw))

    def gluon_launch(module, mod_args, grad_args, q, k, v, grad_out, lse, delta, dk, dv, *args, dq_acc=None,
                     persistent=False):
        buffers.append(dq_acc)
        if dq_acc is not None:
            assert dq_acc.dtype == torch.float32 and dq_acc.shape == q.shape and not dq_acc.any()
        inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():  # (the backward runs without)
            grads = torch.autograd.grad(attention_reference(*inputs)[0], inputs, grad_out.double())
        for buffer, grad in zip((dq_acc, dk, dv), grads):
            if buffer is not None:
                buffer.copy_(grad)

    run = launch.run_with_fallback
    monkeypatch.setattr(launch, "run_with_fallback",
                        lambda kernel, *args, **kwargs: kernels.append(kernel.fn.__name__) or run(kernel, *args, **kwargs))
    monkeypatch.setattr(launch, "_launch_dkdv_ws", gluon_launch)
    monkeypatch.setattr(api, "_warp_specialize_backward", lambda *args, **kwargs: True)
    load_module = api.load_module  # the interpreter cannot import a Gluon kernel: a stand-in module
    monkeypatch.setattr(api, "load_module", lambda source, interpret: types.SimpleNamespace()
                        if "flex_bwd_ws_dkdv_kernel" in source else load_module(source, interpret))
    monkeypatch.setattr(first_calls, "ENABLED", False)  # (this call's own launches, not the worker's beside it)
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 64, dtype=torch.float32, seed=6)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        check_backward(q, k, v, name=f"deterministic={deterministic}")
    finally:
        torch.use_deterministic_algorithms(was)
    assert len(buffers) == 1 and (buffers[0] is None) == deterministic
    assert ("flex_bwd_dq_kernel" in kernels) == deterministic and "flex_bwd_dkdv_kernel" not in kernels
    assert len(configs) == deterministic


def _recording_kernel():
    """A stand-in for a Gluon kernel (those run on a Hopper GPU only) and the list that ``kernel[grid](*args,
    **kwargs)`` appends (grid, args, kwargs) to."""
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))
    return Kernel(), launches


@pytest.mark.parametrize("persistent, programs", [(False, 12), (True, 5)], ids=["per key block", "persistent"])
def test_the_gluon_grid_is_a_program_per_key_block_or_one_per_sm(monkeypatch, persistent, programs):
    """The Gluon launch's grid (the kernel itself runs on a Hopper GPU): 12 key blocks (3 per (batch, kv head)) as
    12 programs, or with the persistent grid as many programs as SMs (here 5), each told how many items there are."""
    from flexlite.api import _q_block_tensors

    kernel, launches = _recording_kernel()

    monkeypatch.setattr(launch, "_device_facts", lambda device: (5, 9))
    q, k, v = rand_qkv(2, 4, 2, 384, 384, 64, dtype=torch.bfloat16, device="cpu")
    lse, delta = torch.zeros(2, 4, 384), torch.zeros(2, 4, 384)
    q_blocks, _, has_full = launch._block_args(*_q_block_tensors(None, 384, 384, torch.device("cpu")))
    launch._launch_dkdv_ws(types.SimpleNamespace(flex_bwd_ws_dkdv_kernel=kernel, LLVM_OPT_LEVELS={}), [], [], q, k,
                           v, q, lse, delta, torch.empty_like(k), torch.empty_like(v), q_blocks, (128, 128), 0.125,
                           False, has_full, True, persistent=persistent)
    (grid, args, kwargs), = launches
    assert grid == (programs,) and kwargs["PERSISTENT"] == persistent
    assert args[9 + len(q_blocks) + 6] == 12  # N_WORK: after 5 descriptors, lse, delta, dk, dv, the lists, 6 strides


@pytest.mark.parametrize("setting, shape, programs", [
    (True, (2, 4, 4, 384, 384, 64), 5), (False, (2, 4, 4, 384, 384, 64), 24), (True, (2, 4, 4, 200, 384, 64), 16)],
    ids=["persistent", "per q block", "persistent, ragged: per q block"])
def test_the_gluon_forward_grid_is_a_program_per_q_block_or_one_per_sm(monkeypatch, setting, shape, programs):
    """The Gluon forward's grid (the kernel itself runs on a Hopper GPU): 24 q blocks (3 per (batch, head)) as 24
    programs, or with the persistent grid (launch.WS_FWD_PERSISTENT) as many programs as SMs (here 5), each told how
    many items and q blocks per head there are; where the descriptors are made on the device (here a query length
    that is not a multiple of 128) a program per q block whatever the setting."""
    kernel, launches = _recording_kernel()

    monkeypatch.setattr(launch, "_device_facts", lambda device: (5, 9))
    monkeypatch.setattr(launch, "WS_FWD_PERSISTENT", setting)
    monkeypatch.setattr(launch, "_ensure_allocator", lambda: None)
    q, k, v = rand_qkv(*shape, dtype=torch.bfloat16, device="cpu")
    blocks = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, shape[3], shape[4],
                               device="cpu")
    from flexlite.api import _block_tensors
    num, idx, full_num, full_idx, sparse = _block_tensors(blocks, shape[3], shape[4], torch.device("cpu"))
    launch.launch_forward_ws(types.SimpleNamespace(flex_fwd_ws_kernel=kernel, LLVM_OPT_LEVELS={}), [], q, k, v, num,
                             idx, full_num, full_idx, sparse, 0.125, False)
    (grid, args, kwargs), = launches
    n_qblocks = -(-shape[3] // 128)
    assert grid == (programs,) and kwargs["PERSISTENT"] == (programs == 5)
    assert kwargs["HOST_DESC"] == (shape[3] % 128 == 0)
    # N_WORK and NQB: after q, k, v, out, 4 descriptors, lse, max_scores, 4 block lists and 18 strides
    assert args[10 + 4 + 18:10 + 4 + 18 + 2] == (2 * 4 * n_qblocks, n_qblocks) and not kwargs["STORE_MAX"]


def test_a_repeated_kind_of_gluon_forward_launches_what_the_first_chose(monkeypatch):
    """launch_forward_ws keeps its choice per kind of call (the module, the inputs' shapes, strides and dtype, the
    flags, which lists, the settings' generation, the SM count): a second call launches the same kernel with the same
    grid, its own tensors and the lists it is given, without asking the wide kernel's spills again; a changed setting
    chooses again."""
    from flexlite.api import _block_tensors
    from flexlite.block_mask import item_lists

    kernel, launches = _recording_kernel()
    monkeypatch.setattr(launch, "_device_facts", lambda device: (5, 9))
    monkeypatch.setattr(launch, "_LAUNCHES", {})
    asked = []
    monkeypatch.setattr(launch.CompiledLaunch, "local_bytes",
                        lambda self, grid, args: asked.append(self.kwargs["BLOCK_M"]) or 0)
    module = types.SimpleNamespace(flex_fwd_ws_kernel=kernel, LLVM_OPT_LEVELS={})
    L = 384
    blocks = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, L, device="cpu")
    lists = _block_tensors(blocks, L, L, torch.device("cpu"))
    wide = item_lists(blocks, 192)

    def call(seed):
        q, k, v = rand_qkv(2, 4, 4, L, L, 64, dtype=torch.bfloat16, device="cpu", seed=seed)
        out, lse, _ = launch.launch_forward_ws(module, [], q, k, v, *lists, 0.125, False, wide=wide)
        return q, out, lse
    first, second = call(0), call(1)
    (grid, args, kwargs), (grid2, args2, kwargs2) = launches
    assert asked == [192] and kwargs["BLOCK_M"] == 192 and (grid2, kwargs2) == (grid, kwargs)
    assert args2[0] is second[0] and args2[8] is second[2] and args2[3] is second[1]  # (q, lse, out: this call's)
    assert args2[7].base.data_ptr() == second[1].data_ptr() != first[1].data_ptr()  # (OUT's descriptor)
    assert all(a is b for a, b in zip(args[10:14], args2[10:14]))  # (the wide items' lists, as given)
    assert [a for a in args if isinstance(a, (int, float))] == [a for a in args2 if isinstance(a, (int, float))]
    monkeypatch.setattr(launch, "WS_FWD_PERSISTENT", not launch.WS_FWD_PERSISTENT)
    call(2)
    assert asked == [192, 192] and launches[2][2]["PERSISTENT"] != kwargs["PERSISTENT"]


def test_the_fused_dq_needs_the_tma_reduce_op(monkeypatch):
    """A Triton whose Gluon builder lacks the TMA reduce-add (its name may change) runs the dQ kernel instead."""
    from triton._C.libtriton import gluon_ir

    assert launch._gluon_tma_reduce_available.__wrapped__()  # Triton 3.6, as pinned
    monkeypatch.delattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
    assert not launch._gluon_tma_reduce_available.__wrapped__()


@pytest.mark.parametrize("allowed", [False, True], ids=["not allowed", "allowed"])
def test_max_scores_take_the_gluon_forward_only_where_allowed(monkeypatch, allowed):
    """return_aux max_scores: the warp-specialized forward stores them (STORE_MAX) only with
    launch.WS_FWD_MAX_SCORES; without it the call runs the Triton forward (here the Gluon kernel's launch is a
    stand-in: it runs on a Hopper GPU only, see test_max_scores_from_the_gluon_forward)."""
    import flexlite.api as api
    from flexlite import AuxRequest

    calls = []

    def gluon_launch(*args, **kwargs):
        calls.append(kwargs)
        q = args[2]
        rows = torch.full(q.shape[:3], 7.0, device=q.device)
        return q.new_zeros(q.shape), rows, rows.clone() if kwargs["max_scores"] else None
    monkeypatch.setattr(launch, "WS_FWD_MAX_SCORES", allowed)
    monkeypatch.setattr(api, "_warp_specialize", lambda *args: args[-1].get("WARP_SPECIALIZE") is not False)
    monkeypatch.setattr(api, "launch_forward_ws", gluon_launch)
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16)
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(max_scores=True))
    if allowed:
        assert [c["max_scores"] for c in calls] == [True]
        assert torch.equal(aux.max_scores, torch.full_like(aux.max_scores, 7.0))
    else:
        assert calls == []
        assert_close(aux.max_scores, attention_reference(q, k, v, return_max=True)[2], 2e-5, 2e-5)
        with pytest.raises(NotImplementedError, match="WARP_SPECIALIZE=True picks the warp-specialized one"):
            flex_attention(q, k, v, return_aux=AuxRequest(max_scores=True), kernel_options={"WARP_SPECIALIZE": True})
    flex_attention(q, k, v)
    assert [c["max_scores"] for c in calls] == [True] * allowed + [False]


LIMIT = launch.WS_FWD_WIDE_MAX_LOCAL


@pytest.mark.parametrize("persistent", [False, True], ids=["per q block", "persistent"])
@pytest.mark.parametrize("local", [0, LIMIT, LIMIT + 16, "skip"], ids=[
    "spills nothing", "spills up to the limit", "spills past the limit", "spills past the limit with the skip"])
@pytest.mark.parametrize("D, walk, wide", [(64, "dense", True), (64, "block mask", True), (64, "block mask", False),
                                           (128, "dense", True)])
def test_wide_items_take_three_consumer_warpgroups_where_they_spill_little(monkeypatch, D, walk, wide, local,
                                                                          persistent):
    """launch.WS_FWD_WIDE_TILES: at D64 the Gluon forward's dense walk, and a block mask's walk with its lists for
    192-row q blocks (block_mask.item_lists), take 192 query rows per item (three consumer warpgroups of 64,
    FlashAttention-3's D64 tile: benchmarks/NOTES.md 84) with three K / V stages and 160 registers a consumer
    thread, where that kernel spills at most WS_FWD_WIDE_MAX_LOCAL bytes a thread (the dense walk's at lengths
    multiples of 128 WS_FWD_DENSE_WIDE_MAX_LOCAL: none); else, without such lists and at
    D128, WS_TILES' 128-row items and two consumers, from the lists given. A block mask's wide kernel has its
    warpgroups skip a walk's first tiles that keep none of their rows (WS_FWD_SKIP_EMPTY_LEAD; where it spills so, the
    128-row items: no third kernel compiled in the call), and on the persistent grid two Q buffers (the next item's Q
    loads while an item runs: NOTES 89); every other kernel one. Inside compile_only both kernels compile (the
    first_calls worker's: the call then has the one it takes)."""
    from flexlite.api import _block_tensors
    from flexlite.block_mask import item_lists

    kernel, launches = _recording_kernel()

    monkeypatch.setattr(launch, "_device_facts", lambda device: (5, 9))
    monkeypatch.setattr(launch, "WS_FWD_PERSISTENT", persistent)
    asked = []

    def local_bytes(self, grid, args):  # (as the real one: compiled and asked once, the answer kept)
        if self.local is None:
            asked.append((self.kwargs["BLOCK_M"], self.kwargs["SKIP_LEAD"]))
            self.local = (LIMIT + 16 if self.kwargs["SKIP_LEAD"] else 0) if local == "skip" else local
        return self.local
    monkeypatch.setattr(launch.CompiledLaunch, "local_bytes", local_bytes)
    monkeypatch.setattr(launch, "_LAUNCHES", {})
    L = 512  # items of 192 rows: 3 per (batch, head), the last one's third warpgroup past the rows
    q, k, v = rand_qkv(2, 4, 4, L, L, D, dtype=torch.bfloat16, device="cpu")
    blocks = None if walk == "dense" else create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                                            L, L, device="cpu")
    lists = _block_tensors(blocks, L, L, torch.device("cpu"))
    wide_arg = wide and (True if blocks is None else item_lists(blocks, 192))
    module = types.SimpleNamespace(flex_fwd_ws_kernel=kernel, LLVM_OPT_LEVELS={})
    launch.launch_forward_ws(module, [], q, k, v, *lists, 0.125, False, dense=walk == "dense", wide=wide_arg)
    (grid, args, kwargs), = launches
    skipping = walk != "dense"
    # (the dense walk's limit at these lengths: launch.WS_FWD_DENSE_WIDE_MAX_LOCAL, nothing)
    assert launch.WS_FWD_DENSE_WIDE_MAX_LOCAL == 0 < LIMIT and launch.dense_lengths_even(L, L)
    taken = D == 64 and wide and (local == 0 or local == LIMIT and skipping or local == "skip" and not skipping)
    block_m, stages, regs = (192, 3, 160) if taken else (128, *[launch.WS_TILES[D][n] for n in ("STAGES",
                                                                                               "CONSUMER_REGS")])
    n_qblocks = -(-L // block_m)
    assert (kwargs["BLOCK_M"], kwargs["STAGES"], kwargs["CONSUMER_REGS"]) == (block_m, stages, regs)
    assert kwargs["SPARSE_Q_BLOCK"] == (192 if taken and walk != "dense" else 128)
    assert kwargs["SKIP_LEAD"] == (taken and skipping)
    assert kwargs["Q_BUFFERS"] == (2 if taken and skipping and persistent else 1)
    assert grid == (min(2 * 4 * n_qblocks, 5) if persistent else 2 * 4 * n_qblocks,)
    assert kwargs["EVEN_M"] == (L % block_m == 0) and kwargs["HOST_DESC"] and kwargs["PERSISTENT"] == persistent
    assert args[10 + 4 + 18:10 + 4 + 18 + 2] == (2 * 4 * n_qblocks, n_qblocks)
    # the lists: the wide items' own (causal: 2 partial blocks per 192-row item, 1 in the last, of 128 rows) or the
    # block mask's
    if walk != "dense":
        assert args[10].flatten().tolist() == ([2, 2, 1] if taken else [1, 1, 1, 1])
    # a second call takes the same kernel without asking again (a wide kernel that does not fit is not even given its
    # arguments)
    launch.launch_forward_ws(module, [], q, k, v, *lists, 0.125, False, dense=walk == "dense", wide=wide_arg)
    assert launches[1][2]["BLOCK_M"] == block_m and asked == ([(192, skipping)] if D == 64 and wide else []), asked
    launches.clear()
    monkeypatch.setattr(launch, "_launch", lambda kernel, grid, args, kwargs: launches.append((grid, args, kwargs)))
    with launch.compile_only():
        launch.launch_forward_ws(module, [], q, k, v, *lists, 0.125, False, dense=walk == "dense", wide=wide_arg)
    assert [(kw["BLOCK_M"], kw["SKIP_LEAD"]) for _, _, kw in launches] == (
        [(192, skipping), (128, False)] if D == 64 and wide else [(128, False)])


@pytest.mark.parametrize("persistent", [False, True], ids=["per q block", "persistent"])
@pytest.mark.parametrize("walk", ["dense", "block mask"])
def test_two_consumer_warpgroups_take_their_tiles_q_buffers_on_a_block_masks_persistent_walk(monkeypatch, walk,
                                                                                            persistent):
    """launch.WS_TILES' Q_BUFFERS (one by default; two at D64 a tuning choice): the 128-row items take two Q buffers (the next
    item's Q loads while an item runs) where the wide items would, a block mask's walk on the persistent grid; the
    dense walk and a program per item one."""
    from flexlite.api import _block_tensors

    kernel, launches = _recording_kernel()
    monkeypatch.setattr(launch, "_device_facts", lambda device: (5, 9))
    monkeypatch.setattr(launch, "WS_FWD_PERSISTENT", persistent)
    monkeypatch.setattr(launch, "WS_TILES", {**launch.WS_TILES, 64: {**launch.WS_TILES[64], "Q_BUFFERS": 2}})
    monkeypatch.setattr(launch, "_LAUNCHES", {})
    q, k, v = rand_qkv(1, 2, 2, 256, 256, 64, dtype=torch.bfloat16, device="cpu")
    blocks = None if walk == "dense" else create_block_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 100, None,
                                                            None, 256, 256, device="cpu")
    module = types.SimpleNamespace(flex_fwd_ws_kernel=kernel, LLVM_OPT_LEVELS={})
    launch.launch_forward_ws(module, [], q, k, v, *_block_tensors(blocks, 256, 256, torch.device("cpu")), 0.125,
                             False, dense=walk == "dense")
    (grid, args, kwargs), = launches
    assert kwargs["BLOCK_M"] == 128 and kwargs["PERSISTENT"] == persistent
    assert kwargs["Q_BUFFERS"] == (2 if persistent and walk != "dense" else 1)


@pytest.mark.parametrize("has_score_mod", [False, True], ids=["no score_mod", "a score_mod"])
@pytest.mark.parametrize("D, wide", [(64, True), (64, False), (128, False)], ids=["D64 wide", "D64", "D128"])
def test_consumers_take_turns_at_d128_and_at_d64_without_a_score_mod(monkeypatch, D, wide, has_score_mod):
    """launch.ws_fwd_turns: the Gluon forward's consumer warpgroups take turns issuing their matmuls (the kernel's
    TURNS) at D128 always, at D64 (two or three consumers) only without a score_mod (benchmarks/NOTES.md 90); the
    settings move it."""
    from flexlite.api import _block_tensors

    kernel, launches = _recording_kernel()
    monkeypatch.setattr(launch, "_device_facts", lambda device: (5, 9))
    monkeypatch.setattr(launch.CompiledLaunch, "local_bytes", lambda self, grid, args: 0)
    monkeypatch.setattr(launch, "_LAUNCHES", {})
    q, k, v = rand_qkv(1, 2, 2, 384, 384, D, dtype=torch.bfloat16, device="cpu")
    module = types.SimpleNamespace(flex_fwd_ws_kernel=kernel, LLVM_OPT_LEVELS={})
    lists = _block_tensors(None, 384, 384, torch.device("cpu"))

    def turns():
        launches.clear()
        launch.launch_forward_ws(module, [], q, k, v, *lists, 0.125, has_score_mod, dense=True, wide=wide)
        (_, _, kwargs), = launches
        assert kwargs["BLOCK_M"] == (192 if D == 64 and wide else 128)
        return kwargs["TURNS"]
    assert turns() == (D == 128 or not has_score_mod)
    monkeypatch.setattr(launch, "WS_FWD_TURNS_PLAIN_HEAD_DIMS", frozenset())
    assert turns() == (D == 128)
    monkeypatch.setattr(launch, "WS_FWD_TURNS_HEAD_DIMS", frozenset({64}))
    assert turns() == (D == 64)


@pytest.mark.parametrize("made_by", ["create_block_mask", "from_kv_blocks", "bits"])
def test_flex_attention_offers_the_wide_items_lists_where_they_can_be_made(monkeypatch, made_by):
    """At D64 flex_attention offers the warp-specialized forward a block mask's lists for 192-row q blocks where
    block_mask.item_lists can make them (create_block_mask's masks), made once per block mask; for block lists
    given by hand, and a new mask_mod's bits (first_calls.BitsMask: its partial blocks only), none (here the Gluon
    kernel's launch is a stand-in: it runs on a Hopper GPU only)."""
    import flexlite.api as api
    from flexlite import BlockMask

    calls = []

    def gluon_launch(module, mod_args, q, k, v, num, idx, full_num, full_idx, sparse, *args, **kwargs):
        calls.append((sparse, kwargs["wide"]))
        return q.new_zeros(q.shape), torch.zeros(q.shape[:3]), None
    monkeypatch.setattr(api, "_warp_specialize", lambda *args: True)
    monkeypatch.setattr(api, "launch_forward_ws", gluon_launch)
    q, k, v = rand_qkv(1, 2, 2, 384, 384, 64, dtype=torch.bfloat16, device="cpu")
    # (keys past 300: a partial kv block per q block of either size, as many tiles per query in 192-row items as in
    # 128-row ones: launch.WS_FWD_WIDE_MAX_WORK)
    made = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < 300, None, None, 384, 384, device="cpu")
    if made_by == "from_kv_blocks":
        made = BlockMask.from_kv_blocks(made.kv_num_blocks, made.kv_indices, made.full_kv_num_blocks,
                                        made.full_kv_indices, mask_mod=made.mask_mod)
    elif made_by == "bits":
        made = first_calls.bits_mask(made, 1, 2, False)
    for _ in range(2):
        flex_attention(q, k, v, block_mask=made)
    assert [sparse for sparse, _ in calls] == [(128, 128)] * 2
    if made_by == "create_block_mask":
        assert calls[0][1] is calls[1][1]  # (the lists made once)
        assert calls[0][1][0].flatten().tolist() == [1, 1]  # partial blocks per 192-row item
    else:
        assert [wide for _, wide in calls] == [None, None]
    flex_attention(q, k, v)
    assert calls[-1][1] is True  # (the dense walk)


@pytest.mark.parametrize("L, wide_masks", [(8192, {"causal", "prefix_lm_2048", "alibi_causal", "softcap30_causal"}),
                                            (2048, {"prefix_lm_2048"})])
def test_wide_items_only_where_they_walk_little_more_than_the_masks_own(monkeypatch, L, wide_masks):
    """Wider items walk more keys per query on a banded mask, more of them partial: a block mask's wide items are
    offered where their tiles, weighed by rows and a partial tile as launch.WS_FWD_PARTIAL_TILE_COST full ones, come
    to at most launch.WS_FWD_WIDE_MAX_WORK times its own items' (sliding window 1024 at S8192: 1.27x, 68 % slower in
    three warpgroups on an H100; causal 1.06x, 11 % faster: NOTES 85). The weighed ratio is checked against the
    lists counted here; the answer kept on the BlockMask follows the settings."""
    import flexlite.api as api
    from flexlite.bench import mask_cases
    from flexlite.block_mask import item_lists
    offered, made = set(), {}
    for name, case in mask_cases(L, 2, "cpu").items():
        if case.mask_mod is None:
            continue
        made[name] = create_block_mask(case.mask_mod, None, None, L, L, device="cpu")
        num, _, full_num, _ = item_lists(made[name], 192)
        cost = launch.WS_FWD_PARTIAL_TILE_COST
        counted = ((num.sum() * cost + full_num.sum()) * 192 /
                   ((made[name].kv_num_blocks.sum() * cost + made[name].full_kv_num_blocks.sum()) * 128)).item()
        assert api._wide_work(made[name], item_lists(made[name], 192), 192) == pytest.approx(counted)
        if api._wide_items(made[name], 64) is not None:
            offered.add(name)
        assert (name in offered) == (counted <= launch.WS_FWD_WIDE_MAX_WORK), (name, counted)
    assert offered == wide_masks
    monkeypatch.setattr(launch, "WS_FWD_WIDE_MAX_WORK", float("inf"))
    assert all(api._wide_items(mask, 64) is not None for mask in made.values())


def _counted(real, record):
    """``real`` recording each launch (``record(args, kwargs)``) but the first_calls worker's, which only compile
    (launch.compile_only): a count of the launches that ran."""
    def launch_(*args, **kwargs):
        if not launch.compiling_only():
            record(args, kwargs)
        return real(*args, **kwargs)
    return launch_


if ON_HOPPER:
    # (B, Hq, Hkv, Lq, Lkv, D)
    WS_SHAPES = [
        pytest.param((2, 2, 2, 256, 256, 128), id="B2-H2-L256-D128"),
        pytest.param((1, 4, 2, 384, 256, 64), id="B1-H4-Hkv2-Lq384-Lkv256-D64-gqa"),
        pytest.param((1, 2, 2, 200, 333, 128), id="B1-H2-Lq200-Lkv333-D128-ragged"),
        pytest.param((2, 2, 1, 63, 130, 64), id="B2-H2-Hkv1-Lq63-Lkv130-D64-mqa"),
    ]

    # Triton 3.6's Gluon compiler fails on captured_bias's whole-tile gathers (test_a_compiler_failure_falls_back...)
    WS_CATALOG = sorted(set(CATALOG) - {"captured_bias"})

    # each shape on a program per q block, and where the forward's descriptors are made on the host (contiguous inputs,
    # lengths multiples of the tiles) on its persistent grid as well, here of three programs (as if the GPU had 3
    # SMs), so that programs take several q blocks (launch.WS_FWD_PERSISTENT)
    def _on_grid(monkeypatch, persistent: bool, setting: str = "WS_FWD_PERSISTENT"):
        """launch.WS_FWD_PERSISTENT (or ``setting``) as asked; persistent, on a grid of three programs (as if the GPU
        had 3 SMs), so that programs take several q (key) blocks."""
        monkeypatch.setattr(launch, setting, persistent)
        if persistent:
            facts = launch._device_facts(torch.device(DEVICE))
            monkeypatch.setattr(launch, "_device_facts", lambda device: (3, facts[1]))

    WS_FORWARD_RUNS = [pytest.param(*case.values, grid, id=f"{case.id}-{grid}") for case in WS_SHAPES
                       for grid in ("per q block", "persistent")
                       if grid == "per q block" or case.values[0][3] % 128 == case.values[0][4] % 128 == 0]

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
    @pytest.mark.parametrize("shape, grid", WS_FORWARD_RUNS)
    @pytest.mark.parametrize("name", WS_CATALOG)
    def test_matches_the_reference(monkeypatch, name, shape, grid, dtype):
        from test_flex_attention import run_case

        _on_grid(monkeypatch, grid == "persistent")
        run_case(name, shape, dtype, kernel_options={"WARP_SPECIALIZE": True})

    def _poisoned_forward(monkeypatch, shape, score_mod, block_mask, seed: int) -> list:
        """The warp-specialized forward of random bf16 inputs of ``shape`` (B, Hq, Hkv, Lq, Lkv, D) with out and
        lse starting as NaN, so that a row left unwritten fails, checked against the reference; returns the items'
        rows of each forward launch that ran (not the first_calls worker's compiles)."""
        from helpers import LSE_TOLERANCES

        ran = []
        real_call, real_empty = launch.CompiledLaunch.__call__, torch.empty

        def call(self, grid, args):
            if not launch.compiling_only() and "BLOCK_M" in self.kwargs:
                ran.append(self.kwargs["BLOCK_M"])
            return real_call(self, grid, args)
        B, Hq, Hkv, Lq, Lkv, D = shape
        q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=torch.bfloat16, seed=seed)
        with monkeypatch.context() as patched:
            patched.setattr(launch.CompiledLaunch, "__call__", call)
            patched.setattr(torch, "empty", lambda *a, **kw: (lambda t: t.fill_(float("nan"))
                                                              if t.is_floating_point() else t)(real_empty(*a, **kw)))
            out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=Hq != Hkv,
                                      return_lse=True, kernel_options={"WARP_SPECIALIZE": True})
        ref, ref_lse = attention_reference(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=Hq != Hkv)
        assert_close(out, ref, *TOLERANCES[torch.bfloat16], name="out")
        assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.bfloat16], name="lse")
        return ran

    @pytest.mark.parametrize("shape, grid", [run for run in WS_FORWARD_RUNS if run.values[0][5] == 64])
    @pytest.mark.parametrize("name", WS_CATALOG)
    def test_block_masks_in_items_of_three_warpgroups(monkeypatch, name, shape, grid):
        # launch.WS_FWD_WIDE_TILES for block masks: their lists remade for 192-row q blocks (block_mask.item_lists),
        # offered here whatever they walk (launch.WS_FWD_WIDE_MAX_WORK: at these lengths a banded mask's would not
        # be), taken where the kernel spills nothing (causal's with host descriptors, lengths multiples of 128,
        # offline and on an H100: it takes them)
        monkeypatch.setattr(launch, "WS_FWD_WIDE_MAX_WORK", float("inf"))
        _on_grid(monkeypatch, grid == "persistent")
        B, Hq, Hkv, Lq, Lkv, D = shape
        case = CATALOG[name](B, Hq, Lq, Lkv, DEVICE)
        uses_bh = name in USES_BH
        bm = create_block_mask(case.mask_mod, B if uses_bh else None, Hq if uses_bh else None, Lq, Lkv,
                               device=DEVICE) if case.mask_mod is not None else None
        ran = _poisoned_forward(monkeypatch, shape, case.score_mod, bm, seed=29)
        host_desc = Lq % 128 == Lkv % 128 == 0
        assert ran and (ran == [192] if name == "causal" and host_desc else set(ran) <= {128, 192}), ran

    @pytest.mark.parametrize("one_in", [2, 4, 8])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
    @pytest.mark.parametrize("shape, grid", WS_FORWARD_RUNS)
    @pytest.mark.parametrize("name", ["softcap_causal", "causal", "fully_masked_rows", "document", "full"])
    def test_exponentials_on_the_fma_pipes_match_the_reference(monkeypatch, name, shape, grid, dtype, one_in):
        # launch.WS_FWD_POLY_EXP2 (off by default, NOTES 70; WS_FWD_POLY_EXP2_BOUNDED for softcap against its bound
        # at D64, NOTES 91): one of every one_in of P's exponentials by codegen.exp2's polynomial, softcap against its
        # bound (bf16) and the running max (fp16)
        monkeypatch.setattr(launch, "WS_FWD_POLY_EXP2", {64: one_in, 128: one_in})
        monkeypatch.setattr(launch, "WS_FWD_POLY_EXP2_BOUNDED", {})
        _on_grid(monkeypatch, grid == "persistent")
        from test_flex_attention import run_case
        run_case(name, shape, dtype, kernel_options={"WARP_SPECIALIZE": True})

    @pytest.mark.parametrize("shape, grid", [run for run in WS_FORWARD_RUNS if "D64" in run.id and
                                             run.id.endswith("persistent")])
    @pytest.mark.parametrize("name", ["sliding_window", "causal", "document", "alibi_causal", "fully_masked_rows"])
    def test_two_q_buffers_in_two_consumer_warpgroups_match_the_reference(monkeypatch, name, shape, grid):
        # launch.WS_TILES' Q_BUFFERS at D64 (one by default; two no faster on the H200, NOTES 92), in the 128-row items
        # (the wide items off), on the persistent grid the next item's Q loaded while an item runs
        monkeypatch.setattr(launch, "WS_TILES", {**launch.WS_TILES, 64: {**launch.WS_TILES[64], "Q_BUFFERS": 2}})
        monkeypatch.setattr(launch, "WS_FWD_WIDE_TILES", {})
        _on_grid(monkeypatch, grid == "persistent")
        from test_flex_attention import run_case
        run_case(name, shape, torch.bfloat16, kernel_options={"WARP_SPECIALIZE": True})

    @pytest.mark.parametrize("one_in", [0, 4])
    def test_exponentials_on_the_fma_pipes_keep_nan(monkeypatch, one_in):
        # a key row of NaN makes every query that sees it NaN, whichever lane its exponential took (the polynomial's
        # NaN in, NaN out: codegen.exp2), and no other
        monkeypatch.setattr(launch, "WS_FWD_POLY_EXP2", {64: one_in, 128: one_in} if one_in else {})
        monkeypatch.setattr(launch, "WS_FWD_POLY_EXP2_BOUNDED", {})
        q, k, v = rand_qkv(1, 2, 2, 256, 256, 64, dtype=torch.bfloat16, seed=5)
        k[:, :, 70] = float("nan")
        bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 256, 256, device=DEVICE)
        out = flex_attention(q, k, v, block_mask=bm, kernel_options={"WARP_SPECIALIZE": True})
        ref, _ = attention_reference(q, k, v, block_mask=bm)
        assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out[:, :, 70:]).all()
        assert_close(out[:, :, :70], ref[:, :, :70], *TOLERANCES[torch.bfloat16], name="rows before the NaN key")

    @pytest.mark.parametrize("shape, grid", WS_FORWARD_RUNS)
    @pytest.mark.parametrize("name", ["fully_masked_rows", "softcap_causal", "alibi_causal", "document"])
    def test_max_scores_from_the_gluon_forward(monkeypatch, name, shape, grid):
        # launch.WS_FWD_MAX_SCORES (on since this passed on an H200): return_aux max_scores stored by the
        # warp-specialized forward are the reference's, and out / lse are what the kernel gives without them
        import flexlite.api as api
        from flexlite import AuxRequest
        from helpers import LSE_TOLERANCES

        monkeypatch.setattr(launch, "WS_FWD_MAX_SCORES", True)
        # (a call without max_scores would run softcap against its bound, WS_FWD_BOUNDED_SOFTMAX; with them it takes
        # the running max, test_codegen's test_max_scores_take_the_running_max)
        monkeypatch.setattr(launch, "WS_FWD_BOUNDED_SOFTMAX", False)
        _on_grid(monkeypatch, grid == "persistent")
        ran = []
        real_launch = api.launch_forward_ws
        monkeypatch.setattr(api, "launch_forward_ws",
                            lambda *a, **kw: ran.append(kw["max_scores"]) or real_launch(*a, **kw))
        B, Hq, Hkv, Lq, Lkv, D = shape
        case = CATALOG[name](B, Hq, Lq, Lkv, DEVICE)
        q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=torch.bfloat16, seed=17)
        bm = None if case.mask_mod is None else create_block_mask(case.mask_mod, None, None, Lq, Lkv, device=DEVICE)
        options = {"WARP_SPECIALIZE": True}
        out, aux = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv,
                                  kernel_options=options, return_aux=AuxRequest(lse=True, max_scores=True))
        plain, lse = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv,
                                    kernel_options=options, return_lse=True)
        ref_max = attention_reference(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv,
                                      return_max=True)[2]
        assert ran == [True, False]
        assert torch.equal(out, plain) and torch.equal(aux.lse, lse)
        assert_close(aux.max_scores, ref_max, *LSE_TOLERANCES[torch.bfloat16], name="max_scores")

    @pytest.mark.parametrize("shape, grid", WS_FORWARD_RUNS)
    @pytest.mark.parametrize("name", ["sliding_window", "prefix_lm", "affine_pair", "negative_factor_and_heads",
                                      "equal_and_or", "with_an_undecided_term", "causal"])
    def test_decided_mask_terms_leave_the_forward_bit_for_bit(monkeypatch, name, shape, grid):
        # launch.DECIDE_MASK_TERMS: the warp-specialized forward leaves out of a partial tile's mask the terms its
        # warpgroup's index ranges decide (two consumer warpgroups; three run the whole mask): out and lse the same
        # bits as with the whole mask on every partial tile, and the reference's (test_decide's masks)
        from test_decide import MASKS

        _on_grid(monkeypatch, grid == "persistent")
        B, Hq, Hkv, Lq, Lkv, D = shape
        mod = MASKS[name][0]
        bm = create_block_mask(mod, None, Hq, Lq, Lkv, device=DEVICE)
        q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=torch.bfloat16, seed=41)
        results = {}
        for on in (True, False):
            monkeypatch.setattr(launch, "DECIDE_MASK_TERMS", frozenset({"fwd_ws.py.jinja"} if on else ()))
            assert ("mask_mod_decide" in kernel_source(None, bm, device=DEVICE, kernel="forward_ws")) == on
            results[on] = flex_attention(q, k, v, block_mask=bm, enable_gqa=Hq != Hkv, return_lse=True,
                                         kernel_options={"WARP_SPECIALIZE": True})
        assert torch.equal(results[True][0], results[False][0]) and torch.equal(results[True][1], results[False][1])
        ref, ref_lse = attention_reference(q, k, v, block_mask=bm, enable_gqa=Hq != Hkv)
        assert_close(results[True][0], ref, *TOLERANCES[torch.bfloat16])

    @pytest.mark.parametrize("shape, grid", [run for run in WS_FORWARD_RUNS if run.values[0][5] == 64])
    @pytest.mark.parametrize("name", ["causal", "prefix_lm", "sliding_window", "equal_and_or"])
    def test_wide_items_skip_the_first_tiles_that_keep_none_of_a_warpgroups_rows(monkeypatch, name, shape, grid):
        # launch.WS_FWD_SKIP_EMPTY_LEAD: in items of three warpgroups each skips the first partial tiles (at most two)
        # whose keys its rows' decided mask terms leave nothing of; out and lse the same bits as without the skip
        # (a skipped tile adds exact zeros), and the reference's (_poisoned_forward: rows left unwritten fail)
        from test_decide import MASKS

        monkeypatch.setattr(launch, "WS_FWD_WIDE_MAX_WORK", float("inf"))
        _on_grid(monkeypatch, grid == "persistent")
        B, Hq, Hkv, Lq, Lkv, D = shape
        bm = create_block_mask(MASKS[name][0], None, Hq, Lq, Lkv, device=DEVICE)
        results, ran = {}, {}
        for on in (True, False):
            monkeypatch.setattr(launch, "WS_FWD_SKIP_EMPTY_LEAD", on)
            ran[on] = _poisoned_forward(monkeypatch, shape, None, bm, seed=43)
            q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=torch.bfloat16, seed=43)
            results[on] = flex_attention(q, k, v, block_mask=bm, enable_gqa=Hq != Hkv, return_lse=True,
                                         kernel_options={"WARP_SPECIALIZE": True})
        assert set(ran[True]) | set(ran[False]) <= {128, 192}, ran
        if name in ("causal", "prefix_lm"):
            # (their wide kernels spill at most launch.WS_FWD_WIDE_MAX_LOCAL either way: the same items)
            assert ran[True] == ran[False] and (192 in ran[True] or Lq % 128 or Lkv % 128), ran
        if ran[True] == ran[False]:  # (else one of the two wide kernels spilled: 128-row items, another walk order)
            assert torch.equal(results[True][0], results[False][0])
            assert torch.equal(results[True][1], results[False][1])

    @pytest.mark.parametrize("key_side", ["affine", "compact key vector", "column vector"])
    @pytest.mark.parametrize("shape, grid", WS_FORWARD_RUNS)
    @pytest.mark.parametrize("name", ["alibi", "input_factor_and_sides", "two_slopes_and_a_head_term",
                                      "query_side_only", "minus_a_float_distance"])
    def test_separable_score_mod_biases(monkeypatch, name, shape, grid, key_side):
        # launch.SEPARATE_SCORE_BIAS, AFFINE_KEY_BIAS, WS_FWD_AFFINE_BIAS_HEAD_DIMS, WS_FWD_COMPACT_BIAS_HEAD_DIMS: the
        # key side of the bias taken along the tiles' keys (where affine in kv_idx as one vector per item plus a
        # scalar per tile in the row max, else on a compact vector or on the tile's columns), the query side added to
        # LSE and max_scores once per row; out, lse and max_scores are the reference's (test_codegen's mods, at every
        # head count here; input_factor_and_sides' key side is not affine)
        from flexlite import AuxRequest
        from helpers import LSE_TOLERANCES
        from test_codegen import SEPARABLE_MODS

        compact = key_side == "compact key vector"
        monkeypatch.setattr(launch, "AFFINE_KEY_BIAS", frozenset({"fwd_ws.py.jinja"} if key_side == "affine" else ()))
        monkeypatch.setattr(launch, "WS_FWD_AFFINE_BIAS_HEAD_DIMS", frozenset({64, 128}))
        monkeypatch.setattr(launch, "WS_FWD_COMPACT_BIAS_HEAD_DIMS", frozenset({64, 128} if compact else ()))
        _on_grid(monkeypatch, grid == "persistent")
        B, Hq, Hkv, Lq, Lkv, D = shape
        slopes = torch.rand(Hq, device=DEVICE)
        mods = {"alibi": lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
                "two_slopes_and_a_head_term": lambda s, b, h, q, kv: s + slopes[h] * kv - slopes[(h + 1) % Hq] * q
                + h * 0.25,
                "query_side_only": lambda s, b, h, q, kv: s + slopes[h] * q,
                "minus_a_float_distance": lambda s, b, h, q, kv: s - slopes[h] * (q - kv).float() / 7}
        mod = mods.get(name) or SEPARABLE_MODS[name][0]
        case = CATALOG["causal"](B, Hq, Lq, Lkv, DEVICE)
        bm = create_block_mask(case.mask_mod, None, None, Lq, Lkv, device=DEVICE)
        q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=torch.bfloat16, seed=23)
        source = kernel_source(mod, bm, device=DEVICE, kernel="forward_ws")
        assert "row_bias" in source and ("offs_kb" in source) == compact
        assert ("tile_bias" in source) == (key_side == "affine" and SEPARABLE_MODS[name][2])
        out, aux = flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=Hq != Hkv,
                                  kernel_options={"WARP_SPECIALIZE": True},
                                  return_aux=AuxRequest(lse=True, max_scores=True))
        ref, ref_lse, ref_max = attention_reference(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=Hq != Hkv,
                                                    return_max=True)
        assert_close(out, ref, *TOLERANCES[torch.bfloat16])
        assert_close(aux.lse, ref_lse, *LSE_TOLERANCES[torch.bfloat16], name="lse")
        assert_close(aux.max_scores, ref_max, *LSE_TOLERANCES[torch.bfloat16], name="max_scores")

    @pytest.mark.parametrize("shape, grid", WS_FORWARD_RUNS)
    @pytest.mark.parametrize("cap", [2.0, 41.0])
    def test_softcap_against_its_bound(monkeypatch, shape, grid, cap):
        # launch.WS_FWD_BOUNDED_SOFTMAX: bf16 softcap through the warp-specialized forward against its bound, P's row
        # sums by the tensor cores; every fifth query row has all its scores near -cap, so that its weights sit near
        # the bound's bottom, 2 ** (-2 * cap * log2(e)) (2 ** -118 for cap 41: still normal); out and lse are the
        # reference's, and the output's error at most 1.5x the running max's (+ 2e-3)
        from flexlite.mods import generate_tanh_softcap
        from helpers import LSE_TOLERANCES

        _on_grid(monkeypatch, grid == "persistent")
        B, Hq, Hkv, Lq, Lkv, D = shape
        mod = generate_tanh_softcap(cap, approx=True)
        bm = create_block_mask(CATALOG["causal"](B, Hq, Lq, Lkv, DEVICE).mask_mod, None, None, Lq, Lkv, device=DEVICE)
        q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=torch.bfloat16, seed=31)
        k = k + 2  # a common component: q rows of -2 score about -4 * sqrt(D) against every key
        q[:, :, ::5] = -2
        assert "ones_smem" in kernel_source(mod, bm, device=DEVICE, kernel="forward_ws", dtype=torch.bfloat16)
        ref, ref_lse = attention_reference(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=Hq != Hkv)
        errors = {}
        for bounded in (True, False):
            monkeypatch.setattr(launch, "WS_FWD_BOUNDED_SOFTMAX", bounded)
            out, lse = flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=Hq != Hkv, return_lse=True,
                                      kernel_options={"WARP_SPECIALIZE": True})
            assert_close(out, ref, *TOLERANCES[torch.bfloat16], name=f"out (bounded: {bounded})")
            assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.bfloat16], name=f"lse (bounded: {bounded})")
            errors[bounded] = (out.double() - ref).abs().max().item()
        assert errors[True] <= 1.5 * errors[False] + 2e-3, errors

    @pytest.mark.parametrize("shape", [(2, 2, 2, 256, 256, 64), (1, 3, 3, 1152, 384, 64), (2, 4, 2, 320, 200, 64)],
                             ids=["host descriptors, last item ragged", "items even", "device descriptors, gqa"])
    @pytest.mark.parametrize("mod", ["none", "alibi", "softcap", "relative"])
    def test_the_dense_walk_in_items_of_three_warpgroups(monkeypatch, mod, shape):
        # launch.WS_FWD_WIDE_TILES: D64 without a block mask in items of 192 rows (offered to every mod, taken where
        # the kernel spills nothing: WS_FWD_WIDE_MAX_LOCAL); a head's last item may have warpgroups past its rows,
        # whose OUT must not land in the next head's rows (host descriptors span every head)
        from flexlite.mods import generate_alibi_bias, generate_tanh_softcap

        mods = {"none": None, "alibi": generate_alibi_bias(shape[1], device=DEVICE),
                "softcap": generate_tanh_softcap(30.0, approx=True),
                "relative": lambda score, b, h, q_idx, kv_idx: score - 0.01 * (q_idx - kv_idx).abs()}
        ran = _poisoned_forward(monkeypatch, shape, mods[mod], None, seed=17)
        # (no score_mod and softcap spill nothing in three warpgroups at LLVM O0, offline, where the lengths are
        # multiples of 128 and the dense walk's wide items are taken only where they spill nothing,
        # launch.WS_FWD_DENSE_WIDE_MAX_LOCAL; at other lengths, at O3, softcap's spills 16-36 bytes, within
        # WS_FWD_WIDE_MAX_LOCAL: they take them)
        assert ran and (ran == [192] if mod in ("none", "softcap") else set(ran) <= {128, 192}), ran

    @pytest.mark.parametrize("D", [128, 64])
    def test_biases_read_from_captured_tensors_with_non_finite_values(monkeypatch, D):
        from test_codegen import check_non_finite_biases

        check_non_finite_biases(monkeypatch, D, torch.bfloat16, 128, kernel_options={"WARP_SPECIALIZE": True})

    @pytest.mark.parametrize("fold", [True, False], ids=["folded", "in the mod"])
    @pytest.mark.parametrize("D", [128, 64])
    def test_folded_score_mod_factors(monkeypatch, D, fold):
        # launch.FOLD_SCORE_SCALES (on by default: softcap's 1 / cap and cap folded into the kernel's multiplies),
        # through the warp-specialized forward and the Triton one
        from test_flex_attention import run_case

        monkeypatch.setattr(launch, "FOLD_SCORE_SCALES", fold)
        for options in ({"WARP_SPECIALIZE": True}, {"WARP_SPECIALIZE": False}):
            run_case("softcap_causal", (1, 2, 2, 256, 256, D), torch.bfloat16, kernel_options=options)

    @pytest.mark.parametrize("name", ["alibi", "explicit_cast_abs_neg", "truediv"])
    def test_index_distances_from_float_vectors_match_the_int_form(monkeypatch, name):
        # api._float_index: the warp-specialized forward lowers them as the Triton one does. The distances are the
        # same numbers, but ptxas contracts ALiBi's slope * distance + score into one FMA in one form and not in the
        # other (H200), so the outputs may differ by a rounding: both are checked against the reference
        import flexlite.api as api
        from test_codegen import FLOAT_INDEX_MODS

        mod = FLOAT_INDEX_MODS[name][0]
        q, k, v = rand_qkv(1, 2, 2, 256, 256, 128, dtype=torch.bfloat16, seed=3)
        options = {"WARP_SPECIALIZE": True}
        ref = attention_reference(q, k, v, score_mod=mod)[0]
        out = flex_attention(q, k, v, score_mod=mod, kernel_options=options)
        monkeypatch.setattr(api, "_float_index", lambda *args: False)
        drop_plans(monkeypatch)  # (a plan's key holds no private function: the next call must decide anew)
        int_form = flex_attention(q, k, v, score_mod=mod, kernel_options=options)
        for got in (out, int_form):
            assert_close(got, ref, *TOLERANCES[torch.bfloat16])
        assert_close(out, int_form, *TOLERANCES[torch.bfloat16], name="float form vs int form")

    def test_a_block_mask_is_not_read_on_the_host_while_a_cuda_graph_is_captured(monkeypatch):
        import flexlite.api as api

        bm = create_block_mask(CATALOG["causal"](1, 1, 512, 512, DEVICE).mask_mod, None, None, 512, 512,
                               device=DEVICE)
        assert api._capturing(bm.kv_num_blocks) is False
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert api._capturing(bm.kv_num_blocks) and not api._capturing(bm.kv_num_blocks.cpu())
        assert api._mean_walk(bm, 512, 512) is None

    def test_forward_and_backward_replay_from_a_cuda_graph():

        # a training step's attention captured once (after a step outside the capture: kernels compiled, the block
        # mask's walk counted) and replayed on new inputs: the replay's output and gradients are the reference's
        case = CATALOG["document"](1, 4, 640, 640, DEVICE)
        bm = create_block_mask(case.mask_mod, None, None, 640, 640, device=DEVICE)
        q, k, v = (t.requires_grad_() for t in rand_qkv(1, 4, 2, 640, 640, 128, dtype=torch.bfloat16, seed=9))
        grad_out = torch.randn(1, 4, 640, 128, device=DEVICE, dtype=torch.bfloat16)

        def step():
            out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
            return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step()
        fresh = rand_qkv(1, 4, 2, 640, 640, 128, dtype=torch.bfloat16, seed=10)
        with torch.no_grad():
            for t, new in zip((q, k, v), fresh):
                t.copy_(new)
        for t in static:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*inputs, block_mask=bm, enable_gqa=True)[0]
        ref_grads = torch.autograd.grad(ref, inputs, grad_out.double())
        assert_close(static[0], ref, *TOLERANCES[torch.bfloat16])
        for name, got, want in zip(("dq", "dk", "dv"), static[1:], ref_grads):
            assert_grad_close(got, want, torch.bfloat16, f"replayed {name}")

    def test_a_training_step_with_a_new_block_mask_does_not_wait_for_the_gpu(monkeypatch):
        # the backward's persistent-grid policy reads each new block mask's walk: the forward started the count
        # without waiting, so neither pass synchronizes (torch's sync debug mode raises on the implicit syncs it
        # detects, a tensor read on the host, as the count did before, among them)
        import flexlite.api as api

        monkeypatch.setattr(launch, "WS_BWD_PERSISTENT", None)
        case = CATALOG["document"](1, 2, 1024, 1024, DEVICE)
        q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 1024, 1024, 128, dtype=torch.bfloat16, seed=4))
        grad_out = torch.randn(1, 2, 1024, 128, device=DEVICE, dtype=torch.bfloat16)

        def step(bm):
            out = flex_attention(q, k, v, block_mask=bm)
            return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

        step(create_block_mask(case.mask_mod, None, None, 1024, 1024, device=DEVICE))  # kernels compiled
        bm = create_block_mask(case.mask_mod, None, None, 1024, 1024, device=DEVICE)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = step(bm)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert bm._block_count[1] == int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
        assert api._ws_backward_persistent(bm, 1024, 1024)  # the grid the step took
        inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*inputs, block_mask=bm)[0]
        assert_close(got[0], ref, *TOLERANCES[torch.bfloat16])
        for name, g, want in zip(("dq", "dk", "dv"), got[1:], torch.autograd.grad(ref, inputs, grad_out.double())):
            assert_grad_close(g, want, torch.bfloat16, name)

    @pytest.mark.parametrize("block_size", [(256, 128), (128, 256)], ids=str)
    def test_larger_sparse_blocks(block_size):
        q, k, v = rand_qkv(1, 2, 2, 512, 512, 128, dtype=torch.bfloat16, seed=1)
        bm = create_block_mask(CATALOG["sliding_window"](1, 2, 512, 512, DEVICE).mask_mod, None, None, 512, 512,
                               device=DEVICE, BLOCK_SIZE=block_size)
        out = flex_attention(q, k, v, block_mask=bm, kernel_options={"WARP_SPECIALIZE": True})
        assert_close(out, attention_reference(q, k, v, block_mask=bm)[0], *TOLERANCES[torch.bfloat16])

    def test_non_contiguous_inputs_and_a_backward_through_it():
        from test_backward import check_backward

        g = torch.Generator().manual_seed(0)
        q, k, v = [torch.randn(2, 256, 3, 64, generator=g).to(DEVICE, torch.bfloat16).transpose(1, 2)
                   for _ in range(3)]
        assert not q.is_contiguous()
        case = CATALOG["alibi_causal"](2, 3, 256, 256, DEVICE)
        bm = create_block_mask(case.mask_mod, None, None, 256, 256, device=DEVICE)
        check_backward(q, k, v, score_mod=case.score_mod, block_mask=bm, name="ws alibi_causal",
                       kernel_options={"WARP_SPECIALIZE": True})

    # (B, Hq, Hkv, Lq, Lkv, D): the dK / dV kernel's shapes (lengths multiples of the block mask's blocks)
    WS_BWD_SHAPES = [
        pytest.param((2, 2, 2, 256, 256, 128), id="B2-H2-L256-D128"),
        pytest.param((1, 4, 2, 384, 256, 64), id="B1-H4-Hkv2-Lq384-Lkv256-D64-gqa"),
        pytest.param((1, 3, 1, 128, 512, 128), id="B1-H3-Hkv1-Lq128-Lkv512-D128-mqa"),
    ]

    class _PoisonedTorch(types.ModuleType):
        """torch for launch.py, whose torch.empty (every kernel output: out, lse, delta, dq, dk, dv) is NaN-filled."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            t = torch.empty(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

    @pytest.fixture(params=["fused dq, per key block", "fused dq, persistent", "dq kernel"])
    def ws_backward(monkeypatch, request):
        """The backward's dK / dV forced through the warp-specialized kernel, with dQ added by it (the default) or
        by the dQ kernel, outputs poisoned; with the fused dQ, on a grid of a program per key block or on the
        persistent grid of three programs (as if the GPU had 3 SMs, so that programs take several key blocks);
        yields the list its launches are counted in."""
        import flexlite.api as api

        ran, real = [], launch._launch_dkdv_ws
        monkeypatch.setattr(launch, "WS_BWD_FUSED_DQ", request.param.startswith("fused dq"))
        if request.param.startswith("fused dq"):
            _on_grid(monkeypatch, request.param.endswith("persistent"), "WS_BWD_PERSISTENT")
        monkeypatch.setattr(launch, "torch", _PoisonedTorch("torch"))
        monkeypatch.setattr(launch, "_launch_dkdv_ws", _counted(real, lambda args, kwargs: ran.append(1)))
        monkeypatch.setattr(api, "_warp_specialize_backward", lambda *args, **kwargs: True)
        yield ran

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
    @pytest.mark.parametrize("shape", WS_BWD_SHAPES)
    @pytest.mark.parametrize("name", sorted(CATALOG))
    def test_backward_matches_the_reference(ws_backward, name, shape, dtype):
        from test_backward import run_catalog

        run_catalog(name, shape, dtype)
        # captured tensors that need gradients (the catalog's captured_bias) take the Triton kernels
        assert ws_backward or name == "captured_bias"

    @pytest.mark.parametrize("block_size", [(64, 128), (256, 256)], ids=str)
    def test_backward_with_sparse_blocks_of_other_sizes(ws_backward, block_size):
        from test_backward import check_backward

        q, k, v = rand_qkv(1, 2, 2, 512, 512, 64, dtype=torch.bfloat16, seed=4)
        bm = create_block_mask(CATALOG["sliding_window"](1, 2, 512, 512, DEVICE).mask_mod, None, None, 512, 512,
                               device=DEVICE, BLOCK_SIZE=block_size)
        check_backward(q, k, v, block_mask=bm, name=f"ws backward {block_size}")
        assert ws_backward

    @pytest.mark.parametrize("full_first", [True, False], ids=["full tiles first", "partial tiles first"])
    def test_backward_walks_either_kind_of_tile_first(ws_backward, monkeypatch, full_first):
        # prefix-LM: key blocks whose walks hold both kinds of tile, over two query heads per kv head
        from test_backward import check_backward

        monkeypatch.setattr(launch, "WS_BWD_FULL_FIRST", full_first)
        q, k, v = rand_qkv(1, 4, 2, 384, 384, 128, dtype=torch.bfloat16, seed=6)
        bm = create_block_mask(CATALOG["prefix_lm"](1, 4, 384, 384, DEVICE).mask_mod, None, None, 384, 384,
                               device=DEVICE)
        check_backward(q, k, v, block_mask=bm, enable_gqa=True, name=f"ws backward, full first {full_first}")
        assert ws_backward

    @pytest.mark.parametrize("name, D", [("alibi_causal", 128), ("document", 128), ("prefix_lm", 64)])
    def test_backward_of_masked_mods_over_ten_key_blocks(ws_backward, name, D):
        # 10 key blocks (5 per kv head): on the persistent grid of 3 programs 4, 3 and 3 each, every program's K / V
        # reloaded between them
        from test_backward import check_backward

        case = CATALOG[name](1, 4, 640, 640, DEVICE)
        q, k, v = rand_qkv(1, 4, 2, 640, 640, D, dtype=torch.bfloat16, seed=7)
        bm = create_block_mask(case.mask_mod, None, None, 640, 640, device=DEVICE)
        check_backward(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=True,
                       name=f"ws backward over ten key blocks, {name}")
        assert ws_backward

    @pytest.mark.parametrize("query_values", [True, False], ids=["compact", "in the tile's layout"])
    @pytest.mark.parametrize("D", [128, 64])
    def test_backward_with_the_masks_query_values_on_a_compact_vector(ws_backward, monkeypatch, D, query_values):
        # launch.WS_BWD_QUERY_VALUES (on by default): the catalog's document mask (doc_q[q_idx]) and one whose query
        # values are a gather of a gather (the document's start) and a difference
        from test_backward import check_backward

        monkeypatch.setattr(launch, "WS_BWD_QUERY_VALUES", query_values)
        doc = (torch.arange(640, device=DEVICE) // 200).to(torch.int32)
        start = torch.arange(0, 800, 200, device=DEVICE, dtype=torch.int32)

        def local_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx - start[doc[q_idx]] >= kv_idx - start[doc[kv_idx]])

        def with_a_head_value(b, h, q_idx, kv_idx):  # start[h % 2] reads h alone: it stays in the mask
            return (doc[q_idx] + start[h % 2] == doc[kv_idx] + start[h % 2]) | (kv_idx < start[h % 2] + 64)

        q, k, v = rand_qkv(1, 4, 2, 640, 640, D, dtype=torch.bfloat16, seed=8)
        for mask in (CATALOG["document"](1, 4, 640, 640, DEVICE).mask_mod, local_causal, with_a_head_value):
            bm = create_block_mask(mask, None, None, 640, 640, device=DEVICE)
            check_backward(q, k, v, block_mask=bm, enable_gqa=True, name="ws backward, query values")
        assert len(ws_backward) == 3

    @pytest.mark.parametrize("score_mod", [None, "softcap"])
    @pytest.mark.parametrize("D", [128, 64])
    @pytest.mark.parametrize("name", ["sliding_window", "prefix_lm", "negative_factor_and_heads", "equal_and_or"])
    def test_decided_mask_terms_leave_the_backward_bit_for_bit(ws_backward, monkeypatch, name, D, score_mod):
        # launch.DECIDE_MASK_TERMS naming the backward templates (none by default, NOTES 90): the warp-specialized
        # dK / dV kernel (and the dQ kernel where the fixture runs it) leave out of a partial tile's mask the terms its
        # index ranges decide: dK and dV the same bits as with the whole mask (test_decide's masks, at a window that
        # cuts 128-wide tiles), dQ too from the dQ kernel (the fused dQ's atomic adds come in no fixed order: there
        # within fp32 sums' rounding), and the reference's
        from flexlite.masks import generate_sliding_window
        from flexlite.mods import generate_tanh_softcap
        from test_backward import check_backward
        from test_decide import MASKS

        mod = MASKS[name][0] if name != "sliding_window" else generate_sliding_window(200)
        sm = generate_tanh_softcap(20.0) if score_mod else None
        q, k, v = [t.requires_grad_() for t in rand_qkv(1, 4, 2, 640, 640, D, dtype=torch.bfloat16, seed=12)]
        grad_out = torch.randn_like(q)
        bm = create_block_mask(mod, None, 4, 640, 640, device=DEVICE)  # (a mask of h: per query head)
        grads = {}
        for on in (False, True):  # (the reference check below with them)
            monkeypatch.setattr(launch, "DECIDE_MASK_TERMS", frozenset({"bwd.py.jinja", "bwd_ws.py.jinja"} if on
                                                                       else ()))
            assert ("mask_mod_decide" in kernel_source(sm, bm, device=DEVICE, kernel="backward_ws")) == on
            out = flex_attention(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=True)
            grads[on] = torch.autograd.grad(out, (q, k, v), grad_out)
        assert all(torch.equal(a, b) for a, b in zip(grads[True][1:], grads[False][1:]))
        if launch.WS_BWD_FUSED_DQ:
            dq = grads[False][0].float()
            torch.testing.assert_close(grads[True][0].float(), dq, rtol=2 ** -7, atol=1e-5 * dq.abs().max().item())
        else:
            assert torch.equal(grads[True][0], grads[False][0])
        check_backward(q.detach(), k.detach(), v.detach(), score_mod=sm, block_mask=bm, enable_gqa=True,
                       name=f"ws backward, decided mask terms, {name}")
        assert ws_backward

    @pytest.mark.parametrize("key_values", [True, False], ids=["compact", "in the tile's layout"])
    @pytest.mark.parametrize("D, L", [(128, 600), (64, 640)], ids=["D128-L600-ragged", "D64-L640"])
    def test_forward_with_the_masks_key_values_on_a_compact_vector(monkeypatch, D, L, key_values):
        # launch.WS_FWD_KEY_VALUES (on by default): mask_mod's values along the keys computed once per partial tile on
        # a compact key vector (the backward's query values with the sides swapped); the catalog's document mask, one
        # whose key values are a gather of a gather and a difference, and one with a value of h alone (it stays in the
        # mask); a ragged length: keys past KV_LEN wrap around for the mods, as in the tile's layout
        import flexlite.api as api
        from flexlite import attention_reference

        monkeypatch.setattr(launch, "WS_FWD_KEY_VALUES", key_values)
        ran = []
        real_launch = api.launch_forward_ws
        monkeypatch.setattr(api, "launch_forward_ws", lambda *a, **kw: ran.append(1) or real_launch(*a, **kw))
        doc = (torch.arange(L, device=DEVICE) // 200).to(torch.int32)
        start = torch.arange(0, 800, 200, device=DEVICE, dtype=torch.int32)

        def local_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx - start[doc[q_idx]] >= kv_idx - start[doc[kv_idx]])

        def with_a_head_value(b, h, q_idx, kv_idx):  # start[h % 2] reads h alone: it stays in the mask
            return (doc[q_idx] + start[h % 2] == doc[kv_idx] + start[h % 2]) | (kv_idx < start[h % 2] + 64)

        q, k, v = rand_qkv(2, 4, 2, L, L, D, dtype=torch.bfloat16, seed=9)
        for mask in (CATALOG["document"](2, 4, L, L, DEVICE).mask_mod, local_causal, with_a_head_value):
            bm = create_block_mask(mask, None, None, L, L, device=DEVICE)
            out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options={"WARP_SPECIALIZE": True})
            ref = attention_reference(q, k, v, block_mask=bm, enable_gqa=True)[0]
            assert_close(out, ref, *TOLERANCES[torch.bfloat16])
        assert len(ran) == 3
        source = api._generate(None, bm, q.device, "fwd_ws.py.jinja").source
        assert ("mask_mod_hoist(off_z, off_h, offs_key" in source) == key_values

    @pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
    def test_dq_is_added_by_the_dkdv_programs_unless_sums_must_be_reproducible(monkeypatch, deterministic):
        import flexlite.api as api
        from test_backward import check_backward

        fused, real = [], launch._launch_dkdv_ws
        monkeypatch.setattr(launch, "_launch_dkdv_ws",
                            _counted(real, lambda args, kwargs: fused.append(kwargs["dq_acc"] is not None)))
        monkeypatch.setattr(api, "_warp_specialize_backward", lambda *args, **kwargs: True)
        q, k, v = rand_qkv(1, 2, 2, 256, 256, 128, dtype=torch.bfloat16, seed=5)
        bm = create_block_mask(CATALOG["causal"](1, 2, 256, 256, DEVICE).mask_mod, None, None, 256, 256,
                               device=DEVICE)
        dq = check_backward(q, k, v, block_mask=bm, name="ws backward")[0]
        grads = []
        was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)  # around flexlite only (the reference's cuBLAS would ask
        try:  # for CUBLAS_WORKSPACE_CONFIG)
            for seed in range(2):
                q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
                out = flex_attention(q_, k_, v_, block_mask=bm)
                g = torch.Generator().manual_seed(0)
                out.backward(torch.randn(out.shape, generator=g).to(out))
                grads.append(q_.grad)
        finally:
            torch.use_deterministic_algorithms(was)
        assert fused == [True] + [not deterministic] * 2
        assert_close(grads[0], dq, *TOLERANCES[torch.bfloat16])
        if deterministic:
            assert torch.equal(grads[0], grads[1])

    def test_whole_tile_gathers_fail_to_compile_and_fall_back():
        case = CATALOG["captured_bias"](1, 2, 256, 256, DEVICE)
        q, k, v = rand_qkv(1, 2, 2, 256, 256, 128, dtype=torch.bfloat16, seed=2)
        with pytest.raises(NotImplementedError, match="cannot compile or fit"):
            flex_attention(q, k, v, score_mod=case.score_mod, kernel_options={"WARP_SPECIALIZE": True})
        case = CATALOG["captured_bias"](1, 2, 256, 4096, DEVICE)
        q, k, v = rand_qkv(1, 2, 2, 256, 4096, 128, dtype=torch.bfloat16, seed=2)
        out = flex_attention(q, k, v, score_mod=case.score_mod)  # would take it, falls back
        assert_close(out, attention_reference(q, k, v, score_mod=case.score_mod)[0], *TOLERANCES[torch.bfloat16])
