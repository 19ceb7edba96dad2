"""Tile choice and the shared-memory fallback of the launcher (a fake kernel stands in for a GPU)."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from flexlite.runtime.launch import TileConfig, fallback_configs, forward_config, run_with_fallback
from helpers import DEVICE, rand_qkv


class FakeKernel:
    """Raises OutOfResources (as Triton does while compiling) when a config needs too much memory."""

    def __init__(self, limit):
        self.limit, self.launched = limit, []

    def __getitem__(self, grid):
        def launch(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, **constexprs):
            need = BLOCK_M * BLOCK_N * num_stages
            if need > self.limit:
                raise OutOfResources(need, self.limit, "shared memory")
            self.launched.append((grid, BLOCK_M, BLOCK_N, num_stages))
        return launch


def test_fallback_order_stages_then_tiles():
    cfgs = list(fallback_configs(TileConfig(64, 32, 4, 3)))
    assert cfgs[:4] == [TileConfig(64, 32, 4, 3), TileConfig(64, 32, 4, 2), TileConfig(64, 32, 4, 1),
                        TileConfig(64, 16, 4, 3)]
    assert cfgs[-1] == TileConfig(16, 16, 4, 1) and len(cfgs) == len(set(cfgs))


def test_run_with_fallback_finds_a_fitting_config_and_remembers_it():
    kernel = FakeKernel(limit=128 * 64)
    grid = lambda cfg: (cfg.BLOCK_M, 1)  # noqa: E731
    cfg = run_with_fallback(kernel, grid, (), {"D": 64}, TileConfig(128, 128, 4, 3), pinned=False)
    assert cfg == TileConfig(128, 64, 4, 1) and kernel.launched == [((128, 1), 128, 64, 1)]
    kernel.limit = 0  # a remembered config is used directly, without retrying the others
    with pytest.raises(OutOfResources):
        run_with_fallback(kernel, grid, (), {"D": 64}, TileConfig(128, 128, 4, 3), pinned=False)


def test_pinned_config_that_does_not_fit_is_a_clear_error():
    with pytest.raises(ValueError, match="do not fit this GPU"):
        run_with_fallback(FakeKernel(limit=1), lambda c: (1,), (), {"D": 32}, TileConfig(64, 64, 4, 2), pinned=True)


def test_forward_config_respects_block_mask_block_size():
    q = torch.empty(1, 1, 1000, 64)
    cfg = forward_config(q, q, (48, 80), {})
    assert 48 % cfg.BLOCK_M == 0 and 80 % cfg.BLOCK_N == 0
    assert forward_config(q, q, (128, 128), {"BLOCK_M": 32, "num_warps": 2}) == TileConfig(32, 128, 2, 1)


def test_captured_scalars_follow_the_kernel_device():
    """0-d CPU tensors (constants a mod builds, like torch.tensor(2.0)) go to the kernel's device, as torch
    lets CPU scalars mix with CUDA tensors; other tensors and plain arguments stay as they are."""
    from flexlite.runtime.launch import scalars_to
    scalar, table = torch.tensor(2.0), torch.ones(3)
    moved = scalars_to([scalar, 1, table, 0.5], torch.device("meta"))
    assert moved[0].device.type == "meta" and moved[0].shape == ()
    assert moved[1:] == [1, table, 0.5] and moved[2] is table
    assert scalars_to([scalar], torch.device("cpu"))[0] is scalar


def test_mods_building_constant_tensors_run():
    """A score_mod / mask_mod that creates tensors while it runs (captured on the CPU at trace time) gives
    the reference result on the test device."""
    from flexlite import attention_reference, create_block_mask, flex_attention
    from helpers import DEVICE, TOLERANCES, assert_close, rand_qkv

    def shifted(score, b, h, q_idx, kv_idx):
        return score * torch.tensor(0.5) + torch.ones(())

    def always(b, h, q_idx, kv_idx):
        return torch.ones((), dtype=torch.bool) & (q_idx >= 0)

    q, k, v = rand_qkv(1, 2, 2, 40, 70, 16)
    bm = create_block_mask(always, None, None, 40, 70, device=DEVICE)
    out = flex_attention(q, k, v, score_mod=shifted, block_mask=bm)
    ref, _ = attention_reference(q, k, v, score_mod=shifted, block_mask=bm)
    assert_close(out, ref, *TOLERANCES[q.dtype])


def test_decode_falls_back_to_tiles_that_fit_without_changing_its_rows(monkeypatch):
    """A mod's gathers are pipelined too, so the decode kernel's tiles can pass shared memory; it then takes
    narrower kv tiles (its BLOCK_M, the packed query rows, stays) and still gives the reference result."""
    import flexlite
    from flexlite.runtime.compile import load_module

    q, k, v = rand_qkv(1, 4, 2, 1, 200, 32, dtype=torch.float32, seed=3)
    module = load_module(flexlite.kernel_source(kernel="decode", device=DEVICE), interpret=DEVICE == "cpu")
    real, seen = module.flex_decode_kernel, []

    class Tight:  # fits only 32-wide kv tiles
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_stages"]))
                if kw["BLOCK_N"] > 32:
                    raise OutOfResources(kw["BLOCK_N"], 32, "shared memory")
                return real[grid](*args, **kw)
            return launch

    flexlite.flex_attention(q, k, v, enable_gqa=True)  # the real kernel first: its tiles fit, for this shape
    monkeypatch.setattr(module, "flex_decode_kernel", Tight())  # another kernel of the same shape still falls back
    out = flexlite.flex_attention(q, k, v, enable_gqa=True)
    ref, _ = flexlite.attention_reference(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert all(m == 16 for m, _, _ in seen)  # the rows stay
    assert seen[-1][1] == 32 and all(n > 32 for _, n, _ in seen[:-1])


class _Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class _Compiled:
    """Stands in for Triton's CompiledKernel: records direct launches."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs, self.hooks = [], []

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid}

    def run(self, g0, g1, g2, stream, function, metadata, launch_meta, enter, exit_, *args):
        self.runs.append(((g0, g1, g2), args))
        self.hooks.append((launch_meta, enter, exit_))


