"""An offline image-text dataset for VLM fine-tuning, and its collator (Qwen2-VL layout).

:class:`SyntheticImageTextDataset` draws small images (a coloured shape on a coloured background,
at several sizes, so dynamic resolution matters) and pairs each with a caption, or a question and
its answer, that describe it. Each image is identical every time it is drawn, from ``seed``, the
split and the index. No file or download is involved.

The processor is built offline: transformers' Qwen2-VL image processor (the PIL backend, no
torchvision) with the model's patch, merge and temporal sizes, plus the run's tokenizer with the
four vision special tokens added. The image processor gives the packed ``pixel_values [P, D]`` and
``image_grid_thw [1, 3]``. The text gets ``t*h*w / merge**2`` image placeholders, which is what
``Qwen2VLProcessor`` does; that class is not used, because it insists on a video processor that
needs torchvision.

An example: ``input_ids [L]`` = ``<|vision_start|> <|image_pad|>*n <|vision_end|> prompt answer
<eos>``; ``labels [L]`` already shifted, ``-100`` except on the positions that predict the answer
(and the EOS); ``pixel_values [P, D]`` float32; ``image_grid_thw [1, 3]`` int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from automodel.data.examples import IGNORE_INDEX
from automodel.errors import UserInputError

__all__ = ["VISION_TOKENS", "SyntheticImageTextDataset", "VLMCollator"]

#: Special tokens added to the tokenizer, in this order (ids ``len(tokenizer) + 0..3`` on a fresh one).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

_COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 210, 40),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
_SHAPES = ("square", "circle", "stripes")
_SPLIT_OFFSET = {"train": 0, "validation": 1_000_003, "all": 0}


def _draw(rng: np.random.Generator, size: tuple[int, int]) -> tuple[np.ndarray, dict[str, str]]:
    """``[H, W, 3]`` uint8 image and what it shows."""
    h, w = size
    names = list(_COLORS)
    fg, bg = rng.choice(len(names), size=2, replace=False)
    shape = _SHAPES[int(rng.integers(len(_SHAPES)))]
    img = np.empty((h, w, 3), dtype=np.uint8)
    img[:] = _COLORS[names[bg]]
    yy, xx = np.mgrid[0:h, 0:w]
    cy, cx, r = h / 2, w / 2, min(h, w) / 3
    if shape == "square":
        mask = (abs(yy - cy) < r) & (abs(xx - cx) < r)
    elif shape == "circle":
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 < r**2
    else:
        mask = (xx // 4) % 2 == 0
    img[mask] = _COLORS[names[fg]]
    noise = rng.integers(-8, 9, size=img.shape)
    img = np.clip(img.astype(np.int64) + noise, 0, 255).astype(np.uint8)
    return img, {"fg": names[fg], "bg": names[bg], "shape": shape, "size": f"{w}x{h}"}


def _text(rng: np.random.Generator, what: dict[str, str]) -> tuple[str, str]:
    """(prompt, answer) describing the image: a caption or one of three questions."""
    kind = int(rng.integers(4))
    if kind == 0:
        return " describe the image.", f" a {what['fg']} {what['shape']} on a {what['bg']} background."
    if kind == 1:
        return " what shape is shown?", f" a {what['shape']}."
    if kind == 2:
        return " what colour is the background?", f" {what['bg']}."
    return " how large is the image?", f" {what['size']} pixels."


class SyntheticImageTextDataset:
    """Generated image-text pairs for VLM fine-tuning (see the module docstring).

    Args:
        tokenizer: the run's tokenizer; the :data:`VISION_TOKENS` are added to it (mutated).
        seq_len: the longest example allowed; longer ones raise (shrink ``image_sizes``).
        split: ``"train"``, ``"validation"`` or ``"all"`` (disjoint draws for train / validation).
        num_examples: examples in the split.
        image_sizes: ``[[H, W], ...]`` pixel sizes drawn from (several, so dynamic resolution matters).
        patch_size, merge_size, temporal_patch_size: the vision tower's (the model config's).
        image_token_id, video_token_id, vision_start_token_id, vision_end_token_id: the model config's
            ids; checked against the tokenizer after the tokens are added.
        seed: base seed.
    """

    def __init__(
        self,
        tokenizer: Any,
        seq_len: int,
        split: str = "train",
        num_examples: int = 64,
        image_sizes: Sequence[Sequence[int]] = ((32, 32), (32, 48), (48, 32), (64, 64), (40, 56)),
        patch_size: int = 4,
        merge_size: int = 2,
        temporal_patch_size: int = 2,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        vision_start_token_id: int | None = None,
        vision_end_token_id: int | None = None,
        seed: int = 0,
    ) -> None:
        from automodel.distributed.torch_internals import Qwen2VLImageProcessorPil

        if split not in _SPLIT_OFFSET:
            raise UserInputError(f"data.dataset split={split!r} is not one of {sorted(_SPLIT_OFFSET)}")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.split = split
        self.num_examples = int(num_examples)
        self.image_sizes = [tuple(int(v) for v in s) for s in image_sizes]
        self.seed = int(seed) + _SPLIT_OFFSET[split]
        tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
        ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
        expected = {
            "<|image_pad|>": image_token_id,
            "<|video_pad|>": video_token_id,
            "<|vision_start|>": vision_start_token_id,
            "<|vision_end|>": vision_end_token_id,
        }
        for token, want in expected.items():
            if want is not None and ids[token] != want:
                raise UserInputError(
                    f"the tokenizer gives {token} the id {ids[token]} but the dataset was told {want} (the model "
                    f"config's id); set model.config's token ids to {ids} (and the dataset's to match)"
                )
        self.image_token_id = ids["<|image_pad|>"]
        self.vision_start, self.vision_end = ids["<|vision_start|>"], ids["<|vision_end|>"]
        self.merge_size = merge_size
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.image_processor = Qwen2VLImageProcessorPil(
            patch_size=patch_size,
            temporal_patch_size=temporal_patch_size,
            merge_size=merge_size,
            size={"shortest_edge": 4 * (patch_size * merge_size) ** 2, "longest_edge": 64 * 64 * 4},
        )

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from PIL import Image

        if not 0 <= index < self.num_examples:
            raise IndexError(index)
        rng = np.random.default_rng(self.seed + index)
        size = self.image_sizes[int(rng.integers(len(self.image_sizes)))]
        img, what = _draw(rng, size)
        prompt, answer = _text(rng, what)
        vision = self.image_processor(images=[Image.fromarray(img)], return_tensors="pt")
        grid = vision["image_grid_thw"].long()
        n = int(grid.prod()) // self.merge_size**2
        prompt_ids = [self.vision_start] + [self.image_token_id] * n + [self.vision_end]
        prompt_ids += self.tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = self.tokenizer.encode(answer, add_special_tokens=False) + [self.eos_token_id]
        ids = torch.tensor(prompt_ids + answer_ids, dtype=torch.long)
        if ids.numel() > self.seq_len:
            raise UserInputError(
                f"example {index} of the synthetic image-text data has {ids.numel()} tokens ({n} image tokens), more "
                f"than data.seq_len={self.seq_len}; raise data.seq_len or use smaller data.dataset.image_sizes"
            )
        labels = torch.full_like(ids, IGNORE_INDEX)
        start = len(prompt_ids) - 1  # the last prompt token predicts the first answer token
        labels[start : ids.numel() - 1] = ids[start + 1 :]
        return {
            "input_ids": ids,
            "labels": labels,
            "pixel_values": vision["pixel_values"].float(),
            "image_grid_thw": grid,
        }

    def make_collator(self, pad_token_id: int, pad_to_multiple_of: int = 1) -> VLMCollator:
        """The collator the data loader uses for this dataset."""
        return VLMCollator(pad_token_id, pad_to_multiple_of)


class VLMCollator:
    """Right-pad ``input_ids`` / ``labels`` to ``[B, S]`` (``S`` a multiple of ``pad_to_multiple_of``),
    and concatenate ``pixel_values`` ``[sum P_i, D]`` and ``image_grid_thw`` ``[N, 3]`` in row order.

    Rows without an image (e.g. the sampler's all-ignored filler rows) add no patches.
    Padding carries label -100 and no attention mask, which is exact for causal attention (see
    :mod:`automodel.data.collator`).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = max(1, int(pad_to_multiple_of))

    def __call__(self, examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(1, max(int(e["input_ids"].numel()) for e in examples))
        seq = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(examples), seq), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), seq), IGNORE_INDEX, dtype=torch.long)
        pixels, grids = [], []
        for b, e in enumerate(examples):
            n = int(e["input_ids"].numel())
            input_ids[b, :n] = e["input_ids"]
            labels[b, :n] = e["labels"]
            if e.get("pixel_values") is not None:
                pixels.append(e["pixel_values"])
                grids.append(e["image_grid_thw"])
        batch = {"input_ids": input_ids, "labels": labels}
        if pixels:
            batch["pixel_values"] = torch.cat(pixels, dim=0)
            batch["image_grid_thw"] = torch.cat(grids, dim=0)
        return batch
