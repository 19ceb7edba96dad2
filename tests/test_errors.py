"""Every bad input to flex_attention: a typed error naming the argument and the fix, before any launch."""

import pytest
import torch

import flexlite.api as api
from flexlite import AuxRequest, attention_reference, create_block_mask, create_mask, flex_attention
from flexlite.runtime import launch
from flexlite.viz import attention_scores, visualize_attention_scores
from helpers import DEVICE, assert_close, rand_qkv


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def qkv(**kw):
    args = dict(B=2, Hq=4, Hkv=4, Lq=32, Lkv=48, D=16)
    args.update(kw)
    return rand_qkv(**args)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Validation must happen before any kernel work."""
    def fail(*a, **k):
        raise AssertionError("a kernel was launched for bad input")
    for module in (launch, api):  # api imported the launchers by name: patch both
        for name in ("launch_forward", "launch_decode", "launch_backward"):
            monkeypatch.setattr(module, name, fail)


def _torch_block_mask(**kw):
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    return torch_create_block_mask(causal, None, None, 32, 48, device="cpu", **kw)


def _3d():
    q, k, v = qkv()
    return (q[0], k, v), {}


CASES = {
    "query_not_4d": (lambda: ((qkv()[0][0],) + tuple(qkv()[1:]), {}), ValueError, "query must be 4-D"),
    "key_not_tensor": (lambda: ((qkv()[0], [1, 2], qkv()[2]), {}), TypeError, "key must be a torch.Tensor"),
    "batch_mismatch": (lambda: ((qkv()[0], *qkv(B=3)[1:]), {}), ValueError, "batch sizes differ"),
    "key_batch_one_value_not": (lambda: ((qkv()[0], qkv(B=1)[1], qkv()[2]), {}), ValueError,
                                "batch sizes differ: query 2, key 1, value 2; .* or both batch 1"),
    "head_dim_mismatch": (lambda: ((qkv()[0], qkv(D=32)[1], qkv()[2]), {}), ValueError,
                          "query and key head_dim differ"),
    "kv_len_mismatch": (lambda: ((*qkv()[:2], qkv(Lkv=40)[2]), {}), ValueError, "key has sequence length 48 but value has 40"),
    "kv_heads_mismatch": (lambda: ((*qkv()[:2], qkv(Hkv=2)[2]), {}), ValueError, "key has 4 heads but value has 2"),
    "gqa_not_divisible": (lambda: (qkv(Hq=6, Hkv=4), {"enable_gqa": True}), ValueError,
                          r"multiple of key/value heads \(4\) .* repeat key/value heads"),
    "gqa_not_enabled": (lambda: (qkv(Hq=8, Hkv=4), {}), ValueError, "enable_gqa=True"),
    "dtype_mismatch": (lambda: ((qkv()[0], qkv()[1].half(), qkv()[2]), {}), TypeError, "key dtype torch.float16"),
    "dtype_unsupported": (lambda: ([t.to(torch.float8_e4m3fn) for t in qkv()], {}), TypeError,
                          "float16, bfloat16, float32 .* or float64"),
    "int_dtype": (lambda: ([t.int() for t in qkv()], {}), TypeError, "not supported"),
    "head_dim_too_large": (lambda: (qkv(D=512), {}), ValueError, "head_dim 512 is out of range"),
    "head_dim_zero": (lambda: (qkv(D=0), {}), ValueError, "head_dim 0 is out of range"),
    "score_mod_arity": (lambda: (qkv(), {"score_mod": lambda s, b, h: s}), TypeError,
                        r"must take \(score, b, h, q_idx, kv_idx\); got a function of 3"),
    "mask_mod_as_score_mod": (lambda: (qkv(), {"score_mod": causal}), TypeError, "looks like a mask_mod"),
    "score_mod_not_callable": (lambda: (qkv(), {"score_mod": 3}), TypeError, "score_mod must be callable"),
    "block_mask_wrong_lengths": (lambda: (qkv(), {"block_mask": create_block_mask(causal, None, None, 64, 64, "cpu")}),
                                 ValueError, r"built for Q_LEN=64, KV_LEN=64.*create_block_mask\(mask_mod, B, H, 32, 48"),
    "block_mask_wrong_batch": (lambda: (qkv(), {"block_mask": create_block_mask(causal, 3, None, 32, 48, "cpu")}),
                               ValueError, "block_mask has batch size 3"),
    "block_mask_wrong_heads": (lambda: (qkv(), {"block_mask": create_block_mask(causal, None, 3, 32, 48, "cpu")}),
                               ValueError, "block_mask has 3 heads"),
    "block_mask_not_blockmask": (lambda: (qkv(), {"block_mask": torch.ones(32, 48, dtype=torch.bool)}), TypeError,
                                 r"block_mask must be a BlockMask \(from flexlite.s create_block_mask, or torch.s\)"),
    "torch_block_mask_block_size": (lambda: (qkv(), {"block_mask": _torch_block_mask(BLOCK_SIZE=8)}), ValueError,
                                    r"positive multiples of 16; got \(8, 8\): rebuild the mask with "
                                    r"flexlite.create_block_mask"),
    "scale_not_number": (lambda: (qkv(), {"scale": torch.tensor([0.5])}), TypeError, "scale must be a Python float"),
    "kernel_options_unknown": (lambda: (qkv(), {"kernel_options": {"BLOCK_Q": 64}}), ValueError,
                               r"unknown kernel_options \['BLOCK_Q'\]"),
    "kernel_options_not_dict": (lambda: (qkv(), {"kernel_options": [("BLOCK_M", 64)]}), TypeError,
                                "kernel_options must be a dict"),
    "return_aux_not_a_request": (lambda: (qkv(), {"return_aux": "lse"}), TypeError,
                                 r"return_aux must be None or an AuxRequest\(lse=..., max_scores=...\)"),
    "return_aux_field_not_bool": (lambda: (qkv(), {"return_aux": AuxRequest(max_scores=1)}), TypeError,
                                  "with bool fields"),
    "return_aux_and_return_lse": (lambda: (qkv(), {"return_aux": AuxRequest(lse=True), "return_lse": True}),
                                  ValueError, r"pass return_aux=AuxRequest\(lse=True\) alone"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name):
    make, exc, match = CASES[name]
    args, kwargs = make()
    with pytest.raises(exc, match=match):
        flex_attention(*args, **kwargs)


def test_every_kernel_option_torch_declares_is_accepted():
    """A drop-in: each key of torch's FlexKernelOptions is one flexlite understands or accepts and ignores."""
    import typing

    from torch.nn.attention.flex_attention import FlexKernelOptions
    known = set(launch.CONFIG_KEYS) | launch.TORCH_PERF_HINTS | launch.FLEXLITE_OPTIONS
    assert set(typing.get_type_hints(FlexKernelOptions)) - known == set()


