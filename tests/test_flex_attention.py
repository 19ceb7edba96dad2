"""flex_attention forward vs the fp64 reference: catalog mods x shapes x dtypes, and API behaviour."""

import os

import pytest
import torch

from catalog import CATALOG, USES_BH
from flexlite import (AuxOutput, AuxRequest, attention_reference, create_block_mask, first_calls,
                      flex_attention)
from helpers import DEVICE, DTYPES, LSE_TOLERANCES, TOLERANCES, assert_close, assert_grad_close, rand_qkv

# (B, Hq, Hkv, Lq, Lkv, D)
SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 32), id="B1-H1-L1-D32"),
    pytest.param((2, 2, 2, 63, 63, 64), id="B2-H2-L63-D64"),
    pytest.param((1, 2, 2, 111, 200, 80), id="B1-H2-Lq111-Lkv200-D80"),
    pytest.param((1, 4, 2, 200, 111, 128), id="B1-H4-Hkv2-Lq200-Lkv111-D128-gqa"),
    pytest.param((2, 2, 1, 256, 256, 32), id="B2-H2-Hkv1-L256-D32-mqa"),
]


def run_case(name, shape, dtype, block_size=128, kernel_options=None):
    B, Hq, Hkv, Lq, Lkv, D = shape
    case = CATALOG[name](B, Hq, Lq, Lkv, DEVICE)
    q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=dtype, seed=hash((name, shape)) % 1000)
    bm = None
    if case.mask_mod is not None:
        mb, mh = (B, Hq) if name in USES_BH else (None, None)
        bm = create_block_mask(case.mask_mod, mb, mh, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block_size)
    out, lse = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv,
                              return_lse=True, kernel_options=kernel_options)
    ref_out, ref_lse = attention_reference(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, *TOLERANCES[dtype], name=f"{name} out")
    assert_close(lse, ref_lse, *LSE_TOLERANCES[dtype], name=f"{name} lse")
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog(name, shape, dtype):
    run_case(name, shape, dtype)


@pytest.mark.parametrize("block_size", [(32, 64), (16, 16), (256, 128), (48, 80)], ids=str)
@pytest.mark.parametrize("name", ["causal", "document", "sliding_window", "per_batch_head"])
def test_block_sizes(name, block_size):
    run_case(name, (2, 2, 2, 200, 137, 64), torch.float32, block_size=block_size)


@pytest.mark.parametrize("opts", [dict(BLOCK_M=16, BLOCK_N=32), dict(BLOCK_M=64, BLOCK_N=16, num_warps=8),
                                  dict(BLOCK_M=128, BLOCK_N=128, num_stages=2, PRESCALE_QK=True)], ids=str)
def test_kernel_options_pin_tiles(opts):
    run_case("alibi_causal", (1, 2, 2, 111, 200, 64), torch.float16, kernel_options=opts)


@pytest.mark.parametrize("d, dv", [(16, 16), (48, 48), (96, 96), (256, 256), (64, 32), (24, 80), (1, 8)], ids=str)
def test_head_dims(d, dv):
    q, k, v = rand_qkv(1, 2, 2, 70, 90, d, dv, dtype=torch.float16)
    bm = create_block_mask(CATALOG["causal"](1, 2, 70, 90, DEVICE).mask_mod, None, None, 70, 90, device=DEVICE)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, block_mask=bm)
    assert out.shape == (1, 2, 70, dv)
    assert_close(out, ref_out, *TOLERANCES[torch.float16])
    assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.float16], name="lse")


