set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
# 1. bitwise: persistent vs per q block at the harness's D128 shape, every mask
python - <<'PY'
import torch, flexlite
from flexlite import flex_attention
from flexlite.bench import probe_cases, mask_cases
from flexlite.runtime import launch
masks = list(mask_cases(1024, 1, "cpu"))
for D, q, k, v, case, bm in probe_cases(masks, [128], requires_grad=False):
    outs = []
    for pers in (True, False):
        launch.WS_FWD_PERSISTENT = pers
        o = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
        outs.append(o)
    launch.WS_FWD_PERSISTENT = True
    same = torch.equal(outs[0], outs[1]) 
    print("bitwise", case.name, same, "nan", bool(outs[0].isnan().any()), flush=True)
PY
# 2. forward GPU tests
FLEXLITE_TEST_DEVICE=cuda timeout 300 python -m pytest -q -n 16 -p no:cacheprovider tests/test_warp_specialized.py -k "matches_the_reference or non_contiguous or cuda_graph or training_step or larger_sparse or folded or float_vectors" 2>&1 | tail -8
# 3. probe
timeout 400 python benchmarks/probe_against.py launch.WS_FWD_PERSISTENT=False full,causal,sliding_window_1024,prefix_lm_2048,document_8_causal,alibi_causal,softcap30_causal 128 --passes=fwd --rounds=3 2>&1 | tail -12
