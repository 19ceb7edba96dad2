"""Split-KV decoding kernel (short queries over a long KV) vs the fp64 reference, GQA packing, the
combine step, and the KV-cache pattern that needs no new kernel per step."""

import pytest
import torch

from catalog import CATALOG, USES_BH
from flexlite import attention_reference, create_block_mask, first_calls, flex_attention
from flexlite.masks.kv_cache import generate_kv_cache_causal
from flexlite.runtime import compile as compile_module
from helpers import DEVICE, LSE_TOLERANCES, TOLERANCES, assert_close, rand_qkv

# (B, Hq, Hkv, Lq, Lkv, D)
SHAPES = [
    pytest.param((2, 8, 2, 1, 300, 64), id="B2-H8-Hkv2-Lq1-Lkv300-D64"),
    pytest.param((1, 4, 1, 7, 513, 80), id="B1-H4-Hkv1-Lq7-Lkv513-D80-mqa"),
    pytest.param((1, 2, 2, 64, 200, 128), id="B1-H2-Lq64-Lkv200-D128"),
    pytest.param((2, 4, 2, 33, 33, 32), id="B2-H4-Hkv2-Lq33-Lkv33-D32"),
]


def _case(name, shape, dtype, splits):
    B, Hq, Hkv, Lq, Lkv, D = shape
    case = CATALOG[name](B, Hq, Lq, Lkv, DEVICE)
    q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=dtype, seed=Lq * 7 + Lkv)
    bm = None
    if case.mask_mod is not None:
        mb, mh = (B, Hq) if name in USES_BH else (None, None)
        bm = create_block_mask(case.mask_mod, mb, mh, Lq, Lkv, device=DEVICE, BLOCK_SIZE=64)
    out, lse = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=True, return_lse=True,
                              kernel_options={"DECODE": True, "DECODE_SPLITS": splits})
    ref, ref_lse = attention_reference(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=True)
    assert_close(out, ref, *TOLERANCES[dtype], name=f"{name} out")
    assert_close(lse, ref_lse, *LSE_TOLERANCES[dtype], name=f"{name} lse")


@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog_decode(name, shape, splits):
    _case(name, shape, torch.float32, splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["causal_bottom_right", "alibi_causal", "document"])
def test_decode_dtypes(name, dtype):
    _case(name, (2, 8, 2, 3, 700, 64), dtype, 4)


def test_short_queries_pick_decode_and_match_the_regular_kernel():
    q, k, v = rand_qkv(1, 4, 2, 4, 300, 64)
    bm = create_block_mask(CATALOG["causal_bottom_right"](1, 4, 4, 300, DEVICE).mask_mod, None, None, 4, 300,
                           device=DEVICE)
    auto = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    regular = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options={"DECODE": False})
    torch_flag = flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                                kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
    assert_close(auto, regular, 1e-5, 1e-5)
    assert torch.equal(regular, torch_flag)


@pytest.mark.parametrize("backend, decodes", [("TRITON_DECODE", True), ("TRITON", False), ("AUTO", True),
                                               ("FLASH", True)])
def test_torch_backend_option_picks_the_kernel(monkeypatch, backend, decodes):
    """torch's kernel_options BACKEND: "TRITON_DECODE" is DECODE=True, "TRITON" DECODE=False, "AUTO" and "FLASH"
    flexlite's choice (decoding, for these 3 queries); the output is that of the DECODE setting; bad values and
    combinations with DECODE / FORCE_USE_FLEX_ATTENTION are refused, as torch does."""
    import flexlite.api as api
    ran = []
    real = api.launch_decode
    monkeypatch.setattr(api, "launch_decode", lambda *a, **kw: ran.append(True) or real(*a, **kw))
    q, k, v = rand_qkv(1, 4, 2, 3, 300, 32)
    out = flex_attention(q, k, v, enable_gqa=True, kernel_options={"BACKEND": backend})
    assert ran == [True] * decodes
    assert torch.equal(out, flex_attention(q, k, v, enable_gqa=True, kernel_options={"DECODE": decodes}))
    ran.clear()  # (torch's forward-pass form: the forward is the pass with the choice)
    assert torch.equal(out, flex_attention(q, k, v, enable_gqa=True, kernel_options={"fwd_BACKEND": backend}))
    assert ran == [True] * decodes
    with pytest.raises(ValueError, match=r"BACKEND must be one of \['AUTO', 'TRITON', 'TRITON_DECODE', 'FLASH'\]"):
        flex_attention(q, k, v, enable_gqa=True, kernel_options={"BACKEND": backend.lower()})
    for other in ("DECODE", "FORCE_USE_FLEX_ATTENTION"):
        with pytest.raises(ValueError, match=f"BACKEND cannot be combined with {other}"):
            flex_attention(q, k, v, enable_gqa=True, kernel_options={"BACKEND": backend, other: True})


