set -x
export PYTHONPATH=$PWD FLEXLITE_COMMIT=$(cat .commit)
FLEXLITE_TEST_DEVICE=cuda timeout 200 python -m pytest -q -n 16 -p no:cacheprovider -W ignore \
  -k "separable or alibi or max_scores or fold" \
  tests/test_warp_specialized.py tests/test_codegen.py tests/test_flex_attention.py > $OUT/tests.log 2>&1
tail -5 $OUT/tests.log
cd benchmarks
timeout 130 python probe_against.py "launch.WS_FWD_COMPACT_BIAS_HEAD_DIMS={64,128}" alibi_causal 64 --passes=fwd --rounds=3 2>&1 | tail -3
timeout 130 python probe_against.py "launch.WS_FWD_COMPACT_BIAS_HEAD_DIMS=()" alibi_causal 128 --passes=fwd --rounds=3 2>&1 | tail -3
timeout 130 python probe_against.py launch.SEPARATE_SCORE_BIAS=False alibi_causal 128,64 --passes=fwd --rounds=3 2>&1 | tail -4