class _JitKernel:
    """Stands in for a JITFunction: X, N runtime parameters, BLOCK constexpr; compiles per specialization."""

    params = [_Param("X", False), _Param("N", False), _Param("BLOCK", True)]

    def __init__(self):
        self.compiles, self.triton_launches = [], 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.triton_launches += 1
            self.compiles.append(_Compiled())
            return self.compiles[-1]
        return launch


def test_compiled_launch_reuses_a_kernel_only_for_the_same_argument_properties(monkeypatch):
    from flexlite.runtime import launch as launch_module
    from flexlite.runtime.launch import CompiledLaunch

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 0))  # no GPU needed
    kernel = _JitKernel()
    launch = CompiledLaunch(kernel, {"BLOCK": 64, "num_warps": 4})
    assert launch.direct and launch.tail == (64,)
    x = torch.zeros(64)
    launch((2,), (x, 32))  # Triton's path, remembered
    launch((3,), (x, 32))  # same properties: direct, the tensor as its address, constexprs appended in order
    assert kernel.triton_launches == 1 and kernel.compiles[0].runs == [((3, 1, 1), (x.data_ptr(), 32, 64))]
    for args in [(x, 33), (x[1:], 32), (x.half(), 32)]:  # another int, address mod 256, dtype: Triton's path
        launch((1,), args)
    assert kernel.triton_launches == 4


def test_a_run_of_ints_is_keyed_as_its_values_and_spread_into_the_launch(monkeypatch):
    """launch.Ints: a run of int arguments keyed as one tuple (a kernel reused only for the same values, as one
    int each would be) and spread into the arguments of both Triton's launch and the direct one."""
    from flexlite.runtime import launch as launch_module
    from flexlite.runtime.launch import CompiledLaunch, Ints

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 0))
    kernel = _JitKernel()
    kernel.params = [_Param("X", False), _Param("N", False), _Param("M", False), _Param("S", False),
                     _Param("BLOCK", True)]
    seen, real = [], _JitKernel.__getitem__

    def triton_launch(self, grid):
        launch = real(self, grid)
        return lambda *args, **kwargs: seen.append(args) or launch(*args, **kwargs)
    monkeypatch.setattr(_JitKernel, "__getitem__", triton_launch)
    launch = CompiledLaunch(kernel, {"BLOCK": 64})
    x = torch.zeros(64)
    launch((2,), (x, Ints((32, 16)), 0.5))  # Triton's path: the ints spread
    assert seen == [(x, 32, 16, 0.5)]
    launch((3,), (x, Ints((32, 16)), 0.25))  # the same values: direct, spread in place
    assert kernel.triton_launches == 1 and kernel.compiles[0].runs == [((3, 1, 1), (x.data_ptr(), 32, 16, 0.25, 64))]
    for ints in (Ints((32, 17)), Ints((1, 16))):  # another value (1: another specialization): Triton's path
        launch((1,), (x, ints, 0.5))
    assert kernel.triton_launches == 3 and seen[-1] == (x, 1, 16, 0.5)


