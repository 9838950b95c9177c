"""The released VAE's memory at real size without a GPU: encode and decode of 1080p x 5 frames
in fp16 traced on fake tensors (no data), every live tensor counted (issue #35, part 3)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from seedvr2.models import vae_blocks
from seedvr2.models.config import vae_config
from seedvr2.models.vae import VideoAutoencoder

GIB = 1 << 30
B, T, H, W = 1, 5, 1088, 1920  # 1080p padded to the multiple of 16, one 5-frame batch


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages made inside the mode (the weights, made before, excluded)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def _free(self, key, n):
        self.seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) in self.seen or storage.nbytes() == 0:
                    continue
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out


def _traced_peak(decode: bool) -> int:
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.float16)
        try:
            vae = VideoAutoencoder(vae_config("vae")).requires_grad_(False)
        finally:
            torch.set_default_dtype(torch.float32)
        x = (torch.empty(B, 16, (T - 1) // 4 + 1, H // 8, W // 8, dtype=torch.float16) if decode
             else torch.empty(B, 3, T, H, W, dtype=torch.float16))
        mode = LiveBytes()
        with torch.inference_mode(), mode:
            (vae.decode if decode else vae.encode)(x)
    return mode.peak


def _band_temporaries() -> int:
    """One band's input and output (each at most a quarter of SPLIT_ELEMENTS, fp16)."""
    return 2 * (vae_blocks.SPLIT_ELEMENTS // 4) * 2


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "encode"])
def test_real_size_peak_is_what_the_layout_holds(decode):
    """Decode: at the first full-resolution block's conv1, its padded input (256 channels,
    T + 2 frames), the shortcut's and conv1's outputs (128 channels, T frames) and one band;
    before (#35) 19.4 GiB: the input and its padded copy, the up-sampler's 4x output, two
    float32 norm pieces. Encode: at a full-resolution block's conv2, the block's input, conv1's
    output, conv2's padded input and output (128 channels) and one band; before 16.9 GiB."""
    frame = H * W * 2  # bytes of one fp16 plane
    if decode:
        held = 256 * (T + 2) * frame + 2 * 128 * T * frame
    else:
        held = 3 * 128 * T * frame + 128 * (T + 2) * frame
    peak = _traced_peak(decode)
    assert held <= peak <= held + _band_temporaries(), (peak / GIB, held / GIB)
