"""The "DIY FlashAttention" API (flexlite.kernels, flexlite.utils; docs/API.md), on CPU through Triton's
interpreter: kernels against flexlite's fp64 reference / float64 matmul, GPU detection with fake CUDA
devices, the selector against the heuristics the kernels really run, benchmarking, validation, errors."""

import dataclasses
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch

import flexlite
import flexlite.api
from flexlite.kernels import flash_attention, reference_attention, triton_matmul
from flexlite.kernels.matmul import INTERPRETER_MATMUL_CONFIG, MATMUL_CONFIGS, padded_dim
from flexlite.utils import (AdaptiveKernelSelector, BenchmarkResult, BenchmarkRunner, GPUArch, GPUCapabilities,
                            benchmark_fn, check_hopper_features, detect_gpu, get_attention_config, get_matmul_config,
                            get_optimal_attention, get_optimal_matmul, supports_fp8, validate_attention,
                            validate_matmul)
from helpers import DEVICE, DTYPES, TOLERANCES, assert_close

# (rtol, atol) of triton_matmul vs float64: the output rounding (fp16 for fp16/fp32 inputs, bf16 for bf16)
MATMUL_TOL = {torch.float16: 1e-3, torch.float32: 1e-3, torch.bfloat16: 8e-3}


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def qkv(*shape, dtype=torch.float32, seed=0):
    return [rand(*shape, dtype=dtype, seed=seed + i) for i in range(3)]


# ---------------------------------------------------------------------------------------------------
# flash_attention / reference_attention

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_4d(causal, dtype):
    q, k, v = qkv(2, 3, 70, 32, dtype=dtype)
    out = flash_attention(q, k, v, causal=causal)
    ref, _ = flexlite.attention_reference(q, k, v, block_mask=_causal_mask(70) if causal else None)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref, *TOLERANCES[dtype])
    assert_close(reference_attention(q, k, v, causal=causal), ref.to(dtype), *TOLERANCES[dtype])


def _causal_mask(n):
    return flexlite.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, n, n, device=DEVICE)


def test_flash_attention_3d_is_batch_times_heads():
    q, k, v = qkv(2, 3, 37, 16)
    out3 = flash_attention(*(t.reshape(6, 37, 16) for t in (q, k, v)), causal=True, sm_scale=0.3)
    assert out3.shape == (6, 37, 16)
    assert_close(out3.reshape(2, 3, 37, 16), reference_attention(q, k, v, causal=True, sm_scale=0.3),
                 *TOLERANCES[torch.float32])
    # sm_scale as flex_attention's scale: a numpy float or a 0-d tensor too
    import numpy as np
    for scale in (np.float32(0.3), torch.tensor(0.3)):
        assert_close(flash_attention(q, k, v, causal=True, sm_scale=scale), out3.reshape(2, 3, 37, 16),
                     *TOLERANCES[torch.float32])


@pytest.mark.parametrize("head_dim", [16, 48, 80, 128])
def test_flash_attention_head_dims(head_dim):
    q, k, v = qkv(1, 2, 50, head_dim, dtype=torch.float16)
    assert_close(flash_attention(q, k, v, causal=True), reference_attention(q, k, v, causal=True),
                 *TOLERANCES[torch.float16])


def test_flash_attention_length_multiple_of_tile():
    q, k, v = qkv(1, 2, 64, 32)
    assert_close(flash_attention(q, k, v), reference_attention(q, k, v), *TOLERANCES[torch.float32])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", [4, 3])
