"""flexlite.viz: the PNG is a real image of the right scores; inputs are checked; a clear ImportError
without matplotlib."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from flexlite import create_mask
from flexlite.masks import causal_mask, generate_sliding_window
from flexlite.mods import generate_alibi_bias
from flexlite.viz import attention_scores, visualize_attention_scores

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def qk(B=2, Hq=4, Hkv=2, Lq=24, Lkv=24, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, Hq, Lq, D, generator=g), torch.randn(B, Hkv, Lkv, D, generator=g)


def read_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    import matplotlib.image
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    return image


@pytest.mark.parametrize("score_mod, mask_mod", [
    (None, generate_sliding_window(4)),
    (generate_alibi_bias(4), causal_mask),
    (generate_alibi_bias(4), None),
    (None, None),
], ids=["mask", "score+mask", "score", "plain"])
def test_png_is_a_valid_image(tmp_path, score_mod, mask_mod):
    q, k = qk()
    path = visualize_attention_scores(q, k, score_mod=score_mod, mask_mod=mask_mod, path=tmp_path / "s.png",
                                      batch_idx=1, head_idx=3)
    assert path == tmp_path / "s.png"
    height, width = read_png(path).shape[:2]
    assert 200 < height < 2000 and 200 < width < 2000
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (width, height)


def test_a_posinf_score_is_drawn_past_the_top_not_as_masked(tmp_path):
    """A +inf score takes its row's whole weight: drawn in the colormap's "over" colour (red, an arrow on the colour
    bar), not in the masked grey that matplotlib gave it (an infinite value is a missing one there), as if that
    position took no weight. -inf and mask_mod's positions stay grey; the scale spans the finite scores."""
    from flexlite.viz import _score_image

    def diagonal_inf(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx == kv_idx, float("inf"), torch.where(q_idx == kv_idx + 1, float("-inf"), score))
    q, k = qk(B=1, Hq=1, Hkv=1, Lq=6, Lkv=6)
    scores, keep = attention_scores(q, k, score_mod=diagonal_inf, mask_mod=causal_mask)
    image, (vmin, vmax), posinf = _score_image(scores, keep)
    eye = torch.eye(6, dtype=torch.bool)
    assert posinf and not image.mask[eye.numpy()].any() and (image.data[eye.numpy()] > vmax).all()
    assert image.mask[torch.ones(6, 6, dtype=torch.bool).triu(1).numpy()].all()  # (mask_mod's: grey)
    assert image.mask[[i + 1 for i in range(5)], list(range(5))].all()  # (-inf: grey)
    finite = scores[keep & scores.isfinite()]
    assert (vmin, vmax) == (finite.min().item(), finite.max().item())
    pixels = read_png(visualize_attention_scores(q, k, score_mod=diagonal_inf, mask_mod=causal_mask,
                                                 path=tmp_path / "inf.png"))
    red = torch.tensor([0xd6, 0x27, 0x28]) / 255
    assert ((torch.from_numpy(pixels[..., :3].copy()) - red).abs().amax(-1) < 0.02).sum() > 1000


def test_large_and_cross_length(tmp_path):
    q, k = qk(B=1, Hq=1, Hkv=1, Lq=300, Lkv=500)
    read_png(visualize_attention_scores(q, k, mask_mod=generate_sliding_window(40), path=tmp_path / "big.png",
                                        title="custom title"))


def test_attention_scores_values():
    """Scores are score_mod(q k^T * scale) of the chosen (batch, head) (GQA: its kv head); keep is the mask."""
    q, k = qk()
    alibi = generate_alibi_bias(4)
    scores, keep = attention_scores(q, k, score_mod=alibi, mask_mod=causal_mask, batch_idx=1, head_idx=3)
    raw = q[1, 3].double() @ k[1, 1].double().T / math.sqrt(8)
    slope = 2.0 ** (-8.0 * 4 / 4)
    dist = (torch.arange(24)[None, :] - torch.arange(24)[:, None]).double()
    torch.testing.assert_close(scores, raw + slope * dist)
    assert keep.equal(create_mask(causal_mask, 1, 1, 24, 24, device="cpu")[0, 0])
    scores, keep = attention_scores(q, k, scale=0.5)
    torch.testing.assert_close(scores, q[0, 0].double() @ k[0, 0].double().T * 0.5)
    assert keep is None


