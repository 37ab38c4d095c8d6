"""Procedural images and their captions: an offline vision-language data set.

An image (3 x S x S, black) holds 1..max_shapes shapes, each a square, circle or
triangle in red, green or blue, in its own quadrant (top left, top right,
bottom left, bottom right) with a small random offset. The caption describes
every image of a sample in order, quadrants in reading order:

    "2 images. red circle top left, blue square bottom right. green triangle top right."

Text is bytes (vocab 256, as the GPT). A sample's sequence is
[image tokens; "\\n" + caption]: `ids` is the text without its last byte,
targets are -100 at the image tokens and the next byte everywhere else, so
the first predicted byte (the image count) already needs the images.

Every sample of a microbatch has the same number of images, drawn per
microbatch in 0..max_images, so images need no padding; captions of one
microbatch are filled to the longest with trailing spaces, which are targets
like any other byte. Each microbatch is a pure function of (seed, step,
microbatch index), so every rank draws the same data without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

COLOURS = ("red", "green", "blue")  # index = the lit RGB channel
SHAPES = ("square", "circle", "triangle")
PLACES = ("top left", "top right", "bottom left", "bottom right")
BOS = "\n"
IGNORE = -100


@dataclass
class VLMDataConfig:
    seed: int = 0
    microbatch_size: int = 4
    image_size: int = 16  # must equal model.image_size
    patch_size: int = 4  # must equal model.patch_size: it sets the image tokens in targets
    max_images: int = 4  # images per sample, drawn per microbatch in 0..max_images
    max_shapes: int = 2  # shapes per image, drawn per image in 1..max_shapes (one per quadrant)

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"VLMDataConfig.seed must be >= 0, got {self.seed}")
        for name in ("microbatch_size", "patch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"VLMDataConfig.{name} must be positive, got {getattr(self, name)}"
                )
        if self.image_size < 8 or self.image_size % 2:
            raise ValueError(
                f"VLMDataConfig.image_size must be even and >= 8, got {self.image_size}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"VLMDataConfig.patch_size ({self.patch_size}) must divide "
                f"image_size ({self.image_size})"
            )
        if self.max_images < 0:
            raise ValueError(f"VLMDataConfig.max_images must be >= 0, got {self.max_images}")
        if not 1 <= self.max_shapes <= len(PLACES):
            raise ValueError(
                f"VLMDataConfig.max_shapes must be in 1..{len(PLACES)}, got {self.max_shapes}"
            )

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class VLMInputs(NamedTuple):
    """A microbatch's first-stage inputs. `.to()` moves both, as a tensor's would."""

    images: torch.Tensor  # float32 [b, n_images, 3, S, S]
    ids: torch.Tensor  # int64 [b, T]

    def to(self, *args, **kwargs) -> VLMInputs:
        return VLMInputs(self.images.to(*args, **kwargs), self.ids.to(*args, **kwargs))


def caption(descriptions: list[str]) -> str:
    """The caption of a sample whose images are described by `descriptions`."""
    n = len(descriptions)
    return f"{n} image{'' if n == 1 else 's'}." + "".join(" " + d for d in descriptions)


def max_text_len(cfg: VLMDataConfig) -> int:
    """An upper bound on len(ids) of any microbatch (for the model's block_size check)."""
    longest = (
        ", ".join(
            f"{max(COLOURS, key=len)} {max(SHAPES, key=len)} {max(PLACES, key=len)}"
            for _ in range(cfg.max_shapes)
        )
        + "."
    )
    return len(BOS + caption([longest] * cfg.max_images)) - 1


def max_seq_len(cfg: VLMDataConfig) -> int:
    """An upper bound on image tokens + text tokens of any microbatch."""
    return cfg.max_images * cfg.tokens_per_image + max_text_len(cfg)


def patchify(images: torch.Tensor, image_size: int, patch: int, dtype: torch.dtype) -> torch.Tensor:
    """Images [b, n, 3, S, S] as patches [b * n, (S / p)^2, 3 * p * p] in ``dtype`` (the data is
    float32 whatever the model's dtype); a ValueError names any other shape."""
    if images.dim() != 5 or images.shape[2:] != (3, image_size, image_size):
        raise ValueError(
            f"images must be [b, n, 3, {image_size}, {image_size}], got {tuple(images.shape)}"
        )
    b, n, g = images.size(0), images.size(1), image_size // patch
    return (
        images.to(dtype)
        .reshape(b * n, 3, g, patch, g, patch)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(b * n, g * g, 3 * patch * patch)
    )


def check_fits(model, data: VLMDataConfig) -> None:
    """ValueError, in one line, unless a model's images and positions take this data: the same
    image and patch size, and a ``block_size`` as long as the longest image-and-text sequence."""
    for name in ("image_size", "patch_size"):
        mine, theirs = getattr(model, name), getattr(data, name)
        if mine != theirs:
            raise ValueError(f"model.{name}={mine} differs from data.{name}={theirs}")
    if max_seq_len(data) > model.block_size:
        raise ValueError(
            f"model.block_size={model.block_size} is below the longest sequence the data can draw "
            f"({max_seq_len(data)} image and text tokens): raise it or lower data.max_images"
        )


def _masks(size: int) -> list[np.ndarray]:
    """Boolean s x s masks in SHAPES order, of different areas; s = size / 2 - 2 leaves room to
    move."""
    s = size // 2 - 2
    yy, xx = np.mgrid[:s, :s]
    c = (s - 1) / 2
    return [
        np.ones((s, s), bool),
        (yy - c) ** 2 + (xx - c) ** 2 <= c * c + 1,
        xx <= yy,
    ]  # triangle: right-angled


def describe(cfg: VLMDataConfig) -> str:
    """What the [data] section is, for the start-up summary: made-up images, drawn per step."""
    return (
        f"synthetic: {cfg.image_size}x{cfg.image_size} images of up to {cfg.max_shapes} shapes, "
        f"up to {cfg.max_images} per sample, drawn from data.seed = {cfg.seed}"
    )


def batches(
    cfg: VLMDataConfig, step: int, n_microbatches: int
) -> list[tuple[VLMInputs, torch.Tensor]]:
    """Microbatches ((images, ids), targets) of step `step`; targets int64 [b, n*P + T].
    Depends only on (cfg, step, microbatch index)."""
    if step < 0 or n_microbatches <= 0:
        raise ValueError(f"need step >= 0 and n_microbatches > 0, got {step}, {n_microbatches}")
    b, size, half = cfg.microbatch_size, cfg.image_size, cfg.image_size // 2
    masks = _masks(size)
    s = masks[0].shape[0]
    out = []
    for m in range(n_microbatches):
        rng = np.random.default_rng([cfg.seed, step, m])
        n = int(rng.integers(0, cfg.max_images + 1))
        counts = rng.integers(1, cfg.max_shapes + 1, size=(b, n))
        places = np.argsort(rng.random((b, n, len(PLACES))), axis=-1)
        colours = rng.integers(0, len(COLOURS), size=(b, n, len(PLACES)))
        shapes = rng.integers(0, len(SHAPES), size=(b, n, len(PLACES)))
        offsets = rng.integers(0, half - s + 1, size=(b, n, len(PLACES), 2))
        images = np.zeros((b, n, 3, size, size), np.float32)
        texts = []
        for i in range(b):
            descriptions = []
            for j in range(n):
                parts = []
                for k in sorted(
                    places[i, j, : counts[i, j]]
                ):  # this image's quadrants, reading order
                    y, x = (
                        (k // 2) * half + offsets[i, j, k, 0],
                        (k % 2) * half + offsets[i, j, k, 1],
                    )
                    images[i, j, colours[i, j, k], y : y + s, x : x + s][masks[shapes[i, j, k]]] = (
                        1.0
                    )
                    parts.append(
                        f"{COLOURS[colours[i, j, k]]} {SHAPES[shapes[i, j, k]]} {PLACES[k]}"
                    )
                descriptions.append(", ".join(parts) + ".")
            texts.append(BOS + caption(descriptions))
        width = max(map(len, texts))
        text = torch.tensor([list(t.ljust(width).encode()) for t in texts], dtype=torch.int64)
        targets = torch.cat(
            [torch.full((b, n * cfg.tokens_per_image), IGNORE, dtype=torch.int64), text[:, 1:]], 1
        )
        out.append((VLMInputs(torch.from_numpy(images), text[:, :-1].contiguous()), targets))
    return out