def test_flash_attention_seq_lens(dims, causal):
    B, H, S, D = 3, 2, 45, 32
    q, k, v = qkv(B, H, S, D)
    lens = [45, 17, 0]
    if dims == 3:
        q, k, v = (t.reshape(B * H, S, D) for t in (q, k, v))
        lens = [45, 17, 1, 30, 0, 44]
    out = flash_attention(q, k, v, causal=causal, seq_lens=torch.tensor(lens, dtype=torch.int32))
    assert out.shape == q.shape
    for b, n in enumerate(lens):
        # the valid rows equal attention over the valid prefix alone; rows past it are 0
        if n:
            ref = reference_attention(*(t[b:b + 1, ..., :n, :] for t in (q, k, v)), causal=causal)
            assert_close(out[b:b + 1, ..., :n, :], ref, *TOLERANCES[torch.float32], name=f"sample {b}")
        assert torch.all(out[b, ..., n:, :] == 0), f"sample {b}: rows past seq_lens must be 0"


def test_flash_attention_seq_lens_new_lengths_reuse_the_kernel(monkeypatch):
    """seq_lens is a kernel argument (captured by the mask_mod), not a constant: new lengths, same kernel."""
    modules = []
    real = flexlite.api.load_module
    monkeypatch.setattr(flexlite.api, "load_module", lambda *a, **kw: modules.append(real(*a, **kw)) or modules[-1])
    q, k, v = qkv(2, 1, 40, 16)
    flash_attention(q, k, v, seq_lens=torch.tensor([40, 3], dtype=torch.int32))
    out = flash_attention(q, k, v, seq_lens=torch.tensor([9, 40]))  # int64 is accepted too
    assert len(modules) == 2 and modules[0] is modules[1]
    assert_close(out[:1, :, :9], reference_attention(q[:1, :, :9], k[:1, :, :9], v[:1, :, :9]),
                 *TOLERANCES[torch.float32])
    assert_close(out[1:], reference_attention(q[1:], k[1:], v[1:]), *TOLERANCES[torch.float32])


def test_flash_attention_gradients_guarded():
    """flexlite's backward is optional here: skip if it is not available."""
    q, k, v = (t.requires_grad_() for t in qkv(2, 1, 33, 16))
    lens = torch.tensor([33, 20], dtype=torch.int32, device=DEVICE)
    flash_attention(q, k, v, causal=True, seq_lens=lens).sum().backward()
    mask = flexlite.create_block_mask(
        lambda b, h, qi, kv: (qi >= kv) & (qi < lens[b]) & (kv < lens[b]), 2, None, 33, 33, device=DEVICE)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    flexlite.attention_reference(q2, k2, v2, block_mask=mask)[0].sum().backward()
    for name, got, want in (("dq", q.grad, q2.grad), ("dk", k.grad, k2.grad), ("dv", v.grad, v2.grad)):
        assert_close(got, want, 1e-4, 1e-4, name=name)


@pytest.mark.parametrize("shape", [(0, 2, 8, 16), (2, 0, 8, 16), (2, 2, 0, 16), (0, 8, 16)], ids=str)
def test_empty_inputs_stay_differentiable(shape):
    """An empty batch, head or sequence returned zeros_like(q), not tied to q, k, v: a loss over it had no
    graph (backward: 'element 0 of tensors does not require grad'), where flex_attention's has one. Now the empty
    output has flex_attention's (and the reference's) graph: empty gradients, causal and seq_lens too."""
    for causal, seq_lens in ((False, None), (True, torch.zeros(shape[0], dtype=torch.int32))):
        for fn in (flash_attention, reference_attention):
            q, k, v = (t.requires_grad_() for t in qkv(*shape))
            out = (fn(q, k, v, causal=causal, seq_lens=seq_lens) if fn is flash_attention else
                   fn(q, k, v, causal=causal))
            assert out.shape == q.shape and out.dtype == q.dtype
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            assert all(g.shape == q.shape for g in grads)