def test_compiled_launch_keys_host_descriptors_by_what_triton_specializes(monkeypatch):
    """A host tensor descriptor reuses the compiled kernel for another base, shape or strides (its launcher encodes
    the tensor map at every launch) and goes to the launcher as it is; another dtype, block shape, layout or padding
    goes through Triton's launch (a kernel of its own)."""
    from types import SimpleNamespace

    from flexlite.runtime import launch as launch_module
    from flexlite.runtime.launch import CompiledLaunch

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 0))

    def desc(base, block_shape=(64, 32), layout="swizzle-128", padding="zero"):
        return SimpleNamespace(base=base, shape=list(base.shape), strides=list(base.stride()),
                               block_shape=list(block_shape), layout=layout, padding=padding)

    kernel = _JitKernel()
    kernel.params = [_Param("DESC", False), _Param("N", False), _Param("BLOCK", True)]
    launch = CompiledLaunch(kernel, {"BLOCK": 64})
    x, y = torch.zeros(256, 32), torch.zeros(512, 32)
    launch((1,), (desc(x), 8))
    second = desc(y)
    launch((2,), (second, 8))  # another base and shape: direct, the descriptor itself to the launcher
    assert kernel.triton_launches == 1 and kernel.compiles[0].runs == [((2, 1, 1), (second, 8, 64))]
    for other in (desc(x.half()), desc(x, block_shape=(128, 32)), desc(x, layout="swizzle-64"),
                  desc(x, padding="nan")):
        launch((1,), (other, 8))
    assert kernel.triton_launches == 5


