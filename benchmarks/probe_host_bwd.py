"""Host time (us) of flex_attention's backward by layer, at short shapes where the backward is host-bound (NOTES 104):
per case (B in 1, 8; H16 S2048; D128 and D64; causal and document masks, bf16), ``out.backward(grad)`` repeated on
one forward's output (the host path alone: the GPU synchronized around each loop only, ``probe_host_plans.host_us``),
then the same calls with a timer around each layer (inclusive times, whichever thread runs them: CUDA backwards
run in autograd's device thread, which cProfile does not see), and torch's compiled flex_attention's backward at the
same call.

Usage: python benchmarks/probe_host_bwd.py [--torch] [--profile]   (``--torch``: torch's compiled flex too;
``--profile``: then cProfile of 300 calls of api._backward with a B1 document backward's arguments, called on the
main thread, by own time)"""

from __future__ import annotations

import cProfile
import functools
import pstats
import sys
import threading
import time

import torch
from tabulate import tabulate

import flexlite
import flexlite.api as api
from flexlite import first_calls
from flexlite.masks import causal_mask, generate_causal_document_mask
from flexlite.runtime import launch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from probe_host_plans import host_us  # noqa: E402

# (owner, attribute name, label): the layers timed, outermost first
LAYERS = [(api.FlexAttentionFunction, "backward", "Function.backward"),
          (api, "_check_unchanged_since_forward", "check unchanged"),
          (api, "_backward", "api._backward"),
          (api, "_plan_key", "plan key"),
          (api, "_block_tensors", "kv block tensors"),
          (api, "_run_backward", "api._run_backward"),
          (api, "load_module", "load_module"),
          (api, "_q_block_tensors", "q block tensors"),
          (api, "backward_config", "backward_config"),
          (api, "launch_backward", "launch_backward"),
          (launch, "_launch_dkdv_ws", "_launch_dkdv_ws"),
          (launch, "scalars_to", "scalars_to"),
          (launch.CompiledLaunch, "__call__", "CompiledLaunch calls")]


class Timers:
    def __init__(self):
        self.total, self.calls, self.saved = {}, {}, []

    def install(self):
        for owner, name, label in LAYERS:
            raw = owner.__dict__[name]
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            self.saved.append((owner, name, raw))
            wrapped = self._timed(fn, label)
            setattr(owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)

    def remove(self):
        for owner, name, raw in reversed(self.saved):
            setattr(owner, name, raw)
        self.saved.clear()

    def _timed(self, fn, label):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1
        return timed


def main():
    rows = []
    H, S = 16, 2048
    for B in (1, 8):
        for D in (128, 64):
            q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3)]
            for name, mask_mod in (("causal", causal_mask),
                                   ("document", generate_causal_document_mask([S // 8] * 8, device="cuda"))):
                bm = flexlite.create_block_mask(mask_mod, None, None, S, S, device="cuda")
                for _ in range(2):  # (the kernels compiled, the first calls' torch ops and bits behind)
                    flexlite.flex_attention(q, k, v, block_mask=bm).sum().backward()
                    first_calls.wait()
                out = flexlite.flex_attention(q, k, v, block_mask=bm)
                grad = torch.randn_like(out)

                def bwd():
                    q.grad = k.grad = v.grad = None
                    out.backward(grad, retain_graph=True)
                row = dict(case=f"B{B} D{D} {name}", backward=host_us(bwd, 200))
                timers = Timers()
                timers.install()
                try:
                    n = 200
                    bwd()
                    torch.cuda.synchronize()
                    timers.total.clear(), timers.calls.clear()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        bwd()
                    row["backward, timed"] = (time.perf_counter() - t0) / n * 1e6
                    torch.cuda.synchronize()
                finally:
                    timers.remove()
                for _, _, label in LAYERS:
                    row[label] = timers.total.get(label, 0.0) / n * 1e6
                row["launches"] = timers.calls.get("CompiledLaunch calls", 0) / n
                if "--torch" in sys.argv:
                    row["torch flex backward"] = torch_backward(q, k, v, mask_mod)
                rows.append(row)
                if "--profile" in sys.argv and B == 1 and name == "document":
                    profile(bwd)
                print({k_: (round(v_, 1) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
    print("threads:", [t.name for t in threading.enumerate()], "switch interval", sys.getswitchinterval())
    columns = list(rows[0])
    print(tabulate([[r.get(c, "") for c in columns] for r in rows], headers=columns, tablefmt="github",
                   floatfmt=".0f"))


def profile(bwd):
    """cProfile of 300 calls of api._backward with the arguments ``bwd`` passes it, on this thread."""
    seen, real = [], api._backward

    def record(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)
    api._backward = record
    try:
        bwd()
    finally:
        api._backward = real
    args, kwargs = seen[0]
    for _ in range(20):
        real(*args, **kwargs)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        real(*args, **kwargs)
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(40)


def torch_backward(q, k, v, mask_mod) -> float:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import torch._functorch.config
    torch._functorch.config.donated_buffer = False  # (its backward repeated on one graph: retain_graph)
    compiled = torch.compile(flex_attention, dynamic=False)
    tbm = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cuda")
    for _ in range(3):
        compiled(q, k, v, block_mask=tbm).sum().backward()
    out = compiled(q, k, v, block_mask=tbm)
    grad = torch.randn_like(out)

    def bwd():
        q.grad = k.grad = v.grad = None
        out.backward(grad, retain_graph=True)
    return host_us(bwd, 200)


if __name__ == "__main__":
    main()
