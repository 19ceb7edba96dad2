"""``python -m flexlite show``: every named mask prints, --png writes an image, bad names and options
fail with the valid choices; the demo still runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from flexlite.__main__ import main
from flexlite.masks import NAMED_MASKS
from helpers import DEVICE


def show(capsys, *args):
    main(["show", *args])
    return capsys.readouterr().out


def test_show_prints_block_mask(capsys):
    out = show(capsys, "sliding_window", "--seq", "512", "--window", "64")
    assert out.startswith("sliding_window_64: Q_LEN=512, KV_LEN=512, BLOCK_SIZE=128")
    assert "BlockMask(shape=(1, 1, 512, 512), sparsity=" in out
    rows = out.split("(0, 0)\n")[1].splitlines()[:4]
    assert rows == ["░░      ", "░░░░    ", "  ░░░░  ", "    ░░░░"]


@pytest.mark.parametrize("name", list(NAMED_MASKS))
def test_show_every_named_mask(capsys, name):
    seq = "256" if "natten" in name or name == "sasa" else "192"
    options = [("--kernel", "5"), ("--tile", "4x4")][:NAMED_MASKS[name].options.count("kernel") +
                                                     NAMED_MASKS[name].options.count("tile")]
    out = show(capsys, name, "--seq", seq, "--block-size", "32", *(a for pair in options for a in pair))
    assert "BlockMask(shape=(1, 1, " in out and ("░░" in out or "██" in out)


def test_show_options(capsys):
    out = show(capsys, "document", "--seq", "100", "--docs", "30,50,20", "--block-size", "16", "--grid", "8")
    assert "document_causal_mask: Q_LEN=100" in out
    out = show(capsys, "natten", "--seq", "128", "--canvas", "16x8", "--kernel", "3x5")
    assert "natten_c16x8_k3x5" in out
    out = show(capsys, "flamingo", "--seq", "96", "--images", "2", "--image-tokens", "40")
    assert "KV_LEN=80" in out


def test_show_png(capsys, tmp_path):
    path = tmp_path / "mask.png"
    out = show(capsys, "prefix_lm", "--seq", "300", "--png", str(path))
    assert f"wrote {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_mask_lists_valid_names(capsys):
    with pytest.raises(SystemExit) as e:
        main(["show", "causul"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'causul'" in err and all(name in err for name in NAMED_MASKS)


@pytest.mark.parametrize("args, message", [
    (["document", "--seq", "100", "--docs", "10,20"], "sum to 30, not 100"),
    (["natten", "--seq", "1000"], "--canvas"),
    (["sliding_window", "--window", "-3"], "window_size must be >= 0"),
    (["natten", "--kernel", "7y7"], "expected N or WxH"),
    (["causal", "--seq", "0"], "seq must be >= 1"),
    # a given 0 is refused, not replaced by the default
    (["block_causal", "--seq", "64", "--block", "0"], "block_size must be >= 1; got 0"),
    (["block_diffusion", "--seq", "64", "--block", "0"], "block_size must be >= 1; got 0"),
    (["causal_bottom_right", "--seq", "64", "--kv-seq", "0"], "kv_len must be >= 1; got 0"),
    (["causal", "--seq", "64", "--grid", "0"], "grid_size 0 has no rows or columns"),
    (["document", "--seq", "256", "--docs=-1,257"], "document lengths (--docs) must be >= 0; got [-1, 257]"),
    # a flag the mask does not read: refused, not ignored; a prefix past the sequence as for shared_prefix
    (["causal", "--seq", "64", "--window", "5"], "mask causal takes no --window (it would be ignored); its options: "
                                                 "only --seq"),
    (["document", "--seq", "64", "--docs", "32,32", "--window", "3", "--dilation", "2"],
     "mask document takes no --window, --dilation"),
    (["prefix_lm", "--seq", "64", "--prefix", "100"], "prefix=100 is longer than seq=64"),
    # refused before the printout, not after it
    (["causal", "--seq", "20000", "--png", "x.png"], "--png: 20000 x 20000 positions is too many to draw"),
    (["causal", "--seq", "64", "--png", "mask.jpg"], "--png: path 'mask.jpg' ends in '.jpg'"),
    (["causal", "--seq", "64", "--png", "no/such/folder/mask.png"], "--png: the folder of path"),
    # a length whose evaluation would take hours (mask_mod runs at every position on the CPU)
    (["causal", "--seq", "3000000", "--block-size", "1024"], "--seq: 3000000 x 3000000 positions is too many to "
                                                             "evaluate"),
    (["causal_bottom_right", "--seq", "1024", "--kv-seq", str(2 ** 24 + 1)], "positions is too many to evaluate"),
])
def test_bad_options(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["show", *args])
    captured = capsys.readouterr()
    assert e.value.code == 2 and message in captured.err and captured.out == ""


@pytest.mark.parametrize("where", ["folder", "file"])
def test_png_path_that_cannot_be_written_fails_before_the_printout(capsys, tmp_path, monkeypatch, where):
    """--png into a folder that takes no files (or over a file that cannot be written): exit 2 naming --png before
    any work, not an error from matplotlib after the printout. (os.access is what reports it; faked here, as a
    read-only folder is writable to root.)"""
    import os
    folder = tmp_path / "read_only"
    folder.mkdir()
    path = folder / "mask.png"
    if where == "file":
        path.write_bytes(b"")
    unwritable = folder if where == "folder" else path
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(unwritable) else access(p, mode,
                                                                                                          **kw))
    with pytest.raises(SystemExit) as e:
        main(["show", "causal", "--seq", "64", "--png", str(path)])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    assert ("--png: the folder of path" if where == "folder" else "--png: path") in captured.err
    assert "is not writable" in captured.err


def test_png_without_matplotlib_fails_before_the_printout(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (importlib.util.find_spec: None, as when not installed)
    with pytest.raises(SystemExit) as e:
        main(["show", "causal", "--seq", "64", "--png", str(tmp_path / "mask.png")])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    assert '--png needs matplotlib; install it with: pip install "flexlite[viz]"' in captured.err


def test_help_lists_masks(capsys):
    with pytest.raises(SystemExit) as e:
        main(["show", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMED_MASKS) and "--png" in out


def test_unknown_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["shwo"])
    assert e.value.code == 2 and "unknown command 'shwo'" in capsys.readouterr().err


def test_demo_refuses_arguments_before_it_runs(capsys, monkeypatch):
    import flexlite.__main__ as cli
    monkeypatch.setattr(cli, "demo", lambda: pytest.fail("the demo ran"))
    with pytest.raises(SystemExit) as e:
        main(["demo", "extra", "args"])
    assert e.value.code == 2 and "unrecognized arguments: extra args" in capsys.readouterr().err


def test_show_subprocess():
    r = subprocess.run([sys.executable, "-m", "flexlite", "show", "block_causal", "--seq", "1024", "--block", "256"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "block_causal_256" in r.stdout and "sparsity=37.50%" in r.stdout


def test_demo_still_runs():
    r = subprocess.run([sys.executable, "-m", "flexlite"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "flex_attention vs the fp64 reference" in r.stdout and "MISMATCH" not in r.stdout


def test_top_level_help(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    assert "show <mask>" in out and "bench" in out


def test_bench_markdown_table_leaves_out_columns_no_row_has():
    from flexlite.bench import markdown_table
    result = {"gpu": "GPU", "torch": "t", "triton": "tr", "commit": "abc", "date": "2026-01-01",
              "rows": [{"mask": "causal", "shape": "B1", "pass": "fwd", "flexlite_ms": 1.5, "torch_flex_ms": 3.0,
                        "speedup_vs_torch_flex": 2.0},
                       {"mask": "full", "shape": "B1", "pass": "fwd", "flexlite_ms": 2.0, "sdpa_cudnn_tflops": 10}]}
    table = markdown_table(result)
    header = table.splitlines()[2]
    assert table.startswith("GPU: GPU, torch t, triton tr, commit abc, 2026-01-01")
    assert "tuned_speedup_vs_torch_flex" not in header and "sdpa_flash_tflops" not in header
    assert "sdpa_cudnn_tflops" in header and "torch_flex_ms" in header
    assert len(table.splitlines()) == 6  # header line, blank, column names, rule, two rows


def test_bench_results_record_the_heating_before_the_rounds(tmp_path, monkeypatch):
    """bench._write_results: the JSON beside the table says how long each implementation ran untimed before its
    rounds (bench.HEAT_MS), so that runs timed with and without it can be told apart."""
    import flexlite.bench as bench
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Some GPU")
    monkeypatch.setenv("FLEXLITE_COMMIT", "abc1234")
    rows = [{"mask": "causal", "shape": "B1", "pass": "fwd", "flexlite_ms": 1.5}]
    result = bench._write_results(rows, tmp_path, "-x", ["mask", "shape", "pass", "flexlite_ms"], torch_warm_s=0.25)
    written = json.loads(next(tmp_path.glob("Some_GPU-*-x.json")).read_text())
    assert written == result and written["heat_ms"] == bench.HEAT_MS > 0 and written["rows"] == rows
    assert written["torch_warm_s"] == 0.25
    assert written["commit"] == "abc1234" and next(tmp_path.glob("Some_GPU-*-x.md")).read_text().startswith("GPU: ")


def test_bench_warms_torch_and_says_how_long_it_took(monkeypatch):
    """bench.warm_torch: a matmul and a softmax on the device before the first calls are timed (the JSON's
    torch_warm_s), waited for."""
    import flexlite.bench as bench
    ran = []
    softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, dim: ran.append((x.device, x.shape)) or softmax(x, dim=dim))
    seconds = bench.warm_torch(torch.device(DEVICE), torch.bfloat16)
    assert ran == [(torch.device(DEVICE), (256, 256))] and isinstance(seconds, float) and seconds > 0.0


def test_bench_commit_label_says_when_the_tree_is_not_its_commit(tmp_path, monkeypatch):
    """Results carry HEAD, HEAD+dirty where tracked files differ from it (a tree copied over a stale .git),
    FLEXLITE_COMMIT where set, and 'unknown' outside a git checkout."""
    import subprocess

    from flexlite.bench import _git_commit

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.delenv("FLEXLITE_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert _git_commit() == "unknown"
    git("init", "-q")
    (tmp_path / "kernel.py").write_text("a = 1\n")
    git("add", "kernel.py")
    git("commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "probe.sh").write_text("untracked\n")
    assert _git_commit() == head
    (tmp_path / "kernel.py").write_text("a = 2\n")
    assert _git_commit() == f"{head}+dirty"
    monkeypatch.setenv("FLEXLITE_COMMIT", "abc1234")
    assert _git_commit() == "abc1234"


@pytest.mark.parametrize("heat_ms", [500.0, 0.0], ids=["heated", "not heated"])
def test_bench_times_in_rounds_of_alternating_order(monkeypatch, heat_ms):
    """The harness's timings (bench.time_rounds): each implementation run untimed for heat_ms first (bench.heat, in
    the first round's order; 0: not), then timed once per round, the order reversed every other round; one that
    raises is recorded by its error's first line and not timed again."""
    import flexlite.bench as bench
    order = []
    monkeypatch.setattr(bench, "_median_ms", lambda fn, grad_to_none=None: fn())
    monkeypatch.setattr(bench, "time_ms", lambda fn, warmup, rep, grad_to_none=None: order.append(("heat", warmup))
                        or fn())

    def timed(name, ms):
        return lambda: order.append(name) or ms

    def unavailable():
        order.append("sdpa")
        raise RuntimeError("No available kernel for this shape\n(the rest of torch's message)")
    times, errors = bench.time_rounds({"flexlite": timed("flexlite", 2.0), "torch_flex": timed("torch_flex", 3.0),
                                       "sdpa": unavailable}, rounds=3, heat_ms=heat_ms)
    if heat_ms:  # (sdpa raises while heating: never timed)
        assert order == [("heat", heat_ms), "flexlite", ("heat", heat_ms), "torch_flex", ("heat", heat_ms), "sdpa",
                         "flexlite", "torch_flex", "torch_flex", "flexlite", "flexlite", "torch_flex"]
    else:
        assert order == ["flexlite", "torch_flex", "sdpa", "torch_flex", "flexlite", "flexlite", "torch_flex"]
    assert times == {"flexlite": [2.0] * 3, "torch_flex": [3.0] * 3, "sdpa": []}
    assert errors == {"sdpa": "No available kernel for this shape"}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rounds must be a positive int"):
            bench.time_rounds({}, bad)


