"""GPU probe: the host time of one flex_attention forward call (document mask, B4 H16 S8192 D128, q / k / v requiring
grad) on the GPU machine, as other masks' kernels (flexlite's and torch's compiled flex, forward and backward) are
added to the process, then with Python's collector frozen and off (NOTES 65). Host time: 100 calls back to back,
timed on the host without waiting for the GPU (the queue does not fill in 100 calls), so it is the Python and launch
work alone; beside it do_bench's eager median. ``--profile``: after the masks, cProfile of 300 calls (by own time);
``--profile-step``: of 100 training steps at B1 H16 S2048 (forward and backward, the gradients set to None between
them), by own and by cumulative time, for where a step's ~1-1.5 ms of host time goes (NOTES 67).

Usage: python benchmarks/probe_host_gpu.py [mask,mask,...] [--profile] [--profile-step]
(masks added in order; default: the harness's other six)"""

import cProfile
import gc
import pstats
import sys

import torch
import triton.testing
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

from flexlite import create_block_mask, flex_attention
from flexlite.bench import host_us, mask_cases

OTHERS = ["full", "causal", "sliding_window_1024", "prefix_lm_2048", "alibi_causal", "softcap30_causal"]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    masks = args[0].split(",") if args else OTHERS
    B, H, S, D = 4, 16, 8192, 128
    q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    cases = mask_cases(S, H, "cuda")
    compiled = torch.compile(torch_flex)
    doc = cases["document_8_causal"]
    doc_mask = create_block_mask(doc.mask_mod, None, None, S, S, device="cuda")

    def document():
        return flex_attention(q, k, v, block_mask=doc_mask)

    def report(label):
        print(f"{label}: document's host time {host_us(document):.0f} us a call, do_bench eager "
              f"{triton.testing.do_bench(document):.4f} ms", flush=True)

    report("fresh")
    for name in masks:
        case = cases[name]
        bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
        flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm).sum().backward()
        try:
            tbm = torch_create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
            compiled(q, k, v, score_mod=case.torch_score_mod, block_mask=tbm).sum().backward()
        except Exception as e:  # noqa: BLE001 - torch's own failure, recorded
            print(f"{name}: torch's flex failed: {str(e).splitlines()[-1][:100]}")
        torch.cuda.synchronize()
        report(f"after {name}")
    if "--profile" in sys.argv:
        cProfile.runctx("for _ in range(300): document()", globals(), {"document": document}, "/tmp/probe_host.prof")
        torch.cuda.synchronize()
        pstats.Stats("/tmp/probe_host.prof").sort_stats("tottime").print_stats(25)
    if "--profile-step" in sys.argv:  # at B1 H16 S2048, whose GPU time stays below the host's (as probe_host_launch_gpu)
        small = [torch.randn(1, H, 2048, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        small_mask = create_block_mask(mask_cases(2048, H, "cuda")["document_8_causal"].mask_mod, None, None, 2048,
                                       2048, device="cuda")
        grad_out = torch.randn_like(small[0])

        def step():
            flex_attention(*small, block_mask=small_mask).backward(grad_out)
            for t in small:
                t.grad = None
        step()
        torch.cuda.synchronize()
        print(f"training step: host time {host_us(step):.0f} us a call", flush=True)
        cProfile.runctx("for _ in range(100): step()", globals(), {"step": step}, "/tmp/probe_step.prof")
        torch.cuda.synchronize()
        for order in ("tottime", "cumulative"):
            pstats.Stats("/tmp/probe_step.prof").sort_stats(order).print_stats(30)
    gc.collect()
    gc.freeze()
    report("gc.freeze()")
    gc.unfreeze()
    gc.disable()
    report("collector off")


if __name__ == "__main__":
    main()
