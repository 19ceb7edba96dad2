"""GPU probe: the SM clock and power the GPU grants flexlite's forward and torch's compiled flex under load.

The H200 runs these kernels at its power cap (NOTES 63): the clock follows the power drawn. For each harness mask
and head dim (``flexlite.bench.probe_cases``), flexlite's forward and torch's flex each run back to back for SECONDS
(after their compiles and a pause of PAUSE seconds, so that each starts from a GPU that cooled alike) while
``nvidia-smi`` samples the SM clock, the power and the clock event reasons every ~0.1 s (the first samples, the
ramp, left out). Prints a table: ms per call over the whole span, the clock's min / mean / max, the mean power, the
reasons' bits seen (0x4: software power cap), and the cycles per call (ms x mean clock): a kernel's speed per clock,
which the power cap does not move.

Usage: python benchmarks/probe_clocks.py [mask,mask,...] [D,D,...] [--seconds=S]"""

import subprocess
import sys
import threading
import time

import torch
from tabulate import tabulate
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

from flexlite import first_calls, flex_attention
from flexlite.bench import probe_args, probe_cases

SECONDS = 4.0  # (--seconds=S) each implementation's span under load
PAUSE = 2.0
RAMP_SAMPLES = 3
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def sampled(fn, seconds: float) -> tuple:
    """``fn`` called in bursts of 20 for ``seconds`` while nvidia-smi is sampled beside it: (ms per call, samples as
    (clock MHz, power W, reasons))."""
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.strip().splitlines()[0]
            clock, power, reasons = (field.strip() for field in out.split(","))
            samples.append((float(clock), float(power), int(reasons, 16)))
            time.sleep(0.1)
    thread = threading.Thread(target=sample)
    thread.start()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        calls += 20
    ms = (time.perf_counter() - start) / calls * 1e3
    stop.set()
    thread.join()
    return ms, samples[RAMP_SAMPLES:] or samples


def main():
    seconds = next((float(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--seconds=")), SECONDS)
    masks, dims = probe_args(sys.argv)
    first_calls.EAGER = False  # the kernels, not a first call's torch ops
    compiled_flex = torch.compile(torch_flex_attention, dynamic=False)
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims, requires_grad=False):
        S = q.shape[2]
        tbm = torch_create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
        impls = {"flexlite": lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm),
                 "torch_flex": lambda: compiled_flex(q, k, v, score_mod=case.torch_score_mod, block_mask=tbm)}
        for fn in impls.values():  # compiled before the spans
            fn()
        first_calls.wait()
        torch.cuda.synchronize()
        for impl, fn in impls.items():
            time.sleep(PAUSE)
            ms, samples = sampled(fn, seconds)
            clocks = [s[0] for s in samples]
            mean_clock = sum(clocks) / len(clocks)
            reasons = 0
            for s in samples:
                reasons |= s[2]
            rows.append([case.name, f"D{D}", impl, round(ms, 3), f"{min(clocks):.0f} / {mean_clock:.0f} / "
                         f"{max(clocks):.0f}", round(sum(s[1] for s in samples) / len(samples)), hex(reasons),
                         round(ms * mean_clock / 1e3, 1)])
            print(rows[-1], flush=True)
    print(tabulate(rows, headers=["mask", "D", "impl", "ms per call", "SM clock MHz min / mean / max", "power W",
                                  "clock event reasons", "M cycles per call"], tablefmt="github"), flush=True)


if __name__ == "__main__":
    main()
