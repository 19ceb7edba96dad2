"""GPU probe for the block-mask builder: create_block_mask at long lengths under several kernel tile settings
(launch_mask.MASK_TILES), with the generated flag kernel's own time beside the whole build's; each setting's
flags are first compared with the vmap builder at S=8192. Prints a table; benchmarks/NOTES.md records it.
"""

import torch
import triton.testing
from tabulate import tabulate

from flexlite import block_mask as bm_module
from flexlite import create_block_mask
from flexlite.bench import mask_cases
from flexlite.runtime import launch_mask

SPACE = [dict(cap=c, num_warps=w) for c in (32, 64, 128) for w in (4, 8)]
MASKS = ["causal", "sliding_window_1024", "document_8_causal"]


def main():
    default = dict(launch_mask.MASK_TILES)
    rows = []
    dev = torch.device("cuda")
    for tiles in SPACE:
        launch_mask.MASK_TILES.update(tiles)
        for name in MASKS:
            small = mask_cases(8192, 1, "cuda")[name].mask_mod
            got = bm_module._block_flags_kernel(small, 1, 1, 8192, 8192, dev, (128, 128))
            want = bm_module._block_flags_vmap(small, 1, 1, 8192, 8192, dev, (128, 128))
            ok = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            for S in (131072,):
                mask_mod = mask_cases(S, 1, "cuda")[name].mask_mod
                try:
                    flags_ms = triton.testing.do_bench(
                        lambda: bm_module._block_flags_kernel(mask_mod, 1, 1, S, S, dev, (128, 128)), rep=50)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    create_block_mask(mask_mod, None, None, S, S, device="cuda")
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                    ms = triton.testing.do_bench(lambda: create_block_mask(mask_mod, None, None, S, S, device="cuda"),
                                                 rep=50)
                    rows.append([f"cap{tiles['cap']} w{tiles['num_warps']}", name, S, ok, round(flags_ms, 3),
                                 round(ms, 3), round(peak, 1)])
                except Exception as e:  # noqa: BLE001 - a setting that does not compile: note it, go on
                    rows.append([f"cap{tiles['cap']} w{tiles['num_warps']}", name, S, ok, type(e).__name__, "", ""])
                print(rows[-1], flush=True)
    launch_mask.MASK_TILES.update(default)
    print(tabulate(rows, headers=["tiles", "mask", "S", "flags == vmap (S=8192)", "flag kernel ms", "build ms",
                                  "peak extra MB"], tablefmt="github"))


if __name__ == "__main__":
    main()
