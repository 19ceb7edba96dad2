"""The generated block-mask kernel (the CUDA builder) against the chunked vmap builder, through the
interpreter on CPU."""

import pytest
import torch

from catalog import CATALOG, USES_BH
from flexlite import block_mask as bm_module
from helpers import DEVICE

MASKED = sorted(name for name in CATALOG if CATALOG[name](1, 1, 8, 8, "cpu").mask_mod is not None)


@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (2, 2, 111, 200), (1, 2, 256, 256), (1, 1, 200, 63)], ids=str)
@pytest.mark.parametrize("block_size", [(128, 128), (32, 64), (48, 16)], ids=str)
@pytest.mark.parametrize("name", MASKED)
def test_kernel_flags_match_vmap_flags(name, sizes, block_size):
    B, H, Lq, Lkv = sizes
    mask_mod = CATALOG[name](B, H, Lq, Lkv, DEVICE).mask_mod
    if name not in USES_BH:
        B, H = 1, 1
    got = bm_module._block_flags_kernel(mask_mod, B, H, Lq, Lkv, torch.device(DEVICE), block_size)
    want = bm_module._block_flags_vmap(mask_mod, B, H, Lq, Lkv, torch.device(DEVICE), block_size)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_kernel_rejects_non_bool_mask():
    def int_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx).int()
    with pytest.raises(TypeError, match="must return a bool"):
        bm_module._block_flags_kernel(int_mask, 1, 1, 32, 32, torch.device(DEVICE), (16, 16))


def _always(b, h, q_idx, kv_idx):
    return torch.ones((), dtype=torch.bool)


def _never(b, h, q_idx, kv_idx):
    return torch.zeros((), dtype=torch.bool)


@pytest.mark.parametrize("mask_mod", [_always, _never], ids=["always", "never"])
@pytest.mark.parametrize("sizes", [(64, 128), (40, 70)], ids=str)
def test_kernel_flags_of_constant_masks(mask_mod, sizes):
    """A mask_mod that ignores its indices lowers to a scalar: the flags still cover every block."""
    got = bm_module._block_flags_kernel(mask_mod, 1, 1, *sizes, torch.device(DEVICE), (16, 32))
    want = bm_module._block_flags_vmap(mask_mod, 1, 1, *sizes, torch.device(DEVICE), (16, 32))
    assert got[0].shape == want[0].shape == (1, 1, -(-sizes[0] // 16), -(-sizes[1] // 32))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