def test_a_prefixed_kernel_option_applies_to_its_pass_alone(monkeypatch):
    """torch's fwd_ / bwd_ prefixes: fwd_X is the forward's X (over X), bwd_X the backward's; each pass's values are
    checked as unprefixed ones; the tiles each pass runs with are the pinned ones, and the results the reference's."""
    options = {"BLOCK_M": 64, "fwd_BLOCK_M": 32, "bwd_BLOCK_M1": 16, "bwd_num_warps": 2, "num_stages": 1}
    assert api._pass_options(options, "fwd_") == {"BLOCK_M": 32, "num_stages": 1}
    assert api._pass_options(options, "bwd_") == {"BLOCK_M": 64, "BLOCK_M1": 16, "num_warps": 2, "num_stages": 1}
    for bad, exc, match in (({"fwd_BLOCK_M": 48}, ValueError, "BLOCK_M must be a power of two"),
                            ({"bwd_num_stages": 0}, ValueError, "num_stages must be an int >= 1"),
                            ({"fwd_BLOCKM": 32}, ValueError, r"unknown kernel_options \['fwd_BLOCKM'\]"),
                            ({"fwd_WARP_SPECIALIZE": True, "BLOCK_M": 32}, ValueError, "WARP_SPECIALIZE=True")):
        with pytest.raises(exc, match=match):
            flex_attention(*qkv(), kernel_options=bad)
    monkeypatch.undo()  # this one runs the kernels
    picked, real = [], launch.forward_config
    monkeypatch.setattr(api, "forward_config", lambda *a, **kw: picked.append(real(*a, **kw)) or picked[-1])
    picked_bwd, real_bwd = [], launch.backward_config
    monkeypatch.setattr(api, "backward_config",
                        lambda *a, **kw: picked_bwd.append(real_bwd(*a, **kw)) or picked_bwd[-1])
    q, k, v = (t.requires_grad_() for t in qkv(B=1, Hq=1, Hkv=1))
    out = flex_attention(q, k, v, kernel_options={"fwd_BLOCK_M": 16, "bwd_BLOCK_M1": 16, "BLOCK_N": 16})
    assert [c.BLOCK_M for c in picked] == [16] and picked[0].BLOCK_N == 16
    ref = attention_reference(q, k, v)[0]
    assert_close(out, ref, 2e-5, 2e-5)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        assert_close(g, w, 1e-4, 1e-4, name="gradient")
    assert [c.BLOCK_M1 for c in picked_bwd] == [16]  # the backward's pin; fwd_BLOCK_M did not reach it