def test_bench_host_us_times_the_calls_between_two_syncs(monkeypatch):
    """bench.host_us: one call before the first sync (a compile is not timed), ``calls`` calls timed between syncs,
    the time per call in us."""
    from types import SimpleNamespace

    import flexlite.bench as bench
    events = []
    clock = iter([10.0, 10.5])  # perf_counter before and after the timed calls: 0.5 s for 4 calls

    def fake_perf_counter():
        events.append("clock")
        return next(clock)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=fake_perf_counter))
    us = bench.host_us(lambda: events.append("call"), calls=4, sync=lambda: events.append("sync"))
    assert us == 125000.0
    assert events == ["call", "sync", "clock", "call", "call", "call", "call", "clock", "sync"]


def test_bench_refuses_fewer_than_one_round(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be at least 1; got 0" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--passes", "forward"], "--passes takes fwd, bwd or fwd,bwd; got 'forward'"),
    (["--passes", ""], "--passes takes fwd, bwd or fwd,bwd; got ''"),
    (["--shapes", "4x16x8192"], "--shapes takes comma-separated BxHxSxD or BxHxSxDxHKV of positive integers"),
    (["--shapes", "4x16x8192x128,4x16x0x64"], "got '4x16x0x64'"),
    (["--shapes", "2x32x4096x128x8x1"], "BxHxSxD or BxHxSxDxHKV of positive integers"),
    (["--shapes", "2x32x4096x128x6"], "H must be a multiple of HKV"),
    (["--masks", "causal,sliding_window"], "unknown --masks ['sliding_window']; choose from full, causal"),
    (["--suites", "attention,decoding"], "unknown --suites ['decoding']"),
])
def test_bench_refuses_bad_arguments_before_anything_runs(capsys, args, message):
    """Exit 2 naming the argument (on a CPU machine too: before the GPU check), instead of a traceback from inside
    the run or, for an unknown pass, a run that times nothing."""
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_times_both_passes_by_default(monkeypatch):
    """The harness's default is the forward and the backward of every mask at both of the issue's shapes."""
    import flexlite.bench as bench
    calls = []
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", lambda masks, shapes, passes, **kw: calls.append((masks, shapes, passes)))
    main(["bench"])
    assert calls == [(list(bench.mask_cases(8192, 16, "cpu")), [(4, 16, 8192, 128), (16, 16, 8192, 64)],
                      ("fwd", "bwd"))]