def test_non_contiguous_inputs():
    # [B, L, H, D] storage viewed as [B, H, L, D], plus a strided slice of the head dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 77, 3, 64, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 90, 3, 128, generator=g).to(DEVICE).transpose(1, 2)[..., ::2]
    v = torch.randn(2, 3, 64, 90, generator=g).to(DEVICE).transpose(-1, -2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    case = CATALOG["alibi_causal"](2, 3, 77, 90, DEVICE)
    bm = create_block_mask(case.mask_mod, None, None, 77, 90, device=DEVICE)
    out = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
    ref_out, _ = attention_reference(q, k, v, score_mod=case.score_mod, block_mask=bm)
    assert_close(out, ref_out, *TOLERANCES[torch.float32])


def test_scale_and_default_scale():
    q, k, v = rand_qkv(1, 1, 1, 40, 50, 32)
    for scale in (None, 0.3, 2):
        out = flex_attention(q, k, v, scale=scale)
        ref, _ = attention_reference(q, k, v, scale=scale)
        assert_close(out, ref, *TOLERANCES[torch.float32], name=f"scale={scale}")


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    q, k, v = rand_qkv(1, 2, 2, 100, 100, 32)
    case = CATALOG["fully_masked_rows"](1, 2, 100, 100, DEVICE)
    bm = create_block_mask(case.mask_mod, None, None, 100, 100, device=DEVICE, BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    rows = (torch.arange(100) % 3 == 1).to(DEVICE)
    assert torch.equal(out[:, :, rows], torch.zeros_like(out[:, :, rows]))
    assert torch.isneginf(lse[:, :, rows]).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse[:, :, ~rows]).any()


def test_everything_masked_and_empty_sequences():
    q, k, v = rand_qkv(1, 1, 1, 64, 64, 16)

    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0
    bm = create_block_mask(nothing, None, None, 64, 64, device=DEVICE)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out, lse = flex_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert out.shape == (1, 1, 64, 16) and torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out = flex_attention(q[:, :, :0], k, v)
    assert out.shape == (1, 1, 0, 16)


AUX_SHAPES = [
    pytest.param((1, 2, 2, 1, 70, 32), id="B1-H2-L1x70-D32"),  # one query: the decode kernel's by default
    pytest.param((2, 2, 2, 63, 63, 64), id="B2-H2-L63-D64"),
    pytest.param((1, 4, 2, 111, 200, 16), id="B1-H4-Hkv2-Lq111-Lkv200-D16-gqa"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", AUX_SHAPES)
@pytest.mark.parametrize("name", ["full", "fully_masked_rows", "softcap_causal", "alibi_causal", "document"])
def test_return_aux_max_scores_and_lse(name, shape, dtype):
    """return_aux=AuxRequest(lse=True, max_scores=True): out, the LSE and the row max after score_mod and masking
    (-inf on fully masked rows) are the reference's, through the Triton forward and (one query) the decode kernel."""
    B, Hq, Hkv, Lq, Lkv, D = shape
    case = CATALOG[name](B, Hq, Lq, Lkv, DEVICE)
    q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=dtype, seed=hash((name, shape)) % 1000)
    bm = None if case.mask_mod is None else create_block_mask(case.mask_mod, None, None, Lq, Lkv, device=DEVICE)
    out, aux = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv,
                              return_aux=AuxRequest(lse=True, max_scores=True))
    ref, ref_lse, ref_max = attention_reference(q, k, v, score_mod=case.score_mod, block_mask=bm,
                                                enable_gqa=Hq != Hkv, return_max=True)
    assert isinstance(aux, AuxOutput) and aux.max_scores.dtype == torch.float32 and aux.max_scores.shape == (B, Hq, Lq)
    assert_close(out, ref, *TOLERANCES[dtype])
    assert_close(aux.lse, ref_lse, *LSE_TOLERANCES[dtype], name="lse")
    assert_close(aux.max_scores, ref_max, *LSE_TOLERANCES[dtype], name="max_scores")
    if name == "fully_masked_rows" and Lq > 1:
        assert torch.isneginf(ref_max).any()  # the case has rows that see nothing


@pytest.mark.parametrize("splits", [1, 3])
def test_return_aux_max_scores_from_the_decode_kernel(splits):
    """max_scores by the split-KV decode kernel (queries <= 64): each split's row max merged by the combine step, -inf
    for rows no key is left to and for splits that see nothing; out, lse as without it; the reference's."""
    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 150) & (kv_idx > q_idx + 120) & (q_idx != 1)  # row 1: nothing; splits past 154 idle
    q, k, v = rand_qkv(2, 4, 2, 3, 200, 32, seed=21)
    bm = create_block_mask(window, None, None, 3, 200, device=DEVICE, BLOCK_SIZE=(16, 32))
    options = {"DECODE": True, "DECODE_SPLITS": splits}
    out, aux = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=options,
                              score_mod=lambda s, b, h, q_idx, kv_idx: s * (h + 1),
                              return_aux=AuxRequest(lse=True, max_scores=True))
    ref, ref_lse, ref_max = attention_reference(q, k, v, block_mask=bm, enable_gqa=True, return_max=True,
                                                score_mod=lambda s, b, h, q_idx, kv_idx: s * (h + 1))
    assert torch.isneginf(ref_max[:, :, 1]).all() and torch.isfinite(ref_max[:, :, [0, 2]]).all()
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_close(aux.lse, ref_lse, *LSE_TOLERANCES[torch.float32], name="lse")
    assert_close(aux.max_scores, ref_max, *LSE_TOLERANCES[torch.float32], name="max_scores")
    plain = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=options,
                           score_mod=lambda s, b, h, q_idx, kv_idx: s * (h + 1))
    assert torch.equal(plain, out)


