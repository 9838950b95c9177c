"""Attention windows of the NaDiT (~400 tokens, regular and half-shifted grids): a
:class:`WindowLayout` batches windows of equal length, built on the CPU, sent in one copy and kept
per shape (:func:`layout_for`). See docs/models.md, "Windows"."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

Window = tuple[int, int, int, int, int, int]  # (t0, t1, h0, h1, w0, w1), half-open


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device``, from the host without stalling it (CPU to CUDA: a non-blocking
    copy from pinned memory, which may be dropped at once; else a plain move)."""
    if device.type == "cuda" and values.device.type == "cpu":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def split_rows(buffer: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive views of ``buffer`` of the given lengths (no copies)."""
    return list(torch.split(buffer, list(lengths)))


def window_sizes(t: int, h: int, w: int, num: tuple[int, int, int]) -> tuple[int, int, int]:
    """Window extent per axis: the grid is scaled to 45x80 patches, then cut into num cells."""
    nt, nh, nw = num
    scale = math.sqrt(45 * 80 / (h * w))
    resized_h, resized_w = round(h * scale), round(w * scale)  # round half to even, as Python
    return math.ceil(min(t, 30) / nt), math.ceil(resized_h / nh), math.ceil(resized_w / nw)


def _regular_ranges(n: int, win: int) -> list[tuple[int, int]]:
    return [(i, min(i + win, n)) for i in range(0, n, win)]


def _shifted_ranges(n: int, win: int) -> list[tuple[int, int]]:
    shift = 0.5 if win < n else 0.0
    count = math.ceil((n - shift) / win) + 1 if shift > 0 else 1
    ranges = [(max(int((i - shift) * win), 0), min(int((i - shift + 1) * win), n))
              for i in range(count)]
    return [(a, b) for a, b in ranges if b > a]


def make_windows(method: str, thw: tuple[int, int, int], num: tuple[int, int, int]) -> list[Window]:
    """The windows of one sample's patched grid under one window rule."""
    sizes = window_sizes(*thw, num)
    ranges = _shifted_ranges if method == "720pswin_by_size_bysize" else _regular_ranges
    rt, rh, rw = (ranges(n, s) for n, s in zip(thw, sizes))
    return [(t0, t1, h0, h1, w0, w1) for t0, t1 in rt for h0, h1 in rh for w0, w1 in rw]


@dataclass
class WindowGroup:
    """Windows of equal video and text length, attended in one batched call; their video tokens are
    rows ``[start, start + count·vid_len)`` in window order (:attr:`WindowLayout.perm`)."""

    start: int
    count: int
    vid_len: int
    txt_index: torch.Tensor  # (count, txt_len) rows of the packed text array
    txt_segments: list[tuple[int, int, int]]  # (first text row, first window, end window)


@dataclass
class WindowLayout:
    """All windows of one rule for a packed call: token order (``perm``), window-local positions and
    extents for RoPE, and ``extents`` as host integers (nothing is read back)."""

    perm: torch.Tensor  # (Nv,) int64
    local_pos: torch.Tensor  # (Nv, 3) int64, window order
    window_size: torch.Tensor  # (Nv, 3) int64, window order
    sample_of_token: torch.Tensor  # (Nv,) int64, window order
    groups: list[WindowGroup]
    txt_windows: torch.Tensor  # (Nt,) float: how many windows each text token appears in
    extents: tuple[tuple[int, ...], ...] = ((), (), ())  # per axis (t, h, w), sorted
    cache: dict = field(default_factory=dict)  # per-call derived tensors (RoPE positions)

    @staticmethod
    def build(method: str, num: tuple[int, int, int], patched_thw: list[tuple[int, int, int]],
              txt_lens: list[int], device: torch.device) -> "WindowLayout":
        """The layout's tensors computed on the CPU, sent to ``device`` in one int64 buffer
        (:func:`to_device`) and split into views there."""
        by_key, txt_windows = _windows_by_length(method, num, patched_thw, txt_lens)
        host, groups, extents = _window_order(by_key)
        host += [torch.cat(txt_windows).long(), *(g.txt_index.reshape(-1) for g in groups)]
        # Plain tensors even under inference mode: they are kept across calls, and autograd
        # may later index with them (on the CPU, to_device returns the concatenation itself).
        with torch.inference_mode(False):
            views = split_rows(to_device(torch.cat(host), device), [t.numel() for t in host])
            views[4] = views[4].float()  # window counts: small integers, exact in float
        perm_d, local_d, sizes_d, samples_d, windows_d = views[:5]
        for g, txt_index in zip(groups, views[5:]):
            g.txt_index = txt_index.view(g.count, -1)
        return WindowLayout(perm=perm_d, local_pos=local_d.view(-1, 3),
                            window_size=sizes_d.view(-1, 3), sample_of_token=samples_d,
                            groups=groups, txt_windows=windows_d, extents=extents)


def _windows_by_length(method: str, num: tuple[int, int, int],
                       patched_thw: list[tuple[int, int, int]], txt_lens: list[int]):
    """Every sample's windows as (video tokens, extent, sample, first text row), keyed by
    (video length, text length); and each text token's window count, per sample."""
    by_key: dict[tuple[int, int], list] = {}
    vid_offset = txt_offset = 0
    txt_windows = []
    for sample, ((t, h, w), txt_len) in enumerate(zip(patched_thw, txt_lens)):
        grid = torch.arange(t * h * w).view(t, h, w) + vid_offset
        windows = make_windows(method, (t, h, w), num)
        for t0, t1, h0, h1, w0, w1 in windows:
            tokens = grid[t0:t1, h0:h1, w0:w1].reshape(-1)
            by_key.setdefault((tokens.numel(), txt_len), []).append(
                (tokens, (t1 - t0, h1 - h0, w1 - w0), sample, txt_offset))
        txt_windows.append(torch.full((txt_len,), float(len(windows))))
        vid_offset += t * h * w
        txt_offset += txt_len
    return by_key, txt_windows


def _window_order(by_key: dict) -> tuple[list[torch.Tensor], list[WindowGroup], tuple]:
    """The host tensors in window order (perm, local positions, extents, samples), a
    :class:`WindowGroup` per key and the extents seen per axis."""
    perm, local, sizes, samples, groups = [], [], [], [], []
    extents: tuple[set, set, set] = (set(), set(), set())
    start = 0
    for (vid_len, txt_len), members in by_key.items():
        for tokens, size, sample, _ in members:
            perm.append(tokens)
            for axis, extent in enumerate(size):
                extents[axis].add(extent)
            pos = torch.stack(torch.meshgrid(*(torch.arange(n) for n in size), indexing="ij"), -1)
            local.append(pos.reshape(-1, 3))
            sizes.append(torch.tensor(size).expand(vid_len, 3))
            samples.append(torch.full((vid_len,), sample))
        offsets = [off for *_, off in members]
        txt_index = torch.stack([torch.arange(txt_len) + off for off in offsets])
        segments = [(off, offsets.index(off), len(offsets) - offsets[::-1].index(off))
                    for off in dict.fromkeys(offsets)]
        groups.append(WindowGroup(start, len(members), vid_len, txt_index, segments))
        start += len(members) * vid_len
    host = [torch.cat(perm), torch.cat(local).reshape(-1), torch.cat(sizes).reshape(-1),
            torch.cat(samples)]
    return host, groups, tuple(tuple(sorted(e)) for e in extents)


# Layouts kept per (rule, shapes, device, stream): the batches of one video share them.
# Bounded (~70 bytes per video token each); keyed by stream: docs/models.md, "Windows".
LAYOUT_CACHE_SIZE = 8
_layouts: "OrderedDict[tuple, WindowLayout]" = OrderedDict()


def layout_for(method: str, num: tuple[int, int, int], patched_thw: list[tuple[int, int, int]],
               txt_lens: list[int], device: torch.device) -> WindowLayout:
    """:meth:`WindowLayout.build`, reusing the device tensors of an earlier call with the same
    shapes. Every call gets its own ``cache`` (per-call RoPE tables are not kept)."""
    key = (method, tuple(num), tuple(map(tuple, patched_thw)), tuple(txt_lens), str(device),
           torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None)
    layout = _layouts.get(key)
    if layout is None:
        layout = WindowLayout.build(method, num, patched_thw, txt_lens, device)
        _layouts[key] = layout
        while len(_layouts) > LAYOUT_CACHE_SIZE:
            _layouts.popitem(last=False)
    else:
        _layouts.move_to_end(key)
    return replace(layout, cache={})