def test_flexlite_declares_its_kernel_options_as_torch_does(monkeypatch):
    """flexlite.FlexKernelOptions (a drop-in for torch's TypedDict, for type checkers): exactly the keys
    kernel_options accepts, torch's among them, with torch's value types where torch declares one."""
    import typing

    import flexlite
    from torch.nn.attention.flex_attention import FlexKernelOptions as TorchOptions
    ours, theirs = typing.get_type_hints(flexlite.FlexKernelOptions), typing.get_type_hints(TorchOptions)
    assert set(ours) == (set(launch.CONFIG_KEYS) | launch.TORCH_PERF_HINTS | launch.FLEXLITE_OPTIONS
                         | {"fwd_num_warps", "fwd_num_stages"})  # (one pass's: any key prefixed fwd_ / bwd_)
    assert set(theirs) <= set(ours) and not flexlite.FlexKernelOptions.__required_keys__
    for key in set(theirs) - {"BACKEND"}:
        assert theirs[key] == ours[key], key
    assert set(typing.get_args(ours["BACKEND"])) == set(launch.BACKENDS)
    monkeypatch.undo()  # this one runs the kernel
    options: flexlite.FlexKernelOptions = {"BLOCK_M": 32, "BLOCK_N": 32, "AUTOTUNE": False}
    q, k, v = qkv(B=1, Hq=1, Hkv=1)
    assert_close(flex_attention(q, k, v, kernel_options=options), flexlite.attention_reference(q, k, v)[0],
                 2e-5, 2e-5)


def test_bad_tile_options_are_rejected(monkeypatch):
    monkeypatch.undo()  # this one gets as far as choosing tiles, which happens before the launch
    q, k, v = qkv()
    for opts, match in (({"BLOCK_M": 48}, "power of two"), ({"BLOCK_N": 256}, "divides the block mask"),
                        ({"BLOCK_M": 8}, ">= 16"), ({"BLOCK_M": 1024}, "^flex_attention: kernel_options")):
        with pytest.raises(ValueError, match=match):
            flex_attention(q, k, v, kernel_options=opts)


@pytest.mark.parametrize("opts, blocks, match", [
    ({"fwd_BLOCK_M": 256}, None, r"kernel_options fwd_BLOCK_M must be .* divides the block mask's BLOCK_SIZE on the "
                                 r"query side \(128\); got 256"),
    ({"BLOCK_M": 64, "fwd_BLOCK_N": 64}, (64, 32), r"kernel_options fwd_BLOCK_N must .* on the key side \(32\)"),
    ({"bwd_BLOCK_N1": 256}, None, r"kernel_options bwd_BLOCK_N1 must .* on the key side \(128\)"),
    ({"bwd_BLOCK_M2": 128}, (64, 64), r"kernel_options bwd_BLOCK_M2 must .* on the query side \(64\)"),
    ({"BLOCK_N2": 64}, (64, 32), r"kernel_options BLOCK_N2 must .* on the key side \(32\); got 64"),
], ids=lambda x: repr(x) if isinstance(x, dict) else "")
def test_a_pinned_tile_that_does_not_divide_the_block_size_is_named_as_written(opts, blocks, match):
    # (was kernel_options['BLOCK_M'] for fwd_BLOCK_M, from the forward's tile choice; a backward tile's only once the
    # backward ran)
    q, k, v = (t.requires_grad_() for t in qkv())
    bm = None if blocks is None else create_block_mask(causal, None, None, 32, 48, device=DEVICE, BLOCK_SIZE=blocks)
    with pytest.raises(ValueError, match=match):
        flex_attention(q, k, v, block_mask=bm, kernel_options=opts)