def test_return_aux_fields_autograd_and_torch_request():
    """Unrequested fields are None; aux.lse is differentiable as return_lse's; max_scores is not; torch's own
    AuxRequest works as a drop-in; a negative scale (moved onto the query) keeps the maxima."""
    from torch.nn.attention.flex_attention import AuxRequest as TorchAuxRequest
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 40, 50, 16, seed=5))
    bm = create_block_mask(CATALOG["causal"](1, 2, 40, 50, DEVICE).mask_mod, None, None, 40, 50, device=DEVICE)
    out, aux = flex_attention(q, k, v, block_mask=bm, scale=-0.3, return_aux=TorchAuxRequest(max_scores=True))
    ref, ref_lse, ref_max = attention_reference(q, k, v, block_mask=bm, scale=-0.3, return_max=True)
    assert aux.lse is None and not aux.max_scores.requires_grad and out.requires_grad
    assert_close(aux.max_scores, ref_max, *LSE_TOLERANCES[torch.float32], name="max_scores")
    out_l, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    out_a, aux = flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True))
    assert aux.max_scores is None and torch.equal(out_l, out_a) and torch.equal(lse, aux.lse)
    grad, w = torch.randn_like(out_a), torch.randn_like(lse)
    got = torch.autograd.grad((out_a * grad).sum() + (aux.lse * w).sum(), (q, k, v))
    ref, ref_lse = attention_reference(q, k, v, block_mask=bm)
    want = torch.autograd.grad((ref * grad).sum() + (ref_lse * w).sum(), (q, k, v))
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert_grad_close(g, r, name=name)
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest())
    assert aux == AuxOutput() and out.shape == q.shape
    out, aux = flex_attention(q, k[:, :, :0], v[:, :, :0], return_aux=AuxRequest(lse=True, max_scores=True))
    assert torch.isneginf(aux.lse).all() and torch.isneginf(aux.max_scores).all()