def test_scale_and_key_batch_as_flex_attention_takes_them():
    """A 0-d tensor or numpy scale, and a key of batch 1 for every query batch, as flex_attention accepts them."""
    import numpy as np

    q, k = qk()
    want, _ = attention_scores(q, k, scale=0.5, batch_idx=1, head_idx=2)
    for scale in (torch.tensor(0.5), np.float32(0.5)):
        torch.testing.assert_close(attention_scores(q, k, scale=scale, batch_idx=1, head_idx=2)[0], want)
    shared = k[1:2]
    got, _ = attention_scores(q, shared, scale=0.5, batch_idx=1, head_idx=2)
    torch.testing.assert_close(got, want)


def test_mask_uses_batch_and_head_indices():
    def per_head(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= h + 2 * b
    q, k = qk()
    _, keep = attention_scores(q, k, mask_mod=per_head, batch_idx=1, head_idx=2)
    assert keep.equal((torch.arange(24)[:, None] - torch.arange(24)[None, :]).abs() <= 4)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(query=torch.zeros(2, 3, 4)), ValueError, "query must be 4-D"),
    (dict(key=torch.zeros(3, 2, 24, 8)), ValueError, "batch"),
    (dict(scale=torch.ones(2)), TypeError, "scale"),
    (dict(key=torch.zeros(2, 2, 24, 4)), ValueError, "head_dim"),
    (dict(key=torch.zeros(2, 3, 24, 8)), ValueError, "multiple"),
    (dict(query=[[1.0]]), TypeError, "torch.Tensor"),
    (dict(batch_idx=2), ValueError, r"batch_idx=2 is out of range for 2 batches: use 0..1"),
    (dict(head_idx=-1), ValueError, "head_idx"),
    (dict(head_idx=True), TypeError, "head_idx"),
    (dict(mask_mod="causal"), TypeError, "mask_mod"),
    (dict(score_mod=causal_mask), TypeError, "score_mod"),
    (dict(scale="1"), TypeError, "scale"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs(tmp_path, kwargs, exc, match):
    q, k = qk()
    args = dict(query=q, key=k, path=tmp_path / "x.png") | kwargs
    with pytest.raises(exc, match=match):
        visualize_attention_scores(**args)
    assert not (tmp_path / "x.png").exists()


def test_a_folder_that_takes_no_files_is_named(monkeypatch, tmp_path):
    from matplotlib.figure import Figure

    def refuse(self, path, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(Figure, "savefig", refuse)
    q, k = qk()
    with pytest.raises(ValueError, match=r"cannot write path .*x\.png': Permission denied; write it somewhere"):
        visualize_attention_scores(q, k, mask_mod=causal_mask, path=tmp_path / "x.png")


def test_too_large_to_draw(monkeypatch, tmp_path):
    import flexlite.viz
    monkeypatch.setattr(flexlite.viz, "MAX_POSITIONS", 100)
    q, k = qk(Lq=20, Lkv=20)
    with pytest.raises(ValueError, match="too many"):
        visualize_attention_scores(q, k, path=tmp_path / "x.png")


def test_missing_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    q, k = qk()
    with pytest.raises(ImportError, match=r'pip install "flexlite\[viz\]"'):
        visualize_attention_scores(q, k, mask_mod=causal_mask, path=tmp_path / "x.png")


def test_leaves_pyplot_backend_alone(tmp_path):
    import matplotlib
    before = matplotlib.get_backend()
    q, k = qk()
    visualize_attention_scores(q, k, mask_mod=causal_mask, path=tmp_path / "x.png")
    assert matplotlib.get_backend() == before


def test_numpy_indices_draw_that_batch_and_head():
    """batch_idx / head_idx as numpy ints (as create_block_mask and the mask generators take them)."""
    import numpy as np

    from flexlite.viz import attention_scores
    q, k = qk()
    for got, want in zip(attention_scores(q, k, mask_mod=causal_mask, batch_idx=np.int64(1), head_idx=np.int32(2)),
                         attention_scores(q, k, mask_mod=causal_mask, batch_idx=1, head_idx=2)):
        assert torch.equal(got, want)
