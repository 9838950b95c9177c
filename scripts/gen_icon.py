"""Draw the pack's registry pictures: a square icon and a 21:9 banner (docs/assets/).

    .venv/bin/python scripts/gen_icon.py

The motif is what the pack does: a picture coarse on one side of a diagonal and sharp on the
other (a low-resolution mosaic of a sphere of light becoming its smooth rendering). Drawn with
Pillow from numbers alone, so the files are ours and come out the same on every machine;
pyproject.toml's ``[tool.comfy]`` points the registry at them (tests/test_registry.py checks
sizes, formats and addresses).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

ASSETS = Path(__file__).resolve().parent.parent / "docs" / "assets"
ICON_SIZE = 256  # the registry shows icons square, at most 400 px
BANNER_SIZE = (840, 360)  # 21:9
MOSAIC = 16  # pixels per block of the coarse side


def _scene(width: int, height: int) -> np.ndarray:
    """A lit sphere on a dark violet field, float RGB in [0, 1], (height, width, 3)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    cx, cy, radius = 0.5 * width, 0.5 * height, 0.36 * min(width, height)
    dx, dy = (x - cx) / radius, (y - cy) / radius
    inside = np.clip(1.0 - (dx * dx + dy * dy), 0.0, 1.0)
    depth = np.sqrt(inside)
    light = np.clip(0.25 + 0.75 * (-0.45 * dx - 0.55 * dy + 0.70 * depth), 0.0, 1.0)
    sphere = np.stack([0.35 + 0.65 * light, 0.55 + 0.45 * light, 0.95 * np.ones_like(light)], -1)
    field = np.stack([0.10 + 0.10 * y / height, 0.06 * np.ones_like(y), 0.22 + 0.12 * x / width],
                     -1)
    edge = np.clip((inside * radius) / 2.0, 0.0, 1.0)[..., None]  # about 2 px of antialiasing
    return field * (1 - edge) + sphere * light[..., None].clip(0.35, 1.0) * edge


def _mosaic(picture: np.ndarray, block: int) -> np.ndarray:
    """Each ``block`` x ``block`` square replaced by its mean (what a low resolution keeps)."""
    h, w, _ = picture.shape
    cropped = picture[: h - h % block, : w - w % block]
    means = cropped.reshape(h // block, block, w // block, block, 3).mean(axis=(1, 3))
    out = picture.copy()
    out[: h - h % block, : w - w % block] = means.repeat(block, 0).repeat(block, 1)
    return out


def draw(width: int, height: int) -> Image.Image:
    sharp = _scene(width, height)
    coarse = _mosaic(sharp, MOSAIC)
    y, x = np.mgrid[0:height, 0:width]
    upper_left = (x / width + y / height) < 1.0  # the diagonal from top right to bottom left
    picture = np.where(upper_left[..., None], coarse, sharp)
    seam = np.abs(x / width + y / height - 1.0) < 1.2 / min(width, height)
    picture[seam] = (0.95, 0.95, 1.0)
    return Image.fromarray((np.clip(picture, 0, 1) * 255 + 0.5).astype(np.uint8), "RGB")


def main():
    ASSETS.mkdir(parents=True, exist_ok=True)
    draw(ICON_SIZE, ICON_SIZE).save(ASSETS / "icon.png", optimize=True)
    draw(*BANNER_SIZE).save(ASSETS / "banner.png", optimize=True)


if __name__ == "__main__":
    main()