@pytest.mark.parametrize("name", ["document", "per_batch_head"])
def test_torch_block_mask_runs_as_it_is(name):
    """A BlockMask from torch's create_block_mask (and a slice of one with its mask_mod assigned, as gpt-fast
    decodes): flex_attention's out and gradients are the reference's with the same mask (which takes torch's too);
    the conversion is kept on torch's object until one of its attributes is replaced."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    B, H, Lq, Lkv = 2, 2, 100, 130
    case = CATALOG[name](B, H, Lq, Lkv, DEVICE)
    mb, mh = (B, H) if name in USES_BH else (None, None)
    tbm = torch_create_block_mask(case.mask_mod, mb, mh, Lq, Lkv, device=DEVICE, BLOCK_SIZE=(32, 64))
    ours = create_block_mask(case.mask_mod, mb, mh, Lq, Lkv, device=DEVICE, BLOCK_SIZE=(32, 64))
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, Lq, Lkv, 16, seed=13))
    out = flex_attention(q, k, v, block_mask=tbm)
    ref = attention_reference(q, k, v, block_mask=ours)[0]
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert torch.equal(attention_reference(q, k, v, block_mask=tbm)[0], ref)  # (the reference takes it too)
    grad = torch.randn_like(out)
    for n, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad),
                       torch.autograd.grad(ref, (q, k, v), grad)):
        assert_grad_close(g, w, name=n)
    first = tbm._flexlite_block_mask[1]
    flex_attention(q.detach(), k.detach(), v.detach(), block_mask=tbm)
    assert tbm._flexlite_block_mask[1] is first
    row = tbm[:, :, 1:2]  # q block 1 alone: a decode-style slice, mask_mod reassigned with the offset
    row.mask_mod = lambda b, h, q_idx, kv_idx: case.mask_mod(b, h, q_idx + 32, kv_idx)
    row.seq_lengths = (32, Lkv)
    got = flex_attention(q[:, :, 32:64].detach(), k.detach(), v.detach(), block_mask=row)
    assert_close(got, ref[:, :, 32:64], *TOLERANCES[torch.float32])


def test_under_torch_autocast():
    """Under torch.autocast the inputs take its dtype, as torch's flex_attention: fp32 (or mixed) inputs give its
    dtype's output, equal to flex_attention on inputs cast by hand; gradients reach the fp32 inputs in fp32."""
    device_type = torch.device(DEVICE).type
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 70, 90, 32, seed=12))
    bm = create_block_mask(CATALOG["causal"](1, 2, 70, 90, DEVICE).mask_mod, None, None, 70, 90, device=DEVICE)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        out = flex_attention(q, k.bfloat16(), v, block_mask=bm, score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5)
    cast = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    want = flex_attention(*cast, block_mask=bm, score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, v), grad)
    for name, g, w in zip(("dq", "dv"), got, torch.autograd.grad(want, (cast[0], cast[2]), grad)):
        assert_grad_close(g, w.float(), torch.float32, name, tolerance_dtype=torch.bfloat16)  # GPU atomics: no order


class _AttentionBlock(torch.nn.Module):
    """The model the torch.compile tests compile: a projection, then flexlite's causal block mask and attention over
    length L (``score_mod``; ``mask_kwargs`` for create_block_mask)."""

    def __init__(self, L: int, score_mod=None, **mask_kwargs):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)
        self.L, self.score_mod, self.mask_kwargs = L, score_mod, mask_kwargs

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        bm = create_block_mask(CATALOG["causal"](1, 2, self.L, self.L, DEVICE).mask_mod, None, None, self.L, self.L,
                               device=x.device, **self.mask_kwargs)
        return flex_attention(q, k, v, block_mask=bm, score_mod=self.score_mod)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # Dynamo's import
def test_inside_a_torch_compiled_model():
    """A model using flexlite under torch.compile (AOT autograd; no C++ compiler needed), and the two functions
    compiled themselves: create_block_mask and flex_attention run as they are; out and the parameter gradients are
    the eager model's."""
    model = _AttentionBlock(64, score_mod=lambda s, b, h, q_idx, kv_idx: s + 0.1 * h).to(DEVICE)
    x = rand_qkv(1, 2, 2, 64, 64, 16, seed=9)[0]
    want = model(x)
    want_grad = torch.autograd.grad(want.square().sum(), model.proj.weight)[0]
    got = torch.compile(model, backend="aot_eager")(x)
    got_grad = torch.autograd.grad(got.square().sum(), model.proj.weight)[0]
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    # attention-gym's habit: the functions themselves compiled
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16, seed=10)
    bm = torch.compile(create_block_mask)(CATALOG["causal"](1, 2, 64, 64, DEVICE).mask_mod, None, None, 64, 64,
                                           device=DEVICE)
    assert torch.equal(torch.compile(flex_attention, backend="aot_eager")(q, k, v, block_mask=bm),
                       flex_attention(q, k, v, block_mask=bm))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # Dynamo's import
