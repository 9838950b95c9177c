"""3-D rotary position embeddings of the two NaDiT families.

Both rotate interleaved pairs of head dimensions: pair p = (2p, 2p+1) turns by angle
``pos·f_k``; three axis groups (t, h, w) of n pairs each are concatenated, so the first 6n
dims of a head rotate and the rest pass through. Positions are local to the attention window
(see ``window.py``). The frequency table is the persistent buffer ``rope.rope.freqs`` of
every block, so checkpoints carry it; angles and rotations are always computed in fp32 from
the buffer's values.

* 3B ("mmrope3d"): language-model frequencies ``f_k = 1/10000^(2k/a)``, a = rope_dim // 3.
  Video token at window-local (t, h, w) of a sample with L text tokens sits at (L + t, h, w);
  text token j sits at (j, j, j). Video and text q/k are both rotated.
* 7B ("3d pixel"): ``f_k = π·linspace(1, 128, n)``, a = (head_dim/2) // 3; positions along each
  axis of a window are ``linspace(-1, 1, extent)``. Only video q/k are rotated.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .window import WindowLayout


class FrequencyTable(nn.Module):
    """Holds the ``freqs`` buffer under the official key name (``...rope.rope.freqs``)."""

    def __init__(self, freqs: torch.Tensor):
        super().__init__()
        self.register_buffer("freqs", freqs, persistent=True)

    def _apply(self, fn, recurse=True):
        # Follow device moves but never lose precision: a model cast to bf16 keeps fp32 values.
        values = self.freqs
        super()._apply(fn, recurse)
        self.freqs = values.to(device=self.freqs.device, dtype=torch.float32)
        return self


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (N, heads, D) by angles (N, P); returns fp32."""
    x = x.float()
    rot = 2 * angles.shape[-1]
    pairs = x[..., :rot].unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    rotated = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., rot:]], dim=-1) if rot < x.shape[-1] else rotated


def _axis_angles(pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """(N, 3) positions x (n,) freqs -> (N, 3n) angles, axis groups t, h, w."""
    return (pos.float()[:, :, None] * freqs.float()[None, None]).flatten(1)


class MMRoPE3d(nn.Module):
    rotates_text = True

    def __init__(self, rope_dim: int):
        super().__init__()
        self.axis_dim = rope_dim // 3
        self.rope = FrequencyTable(self.default_freqs(self.axis_dim))

    @staticmethod
    def default_freqs(axis_dim: int) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, axis_dim, 2)[: axis_dim // 2].float() / axis_dim))

    def video_angles(self, layout: WindowLayout, txt_lens: torch.Tensor) -> torch.Tensor:
        pos = layout.cache.get("mmrope3d")
        if pos is None:
            pos = layout.local_pos.clone()
            pos[:, 0] += txt_lens[layout.sample_of_token]
            layout.cache["mmrope3d"] = pos
        return _axis_angles(pos, self.rope.freqs)

    def text_angles(self, txt_pos: torch.Tensor) -> torch.Tensor:
        return _axis_angles(txt_pos[:, None].expand(-1, 3), self.rope.freqs)


class PixelRoPE3d(nn.Module):
    rotates_text = False

    def __init__(self, head_dim: int):
        super().__init__()
        self.axis_dim = (head_dim // 2) // 3
        self.rope = FrequencyTable(self.default_freqs(self.axis_dim))

    @staticmethod
    def default_freqs(axis_dim: int, max_freq: float = 256.0) -> torch.Tensor:
        return torch.linspace(1.0, max_freq / 2, axis_dim // 2) * math.pi

    def video_angles(self, layout: WindowLayout, txt_lens: torch.Tensor) -> torch.Tensor:
        pos = layout.cache.get("pixel")
        if pos is None:
            # linspace(-1, 1, extent)[i] looked up per distinct extent: bit-equal to the reference.
            pos = torch.empty(layout.local_pos.shape, dtype=torch.float32,
                              device=layout.local_pos.device)
            for axis in range(3):
                extent = layout.window_size[:, axis]
                for size in extent.unique().tolist():
                    mask = extent == size
                    table = torch.linspace(-1.0, 1.0, size, device=pos.device)
                    pos[mask, axis] = table[layout.local_pos[mask, axis]]
            layout.cache["pixel"] = pos
        return _axis_angles(pos, self.rope.freqs)

    def text_angles(self, txt_pos: torch.Tensor) -> None:
        return None
