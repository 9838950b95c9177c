"""3-D rotary position embeddings of the two NaDiT families, on window-local positions.

Interleaved pairs (2p, 2p+1) of head dims turn by ``pos·f_k`` in three axis groups (t, h, w); 3B
("mmrope3d", ``f_k = 1/10000^(2k/a)``) rotates video and text, 7B ("3d pixel",
``f_k = π·linspace(1, 128, n)``, positions ``linspace(-1, 1, extent)``) video only. Angles in fp32
from the ``rope.rope.freqs`` buffer. Positions and families: docs/models.md, "RoPE"."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable, Optional

import torch
from torch import nn

from .window import WindowLayout

_TABLE_IDS = itertools.count()


class FrequencyTable(nn.Module):
    """The ``freqs`` buffer under the official key (``...rope.rope.freqs``). ``table_id`` names its
    values for caches (never ``data_ptr()``: placement gives tables fresh copies); ``defining``
    recomputes the values of a table built on ``meta`` (docs/models.md, "RoPE")."""

    def __init__(self, freqs: torch.Tensor, defining: Optional[Callable[[], torch.Tensor]] = None):
        super().__init__()
        self.register_buffer("freqs", freqs, persistent=True)
        self.table_id = next(_TABLE_IDS)
        self._defining = defining

    def defining_values(self) -> torch.Tensor:
        """The values this table is defined by (fp32, on the CPU)."""
        if self._defining is None:
            raise RuntimeError("this RoPE frequency table was built without its defining "
                               "formula, so it cannot be recomputed; load its values from a "
                               "checkpoint instead")
        return self._defining()

    def _apply(self, fn, recurse=True):
        # Follow device moves but never lose precision: a model cast to bf16 keeps fp32 values.
        values = self.freqs
        super()._apply(fn, recurse)
        if values.is_meta and not self.freqs.is_meta:  # materialised (to_empty): recompute
            values = self.defining_values()
        self.freqs = values.to(device=self.freqs.device, dtype=torch.float32)
        return self


def share_equal_tables(model: nn.Module):
    """Blocks whose tables hold equal values get one tensor, so rotations are computed once."""
    seen: list[FrequencyTable] = []
    for table in (m for m in model.modules() if isinstance(m, FrequencyTable)):
        if table.freqs.is_meta:
            return
        same = next((s for s in seen if s.freqs.shape == table.freqs.shape
                     and s.freqs.device == table.freqs.device
                     and torch.equal(s.freqs, table.freqs)), None)
        if same is None:
            seen.append(table)
        else:
            table.freqs, table.table_id = same.freqs, same.table_id


def rotation(angles: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Angles (N, P) -> unit complex rotations (N, 1, head_dim/2); pass-through pairs get 1."""
    cis = torch.polar(torch.ones_like(angles), angles)
    rest = head_dim // 2 - angles.shape[-1]
    if rest:
        cis = torch.cat([cis, cis.new_ones(cis.shape[0], rest)], dim=-1)
    return cis[:, None]


def apply_rotary(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x (N, heads, D) by ``cis`` from :func:`rotation`; fp32 out:
    (x0 + i·x1)·e^{iθ} is exactly (x0·cos − x1·sin, x1·cos + x0·sin)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * cis).flatten(-2)


def _axis_angles(pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """(N, 3) positions x (n,) freqs -> (N, 3n) angles, axis groups t, h, w."""
    return (pos.float()[:, :, None] * freqs.float()[None, None]).flatten(1)


class _RoPE3d(nn.Module):
    axis_dim: int

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        defining = functools.partial(self.default_freqs, self.axis_dim)
        self.rope = FrequencyTable(defining(), defining)

    def video_rotation(self, layout: WindowLayout, txt_lens: torch.Tensor) -> torch.Tensor:
        """(Nv, 1, head_dim/2) rotations of the video tokens in window order, cached per call
        for blocks sharing one table (the loader shares tables holding equal values)."""
        freqs = self.rope.freqs
        # By the table's identity (constant during a call), not its address: see FrequencyTable.
        key = (type(self).__name__, self.rope.table_id, freqs.device)
        if key not in layout.cache:
            angles = _axis_angles(self.video_positions(layout, txt_lens), freqs)
            layout.cache[key] = rotation(angles, self.head_dim)
        return layout.cache[key]


class MMRoPE3d(_RoPE3d):
    rotates_text = True

    def __init__(self, rope_dim: int, head_dim: int):
        self.axis_dim = rope_dim // 3
        super().__init__(head_dim)

    @staticmethod
    def default_freqs(axis_dim: int) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, axis_dim, 2)[: axis_dim // 2].float() / axis_dim))

    @staticmethod
    def video_positions(layout: WindowLayout, txt_lens: torch.Tensor) -> torch.Tensor:
        pos = layout.local_pos.clone()
        pos[:, 0] += txt_lens[layout.sample_of_token]
        return pos

    def text_rotation(self, txt_pos: torch.Tensor) -> torch.Tensor:
        return rotation(_axis_angles(txt_pos[:, None].expand(-1, 3), self.rope.freqs), self.head_dim)


class PixelRoPE3d(_RoPE3d):
    rotates_text = False

    def __init__(self, head_dim: int):
        self.axis_dim = (head_dim // 2) // 3
        super().__init__(head_dim)

    @staticmethod
    def default_freqs(axis_dim: int, max_freq: float = 256.0) -> torch.Tensor:
        return torch.linspace(1.0, max_freq / 2, axis_dim // 2) * math.pi

    @staticmethod
    def video_positions(layout: WindowLayout, txt_lens: torch.Tensor) -> torch.Tensor:
        # linspace(-1, 1, extent)[i] looked up per distinct extent: bit-equal to the reference.
        # The extents are host facts of the layout and the lookup is a select, not a masked
        # assignment: on a GPU neither reads anything back (no sync per forward).
        pos = torch.zeros(layout.local_pos.shape, dtype=torch.float32,
                          device=layout.local_pos.device)
        for axis in range(3):
            extent, local = layout.window_size[:, axis], layout.local_pos[:, axis]
            for size in layout.extents[axis]:
                table = torch.linspace(-1.0, 1.0, size, device=pos.device)
                pos[:, axis] = torch.where(extent == size, table[local.clamp(max=size - 1)],
                                           pos[:, axis])
        return pos

    def text_rotation(self, txt_pos: torch.Tensor) -> None:
        return None
