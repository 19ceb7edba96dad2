export PYTHONPATH=$PWD
FLEXLITE_TEST_DEVICE=cuda timeout 300 python -m pytest -q -n 16 -p no:cacheprovider tests/test_warp_specialized.py -k "matches_the_reference or non_contiguous or cuda_graph or training_step or larger_sparse or folded or float_vectors" 2>&1 | tail -3
timeout 400 python benchmarks/probe_fwd_grid.py full,causal,sliding_window_1024,prefix_lm_2048,document_8_causal,alibi_causal,softcap30_causal 128 --rounds=3 2>&1 | tail -10
