"""Stand-alone self-attention (SASA) window on a 2-D canvas flattened row-major to a sequence: each pixel
attends to the pixels within ``window`` rows and columns of it (fewer at the edges, unlike NATTEN, whose
window shifts to stay inside the canvas). https://arxiv.org/abs/1906.05909
"""

from ._checks import check_int
from .natten import grid_coords


def generate_sasa_mask(canvas_w: int, canvas_h: int, window: int):
    """Keep ``|q_row - kv_row| <= window`` and ``|q_col - kv_col| <= window`` on a row-major
    ``canvas_h x canvas_w`` canvas (sequence length ``canvas_w * canvas_h``). Named ``sasa_c<W>x<H>_w<window>``."""
    caller = "generate_sasa_mask"
    canvas_w = check_int(caller, "canvas_w", canvas_w, 1)
    canvas_h = check_int(caller, "canvas_h", canvas_h, 1)
    window = check_int(caller, "window", window)

    def sasa(b, h, q_idx, kv_idx):
        q_row, q_col = grid_coords(q_idx, canvas_w)
        kv_row, kv_col = grid_coords(kv_idx, canvas_w)
        return ((q_row - kv_row).abs() <= window) & ((q_col - kv_col).abs() <= window)

    sasa.__name__ = f"sasa_c{canvas_w}x{canvas_h}_w{window}"
    return sasa


def main(canvas: int = 32, window: int = 3):
    from flexlite import create_block_mask
    mask = generate_sasa_mask(canvas, canvas, window)
    S = canvas * canvas
    print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, S, S, device='cpu', BLOCK_SIZE=32)}")


if __name__ == "__main__":
    main()