class _DescLauncher:
    """Stands in for Triton 3.6's CudaLauncher of a kernel with host descriptors: ``launch`` is driver.py's own
    wrapper that expands each descriptor (make_tensordesc_arg) around the compiled launcher, here a recorder."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, signature, metas):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc
        self.received = []
        self.launch = wrap_handle_tensordesc(lambda *args: self.received.append(args), signature, metas)

    def __call__(self, g0, g1, g2, stream, function, *args):  # as CudaLauncher.__call__ with no scratch
        self.launch(g0, g1, g2, stream, function, False, False, None, None, *args)


class _DescKernel(_JitKernel):
    """A kernel stand-in (DESC, N runtime, BLOCK constexpr) whose compiled kernels launch through _DescLauncher."""

    params = [_Param("DESC", False), _Param("N", False), _Param("BLOCK", True)]
    signature = {"DESC": "tensordesc<bf16[64, 32]>", "N": "i32", "BLOCK": "constexpr"}

    def __init__(self, metas, second_desc: bool = False):
        super().__init__()
        self.metas = metas
        if second_desc:  # a second descriptor parameter, after N
            self.params = self.params[:2] + [_Param("DESC2", False), self.params[2]]
            self.signature = {"DESC": self.signature["DESC"], "N": "i32", "DESC2": self.signature["DESC"],
                              "BLOCK": "constexpr"}

    def __getitem__(self, grid):
        from types import SimpleNamespace

        def launch(*args, **kwargs):
            self.triton_launches += 1
            self.compiles.append(SimpleNamespace(
                run=_DescLauncher(self.signature, self.metas), function="fn", packed_metadata="meta",
                metadata=SimpleNamespace(tensordesc_meta=self.metas), triton_args=args,
                launch_metadata=lambda grid, stream, *args: {"grid": grid, "desc": type(args[0]).__name__}))
            return self.compiles[-1]
        return launch


@pytest.mark.parametrize("variant", ["maps kept", "scratch memory", "CACHED_TENSOR_MAPS off"])
def test_rows_descriptors_reach_the_launcher_as_tritons_wrapper_expands_them(monkeypatch, variant):
    """A RowsDescriptor goes to Triton's launch as Gluon's TensorDescriptor of the tensor's rows; launched directly,
    the compiled launcher gets what Triton's own descriptor wrapper would hand it (same arguments, in the same
    places), with each tensor map encoded once per address, shape and strides, and again for another. A kernel that
    needs scratch memory, or any with launch.CACHED_TENSOR_MAPS off, launches through Triton's launcher (the wrapper
    encoding at every launch)."""
    from triton import knobs
    from triton.backends.nvidia import driver

    from flexlite.runtime import launch as launch_module
    from flexlite.runtime.launch import CompiledLaunch, RowsDescriptor, _ws_smem_layout

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 7))
    encoded = []

    def encode(desc, meta):  # stands in for the driver's cuTensorMapEncodeTiled
        encoded.append((desc.base.data_ptr(), tuple(desc.shape)))
        return [("map", desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape),
                 meta), *desc.shape, *desc.strides]
    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    kernel = _DescKernel([{"swizzle": 3}])
    layout = _ws_smem_layout(64, 32, torch.bfloat16)
    x, y = torch.randn(2, 4, 64, 32).bfloat16(), torch.randn(2, 2, 128, 32).bfloat16()
    monkeypatch.setattr(_DescLauncher, "global_scratch_size", 256 if variant == "scratch memory" else 0)
    monkeypatch.setattr(launch_module, "CACHED_TENSOR_MAPS", variant != "CACHED_TENSOR_MAPS off")
    launch = CompiledLaunch(kernel, {"BLOCK": 64})
    launch((1,), (RowsDescriptor(x, (64, 32), layout), 8))  # Triton's launch: a TensorDescriptor of x's rows
    made = kernel.compiles[0].triton_args[0]
    assert (made.base.data_ptr(), list(made.shape), list(made.strides), list(made.block_shape), made.layout) == (
        x.data_ptr(), [512, 32], [32, 1], [64, 32], layout)
    run, ours = kernel.compiles[0].run, []
    for t in (x, x, y, x):
        before = len(encoded)
        launch((3, 2), (RowsDescriptor(t, (64, 32), layout), 8))
        ours.append(encoded[before:])
        want = len(run.received)
        run(3, 2, 1, 7, "fn", "meta", None, None, None, RowsDescriptor(t, (64, 32), layout).make(), 8, 64)
        assert run.received[want] == run.received[want - 1]  # Triton's wrapper and the direct launch agree
    assert kernel.triton_launches == 1
    assert run.received[0][:13] == (3, 2, 1, 7, "fn", False, False, None, None, "meta", None, None, None)
    assert run.received[0][13:] == (("map", x.data_ptr(), (512, 32), (32, 1), (64, 32), {"swizzle": 3}),
                                    512, 32, 32, 1, 8, 64)
    assert ours == ([[(x.data_ptr(), (512, 32))], [], [(y.data_ptr(), (512, 32))], []] if variant == "maps kept"
                    else [[(t.data_ptr(), (512, 32))] for t in (x, x, y, x)])
    chain = knobs.runtime.launch_enter_hook

    def hook(meta):
        pass
    chain.add(hook)  # a launch hook: the made descriptors through Triton's launcher, for its launch metadata
    try:
        launch((3, 2), (RowsDescriptor(y, (64, 32), layout), 8))
    finally:
        chain.remove(hook)
    assert run.received[-1][10] == {"grid": (3, 2), "desc": "TensorDescriptor"} and run.received[-1][11] is chain
    assert run.received[-1][13:] == run.received[4][13:]  # (y's first direct launch)


def test_a_descriptor_not_a_rows_descriptor_sends_the_launch_through_tritons_launcher(monkeypatch):
    """Expanded maps are passed only where every descriptor argument is a RowsDescriptor: beside another kind of
    descriptor, Triton's launcher (its wrapper) expands them all, the RowsDescriptor made into Gluon's descriptor."""
    from types import SimpleNamespace

    from triton.backends.nvidia import driver

    from flexlite.runtime import launch as launch_module
    from flexlite.runtime.launch import CompiledLaunch, RowsDescriptor, _ws_smem_layout

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 7))
    monkeypatch.setattr(driver, "make_tensordesc_arg",
                        lambda desc, meta: [("map", desc.base.data_ptr()), *desc.shape, *desc.strides])
    kernel = _DescKernel([{"swizzle": 3}, {"swizzle": 3}], second_desc=True)
    layout = _ws_smem_layout(64, 32, torch.bfloat16)
    x, y = torch.randn(256, 32).bfloat16(), torch.randn(128, 32).bfloat16()
    other = SimpleNamespace(base=y, shape=[128, 32], strides=[32, 1], block_shape=[64, 32], layout=layout,
                            padding="zero")
    launch = CompiledLaunch(kernel, {"BLOCK": 64})
    for _ in range(2):
        launch((1,), (RowsDescriptor(x, (64, 32), layout), 8, other))
    assert kernel.triton_launches == 1
    assert kernel.compiles[0].run.received[-1][13:] == (("map", x.data_ptr()), 256, 32, 32, 1, 8,
                                                        ("map", y.data_ptr()), 128, 32, 32, 1, 64)


def test_compiled_launch_is_one_per_kernel_and_kwargs(monkeypatch):
    from flexlite.runtime import launch as launch_module
    from flexlite.runtime.launch import compiled_launch

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 0))
    kernel, other = _JitKernel(), _JitKernel()
    first = compiled_launch(kernel, {"BLOCK": 64, "num_warps": 4})
    assert compiled_launch(kernel, {"BLOCK": 64, "num_warps": 4}) is first
    assert first.kwargs == {"BLOCK": 64, "num_warps": 4} and first.kernel is kernel
    assert compiled_launch(kernel, {"BLOCK": 32, "num_warps": 4}) is not first
    assert compiled_launch(other, {"BLOCK": 64, "num_warps": 4}).kernel is other


def test_run_with_fallback_launches_a_remembered_config_directly(monkeypatch):
    """Once a config is known to fit, run_with_fallback launches through compiled_launch: the grid function still
    runs first (it sets constexprs that depend on the config), and Triton's launch is needed once more only (to
    hand back the compiled kernel), then never."""
    from flexlite.runtime import launch as launch_module

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 0))
    kernel = _JitKernel()
    kernel.params = [_Param("X", False), _Param("N", False), _Param("BLOCK_M", True), _Param("BLOCK_N", True),
                     _Param("EVEN", True)]
    x = torch.zeros(64)
    for _ in range(3):  # each call with its own constexprs, as launch_forward's
        constexprs = {}

        def grid(cfg):
            constexprs["EVEN"] = 200 % cfg.BLOCK_M == 0
            return (cfg.BLOCK_M, 2)
        cfg = run_with_fallback(kernel, grid, (x, 200), constexprs, TileConfig(64, 32, 4, 2), pinned=False)
        assert cfg == TileConfig(64, 32, 4, 2)
    assert kernel.triton_launches == 2
    assert kernel.compiles[-1].runs == [((64, 2, 1), (x.data_ptr(), 200, 64, 32, False))]


def test_compiled_launch_builds_launch_metadata_only_for_launch_hooks(monkeypatch):
    """Triton 3.6's launch hooks are chains, empty unless a profiler adds to them: an empty chain goes to the
    launcher as None, without launch metadata; a hook that is there sees the launch as under Triton's launch."""
    from triton import knobs

    from flexlite.runtime import launch as launch_module
    from flexlite.runtime.launch import CompiledLaunch

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 0))
    kernel = _JitKernel()
    launch = CompiledLaunch(kernel, {"BLOCK": 64})
    x = torch.zeros(64)
    launch((1,), (x, 32))
    launch((2,), (x, 32))
    compiled = kernel.compiles[0]
    assert compiled.hooks == [(None, None, None)]
    chain = knobs.runtime.launch_enter_hook  # (Triton 3.6, which the direct launches need)

    def hook(meta):
        pass
    chain.add(hook)
    try:
        launch((3,), (x, 32))
    finally:
        chain.remove(hook)
    assert compiled.hooks[-1] == ({"grid": (3,)}, chain, None)