def test_decode_and_force_use_flex_attention_together_are_refused(monkeypatch):
    """DECODE=True insists on the decode kernel, FORCE_USE_FLEX_ATTENTION=True forbids it: both in the forward's
    options is a ValueError naming the two keys as written (DECODE won, silently); a FORCE_USE_FLEX_ATTENTION that the
    forward does not see (bwd_, or overridden by fwd_ ... False) is no conflict, and the decode kernel runs."""
    import flexlite.api as api
    q, k, v = rand_qkv(1, 4, 2, 3, 300, 32)
    for options, decode, force in (({"DECODE": True, "FORCE_USE_FLEX_ATTENTION": True}, "DECODE",
                                     "FORCE_USE_FLEX_ATTENTION"),
                                    ({"fwd_DECODE": True, "FORCE_USE_FLEX_ATTENTION": True}, "fwd_DECODE",
                                     "FORCE_USE_FLEX_ATTENTION"),
                                    ({"DECODE": True, "fwd_FORCE_USE_FLEX_ATTENTION": True}, "DECODE",
                                     "fwd_FORCE_USE_FLEX_ATTENTION")):
        with pytest.raises(ValueError, match=f"kernel_options {decode}=True .*cannot be combined with {force}=True: "
                                             f".*pass one of them"):
            flex_attention(q, k, v, enable_gqa=True, kernel_options=options)
    ran = []
    real = api.launch_decode
    monkeypatch.setattr(api, "launch_decode", lambda *a, **kw: ran.append(True) or real(*a, **kw))
    for options in ({"DECODE": True, "bwd_FORCE_USE_FLEX_ATTENTION": True},
                    {"DECODE": True, "FORCE_USE_FLEX_ATTENTION": True, "fwd_FORCE_USE_FLEX_ATTENTION": False}):
        flex_attention(q, k, v, enable_gqa=True, kernel_options=options)
    assert ran == [True, True]


def test_decode_with_pinned_forward_tiles_is_refused(monkeypatch):
    """DECODE=True picks the decoding kernel, which takes no tile config; pinned forward tiles pick the regular kernel
    (without DECODE): both is a ValueError naming the keys as written (the pins were ignored, silently); tiles pinned
    for the backward alone (bwd_) are no conflict, and the decode kernel runs."""
    import flexlite.api as api
    q, k, v = rand_qkv(1, 4, 2, 3, 300, 32)
    for options, named in (({"DECODE": True, "BLOCK_M": 16}, r"\['BLOCK_M'\]"),
                           ({"BACKEND": "TRITON_DECODE", "fwd_num_warps": 8, "BLOCK_N": 16},
                            r"\['BLOCK_N', 'fwd_num_warps'\]")):
        with pytest.raises(ValueError, match=r"DECODE=True \(or torch's BACKEND='TRITON_DECODE'\) picks the decoding "
                                             rf"kernel, which takes no tile config, so the forward's pinned {named} "
                                             r"would be ignored"):
            flex_attention(q, k, v, enable_gqa=True, kernel_options=options)
    ran = []
    real = api.launch_decode
    monkeypatch.setattr(api, "launch_decode", lambda *a, **kw: ran.append(True) or real(*a, **kw))
    flex_attention(q, k, v, enable_gqa=True, kernel_options={"DECODE": True, "bwd_num_warps": 8, "bwd_BLOCK_M1": 16})
    assert ran == [True]


