"""Every gym_examples script runs at its small (CPU) size in a subprocess and reports its checks passed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "gym_examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
# what each script must print besides "all checks passed" (the tour also says that timings are skipped)
EXPECTED = {"tour.py": ["### causal_mask", "### flamingo", "timing: skipped", "TFLOP/s"],
            "flamingo.py": ["intervals: [[0, 7], [1, 7], [7, 12]]"], "document.py": ["same kernel file: True"],
            "score_mods.py": ["alibi_2 + causal", "tanh_softcap_2_approx + causal", "relative_bias_128_per_head",
                              "output unchanged"],
            "drop_in.py": ["torch.nn.attention.flex_attention.BlockMask(shape=", "torch.compile(flex_attention): fwd",
                           "AuxRequest max_scores: fwd", "compiled model under autocast: out torch.bfloat16"]}


def test_every_family_has_an_example():
    assert {"tour.py", "causal.py", "sliding_window.py", "dilated_sliding_window.py", "global_sliding_window.py",
            "prefix_lm.py", "shared_prefix.py", "document.py", "natten.py", "sasa.py", "flamingo.py",
            "block_causal.py", "score_mods.py", "drop_in.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, tmp_path):
    args = [sys.executable, str(EXAMPLES / script), "--small"]
    if script == "causal.py":
        args += ["--png", str(tmp_path)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, f"{script} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "all checks passed" in r.stdout
    assert "fwd+bwd vs fp64 reference" in r.stdout or "backward: not available" in r.stdout
    for text in EXPECTED.get(script, ["BlockMask(shape="]):
        assert text in r.stdout, f"{script}: {text!r} not in its output"
    if script == "causal.py":
        assert (tmp_path / "causal_mask.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
