"""A drop-in swap: code written for torch's FlexAttention, with only the flex_attention import changed to flexlite's.
torch's own create_block_mask and AuxRequest stay; the notebooks' torch.compile(flex_attention) stays; a model under
torch.compile and torch.autocast stays. Each result is checked against flexlite's fp64 reference.

    python gym_examples/drop_in.py [--small]
"""

# %%
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask  # torch's, unchanged

from _common import TOLERANCE, _rel_err, setup
from flexlite import attention_reference
from flexlite import create_block_mask as flexlite_block_mask  # only for the reference's mask
from flexlite import flex_attention  # the one swapped import (was: from torch.nn.attention.flex_attention)

cfg = setup(__doc__)
B, H, S, D = 1, cfg.size(4, 2), cfg.size(2048, 128), cfg.size(64, 16)
WINDOW, BLOCK = cfg.size(256, 32), cfg.size(128, 32)
tol = TOLERANCE[cfg.dtype]


def report(name: str, got: torch.Tensor, want: torch.Tensor, passes: str = "fwd") -> None:
    err = _rel_err(got, want)
    status = "ok" if err <= tol else "MISMATCH"
    print(f"  {name}: {passes} vs fp64 reference, max rel err {err:.1e} (tol {tol:g}) {status}")
    if status != "ok":
        cfg.failures.append(name)


def sliding_window_causal(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


q, k, v = (torch.randn(B, H, S, D, device=cfg.device, dtype=cfg.dtype) for _ in range(3))
ref_mask = flexlite_block_mask(sliding_window_causal, None, None, S, S, device=cfg.device)
ref, ref_lse, ref_max = attention_reference(q, k, v, score_mod=softcap, block_mask=ref_mask, return_max=True)

# %% torch's create_block_mask: its BlockMask goes to flexlite as it is
block_mask = create_block_mask(sliding_window_causal, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{type(block_mask).__module__}.{block_mask}")
report("torch BlockMask", flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask), ref)

# %% the notebooks' torch.compile(flex_attention): flexlite runs its own kernels under it
compiled = torch.compile(flex_attention, backend="aot_eager" if cfg.device.type == "cpu" else "inductor")
report("torch.compile(flex_attention)", compiled(q, k, v, score_mod=softcap, block_mask=block_mask), ref)

# %% return_aux=AuxRequest(...) (torch >= 2.9): the log-sum-exp and each row's largest score
out, aux = flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask,
                          return_aux=AuxRequest(lse=True, max_scores=True))
report("AuxRequest lse", aux.lse, ref_lse)
report("AuxRequest max_scores", aux.max_scores, ref_max)


# %% a model compiled and run under autocast, training: out and the projection's gradient
class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)

    def forward(self, x, attend=flex_attention):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return attend(q, k, v, score_mod=softcap, block_mask=block_mask)


def reference_attend(q, k, v, score_mod, block_mask):
    return attention_reference(q, k, v, score_mod=score_mod, block_mask=ref_mask)[0].to(q.dtype)


model = Attention().to(cfg.device)
x = torch.randn(B, H, S, D, device=cfg.device)
autocast_dtype = torch.bfloat16
with torch.autocast(cfg.device.type, dtype=autocast_dtype):
    y = torch.compile(model, backend="aot_eager" if cfg.device.type == "cpu" else "inductor")(x)
grad = torch.autograd.grad(y.float().square().sum(), model.qkv.weight)[0]
with torch.autocast(cfg.device.type, dtype=autocast_dtype):
    y_ref = model(x, attend=reference_attend)
grad_ref = torch.autograd.grad(y_ref.float().square().sum(), model.qkv.weight)[0]
tol = TOLERANCE[autocast_dtype]
print(f"  compiled model under autocast: out {y.dtype}")
report("compiled model under autocast, out", y, y_ref.double())
report("compiled model under autocast, d(weight)", grad, grad_ref.double(), passes="fwd+bwd")

cfg.finish()