def test_decode_refuses_long_queries():
    q, k, v = rand_qkv(1, 1, 1, 100, 100, 16)
    for options in ({"DECODE": True}, {"BACKEND": "TRITON_DECODE"}):
        with pytest.raises(ValueError, match=r"DECODE=True \(or torch's BACKEND='TRITON_DECODE'\) needs at most 64"):
            flex_attention(q, k, v, kernel_options=options)


def test_rows_no_split_sees_are_zero_with_lse_minus_inf():
    # with many splits some see only masked tiles; with every key masked, no split sees anything
    q, k, v = rand_qkv(1, 4, 2, 3, 500, 32)

    def late_keys(b, h, q_idx, kv_idx):
        return (kv_idx > 400) & (q_idx != 1)
    bm = create_block_mask(late_keys, None, None, 3, 500, device=DEVICE, BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True,
                              kernel_options={"DECODE": True, "DECODE_SPLITS": 7})
    ref, ref_lse = attention_reference(q, k, v, block_mask=bm, enable_gqa=True)
    assert (out[:, :, 1] == 0).all() and torch.isneginf(lse[:, :, 1]).all()
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.float32], name="lse")


def test_kv_cache_steps_reuse_trace_and_kernel(monkeypatch):
    monkeypatch.setattr(first_calls, "ENABLED", False)  # (counts the kernel modules of this call's own kernels alone)
    offset = torch.tensor(0, device=DEVICE)
    mask = generate_kv_cache_causal(offset)
    B, Hq, Hkv, D = 1, 4, 2, 32
    n_modules = None
    for cache_len in (100, 101, 163):
        offset.fill_(cache_len - 2)
        q, k, v = rand_qkv(B, Hq, Hkv, 2, cache_len, D, seed=cache_len)
        bm = create_block_mask(mask, None, None, 2, cache_len, device=DEVICE, BLOCK_SIZE=32)
        out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        ref, _ = attention_reference(q, k, v, block_mask=bm, enable_gqa=True)
        assert_close(out, ref, *TOLERANCES[torch.float32], name=f"step {cache_len}")
        if n_modules is None:
            n_modules = len(compile_module._MODULES)
    assert len(compile_module._MODULES) == n_modules


@pytest.mark.parametrize("decode", [False, True], ids=["attention kernel", "decoding kernel"])
def test_kv_cache_with_a_cache_length_per_batch_element(decode):
    # generate_kv_cache_causal with a 1-D offset: each sample's queries sit at its own offset, so a sample's output is
    # attention over its own cache alone (the batch's longer caches' keys past it never seen)
    lengths = [37, 100, 64]
    Lq, Lkv = 2, max(lengths)
    offset = torch.tensor([n - Lq for n in lengths], device=DEVICE)
    q, k, v = rand_qkv(len(lengths), 4, 2, Lq, Lkv, 32, seed=3)
    mask = generate_kv_cache_causal(offset)
    bm = create_block_mask(mask, len(lengths), None, Lq, Lkv, device=DEVICE, BLOCK_SIZE=32)
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options={"DECODE": decode})
    for b, n in enumerate(lengths):
        alone = generate_kv_cache_causal(torch.tensor(n - Lq, device=DEVICE))
        ref, _ = attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], enable_gqa=True,
                                     block_mask=create_block_mask(alone, None, None, Lq, n, device=DEVICE,
                                                                  BLOCK_SIZE=32))
        assert_close(out[b:b + 1], ref, *TOLERANCES[torch.float32], name=f"sample {b}")
    offset += 1  # a step on: the same mod reads the new positions
    q1, k1, v1 = rand_qkv(len(lengths), 4, 2, Lq, Lkv + 1, 32, seed=4)
    bm = create_block_mask(mask, len(lengths), None, Lq, Lkv + 1, device=DEVICE, BLOCK_SIZE=32)
    out = flex_attention(q1, k1, v1, block_mask=bm, enable_gqa=True, kernel_options={"DECODE": decode})
    ref, _ = attention_reference(q1, k1, v1, block_mask=bm, enable_gqa=True)
    assert_close(out, ref, *TOLERANCES[torch.float32], name="next step")


