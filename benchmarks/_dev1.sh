set -x
export PYTHONPATH=$PWD FLEXLITE_COMMIT=$(cat .commit)
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv
FLEXLITE_TEST_DEVICE=cuda timeout 240 python -m pytest -q -n 16 -p no:cacheprovider -W ignore \
  -k "separable or alibi or max_scores or folded or float_vectors or fold" \
  tests/test_warp_specialized.py tests/test_codegen.py tests/test_flex_attention.py > $OUT/tests.log 2>&1
tail -15 $OUT/tests.log
cd benchmarks
timeout 170 python probe_against.py launch.SEPARATE_SCORE_BIAS=False alibi_causal 128,64 --passes=fwd --rounds=3 2>&1 | tail -8
timeout 150 python probe_against.py launch.WS_FWD_COMPACT_BIAS=False alibi_causal 128,64 --passes=fwd --rounds=3 2>&1 | tail -8