# ---------------------------------------------------------------------------------------------------
# triton_matmul

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mnk", [(1, 1, 1), (33, 47, 61), (100, 130, 150), (17, 200, 9)], ids=str)
def test_triton_matmul(mnk, dtype):
    M, N, K = mnk
    a, b = rand(M, K, dtype=dtype, seed=1), rand(K, N, dtype=dtype, seed=2)
    c = triton_matmul(a, b)
    assert c.shape == (M, N)
    assert c.dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)  # fp32 -> fp16
    # fp32 inputs are computed in fp16: the reference uses the same rounded values
    a64, b64 = ((t.half() if dtype == torch.float32 else t).double() for t in (a, b))
    tol = MATMUL_TOL[dtype]
    assert_close(c, a64 @ b64, tol, tol)


def test_triton_matmul_strided_inputs_and_empty_dims():
    a, b = rand(40, 70, dtype=torch.float16, seed=1), rand(50, 40, dtype=torch.float16, seed=2)
    at, bt = a.t(), b.t()  # (70, 40) @ (40, 50), non-contiguous
    assert_close(triton_matmul(at, bt), at.double() @ bt.double(), 1e-3, 1e-3)
    assert triton_matmul(rand(0, 5), rand(5, 3)).shape == (0, 3)
    assert torch.all(triton_matmul(rand(4, 0), rand(0, 3)) == 0)


@pytest.mark.parametrize("blocks", [(16, 16, 16), (32, 64, 16), (64, 64, 32), (16, 16, 32)], ids=str)
def test_triton_matmul_block_sizes(blocks):
    M, N, K = 70, 100, 40  # padded to 80, 112, 48: blocks up to 64, 64, 32
    a, b = rand(M, K, dtype=torch.float16, seed=3), rand(K, N, dtype=torch.float16, seed=4)
    c = triton_matmul(a, b, block_m=blocks[0], block_n=blocks[1], block_k=blocks[2])
    assert_close(c, a.double() @ b.double(), 1e-3, 1e-3)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU behaviour: on a GPU autotuning may pick another config")
def test_triton_matmul_autotune_flag_on_cpu_uses_the_interpreter_config():
    a, b = rand(70, 40, dtype=torch.float16), rand(40, 100, dtype=torch.float16)
    assert torch.equal(triton_matmul(a, b, use_autotune=True), triton_matmul(a, b, use_autotune=False))


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_m=32), "together"),
    (dict(block_m=32, block_n=32), "together"),
    (dict(block_m=24, block_n=16, block_k=16), "block_m=24"),
    (dict(block_m=8, block_n=16, block_k=16), "block_m=8"),
    (dict(block_m=0, block_n=16, block_k=16), "block_m=0"),
    (dict(block_m=-16, block_n=16, block_k=16), "block_m=-16"),
    (dict(block_m=16, block_n=64, block_k=16), "block_n=64"),   # N=20 -> at most 32
    (dict(block_m=16, block_n=16, block_k=64), "block_k=64"),   # K=33 -> at most 48
    (dict(block_m=True, block_n=16, block_k=16), "block_m=True"),
    (dict(block_m=16.0, block_n=16, block_k=16), "block_m=16.0"),
], ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_triton_matmul_invalid_block_sizes(kwargs, match):
    with pytest.raises(ValueError, match=f"invalid block size.*{match}|{match}.*"):
        triton_matmul(rand(10, 33), rand(33, 20), **kwargs)


def test_padded_dim():
    assert [padded_dim(n) for n in (0, 1, 16, 17, 100, 112)] == [16, 16, 16, 32, 112, 112]


# ---------------------------------------------------------------------------------------------------
# errors (the original's table)

@pytest.mark.parametrize("a_shape, b_shape, exc, match", [
    ((2, 3, 4), (4, 5), ValueError, "expected 2-D"),
    ((3,), (3, 5), ValueError, "expected 2-D"),
    ((3, 4), (5, 6), ValueError, "incompatible dimensions"),
])
def test_matmul_shape_errors(a_shape, b_shape, exc, match):
    with pytest.raises(exc, match=match):
        triton_matmul(rand(*a_shape), rand(*b_shape))