@pytest.mark.parametrize("opts, exc, match", [
    ({"DECODE_SPLITS": 0}, ValueError, "DECODE_SPLITS must be an int >= 1; got int 0"),
    ({"DECODE_SPLITS": 2.5}, TypeError, "DECODE_SPLITS must be an int >= 1; got float 2.5"),
    ({"DECODE_SPLITS": "4"}, TypeError, "DECODE_SPLITS must be an int"),
    ({"num_stages": 0}, ValueError, "num_stages must be an int >= 1; got int 0"),
    ({"num_stages": "x"}, TypeError, "num_stages must be an int"),
    ({"num_warps": 0}, ValueError, "num_warps must be a power of two from 1 to 32"),
    ({"num_warps": 6}, ValueError, "num_warps must be a power of two"),
    ({"num_warps": 1.5}, TypeError, "num_warps must be a power of two"),
    ({"DECODE": "False"}, TypeError, "kernel_options DECODE must be a bool .* got str 'False'"),
    ({"USE_TMA": 1}, TypeError, "kernel_options USE_TMA must be a bool"),
    ({"AUTOTUNE": None}, TypeError, "kernel_options AUTOTUNE must be a bool"),
    ({"FORCE_USE_FLEX_ATTENTION": "yes"}, TypeError, "FORCE_USE_FLEX_ATTENTION must be a bool"),
    ({"DETERMINISTIC_CAPTURED_GRADS": 0}, TypeError, "DETERMINISTIC_CAPTURED_GRADS must be a bool"),
    ({"BLOCK_M1": 7}, ValueError, "BLOCK_M1 must be a power of two >= 16"),
    ({"BLOCK_N2": "32"}, TypeError, "BLOCK_N2 must be a power of two >= 16"),
    ({"BLOCK_M": True}, TypeError, "BLOCK_M must be a power of two >= 16"),
    # torch's performance hints: no effect here, but values of torch's types
    ({"ROWS_GUARANTEED_SAFE": "yes"}, TypeError, "ROWS_GUARANTEED_SAFE must be a bool"),
    ({"PRESCALE_QK": None}, TypeError, "PRESCALE_QK must be a bool"),
    ({"OUTPUT_MAX": 2}, TypeError, r"OUTPUT_MAX must be a bool \(or 0 / 1"),
    ({"fwd_BACKEND": "bogus"}, ValueError, "kernel_options fwd_BACKEND must be one of"),
    ({"bwd_BACKEND": "CUDNN"}, ValueError, "kernel_options bwd_BACKEND must be one of"),
    ({"bwd_WRITE_DQ": "1"}, TypeError, "WRITE_DQ must be a bool"),
    ({"kpack": 0}, ValueError, "kpack must be an int >= 1"),
    ({"waves_per_eu": "2"}, TypeError, "waves_per_eu must be an int >= 0"),
    ({1: 2}, TypeError, "kernel_options keys must be str .* got 1"),
    ({"bwd_DECODE": True}, ValueError, "bwd_DECODE: DECODE chooses the forward's decoding kernel.* drop the bwd_"),
    ({"bwd_DECODE_SPLITS": 2}, ValueError, "bwd_DECODE_SPLITS: DECODE_SPLITS chooses the forward's decoding"),
    # a value that is not even hashable (was the `in` test's own TypeError: unhashable type 'list')
    ({"BACKEND": ["TRITON"]}, ValueError, r"kernel_options BACKEND must be one of .*; got \['TRITON'\]"),
    ({"fwd_BACKEND": {}}, ValueError, r"kernel_options fwd_BACKEND must be one of .*; got \{\}"),
    # a prefixed key's bad value is named as given (the message named the unprefixed option)
    ({"fwd_BLOCK_M": 24}, ValueError, "kernel_options fwd_BLOCK_M must be a power of two >= 16"),
    ({"bwd_num_warps": 3}, ValueError, "kernel_options bwd_num_warps must be a power of two from 1 to 32"),
    ({"fwd_num_stages": 0}, ValueError, "kernel_options fwd_num_stages must be an int >= 1"),
    ({"bwd_USE_TMA": "no"}, TypeError, "kernel_options bwd_USE_TMA must be a bool"),
], ids=lambda x: repr(x) if isinstance(x, dict) else "")
def test_bad_kernel_option_values_are_named_before_anything_runs(opts, exc, match):
    # (each of these ran before: DECODE_SPLITS 0 gave every row as fully masked, num_stages 0 a TypeError from
    # inside the launcher, the string "False" read as True, BLOCK_M1 7 failed only in the backward)
    q, k, v = qkv()
    with pytest.raises(exc, match=match):
        flex_attention(q[:, :, :4], k, v, kernel_options=opts)  # (4 queries: the decode kernel's inputs)