def test_compiled_launches_off_sends_every_launch_through_triton(monkeypatch):
    from flexlite.runtime import launch as launch_module
    from flexlite.runtime.launch import CompiledLaunch

    monkeypatch.setattr(launch_module, "_current_device_and_stream", lambda: (0, 0))
    monkeypatch.setattr(launch_module, "COMPILED_LAUNCHES", False)
    kernel = _JitKernel()
    launch = CompiledLaunch(kernel, {"BLOCK": 64})
    x = torch.zeros(64)
    for _ in range(3):
        launch((1,), (x, 32))
    assert kernel.triton_launches == 3 and all(c.runs == [] for c in kernel.compiles)


def test_compiled_launch_leaves_interpreted_or_unusual_kernels_to_triton():
    from flexlite.runtime.launch import CompiledLaunch

    class Interpreted:  # no jit parameters (Triton's interpreter)
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append(args)

    calls = []
    launch = CompiledLaunch(Interpreted(), {"BLOCK": 16})
    assert not launch.direct
    launch((1,), (1, 2))
    launch((1,), (1, 2))
    assert calls == [(1, 2), (1, 2)]
    kernel = _JitKernel()
    kernel.params = [_Param("BLOCK", True), _Param("X", False)]  # a constexpr before a runtime parameter
    assert not CompiledLaunch(kernel, {"BLOCK": 16}).direct
    assert not CompiledLaunch(_JitKernel(), {}).direct  # a constexpr without a value


