"""Neighborhood attention (NATTEN) on a 2-D canvas flattened to a sequence.

Each query pixel attends to the ``kernel_h x kernel_w`` pixels around it; near an edge the window is
shifted (its centre clamped) so that it stays inside the canvas and every query sees exactly
``kernel_h * kernel_w`` keys. https://github.com/SHI-Labs/NATTEN

Token orders (the same mask, different layouts of the pixels in the sequence):

* row-major (:func:`generate_natten`): token ``i`` is pixel ``(i // canvas_w, i % canvas_w)``;
* tiled (:func:`generate_tiled_natten`): ``tile_h x tile_w`` tiles in row-major order, row-major inside
  each tile, which keeps 2-D neighbours close in 1-D and makes the block mask much sparser
  (https://arxiv.org/abs/2403.04690);
* Morton / Z-order (:func:`generate_morton_natten`): bits of row and column interleaved.
"""

from __future__ import annotations

import torch

from ._checks import check_int


def grid_coords(idx, canvas_w: int):
    """(row, col) of row-major token ``idx`` on a canvas ``canvas_w`` pixels wide."""
    return idx // canvas_w, idx % canvas_w


def tiled_coords(idx, canvas_w: int, tile_w: int, tile_h: int):
    """(row, col) of token ``idx`` in the tiled order (see the module docstring)."""
    tile, offset = idx // (tile_h * tile_w), idx % (tile_h * tile_w)
    tiles_per_row = canvas_w // tile_w
    return ((tile // tiles_per_row) * tile_h + offset // tile_w,
            (tile % tiles_per_row) * tile_w + offset % tile_w)


def _deinterleave_bits(code):
    code = code & 0x55555555
    code = (code | (code >> 1)) & 0x33333333
    code = (code | (code >> 2)) & 0x0F0F0F0F
    code = (code | (code >> 4)) & 0x00FF00FF
    return (code | (code >> 8)) & 0x0000FFFF


def morton_coords(idx):
    """(row, col) of token ``idx`` in Morton (Z-curve) order: col from the even bits, row from the odd."""
    return _deinterleave_bits(idx >> 1), _deinterleave_bits(idx)


def _natten_window(canvas_w, canvas_h, kernel_w, kernel_h, q_row, q_col, kv_row, kv_col):
    """Whether kv pixel is inside q pixel's kernel_h x kernel_w window (centre clamped into the canvas)."""
    centre_row = q_row.clamp(kernel_h // 2, (canvas_h - 1) - kernel_h // 2)
    centre_col = q_col.clamp(kernel_w // 2, (canvas_w - 1) - kernel_w // 2)
    return ((centre_row - kv_row).abs() <= kernel_h // 2) & ((centre_col - kv_col).abs() <= kernel_w // 2)


def _check_natten(caller, canvas_w, canvas_h, kernel_w, kernel_h):
    canvas_w = check_int(caller, "canvas_w", canvas_w, 1)
    canvas_h = check_int(caller, "canvas_h", canvas_h, 1)
    kernel_w = check_int(caller, "kernel_w", kernel_w, 1)
    kernel_h = check_int(caller, "kernel_h", kernel_h, 1)
    for name, k, c, cname in (("kernel_w", kernel_w, canvas_w, "canvas_w"),
                              ("kernel_h", kernel_h, canvas_h, "canvas_h")):
        if k % 2 == 0:
            raise ValueError(f"{caller}: {name} must be odd (the window is centred on the query); got {k}")
        if k > c:
            raise ValueError(f"{caller}: {name} ({k}) must not exceed {cname} ({c})")
    return canvas_w, canvas_h, kernel_w, kernel_h


def generate_natten(canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int):
    """NATTEN mask over a row-major ``canvas_h x canvas_w`` canvas (sequence length ``canvas_w * canvas_h``);
    odd kernel sizes. Named ``natten_c<W>x<H>_k<KW>x<KH>`` (attention-gym's argument order and names)."""
    canvas_w, canvas_h, kernel_w, kernel_h = _check_natten("generate_natten", canvas_w, canvas_h, kernel_w, kernel_h)

    def natten(b, h, q_idx, kv_idx):
        return _natten_window(canvas_w, canvas_h, kernel_w, kernel_h,
                              *grid_coords(q_idx, canvas_w), *grid_coords(kv_idx, canvas_w))

    natten.__name__ = f"natten_c{canvas_w}x{canvas_h}_k{kernel_w}x{kernel_h}"
    return natten


def generate_tiled_natten(W: int, H: int, K_W: int, K_H: int, T_W: int, T_H: int):
    """NATTEN mask with the pixels in tiled order: ``T_H x T_W`` tiles (which must divide the ``H x W``
    canvas). Same arguments and name as attention-gym: ``tiled_natten_c<W>x<H>_k<KW>x<KH>_t<TW>x<TH>``."""
    caller = "generate_tiled_natten"
    W, H, K_W, K_H = _check_natten(caller, W, H, K_W, K_H)
    T_W, T_H = check_int(caller, "T_W", T_W, 1), check_int(caller, "T_H", T_H, 1)
    if W % T_W or H % T_H:
        raise ValueError(f"{caller}: the tile T_W x T_H = {T_W}x{T_H} must divide the canvas W x H = {W}x{H}")

    def tiled_natten(b, h, q_idx, kv_idx):
        return _natten_window(W, H, K_W, K_H, *tiled_coords(q_idx, W, T_W, T_H), *tiled_coords(kv_idx, W, T_W, T_H))

    tiled_natten.__name__ = f"tiled_natten_c{W}x{H}_k{K_W}x{K_H}_t{T_W}x{T_H}"
    return tiled_natten


def generate_morton_natten(canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int):
    """NATTEN mask with the pixels in Morton (Z-curve) order; the canvas must be square with a power-of-two
    side of at most 2**15. Named ``morton_natten_c<W>x<H>_k<KW>x<KH>``."""
    caller = "generate_morton_natten"
    canvas_w, canvas_h, kernel_w, kernel_h = _check_natten(caller, canvas_w, canvas_h, kernel_w, kernel_h)
    if canvas_w != canvas_h or canvas_w & (canvas_w - 1) or canvas_w > 2 ** 15:
        raise ValueError(f"{caller}: the canvas must be square with a power-of-two side <= 32768 for Morton "
                         f"order; got canvas_w={canvas_w}, canvas_h={canvas_h}")

    def morton_natten(b, h, q_idx, kv_idx):
        return _natten_window(canvas_w, canvas_h, kernel_w, kernel_h, *morton_coords(q_idx), *morton_coords(kv_idx))

    morton_natten.__name__ = f"morton_natten_c{canvas_w}x{canvas_h}_k{kernel_w}x{kernel_h}"
    return morton_natten


def tiled_natten_permutation(W: int, H: int, T_W: int, T_H: int, device=None) -> torch.Tensor:
    """int64 [W * H]: ``perm[i]`` is the row-major index of the pixel at position ``i`` of the tiled order,
    so ``x_tiled = x[..., perm, :]`` and ``x[..., perm, :] = x_tiled`` convert between the two layouts."""
    caller = "tiled_natten_permutation"
    W, H = check_int(caller, "W", W, 1), check_int(caller, "H", H, 1)
    T_W, T_H = check_int(caller, "T_W", T_W, 1), check_int(caller, "T_H", T_H, 1)
    if W % T_W or H % T_H:
        raise ValueError(f"{caller}: the tile T_W x T_H = {T_W}x{T_H} must divide the canvas W x H = {W}x{H}")
    row, col = tiled_coords(torch.arange(W * H, device=device), W, T_W, T_H)
    return row * W + col


def main(canvas: int = 32, kernel: int = 7, tile: int = 8):
    from flexlite import create_block_mask
    S = canvas * canvas
    for mask in (generate_natten(canvas, canvas, kernel, kernel),
                 generate_tiled_natten(canvas, canvas, kernel, kernel, tile, tile),
                 generate_morton_natten(canvas, canvas, kernel, kernel)):
        print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, S, S, device='cpu', BLOCK_SIZE=32)}")


if __name__ == "__main__":
    main()
