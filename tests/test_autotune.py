"""Autotune choice and its on-disk cache: picks the fastest, remembers it across processes, survives
corrupt files, read-only directories and concurrent writers."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from flexlite import create_block_mask
from flexlite.runtime import autotune
from flexlite.runtime.launch import TileConfig, backward_candidates, forward_candidates
from helpers import DEVICE, rand_qkv
from test_backward import check_backward

CANDIDATES = [{"BLOCK_M": 128, "BLOCK_N": 64}, {"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 128, "BLOCK_N": 128}]
TIMES = {(128, 64): 2.0, (64, 64): 1.5, (128, 128): math.inf}


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXLITE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    return tmp_path


def measure_counting(calls):
    def measure(cfg):
        calls.append(cfg)
        return TIMES[(cfg["BLOCK_M"], cfg["BLOCK_N"])]
    return measure


def test_picks_fastest_and_caches_on_disk(fresh_cache):
    calls = []
    best = autotune.tune("H200", "k1", CANDIDATES, measure_counting(calls))
    assert best == {"BLOCK_M": 64, "BLOCK_N": 64} and len(calls) == 3
    assert autotune.tune("H200", "k1", CANDIDATES, measure_counting(calls)) == best and len(calls) == 3
    autotune._MEMORY.clear()  # a new process: read back from disk, no measuring
    assert autotune.tune("H200", "k1", CANDIDATES, measure_counting(calls)) == best and len(calls) == 3
    assert json.loads((fresh_cache / "autotune" / "H200.json").read_text())["k1"] == best


def test_corrupt_or_truncated_file_is_ignored(fresh_cache):
    path = fresh_cache / "autotune" / "H200.json"
    path.parent.mkdir(parents=True)
    for junk in ('{"k1": {"BLOCK_M"', "[1, 2]", "\x00\x01"):
        path.write_text(junk)
        autotune._MEMORY.clear()
        assert autotune.lookup("H200", "k1") is None
        assert autotune.tune("H200", "k1", CANDIDATES, measure_counting([])) == {"BLOCK_M": 64, "BLOCK_N": 64}
        assert json.loads(path.read_text())["k1"]["BLOCK_M"] == 64


def test_read_only_directory_keeps_the_choice_in_memory(fresh_cache, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(autotune.tempfile, "mkstemp", refuse)  # what a read-only directory does
    assert autotune.tune("H200", "k1", CANDIDATES, measure_counting([]))["BLOCK_M"] == 64
    assert "could not save" in capsys.readouterr().err
    assert autotune.lookup("H200", "k1")["BLOCK_M"] == 64


def test_unwritable_cache_path_keeps_the_choice_in_memory(fresh_cache, capsys, monkeypatch):
    blocker = fresh_cache / "file"
    blocker.write_text("")
    monkeypatch.setenv("FLEXLITE_CACHE_DIR", str(blocker))  # a file where a directory should be
    assert autotune.tune("H200", "k9", CANDIDATES, measure_counting([]))["BLOCK_M"] == 64
    assert "could not save" in capsys.readouterr().err


def test_concurrent_writers_leave_valid_json_and_keep_each_others_entries(fresh_cache):
    code = ("import sys; from flexlite.runtime import autotune\n"
            "for i in range(30):\n"
            "    autotune._write(autotune._cache_file('H200'), f'{sys.argv[1]}-{i}', {'BLOCK_M': i})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(p)], env=dict(os.environ)) for p in range(3)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    data = json.loads((fresh_cache / "autotune" / "H200.json").read_text())
    assert data and all(isinstance(v, dict) for v in data.values())
    assert sorted(data) == sorted(f"{p}-{i}" for p in range(3) for i in range(30))  # no read-merge-write lost one


@pytest.mark.parametrize("entry", [{"BLOCK_M": 64}, {"BLOCK_M": "64", "BLOCK_N": 64}, {},
                                   {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
                                   {"BLOCK_M": 256, "BLOCK_N": 256}],
                         ids=["missing_key", "string_value", "empty", "extra_key", "not_a_candidate"])
def test_a_remembered_choice_that_is_no_candidate_is_tuned_anew(fresh_cache, entry):
    """A file of another flexlite version's format (or edited by hand) is not taken as it is: its entry would
    crash TileConfig(**choice) or run tiles that do not fit the block mask."""
    path = fresh_cache / "autotune" / "H200.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"k1": entry}))
    calls = []
    assert autotune.tune("H200", "k1", CANDIDATES, measure_counting(calls)) == {"BLOCK_M": 64, "BLOCK_N": 64}
    assert len(calls) == 3 and json.loads(path.read_text())["k1"] == {"BLOCK_M": 64, "BLOCK_N": 64}


def test_no_config_runs_is_an_error():
    with pytest.raises(RuntimeError, match="no config"):
        autotune.tune("H200", "k2", CANDIDATES, lambda cfg: math.inf)


def test_enabled_by_option_or_env(monkeypatch):
    assert not autotune.autotune_enabled({})
    assert autotune.autotune_enabled({"AUTOTUNE": True})
    monkeypatch.setenv("FLEXLITE_AUTOTUNE", "1")
    assert autotune.autotune_enabled({}) and not autotune.autotune_enabled({"AUTOTUNE": False})


def test_length_buckets():
    assert autotune.length_bucket(1) == 128 and autotune.length_bucket(129) == 256
    assert autotune.length_bucket(8192) == 8192


def test_forward_candidates_fit_the_block_mask():
    q = torch.empty(1, 1, 64, 128, dtype=torch.bfloat16)
    cands = forward_candidates(q, q, (64, 32))
    assert cands and all(isinstance(c, TileConfig) and 64 % c.BLOCK_M == 0 and 32 % c.BLOCK_N == 0 for c in cands)
    assert len(cands) == len(set(cands))


def test_backward_candidates_fit_the_block_mask():
    q = torch.empty(1, 1, 64, 64, dtype=torch.float32)
    for space in backward_candidates(q, q, (64, 32)):
        assert space and all(isinstance(c, TileConfig) and 64 % c.BLOCK_M == 0 and 32 % c.BLOCK_N == 0
                             for c in space)
        assert len(space) == len(set(space))


@pytest.mark.parametrize("learned_bias", [False, True], ids=["plain", "learned_bias"])
def test_autotune_option_tunes_the_forward_and_both_backward_kernels(monkeypatch, learned_bias):
    """kernel_options AUTOTUNE: the forward, the dK/dV and the dQ kernels are each tuned over their own space under
    their own key and run with the choice (a stand-in tuner takes each space's last candidate other than the default; on CPU the real
    one keeps the defaults, interpreter timings being meaningless); the gradients match the reference. A learned
    captured tensor's gradient is scattered with atomics by the dK/dV kernel, which a timing rerun would add
    twice: those tiles are not tuned."""
    from flexlite.runtime import launch

    tuned, ran = [], []

    def take_last(kernel, grid, args, constexprs, default, candidates, key, device):
        assert "|torch.float32|D32|DV32|(128, 128)|" in key  # dtype, head dims, sparse block
        assert "|dense=False|tma=False|" in key  # the kernel variant the launch picked (a block mask, pointers)
        choice = [c for c in candidates if c != default][-1]
        tuned.append((key.split("|")[0], default, choice))
        return choice
    run = launch.run_with_fallback

    def recording_run(kernel, grid, args, constexprs, config, pinned, shrink_m=True):
        ran.append(config)
        return run(kernel, grid, args, constexprs, config, pinned, shrink_m)
    monkeypatch.setattr(launch, "_autotune", take_last)
    monkeypatch.setattr(launch, "run_with_fallback", recording_run)
    q, k, v = rand_qkv(1, 2, 2, 100, 90, 32, seed=3)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 100, 90, device=DEVICE)
    bias = torch.randn(2, device=DEVICE, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    check_backward(q, k, v, score_mod=biased if learned_bias else None, block_mask=bm,
                   captured=(bias,) if learned_bias else (), kernel_options={"AUTOTUNE": True})
    assert [p for p, _, _ in tuned] == (["fwd", "bwd-dq"] if learned_bias else ["fwd", "bwd-dkdv", "bwd-dq"])
    chosen = dict((p, choice) for p, _, choice in tuned)
    assert ran[0] == chosen["fwd"] and ran[-1] == chosen["bwd-dq"] and len(ran) == 3
    assert (ran[1] == chosen["bwd-dkdv"]) if not learned_bias else "bwd-dkdv" not in chosen