# on a GPU: the warp-specialized kernels (D128, D64) and the Triton ones, and the warp-specialized forward making its
# tensor descriptors on the device (strided inputs, [B, L, H, D] in memory); the interpreter (no direct launches
# there): small cases, for the values
_REPEATED = ([(name, D, ws, False) for name in ("document", "softcap_causal") for D in (128, 64) for ws in (None, False)]
             + [("document", 128, True, True)] if DEVICE == "cuda"
             else [("document", 16, None, False), ("document", 16, None, True)])


@pytest.mark.parametrize("name, D, ws, strided", _REPEATED, ids=str)
def test_repeated_training_calls_launch_directly_and_match_the_reference(monkeypatch, name, D, ws, strided):
    """A training loop's calls: one shape, new values each call, forward and backward. On a GPU, from the third call
    on no kernel goes through Triton's launch path (JITFunction.run): each launches its compiled kernel directly
    (launch.compiled_launch), and every call's output and gradients still match the reference."""
    from triton.runtime.jit import JITFunction

    from flexlite import attention_reference, create_block_mask, flex_attention

    from catalog import CATALOG
    from helpers import TOLERANCES, assert_close, assert_grad_close

    cuda = DEVICE == "cuda"
    B, H, L, dtype = (1, 2, 256, torch.bfloat16) if cuda else (1, 1, 128, torch.float32)
    case = CATALOG[name](B, H, L, L, DEVICE)
    bm = create_block_mask(case.mask_mod, None, None, L, L, device=DEVICE)
    options = None if ws is None else {"WARP_SPECIALIZE": ws}
    triton_runs = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: triton_runs.append(self) or run(self, *a, **kw))
    for call in range(3):
        q, k, v = rand_qkv(B, H, H, L, L, D, dtype=dtype, seed=call)
        if strided:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        grad_out = torch.randn(B, H, L, D, dtype=dtype, device=DEVICE)
        triton_runs.clear()
        out = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, kernel_options=options)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        if cuda and call == 2:
            assert triton_runs == []
        inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*inputs, score_mod=case.score_mod, block_mask=bm)[0]
        assert_close(out, ref, *TOLERANCES[dtype], name=f"call {call} output")
        for grad_name, got, want in zip(("dq", "dk", "dv"), grads,
                                        torch.autograd.grad(ref, inputs, grad_out.double())):
            assert_grad_close(got, want, dtype, f"call {call} {grad_name}")


def test_device_facts_come_from_detect_gpu(monkeypatch):
    """The decode path's SM count and compute capability are utils.gpu.detect_gpu's, asked once per device."""
    from types import SimpleNamespace

    from flexlite.runtime import launch
    from flexlite.utils import gpu

    asked = []
    monkeypatch.setattr(gpu, "detect_gpu", lambda i: asked.append(i) or SimpleNamespace(
        num_sms=132, compute_capability=(9, 0)))
    launch._device_facts.cache_clear()
    try:
        for _ in range(2):
            assert launch._device_facts(torch.device("cuda", 1)) == (132, 9)
        assert asked == [1]
    finally:
        launch._device_facts.cache_clear()


def _gpu_spec(D, dtype=torch.bfloat16):
    """What the tile heuristics read of a tensor, as on a GPU (no GPU needed)."""
    import types
    return types.SimpleNamespace(shape=(1, 1, 8192, D), dtype=dtype, device=torch.device("cuda"))