def test_a_compiled_models_steps_do_not_recompile_flexlites_entry_points():
    """Dynamo compiled the frame of the wrapper that makes flexlite's entry points opaque (runtime.guards), one cache
    entry per entry point, grad mode and autocast state: a compiled model calling create_block_mask and flex_attention
    for training and evaluation steps with and without autocast hit its recompile limit (torch's warning naming
    'opaque'). The wrapper's frame is skipped: at most the entry made before the first call marked it, and the
    results are the eager model's."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()  # (as a fresh process: the mark is made again)
    model = _AttentionBlock(32, BLOCK_SIZE=16).to(DEVICE)
    compiled = torch.compile(model, backend="eager")
    x = rand_qkv(1, 2, 2, 32, 32, 16, seed=11)[0]
    for autocast in (False, True, False, True):
        for grad in (True, False):
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grad):
                assert torch.equal(compiled(x), model(x))
    assert len(_debug_get_cache_entry_list(flex_attention.__code__)) <= 1


def test_import_does_not_load_dynamo():
    """Being opaque to torch.compile costs no import time: Dynamo (about 1 s to import) is not loaded by
    ``import flexlite``, nor by a first call."""
    import subprocess
    import sys
    code = ("import sys, torch, flexlite; assert 'torch._dynamo' not in sys.modules; "
            f"q = torch.randn(1, 1, 16, 16, device={DEVICE!r}); flexlite.flex_attention(q, q, q); "
            "assert 'torch._dynamo' not in sys.modules")
    env = dict(os.environ)
    if DEVICE == "cpu":  # the child on CPU tensors runs the interpreter, as the tests do
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_returns_only_out_by_default():
    q, k, v = rand_qkv(1, 1, 1, 16, 16, 16)
    out = flex_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


@pytest.mark.parametrize("decode", [False, True], ids=["forward", "decode"])
@pytest.mark.parametrize("lq, lkv", [(16, 16), (64, 192), (32, 64), (48, 320)], ids=str)
def test_lengths_multiple_of_the_tile_but_not_of_the_block(lq, lkv, decode):
    # regression: the kv walk covers whole 128-wide sparse blocks, so a length that divides the tile
    # but not the block must still be bounds-checked (it read past the end of K / V)
    q, k, v = rand_qkv(1, 2, 2, lq, lkv, 16)
    case = CATALOG["alibi_causal"](1, 2, lq, lkv, DEVICE)
    for bm in (None, create_block_mask(CATALOG["causal_bottom_right"](1, 2, lq, lkv, DEVICE).mask_mod, None, None,
                                       lq, lkv, device=DEVICE)):
        out, lse = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, return_lse=True,
                                  kernel_options={"DECODE": decode})
        ref, ref_lse = attention_reference(q, k, v, score_mod=case.score_mod, block_mask=bm)
        assert_close(out, ref, *TOLERANCES[torch.float32])
        assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.float32], name="lse")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on the NaNs we feed
@pytest.mark.parametrize("decode", [False, True], ids=["forward", "decode"])
def test_nan_and_inf_inputs_propagate_like_torch(decode):
    q, k, v = rand_qkv(1, 2, 2, 40 if not decode else 8, 70, 16, seed=3)
    q[0, 0, 3, 2] = float("nan")
    k[0, 1, 7, 1] = float("inf")
    v[0, 0, 50, 0] = float("-inf")
    out = flex_attention(q, k, v, kernel_options={"DECODE": decode})
    expected = torch.nn.functional.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu())
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(expected))
    finite = torch.isfinite(expected)
    assert_close(out.cpu()[finite], expected[finite], *TOLERANCES[torch.float32], name="finite part")


@pytest.mark.parametrize("scale", [-0.7, 0.0, 0.3])
@pytest.mark.parametrize("with_score_mod", [False, True])
@pytest.mark.parametrize("Lq", [1, 50])  # the decode kernel and the forward kernel
def test_any_sign_of_scale(scale, with_score_mod, Lq):
    """The forward applies the scale after the row max when there is no score_mod (one FMA per score); a
    negative or zero scale must still give the reference result, through out, LSE and the gradients."""
    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.01 * (q_idx - kv_idx)

    q, k, v = rand_qkv(1, 2, 2, Lq, 70, 16)
    q.requires_grad_(True)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + 20 >= kv_idx, None, None, Lq, 70, device=DEVICE)
    mod = bias if with_score_mod else None
    out, lse = flex_attention(q, k, v, score_mod=mod, block_mask=bm, scale=scale, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=mod, block_mask=bm, scale=scale)
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.float32], name="lse")
    grad = torch.randn_like(out)
    got, = torch.autograd.grad(out, q, grad)
    want, = torch.autograd.grad(ref, q, grad.double())
    assert_grad_close(got, want, name="dq")


@pytest.mark.parametrize("lq", [100, 4])  # the forward kernel, and the decode kernel with its combine
def test_a_plus_inf_score_gives_lse_plus_inf_as_torch(lq):
    """A score_mod may return +inf: that row's out is NaN (inf / inf) and its LSE +inf, as torch's logsumexp
    and the reference give; the other rows are unaffected."""
    q, k, v = rand_qkv(1, 2, 2, lq, 100, 32, seed=5)

    def boost(score, b, h, q_idx, kv_idx):
        return torch.where((q_idx == 3) & (kv_idx == 50), float("inf"), score)

    out, lse = flex_attention(q, k, v, score_mod=boost, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=boost)
    assert torch.isposinf(ref_lse[:, :, 3]).all() and torch.isposinf(lse[:, :, 3]).all()
    assert torch.isnan(ref[:, :, 3]).all() and torch.isnan(out[:, :, 3]).all()
    others = torch.arange(lq, device=DEVICE) != 3
    assert_close(out[:, :, others], ref[:, :, others], *TOLERANCES[torch.float32])
    assert_close(lse[:, :, others], ref_lse[:, :, others], *LSE_TOLERANCES[torch.float32], name="lse")


@pytest.mark.parametrize("masked", [False, True], ids=["no_block_mask", "block_mask"])
@pytest.mark.parametrize("lkv", [200, 256])  # ragged (every tile bounds-checked) and whole tiles
def test_no_block_mask_walks_every_tile_in_one_loop(monkeypatch, masked, lkv):
    """Without a block mask the forward, dK/dV and dQ kernels run their dense walks (DENSE: one loop over every
    tile, no block-index loads); with one, the block lists. Both give the reference's out and gradients, with a
    score_mod and GQA."""
    monkeypatch.setattr(first_calls, "ENABLED", False)  # (counts this call's own launches alone)
    from flexlite.runtime import launch

    dense, real = [], launch.run_with_fallback

    def spy(kernel, grid, args, constexprs, *rest, **kwargs):
        dense.append(constexprs["DENSE"])
        return real(kernel, grid, args, constexprs, *rest, **kwargs)
    monkeypatch.setattr(launch, "run_with_fallback", spy)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 4, 2, 111, lkv, 32, seed=lkv))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 111, lkv, device=DEVICE,
                           BLOCK_SIZE=64) if masked else None

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.01 * (kv_idx - q_idx) * (h + 1)
    tiles = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
    out = flex_attention(q, k, v, score_mod=bias, block_mask=bm, enable_gqa=True, kernel_options=tiles)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert dense == [not masked] * 3  # forward, dK/dV, dQ
    ref = attention_reference(q, k, v, score_mod=bias, block_mask=bm, enable_gqa=True)[0]
    assert_close(out, ref, *TOLERANCES[torch.float32])
    for name, g, want in zip(("dq", "dk", "dv"), got, torch.autograd.grad(ref, (q, k, v), grad)):
        assert_grad_close(g, want, name=name)


@pytest.mark.parametrize("name, shape", [
    ("causal", (1, 2, 2, 200, 111, 64)),           # ragged: the half tiles past KV_LEN are bounds-checked
    ("sliding_window", (2, 4, 2, 256, 256, 32)),   # GQA, whole tiles
    ("document", (1, 2, 2, 200, 200, 128)),        # a mask_mod that gathers
    ("alibi_causal", (1, 2, 2, 111, 200, 64)),     # a score_mod on the partial half tiles
    ("full", (1, 2, 2, 111, 200, 64)),             # no block mask: the dense walk, the flag has nothing to split
])
def test_partial_blocks_in_half_tiles_match_the_reference(monkeypatch, name, shape):
    """The forward can walk its partial blocks (mask_mod evaluated) BLOCK_N // 2 keys at a time (NOTES 37; on CUDA
    flex_attention asks for it at padded head dim 128 without score_mod or mask gathers). Forced on here for any
    mods: the launch passes half the tile width as PARTIAL_BLOCK_N wherever a block mask is walked, and out and LSE
    still match the reference."""
    monkeypatch.setattr(first_calls, "ENABLED", False)  # (counts this call's own launches alone)
    import flexlite.api
    from flexlite.runtime import launch

    seen, real = [], launch.run_with_fallback

    def spy(kernel, grid, args, constexprs, config, *rest, **kwargs):
        cfg = real(kernel, grid, args, constexprs, config, *rest, **kwargs)
        seen.append((constexprs["DENSE"], constexprs["PARTIAL_BLOCK_N"], cfg.BLOCK_N))
        return cfg
    monkeypatch.setattr(launch, "run_with_fallback", spy)
    monkeypatch.setattr(flexlite.api, "_split_partial", lambda *args: True)
    run_case(name, shape, torch.float32, block_size=64)
    (dense, partial_n, block_n), = seen
    assert partial_n == (block_n if dense or block_n < 64 else block_n // 2)
    assert dense == (CATALOG[name](1, 1, 8, 8, "cpu").mask_mod is None)


def test_flex_attention_asks_for_half_partial_tiles_only_where_they_measured_faster():
    import types

    from flexlite.api import _split_partial
    from flexlite.codegen.kernel import generate
    from flexlite.masks import causal_mask, generate_doc_mask_mod
    from flexlite.mods import generate_tanh_softcap

    def spec(D, cuda=True):
        return types.SimpleNamespace(shape=(1, 1, 256, D), is_cuda=cuda)
    plain = generate("fwd.py.jinja", None, causal_mask, interpret=False)
    doc = generate("fwd.py.jinja", None, generate_doc_mask_mod(causal_mask, torch.tensor([0, 0, 1, 1])),
                   interpret=False)
    softcap = generate("fwd.py.jinja", generate_tanh_softcap(30.0), causal_mask, interpret=False)
    assert _split_partial(plain, spec(128), spec(128)) and _split_partial(plain, spec(96), spec(128))
    assert not _split_partial(plain, spec(64), spec(64))  # D64: no gain measured
    assert not _split_partial(plain, spec(128, cuda=False), spec(128, cuda=False))  # the interpreter
    assert not _split_partial(doc, spec(128), spec(128)) and not _split_partial(softcap, spec(128), spec(128))