def test_bench_takes_kv_heads_as_a_fifth_shape_field(monkeypatch):
    """BxHxSxDxHKV: grouped-query attention (HKV key / value heads) beside the plain shapes."""
    import flexlite.bench as bench
    calls = []
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", lambda masks, shapes, passes, **kw: calls.append(shapes))
    main(["bench", "--shapes", "2x32x4096x128x8,8x16x2048x64"])
    assert calls == [[(2, 32, 4096, 128, 8), (8, 16, 2048, 64)]]


@pytest.mark.parametrize("argv, shapes", [
    (["probe"], [(4, 16, 8192, 128), (16, 16, 8192, 64)]),
    (["probe", "causal", "64", "--shapes=8x16x2048x64,1x2x256x128"], [(8, 16, 2048, 64), (1, 2, 256, 128)]),
])
def test_probe_shapes_default_to_the_harness_and_take_shapes(argv, shapes):
    """The GPU probes' --shapes=BxHxSxD (benchmarks/probe_bwd_costs.py): the harness's shapes unless given, parsed as
    the harness's own --shapes."""
    import flexlite.bench as bench
    assert bench.probe_shapes(argv) == shapes
    assert bench.probe_args(argv)[0] == (["causal"] if "causal" in argv else list(bench.mask_cases(1024, 1, "cpu")))


@pytest.mark.parametrize("flag, message", [
    ("--shapes=8x16x2048", "BxHxSxD or BxHxSxDxHKV of positive integers"),
    ("--shapes=2x32x4096x128x8", "a probe's --shapes takes BxHxSxD only"),
    ("--shapes", "a probe takes --shapes=BxHxSxD,... with '='"),
])
def test_probe_shapes_refuse_bad_shapes(flag, message):
    import flexlite.bench as bench
    with pytest.raises(ValueError, match=re.escape(message)):
        bench.probe_shapes(["probe", flag])


def test_bench_reference_check_with_grouped_query_heads():
    """The harness's fp64 check of a GQA shape: 2 KV heads, each read by gqa_group query heads (enable_gqa), errors
    of out and of every gradient at the dtype's level."""
    import flexlite.bench as bench
    case = bench.mask_cases(128, 4, "cpu")["alibi_causal"]
    errors = bench.check_against_reference(case, 16, "cpu", torch.float32, backward=True, S=128, gqa_group=2)
    assert set(errors) == {"max_err_vs_fp64", "max_dq_err_vs_fp64", "max_dk_err_vs_fp64", "max_dv_err_vs_fp64"}
    assert max(errors.values()) < 1e-4