@pytest.mark.parametrize("D, gathers, m1", [(128, False, 64), (128, True, 32), (64, False, 64), (64, True, 64)])
def test_backward_config_steps_32_queries_when_a_d128_mod_gathers(D, gathers, m1):
    from flexlite.runtime.launch import backward_config
    spec = _gpu_spec(D)
    cfg = backward_config(spec, spec, (128, 128), {}, gathers=gathers)
    assert (cfg.BLOCK_M1, cfg.BLOCK_N1) == (m1, 64)
    pinned = backward_config(spec, spec, (128, 128), {"BLOCK_M1": 16}, gathers=gathers)
    assert pinned.BLOCK_M1 == 16  # kernel_options still win


def test_flex_attention_tells_the_backward_heuristic_whether_a_mod_gathers(monkeypatch):
    import flexlite.api
    from flexlite import create_block_mask, first_calls, flex_attention
    from flexlite.masks import causal_mask, generate_doc_mask_mod
    from flexlite.mods import generate_alibi_bias, generate_tanh_softcap

    monkeypatch.setattr(first_calls, "ENABLED", False)  # (this call's own backward alone, not the worker's)
    seen, real = [], flexlite.api.backward_config

    def spy(*args, gathers=False, **kwargs):
        seen.append(gathers)
        return real(*args, gathers=gathers, **kwargs)
    monkeypatch.setattr(flexlite.api, "backward_config", spy)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 32, 32, 16))
    document = torch.tensor([0] * 20 + [1] * 12, device=DEVICE)
    masks = {"causal": create_block_mask(causal_mask, None, None, 32, 32, device=DEVICE),
             "document": create_block_mask(generate_doc_mask_mod(causal_mask, document), None, None, 32, 32,
                                           device=DEVICE)}
    for score_mod, mask in [(generate_alibi_bias(2, device=DEVICE), None), (generate_tanh_softcap(20.0), None),
                            (None, None), (None, "causal"), (None, "document")]:
        flex_attention(q, k, v, score_mod=score_mod, block_mask=masks.get(mask)).sum().backward()
    assert seen == [True, False, False, False, True]


def test_kernels_launch_on_the_inputs_gpu(monkeypatch):
    """Triton launches on the current CUDA device: on_device / work_scope make the inputs' GPU current where it is not
    (cuda:1 tensors while cuda:0 is current) and do nothing for the current GPU or CPU tensors; flex_attention's
    forward and backward, create_block_mask and triton_matmul all launch inside them, for their inputs' device."""
    import contextlib

    import flexlite.api as api
    import flexlite.block_mask as block_mask
    import flexlite.kernels.matmul as matmul
    from flexlite import create_block_mask, first_calls, flex_attention
    from flexlite.runtime.guards import on_device, work_scope
    from flexlite.kernels import triton_matmul

    monkeypatch.setattr(first_calls, "ENABLED", False)  # (the calls' own launches, in this thread: not the worker's)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    switch = on_device(torch.device("cuda", 1))
    assert isinstance(switch, torch.cuda.device) and switch.idx == 1
    assert isinstance(on_device(torch.device("cuda", 0)), contextlib.nullcontext)
    assert isinstance(on_device(torch.device("cpu")), contextlib.nullcontext)
    cpu = torch.zeros(1)
    assert isinstance(work_scope(cpu, False), contextlib.nullcontext)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with work_scope(cpu, True):  # under autocast (the inputs cast already): autocast off inside
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")

    seen = []

    def spy(device):
        seen.append(torch.device(device).type)
        return contextlib.nullcontext()
    for module in (block_mask, matmul):
        monkeypatch.setattr(module, "on_device", spy)
    # flex_attention's forward and backward: work_scope (on_device's switch, and autocast off under autocast)
    monkeypatch.setattr(api, "work_scope", lambda tensor, autocast: spy(tensor.device))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 32, 32, device=DEVICE)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 1, 1, 32, 32, 16))
    flex_attention(q, k, v, block_mask=bm).sum().backward()
    triton_matmul(q[0, 0].detach(), k[0, 0].detach().t(), use_autotune=False)  # one launch (no timing runs)
    want = torch.device(DEVICE).type
    # the mask kernel where create_block_mask runs one (CUDA; CPU vmaps mask_mod), the forward, the backward, the matmul
    assert seen == [want] * (4 if want == "cuda" else 3)