def test_bfloat16_arithmetic_in_a_mod(monkeypatch):
    # Triton's interpreter (CPU) gets bfloat16 arithmetic wrong (products of captured bf16 values NaN or off by
    # units): refused there with the fix named; a bf16 value only read (and added to the fp32 score) is fine, and
    # on a GPU the arithmetic is right
    monkeypatch.undo()  # this one runs the kernels
    table = torch.randn(64, device=DEVICE).bfloat16()

    def product(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx] * table[q_idx]

    def read(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]
    q, k, v = qkv(B=1, Hq=1, Hkv=1)
    assert_close(flex_attention(q, k, v, score_mod=read), attention_reference(q, k, v, score_mod=read)[0], 2e-5, 2e-5)
    if DEVICE == "cpu":
        with pytest.raises(NotImplementedError, match=r"score_mod 'product' computes in bfloat16 .* Triton's "
                                                      r"interpreter .* capture float32 tensors"):
            flex_attention(q, k, v, score_mod=product)
    else:
        assert_close(flex_attention(q, k, v, score_mod=product), attention_reference(q, k, v, score_mod=product)[0],
                     2e-5, 2e-5)


def test_captured_tensor_on_wrong_device_is_named(monkeypatch):
    monkeypatch.undo()
    bias = torch.zeros(48, device="meta")

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    with pytest.raises(ValueError, match="captured by a mod is on meta"):
        flex_attention(*qkv(), score_mod=mod)


_META_LENGTHS = torch.tensor([100, 200], device="meta")
_META_BIAS = torch.zeros(2, device="meta")


def _meta_mask(b, h, q_idx, kv_idx):
    return kv_idx < _META_LENGTHS[b]


def _meta_score(score, b, h, q_idx, kv_idx):
    return score + _META_BIAS[h]


@pytest.mark.parametrize("call, match", [
    (lambda: create_block_mask(_meta_mask, 2, None, 128, 128, device="cpu"),
     "create_block_mask: a tensor captured by mask_mod is on meta but the kernel runs on cpu"),
    (lambda: create_mask(_meta_mask, 2, 1, 64, 64, device="cpu"),
     "create_mask: a tensor captured by mask_mod is on meta but mask_mod is evaluated on cpu"),
    (lambda: create_mask(_meta_score, 1, 2, 64, 64, device="cpu"),
     "create_mask: a tensor captured by score_mod is on meta but score_mod is evaluated on cpu"),
    (lambda: visualize_attention_scores(torch.randn(2, 1, 64, 16), torch.randn(2, 1, 64, 16), mask_mod=_meta_mask,
                                        path="unwritten.png"),
     "visualize_attention_scores: a tensor captured by mask_mod is on meta but mask_mod is evaluated on cpu"),
    (lambda: attention_scores(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), score_mod=_meta_score),
     "a tensor captured by score_mod is on meta but score_mod is evaluated on cpu"),
])
def test_a_tensor_captured_on_another_device_is_named_where_a_mod_runs_in_torch_ops(call, match):
    """create_block_mask on CPU, create_mask and the pictures evaluate the mods in torch ops: a capture on another
    device gets flexlite's error naming it (as the kernels' launches give), not torch's "Tensor on device meta is not
    on the expected device" from inside vmap."""
    with pytest.raises(ValueError, match=match):
        call()


def test_in_slice_offsets_past_32_bits_are_refused():
    # meta tensors: the strides of a huge (L, D) slice without allocating it
    q = torch.empty_strided((1, 1, 3, 16), (48, 48, 2**30, 1), device="meta")
    k = torch.empty_strided((1, 1, 3, 16), (48, 48, 16, 1), device="meta")
    with pytest.raises(ValueError, match=r"query spans 2147483663 elements within one \(batch, head\) slice"):
        flex_attention(q, k, k)


def test_forward_mode_dual_tensors_and_torch_func_over_captured_tensors_are_refused(monkeypatch):
    """A dual tensor's tangent would be dropped silently; a captured tensor from a torch.func transform gave torch's
    raw errors: both NotImplementedError naming the way that works (reverse-mode autograd)."""
    import torch.autograd.forward_ad as fwAD

    monkeypatch.undo()
    q, k, v = qkv(B=1, Hq=1, Hkv=1)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="query is a forward-mode AD dual tensor"):
            flex_attention(dual, k, v)

    def attend(bias):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[ki]).sum()
    with pytest.raises(NotImplementedError, match="score_mod captures .* from a torch.func transform") as raised:
        torch.func.grad(attend)(torch.randn(k.shape[2], device=q.device))
    # described by its shape and dtype, not by the trace's name for it (fx's '_tensor_constant0')
    assert "_tensor_constant" not in str(raised.value)
    assert f"a tensor (shape ({k.shape[2]},), torch.float32)" in str(raised.value)