def test_kv_cache_offset_must_be_an_int_tensor():
    with pytest.raises(TypeError, match="0-d integer tensor"):
        generate_kv_cache_causal(5)


@pytest.mark.parametrize("programs, tiles, sms, want", [
    (64, 512, 132, 8),    # H200, B8 x 8 KV heads: 8 splits fill 3.9 waves, 9 would leave the 5th wave 36 % full
    (8, 2048, 132, 66),   # B1: 66 splits are exactly 4 waves
    (64, 3, 132, 2),      # never more splits than key tiles
    (1, 1, 2, 1),
    (4096, 64, 132, 1),   # plenty of programs: no split
])
def test_decode_split_count(programs, tiles, sms, want):
    from flexlite.runtime.launch import decode_splits
    got = decode_splits(programs, tiles, sms, waves=4)
    assert got == want
    assert 1 <= got <= tiles


def test_inference_calls_build_no_autograd_node(monkeypatch):
    """Without grad mode, or with no input needing a gradient, flex_attention runs the kernels directly (less
    host time per decode step); with one, it goes through the autograd function."""
    from flexlite import api

    q, k, v = rand_qkv(1, 4, 2, 1, 100, 32, seed=2)
    ref, _ = attention_reference(q, k, v, enable_gqa=True)

    def no_autograd(*args):
        raise AssertionError("autograd function used for an inference call")

    with monkeypatch.context() as m:
        m.setattr(api.FlexAttentionFunction, "apply", no_autograd)
        for grad_mode in (True, False):
            with torch.set_grad_enabled(grad_mode):
                out = flex_attention(q, k, v, enable_gqa=True)
            assert out.grad_fn is None
            assert_close(out, ref, 1e-5, 1e-5)
    q.requires_grad_(True)
    assert flex_attention(q, k, v, enable_gqa=True).grad_fn is not None


@pytest.mark.parametrize("lq", [1, 100])  # the decode kernel, the forward kernel
@pytest.mark.parametrize("use_tma", [True, False])
def test_use_tma_option_reaches_the_kernels(monkeypatch, lq, use_tma):
    """kernel_options USE_TMA switches the decode kernel's K / V loads to tensor descriptors as the forward's
    (Triton's interpreter runs descriptors too: tma_ok, which wants a Hopper GPU, is forced here); the result is
    the reference's either way."""
    from flexlite.runtime import launch

    used, install = [], launch._ensure_allocator
    q, k, v = rand_qkv(2, 8, 2, lq, 300, 64, seed=9)

    def ensure_allocator():  # called only for descriptors; a GPU needs the allocator (the interpreter does not)
        used.append(True)
        if q.is_cuda:
            install()
    monkeypatch.setattr(launch, "tma_ok", lambda *tensors: True)
    monkeypatch.setattr(launch, "_ensure_allocator", ensure_allocator)
    out = flex_attention(q, k, v, enable_gqa=True, kernel_options={"USE_TMA": use_tma})
    assert_close(out, attention_reference(q, k, v, enable_gqa=True)[0], *TOLERANCES[torch.float32])
    assert bool(used) == use_tma


def test_repeated_decode_steps_match_the_reference():
    """A decode loop: one shape, new values each step, a mod with a captured tensor. From the second step on a
    GPU launches the compiled kernels directly (launch.CompiledLaunch); every step still gives the reference."""
    from flexlite.mods import generate_alibi_bias

    alibi = generate_alibi_bias(8, device=DEVICE)
    q, k, v = rand_qkv(2, 8, 2, 1, 300, 64, seed=11)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g))
        out = flex_attention(q, k, v, score_mod=alibi, enable_gqa=True)
        ref, _ = attention_reference(q, k, v, score_mod=alibi, enable_gqa=True)
        assert_close(out, ref, *TOLERANCES[torch.float32])