def test_matmul_dtype_errors():
    with pytest.raises(TypeError, match="unsupported dtype"):
        triton_matmul(rand(4, 4).double(), rand(4, 4).double())
    with pytest.raises(TypeError, match="unsupported dtype"):
        triton_matmul(torch.ones(4, 4, dtype=torch.int32), torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="dtypes must match"):
        triton_matmul(rand(4, 4, dtype=torch.float16), rand(4, 4))
    with pytest.raises(TypeError, match="torch.Tensor"):
        triton_matmul([[1.0]], rand(1, 1))


@pytest.mark.parametrize("fn", [flash_attention, reference_attention], ids=lambda f: f.__name__)
def test_attention_errors(fn):
    q = rand(1, 2, 8, 16)
    with pytest.raises(ValueError, match="expected 3-D .* or 4-D"):
        fn(rand(8, 16), rand(8, 16), rand(8, 16))
    with pytest.raises(ValueError, match="expected 3-D .* or 4-D"):
        fn(*(rand(1, 1, 1, 8, 16) for _ in range(3)))
    with pytest.raises(ValueError, match="shape mismatch"):
        fn(q, rand(1, 2, 9, 16), q)
    with pytest.raises(ValueError, match="unsupported head_dim 300"):
        fn(*(rand(1, 1, 4, 300) for _ in range(3)))
    with pytest.raises(TypeError, match="unsupported dtype torch.float64"):
        fn(q.double(), q.double(), q.double())
    with pytest.raises(TypeError, match="dtypes must match"):
        fn(q, q.half(), q)
    with pytest.raises(TypeError, match="sm_scale"):
        fn(q, q, q, sm_scale="0.1")


@pytest.mark.parametrize("seq_lens, exc, match", [
    (torch.tensor([4.0]), TypeError, "integer"),
    (torch.tensor([True]), TypeError, "integer"),
    ([4], TypeError, "int32 tensor"),
    (torch.tensor([[4]], dtype=torch.int32), ValueError, "1-D"),
    (torch.tensor([4, 4], dtype=torch.int32), ValueError, "2 entries but the batch size is 1"),
    (torch.tensor([9], dtype=torch.int32), ValueError, r"in \[0, 8\]"),
    (torch.tensor([-1], dtype=torch.int32), ValueError, r"in \[0, 8\]"),
], ids=["float", "bool", "list", "2-D", "length", "too long", "negative"])
def test_seq_lens_errors(seq_lens, exc, match):
    q = rand(1, 2, 8, 16)
    with pytest.raises(exc, match=match):
        flash_attention(q, q, q, seq_lens=seq_lens)


def test_missing_triton_names_the_install_command(monkeypatch):
    path = Path(flexlite.kernels.__file__)
    spec = importlib.util.spec_from_file_location("flexlite_kernels_probe", path)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(ImportError, match="pip install triton"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# ---------------------------------------------------------------------------------------------------
# GPU detection with fake CUDA devices

def _props(name, cc, sms, mem_gb, smem=None):
    props = types.SimpleNamespace(name=name, major=cc[0], minor=cc[1], multi_processor_count=sms,
                                  total_memory=int(mem_gb * 1024 ** 3))
    if smem is not None:
        props.shared_memory_per_multiprocessor = smem
    return props


FAKE_GPUS = {
    "H100": _props("NVIDIA H100 80GB HBM3", (9, 0), 132, 79.1, 233472),
    "A100": _props("NVIDIA A100-SXM4-40GB", (8, 0), 108, 39.4, 167936),
    "RTX4090": _props("NVIDIA GeForce RTX 4090", (8, 9), 128, 23.6, 102400),
    "B200": _props("NVIDIA B200", (10, 0), 148, 178.0),  # no smem attribute: table fallback
    "T4": _props("Tesla T4", (7, 5), 40, 14.6, 65536),
    "V100": _props("Tesla V100-SXM2-16GB", (7, 0), 80, 15.8, 98304),
    "A10": _props("NVIDIA A10", (8, 6), 72, 22.0, 102400),
    "RTX5090": _props("NVIDIA GeForce RTX 5090", (12, 0), 170, 31.4, 102400),
    "P100": _props("Tesla P100", (6, 0), 56, 16.0, 65536),
}


@pytest.fixture
def fake_gpu(monkeypatch):
    def install(name):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: FAKE_GPUS[name])
    return install


