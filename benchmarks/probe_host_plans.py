"""Host time per call (us) of flex_attention's forward (with and without grad) and backward at B1 H16 S2048 (D128,
D64; causal and document masks, bf16): GPU times far below the host's, so each loop of calls measures the host path
(the best of three loops of 400 calls, 200 backwards; the gradients accumulate into q / k / v: three adds a
backward). One process per checkout, to compare two trees on one machine (NOTES 102: the plans against the tree
before them):

    PYTHONPATH=<checkout> python benchmarks/probe_host_plans.py <label>

Prints a line per case: label, head dim, mask, fwd, fwd_nograd, bwd (us per call). ``--profile``: then cProfile of
300 D128 document forwards and 300 backwards, by own and by cumulative time (where the host time goes); ``--parts``:
then each layer of that forward alone (validation, the forward under the autograd Function, launch_forward_ws, the
compiled launch, the outputs' allocation) and torch's compiled flex_attention with and without grad."""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import flexlite
from flexlite import first_calls
from flexlite.masks import causal_mask, generate_causal_document_mask


def host_us(fn, calls: int = 400) -> float:
    """The best of three loops of ``calls`` calls, in us per call (the GPU synchronized around each loop only)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return min(loops)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    label = args[0] if args else "tree"
    B, H, S = 1, 16, 2048
    for D in (128, 64):
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        for name, mask_mod in (("causal", causal_mask),
                               ("document", generate_causal_document_mask([S // 8] * 8, device="cuda"))):
            bm = flexlite.create_block_mask(mask_mod, None, None, S, S, device="cuda")

            def forward():
                return flexlite.flex_attention(q, k, v, block_mask=bm)

            def no_grad():
                with torch.no_grad():
                    return forward()
            for _ in range(2):  # (the kernels compiled, the first calls' torch ops and bits behind)
                forward().sum().backward()
                first_calls.wait()
            out = forward()
            grad = torch.randn_like(out)
            times = dict(fwd=host_us(forward), fwd_nograd=host_us(no_grad),
                         bwd=host_us(lambda: out.backward(grad, retain_graph=True), 200))
            print(label, f"D={D}", f"mask={name}", " ".join(f"{k}={t:.0f}" for k, t in times.items()), flush=True)
            if D == 128 and name == "document" and "--profile" in sys.argv:
                profile(forward=forward, backward=lambda: out.backward(grad, retain_graph=True))
            if D == 128 and name == "document" and "--parts" in sys.argv:
                parts(label, q, k, v, bm, mask_mod, forward)


def parts(label, q, k, v, bm, mask_mod, forward):
    """Host time (us) of each layer of ``forward`` (a planned D128 document forward) alone, and of torch's compiled
    flex_attention at the same call."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    import flexlite.api as api
    from flexlite.runtime import launch
    seen = {}
    real_ws, real_call = api.launch_forward_ws, launch.CompiledLaunch.__call__

    def ws(*args, **kwargs):
        seen["ws"] = (args, kwargs)
        return real_ws(*args, **kwargs)

    def call(self, grid, args):
        seen["launch"] = (self, grid, args)
        return real_call(self, grid, args)
    api.launch_forward_ws, launch.CompiledLaunch.__call__ = ws, call
    forward()
    api.launch_forward_ws, launch.CompiledLaunch.__call__ = real_ws, real_call
    traced = api._validate(q, k, v, None, bm, None, False, None)
    scale = q.shape[-1] ** -0.5
    (ws_args, ws_kwargs), (cl, grid, cl_args) = seen["ws"], seen["launch"]
    compiled = torch.compile(torch_flex)
    tbm = torch_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cuda")

    def torch_forward():
        return compiled(q, k, v, block_mask=tbm)

    def torch_no_grad():
        with torch.no_grad():
            return torch_forward()
    for _ in range(3):
        torch_forward().sum().backward()
    times = dict(
        flex_attention=host_us(forward),
        validate=host_us(lambda: api._validate(q, k, v, None, bm, None, False, None)),
        function_apply=host_us(lambda: api.FlexAttentionFunction.apply(q, k, v, None, bm, scale, None, False,
                                                                       traced)),
        forward_no_grad=host_us(lambda: api._forward(q, k, v, None, bm, scale, None, False, traced)),
        launch_forward_ws=host_us(lambda: real_ws(*ws_args, **ws_kwargs)),
        compiled_launch=host_us(lambda: cl(grid, cl_args)),
        two_empties=host_us(lambda: (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                                     torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))),
        torch_flex=host_us(torch_forward), torch_flex_no_grad=host_us(torch_no_grad))
    print(label, "parts (D128 document):", " ".join(f"{k}={t:.0f}" for k, t in times.items()), flush=True)


def _calls(fn, n: int):
    for _ in range(n):  # (each output freed at once: its memory reused, as in a model)
        fn()


def profile(**calls):
    for what, fn in calls.items():
        profiler = cProfile.Profile()
        profiler.runcall(_calls, fn, 300)
        torch.cuda.synchronize()
        print(f"--- {what}, 300 calls ---")
        for order in ("tottime", "cumulative"):
            pstats.Stats(profiler).sort_stats(order).print_stats(28)


if __name__ == "__main__":
    main()