def test_torch_paged_attention_runs_as_it_is():
    """torch's experimental PagedAttention (attention-gym's): sequences of several lengths in one paged KV cache of
    batch 1, a decode step's queries through its physical BlockMask and its page-translating mask_mod / score_mod
    (torch's BlockMask, batch-1 key / value): each sequence's output is the reference over its own keys."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    B, H, D, page, n_pages = 3, 2, 16, 32, 24
    lengths = [100, 37, 200]
    paged = PagedAttention(n_pages, page, B, device=DEVICE)
    k_cache = torch.zeros(1, H, n_pages * page, D, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    keys = []
    for b, n in enumerate(lengths):
        k, v = rand_qkv(1, H, H, n, n, D, seed=b)[1:]
        paged.reserve(torch.tensor(b, device=DEVICE), torch.tensor(n, device=DEVICE))
        paged.assign(torch.tensor([b], device=DEVICE), torch.arange(n, device=DEVICE)[None], k, v, k_cache, v_cache)
        keys.append((k, v))
    q = rand_qkv(B, H, H, 1, 1, D, seed=7)[0]
    last = torch.tensor(lengths, device=DEVICE) - 1

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= last[b] + q_idx

    def bias(score, b, h, q_idx, kv_idx):
        return score - 0.01 * (last[b] + q_idx - kv_idx) * (h + 1)

    logical = torch_create_block_mask(causal, B, 1, 1, 256, device=DEVICE, BLOCK_SIZE=(32, page))
    physical = paged.convert_logical_block_mask(logical)
    physical.mask_mod = paged.get_mask_mod(causal)
    out = flex_attention(q, k_cache, v_cache, block_mask=physical, score_mod=paged.get_score_mod(bias))
    for b, (k, v) in enumerate(keys):
        def own_bias(score, b_, h, q_idx, kv_idx, b=b):  # sequence b alone: its batch index is 0 here
            return bias(score, b, h, q_idx, kv_idx)
        ref = attention_reference(q[b:b + 1], k, v, score_mod=own_bias)[0]
        assert_close(out[b:b + 1], ref, *TOLERANCES[torch.float32], name=f"sequence {b}")


def test_more_decode_splits_than_key_tiles_run_as_many_as_there_are_tiles():
    """kernel_options DECODE_SPLITS past the key tiles: one split per tile runs (the others would walk nothing). 4097
    splits at value head dim 256 made a combine tile past Triton's largest (an InterpreterError 'numel (2097152)
    exceeds triton maximum tensor numel' from inside the call, after 4097 decode programs); a count the combine step
    cannot merge where there are that many tiles is a ValueError naming DECODE_SPLITS."""
    from flexlite.runtime import launch

    q, k, v = rand_qkv(1, 1, 1, 1, 20, 256, seed=3)
    out, lse = flex_attention(q, k, v, return_lse=True, kernel_options={"DECODE": True, "DECODE_SPLITS": 4097})
    ref, ref_lse = attention_reference(q, k, v)
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.float32], name="lse")
    tiles = tuple(launch._INTERPRETER_DECODE_TILES.items())
    plan = launch._decode_plan(torch.device("cpu"), 1, 1, 1, 16, 1, 20, 256, (128, 128), 1, False, False, 4097,
                               False, False, tiles)
    assert plan.num_splits == 1
    with pytest.raises(ValueError, match=r"kernel_options DECODE_SPLITS=5000 is more splits than the decode kernel's "
                                         r"combine step merges at value head dim 256 \(at most 4096\); pin fewer"):
        launch._decode_plan(torch.device("cpu"), 1, 1, 1, 16, 1, 2 ** 20, 256, (128, 128), 1, False, False, 5000,
                            False, False, tiles)