@pytest.mark.parametrize("name, arch, tma, fp8, wgmma, smem", [
    ("H100", GPUArch.HOPPER, True, True, True, 233472),
    ("A100", GPUArch.AMPERE, False, False, False, 167936),
    ("RTX4090", GPUArch.ADA, False, True, False, 102400),
    ("B200", GPUArch.BLACKWELL, True, True, False, 228 * 1024),
    ("T4", GPUArch.TURING, False, False, False, 65536),
    ("V100", GPUArch.VOLTA, False, False, False, 98304),
    ("A10", GPUArch.AMPERE, False, False, False, 102400),
    ("RTX5090", GPUArch.BLACKWELL, True, True, False, 102400),
    ("P100", GPUArch.UNKNOWN, False, False, False, 65536),
])
def test_detect_gpu(fake_gpu, name, arch, tma, fp8, wgmma, smem):
    fake_gpu(name)
    caps = detect_gpu()
    props = FAKE_GPUS[name]
    assert caps == GPUCapabilities(name=props.name, arch=arch, compute_capability=(props.major, props.minor),
                                   has_tma=tma, has_fp8=fp8, has_warpgroup_mma=wgmma, sram_per_sm=smem,
                                   num_sms=props.multi_processor_count, total_memory_gb=caps.total_memory_gb)
    assert math.isclose(caps.total_memory_gb, props.total_memory / 1024 ** 3)
    features = check_hopper_features()
    assert features["fp8_available"] == fp8 == supports_fp8()
    assert features["wgmma_available"] == wgmma
    assert features["arch"] == arch.value and features["compute_capability"] == (props.major, props.minor)
    assert features["tma_available"] == (tma and hasattr(__import__("triton.language").language,
                                                         "make_tensor_descriptor"))


def test_detect_gpu_amd_is_unknown(fake_gpu, monkeypatch):
    fake_gpu("H100")  # a ROCm build reporting major 9
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    caps = detect_gpu()
    assert caps.arch is GPUArch.UNKNOWN and not (caps.has_tma or caps.has_fp8 or caps.has_warpgroup_mma)


def test_detect_gpu_bad_device_id(fake_gpu):
    fake_gpu("A100")
    with pytest.raises(ValueError, match="device_id"):
        detect_gpu(1)


def test_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        detect_gpu()
    assert check_hopper_features() == {"tma_available": False, "fp8_available": False, "wgmma_available": False,
                                       "arch": "unknown", "compute_capability": (0, 0)}
    assert supports_fp8() is False
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        BenchmarkRunner()


# ---------------------------------------------------------------------------------------------------
# selector: the heuristics the kernels really run

@pytest.mark.parametrize("name, expected", [
    ("H100", MATMUL_CONFIGS[0]), ("A100", MATMUL_CONFIGS[0]), ("RTX4090", MATMUL_CONFIGS[1]),
    ("T4", MATMUL_CONFIGS[4]),
])
def test_selector_matmul_config_on_fake_gpus(fake_gpu, name, expected):
    fake_gpu(name)
    config = AdaptiveKernelSelector("cuda").get_matmul_config(4096, 4096, 4096)
    assert {k: config[k] for k in expected} == expected
    assert config["use_tma"] is False and config["arch"] == detect_gpu().arch.value
    small = AdaptiveKernelSelector("cuda").get_matmul_config(20, 100, 33)  # padded 32, 112, 48
    assert (small["BLOCK_M"], small["BLOCK_N"], small["BLOCK_K"]) == (
        min(32, expected["BLOCK_M"]), min(64, expected["BLOCK_N"]), min(32, expected["BLOCK_K"]))


