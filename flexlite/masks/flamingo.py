"""Flamingo-style vision cross-attention (https://arxiv.org/abs/2204.14198): text tokens (queries)
attend to the tokens of their images (keys); each image is seen by a range of text tokens.

Keys are the images' tokens concatenated: ``image_token_length`` per image (or one length per image).
``intervals[i] = [start, end)`` is the range of text positions that image ``i`` is visible to. The mask
looks the range up through two captured tensors, ``intervals[image_of[kv_idx]]``
(:func:`generate_vision_cross_attention_mask_mod`, attention-gym's); or, from the text side, each text
token's range of images (:func:`generate_vision_cross_attention_from_ranges`).

torchtune's ``VisionCrossAttentionMask`` example: text ``"<img1><img2>These are two dogs. <img3>This is a
cat."``, tokens ``[1, 1, 9673, 527, 1403, 12875, 13, 1, 1115, 374, 264, 8415]`` with image token 1, gives
intervals ``[[0, 7], [1, 7], [7, 12]]`` (:func:`image_intervals_from_tokens`) and, with 3 tokens per image,
the mask (``python -m flexlite.masks.flamingo``)::

             img1    img2    img3
         1   █ █ █ | ░ ░ ░ | ░ ░ ░
         1   █ █ █ | █ █ █ | ░ ░ ░
      9673   █ █ █ | █ █ █ | ░ ░ ░
       527   █ █ █ | █ █ █ | ░ ░ ░
      1403   █ █ █ | █ █ █ | ░ ░ ░
     12875   █ █ █ | █ █ █ | ░ ░ ░
        13   █ █ █ | █ █ █ | ░ ░ ░
         1   ░ ░ ░ | ░ ░ ░ | █ █ █
      1115   ░ ░ ░ | ░ ░ ░ | █ █ █
       374   ░ ░ ░ | ░ ░ ░ | █ █ █
       264   ░ ░ ░ | ░ ░ ░ | █ █ █
      8415   ░ ░ ░ | ░ ░ ░ | █ █ █
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from ._checks import check_device_arg, check_index_tensor, check_int, check_lengths, pairs_tensor


def image_intervals_from_tokens(tokens: Sequence[int], image_token_id: int) -> list[list[int]]:
    """``[[start, end), ...]`` per image token in ``tokens``: an image is visible from its own position up to
    (not including) the next image token that does not directly follow it, or to the end (as torchtune)."""
    tokens = check_lengths("image_intervals_from_tokens", "tokens", tokens, minimum=None)
    image_token_id = check_int("image_intervals_from_tokens", "image_token_id", image_token_id, None)
    positions = [i for i, t in enumerate(tokens) if t == image_token_id]
    image = set(positions)
    return [[start, next((p for p in positions if p > start and p - 1 not in image), len(tokens))]
            for start in positions]


def generate_vision_cross_attention_mask_mod(intervals: Union[torch.Tensor, Sequence[Sequence[int]]],
                                             image_token_length: Union[int, Sequence[int]], device=None):
    """Text token ``q_idx`` attends to the tokens of image ``i`` iff ``intervals[i][0] <= q_idx < intervals[i][1]``.

    Args:
        intervals: [num_images, 2] int, text-position range ``[start, end)`` of each image.
        image_token_length: tokens per image (int), or one count per image.
        device: where the captured tensors live (default: ``intervals``' device if it is a tensor, else CPU).

    The key length is ``sum`` of the image token counts. Named
    ``vision_cross_attention_<num_images>x<image_token_length>``.
    """
    caller = "generate_vision_cross_attention_mask_mod"
    intervals = check_index_tensor(caller, "intervals", pairs_tensor(caller, "intervals", intervals), dim=2)
    if intervals.shape[0] == 0 or intervals.shape[1] != 2:
        raise ValueError(f"{caller}: intervals must have shape [num_images >= 1, 2]; got {tuple(intervals.shape)}")
    if (intervals[:, 0] > intervals[:, 1]).any() or (intervals < 0).any():
        raise ValueError(f"{caller}: each interval must be [start, end) with 0 <= start <= end; got "
                         f"{intervals.tolist()}")
    num_images = intervals.shape[0]
    if isinstance(image_token_length, (list, tuple, torch.Tensor)):
        counts = check_lengths(caller, "image_token_length", image_token_length)
        if len(counts) != num_images:
            raise ValueError(f"{caller}: image_token_length has {len(counts)} entries but intervals has "
                             f"{num_images} images")
        name = "var"
    else:
        counts = [check_int(caller, "image_token_length", image_token_length, 1)] * num_images
        name = str(counts[0])
    device = intervals.device if device is None else check_device_arg(caller, device)
    intervals = intervals.to(device)
    image_of = torch.repeat_interleave(torch.arange(num_images, device=device, dtype=torch.int32),
                                       torch.tensor(counts, device=device), output_size=sum(counts))  # (meta too)

    def vision_cross_attention(b, h, q_idx, kv_idx):
        return (intervals[image_of[kv_idx]][0] <= q_idx) & (q_idx < intervals[image_of[kv_idx]][1])

    vision_cross_attention.__name__ = f"vision_cross_attention_{num_images}x{name}"
    return vision_cross_attention


def generate_vision_cross_attention_from_ranges(image_ranges: Union[torch.Tensor, Sequence[Sequence[int]]],
                                                image_token_length: Union[int, Sequence[int]], device=None):
    """The same mask from the text side: text token ``t`` attends to images ``image_ranges[t][0] <= i <
    image_ranges[t][1]`` (an empty range, e.g. ``[0, 0]``, sees no image: that row is fully masked).

    Args:
        image_ranges: [num_text_tokens, 2] int, per text token the range of images it sees.
        image_token_length: tokens per image (int), or one count per image; the images are
            ``range(len(counts))`` (an int length needs ``num_images``: the largest range end).
        device: where the captured tensors live (default: ``image_ranges``' device if a tensor, else CPU).

    Named ``vision_cross_attention_ranges_<num_text_tokens>x<num_images>``.
    """
    caller = "generate_vision_cross_attention_from_ranges"
    image_ranges = check_index_tensor(caller, "image_ranges", pairs_tensor(caller, "image_ranges", image_ranges), dim=2)
    if image_ranges.shape[0] == 0 or image_ranges.shape[1] != 2:
        raise ValueError(f"{caller}: image_ranges must have shape [num_text_tokens >= 1, 2]; got "
                         f"{tuple(image_ranges.shape)}")
    if (image_ranges[:, 0] > image_ranges[:, 1]).any() or (image_ranges < 0).any():
        raise ValueError(f"{caller}: each image range must be [first, end) with 0 <= first <= end")
    if isinstance(image_token_length, (list, tuple, torch.Tensor)):
        counts = check_lengths(caller, "image_token_length", image_token_length)
    else:
        counts = [check_int(caller, "image_token_length", image_token_length, 1)] * max(1, int(image_ranges.max()))
    if int(image_ranges.max()) > len(counts):
        raise ValueError(f"{caller}: image_ranges refer to image {int(image_ranges.max()) - 1} but there are "
                         f"{len(counts)} images")
    device = image_ranges.device if device is None else check_device_arg(caller, device)
    image_ranges = image_ranges.to(device)
    image_of = torch.repeat_interleave(torch.arange(len(counts), device=device, dtype=torch.int32),
                                       torch.tensor(counts, device=device), output_size=sum(counts))  # (meta too)

    def vision_cross_attention_ranges(b, h, q_idx, kv_idx):
        image = image_of[kv_idx]
        return (image_ranges[q_idx][0] <= image) & (image < image_ranges[q_idx][1])

    vision_cross_attention_ranges.__name__ = f"vision_cross_attention_ranges_{image_ranges.shape[0]}x{len(counts)}"
    return vision_cross_attention_ranges


def main():
    from flexlite import create_block_mask, create_mask
    tokens = [1, 1, 9673, 527, 1403, 12875, 13, 1, 1115, 374, 264, 8415]
    intervals = image_intervals_from_tokens(tokens, image_token_id=1)
    mask = generate_vision_cross_attention_mask_mod(intervals, image_token_length=3)
    dense = create_mask(mask, None, None, len(tokens), 9, device="cpu")[0, 0]
    print(f"{mask.__name__}: intervals {intervals}")
    for token, row in zip(tokens, dense.tolist()):
        print(f"{token:>6}  " + " | ".join(" ".join("█" if x else "░" for x in row[i:i + 3]) for i in (0, 3, 6)))
    # 1024 text tokens, three images of 256 tokens: the first two seen from the start, the third later
    mask = generate_vision_cross_attention_mask_mod([[0, 600], [1, 600], [600, 1024]], image_token_length=256)
    print(f"\n{mask.__name__}:\n{create_block_mask(mask, None, None, 1024, 768, device='cpu', BLOCK_SIZE=64)}")


if __name__ == "__main__":
    main()