def test_selector_attention_config_on_fake_gpu_is_flexlites_cuda_heuristic(fake_gpu):
    from flexlite.runtime.launch import forward_config
    fake_gpu("H100")
    selector = AdaptiveKernelSelector("cuda")
    for head_dim, dtype, causal, varlen in [(64, torch.float16, False, False), (128, torch.bfloat16, True, False),
                                            (128, torch.float16, True, True), (256, torch.float32, False, False),
                                            (128, torch.bfloat16, False, False)]:
        config = selector.get_attention_config(8192, head_dim, dtype, causal, varlen)
        spec = types.SimpleNamespace(shape=(1, 1, 8192, head_dim), dtype=dtype, device=torch.device("cuda"))
        tile = forward_config(spec, spec, (128, 128), {}, gathers=varlen)
        assert (config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"]) == (
            tile.BLOCK_M, tile.BLOCK_N, tile.num_warps, tile.num_stages)
        assert config["arch"] == "sm_90"
        # tensor descriptors only where the kernel takes them by default: no mask, head dims up to 128
        assert config["use_tma"] is (head_dim <= 128 and not causal and not varlen)


@pytest.mark.parametrize("causal, varlen", [(False, False), (True, False), (True, True)])
def test_attention_config_is_what_flash_attention_launches(monkeypatch, causal, varlen):
    launched = []
    real = flexlite.api.forward_config
    monkeypatch.setattr(flexlite.api, "forward_config",
                        lambda *a, **kw: launched.append(real(*a, **kw)) or launched[-1])
    q, k, v = qkv(2, 1, 45, 48, dtype=torch.float16)
    flash_attention(q, k, v, causal=causal, seq_lens=torch.tensor([45, 20], dtype=torch.int32) if varlen else None)
    config = get_attention_config(45, 48, torch.float16, causal=causal, varlen=varlen)
    assert len(launched) == 1
    assert {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")} == dataclasses.asdict(launched[0])


def test_selected_matmul_kernel_runs_get_matmul_config():
    a, b = rand(70, 40, dtype=torch.bfloat16, seed=5), rand(40, 100, dtype=torch.bfloat16, seed=6)
    config = get_matmul_config(70, 100, 40)
    if DEVICE == "cpu":  # the interpreter config clipped to 80 x 112 x 48
        assert {k: config[k] for k in INTERPRETER_MATMUL_CONFIG if k.startswith("BLOCK")} == dict(
            BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)
    explicit = triton_matmul(a, b, block_m=config["BLOCK_M"], block_n=config["BLOCK_N"], block_k=config["BLOCK_K"])
    for fn in (get_optimal_matmul(), AdaptiveKernelSelector().select_matmul_kernel()):
        assert torch.equal(fn(a, b), explicit)
    assert get_optimal_attention() is flash_attention is AdaptiveKernelSelector().select_attention_kernel()


# ---------------------------------------------------------------------------------------------------
# benchmarking and validation

def test_benchmark_fn_on_cpu():
    calls = []
    median, p20, p80 = benchmark_fn(lambda x, scale: calls.append(x * scale), 2.0, warmup=1, rep=5, scale=3.0)
    assert calls and calls[0] == 6.0
    assert 0 <= p20 <= median <= p80
    assert len(benchmark_fn(torch.zeros, 4, warmup=1, rep=1, quantiles=(0.1, 0.5, 0.9, 0.99))) == 4


def test_benchmark_runner_on_cpu(capsys):
    runner = BenchmarkRunner(device="cpu", warmup=1, rep=1)
    mm = runner.benchmark_matmul(triton_matmul, [(33, 47, 61)], block_configs=[None, {"BLOCK_M": 16, "BLOCK_N": 32,
                                                                                        "BLOCK_K": 16}])
    att = runner.benchmark_attention(flash_attention, [40], batch_size=1, num_heads=2, head_dim=16, causal=True)
    assert [r.name for r in mm] == ["torch.matmul", "triton_matmul", "triton_matmul"]
    assert [r.name for r in att] == ["torch SDPA", "flash_attention"]
    assert mm[2].block_config == {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16} and mm[1].block_config is None
    assert all(isinstance(r, BenchmarkResult) and r.time_ms > 0 and r.tflops > 0 and r.memory_mb == 0.0
               for r in mm + att)
    assert math.isclose(mm[1].tflops, 2 * 33 * 47 * 61 / mm[1].time_ms / 1e9)
    assert math.isclose(att[1].tflops, 0.5 * 4 * 1 * 2 * 40 * 40 * 16 / att[1].time_ms / 1e9)
    assert att[0].size == (1, 2, 40, 16) and len(runner.results) == 5
    text = runner.print_comparison_table(title="CPU check")
    printed = capsys.readouterr().out
    assert "CPU check" in printed and "wall clock" in printed and "16x32x16" in printed and text in printed
    runner.clear_results()
    assert runner.results == []


def test_validate_matmul():
    for dtype in DTYPES:
        ok, diff = validate_matmul(triton_matmul, 33, 47, 61, dtype=dtype, device=DEVICE)
        assert ok and 0 <= diff < 0.2, (dtype, diff)
    ok, diff = validate_matmul(lambda a, b: triton_matmul(a, b) * 1.01, 33, 47, 61, device=DEVICE)
    assert not ok and diff > 0.01
    assert validate_matmul(lambda a, b: a, 8, 8, 4, device=DEVICE) == (False, float("inf"))


def test_validate_attention(capsys):
    ok, diff = validate_attention(flash_attention, 1, 2, 40, 32, causal=True, dtype=torch.bfloat16, device=DEVICE,
                                  verbose=True)
    assert ok and 0 <= diff < 2.5e-2 and "PASS" in capsys.readouterr().out
    ok, diff = validate_attention(flash_attention, 1, 2, 40, 32, causal=False, device=DEVICE)
    assert ok and diff < 4e-3  # float16 by default
    wrong = lambda q, k, v, causal: flash_attention(q, k, v, causal=not causal)  # noqa: E731
    ok, diff = validate_attention(wrong, 1, 2, 40, 32, causal=True, dtype=torch.float16, device=DEVICE, verbose=True)
    assert not ok and diff > 0.01 and "FAIL" in capsys.readouterr().out


def test_names_exported():
    import flexlite.kernels as kernels
    import flexlite.utils as utils
    for name in ("flash_attention", "reference_attention", "triton_matmul", "detect_gpu"):
        assert getattr(flexlite, name) is not None and name in flexlite.__all__
    for name in utils.__all__:
        assert hasattr(utils, name)
    for name in kernels.__all__:
        assert hasattr(kernels, name)


def test_the_interpreter_reads_scalars_as_numpy_2_4_requires():
    """Triton 3.6's interpreter made a scalar an index with ``int`` of a 1-element array: deprecated since numpy
    1.25 and an error in numpy 2.4, where every CPU kernel with a ``range`` over a runtime bound failed. flexlite's
    interpreted launches read it with ``.item()`` (runtime.compile._interpreter_numpy_compat), so no such conversion
    is left: numpy's deprecation warning, made an error here, is not raised (on CPU, whatever the suite's device)."""
    import warnings
    a = torch.randn(33, 47)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Conversion of an array with ndim > 0", category=DeprecationWarning)
        c = triton_matmul(a, a.T.contiguous())
        out = flash_attention(q, k, v, causal=True)
    assert_close(c.float(), a @ a.T, 2e-2, 2e-2, name="matmul")
    assert_close(out, reference_attention(q, k, v, causal=True), *TOLERANCES[torch.float32], name="flash_attention")
