"""Windowed joint attention of the NaDiT.

Every window is one sequence: the window's video tokens followed by all text tokens of the
same sample. Video outputs return to their positions; a text token's output is the mean of
its outputs over the sample's windows. Windows of equal (video, text) length are stacked and
run through one ``scaled_dot_product_attention`` call.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm, rms_norm
from .packing import Packing
from .rope import apply_rotary
from .streams import PerStream
from .window import WindowLayout


def _sdpa(q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _flash_attn_2(q, k, v):
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v)


def _flash_attn_3(q, k, v):
    from flash_attn_interface import flash_attn_func

    out = flash_attn_func(q, k, v)
    return out[0] if isinstance(out, tuple) else out


def _sageattn_2(q, k, v):
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="NHD")


# Optional kernels are imported on first use only; the package never needs them.
BACKENDS = {"sdpa": _sdpa, "flash_attn_2": _flash_attn_2, "flash_attn_3": _flash_attn_3,
            "sageattn_2": _sageattn_2}
ATTENTION_BACKENDS = ("auto", *BACKENDS)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(head_dim). q/k/v: (batch, seq, heads, head_dim).

    The optional kernels need CUDA and fp16/bf16 and raise where they cannot run.
    """
    if backend in ("auto", "sdpa"):
        return _sdpa(q, k, v)
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        raise RuntimeError(f"{backend} needs CUDA tensors in fp16/bf16")
    return BACKENDS[backend](q, k, v)


class WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float, shared: bool,
                 rope: nn.Module):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        inner = heads * head_dim
        self.proj_qkv = PerStream(lambda: nn.Linear(dim, 3 * inner, bias=False), shared)
        self.proj_out = PerStream(lambda: nn.Linear(inner, dim), shared)
        self.norm_q = PerStream(lambda: RMSNorm(head_dim, eps), shared)
        self.norm_k = PerStream(lambda: RMSNorm(head_dim, eps), shared)
        self.rope = rope
        self.backend = "sdpa"

    def _qkv(self, x: torch.Tensor, stream: str, cis: torch.Tensor | None):
        """(N, dim) -> q, k, v each (N, heads, head_dim); q/k normed and rotated in fp32."""
        q, k, v = self.proj_qkv[stream](x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(1)
        q = rms_norm(q, self.eps, self.norm_q[stream].weight)
        k = rms_norm(k, self.eps, self.norm_k[stream].weight)
        if cis is not None:
            q, k = apply_rotary(q, cis), apply_rotary(k, cis)
        return q.to(x.dtype), k.to(x.dtype), v

    def _attend(self, q, k, v):
        try:
            return attend(q, k, v, self.backend)
        except Exception as e:  # missing package, unsupported GPU/shape: keep working on SDPA
            warnings.warn(f"attention backend {self.backend} unavailable ({e}); using sdpa")
            self.backend = "sdpa"
            return attend(q, k, v)

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, packing: Packing,
                layout: WindowLayout, need_txt: bool = True):
        """vid (Nv, dim), txt (Nt, dim) -> attention outputs (Nv, dim), (Nt, dim) or None."""
        # Video tokens in window order, so each group's windows are contiguous rows.
        cis_v = self.rope.video_rotation(layout, packing.txt_lens_tensor())
        q_v, k_v, v_v = self._qkv(vid[layout.perm], "vid", cis_v)
        cis_t = self.rope.text_rotation(packing.txt_positions()) if self.rope.rotates_text else None
        q_t, k_t, v_t = self._qkv(txt, "txt", cis_t)

        out_v = torch.empty(vid.shape[0], self.heads * self.head_dim, dtype=vid.dtype,
                            device=vid.device)
        out_t = torch.zeros(txt.shape[0], out_v.shape[1], dtype=torch.float32, device=txt.device) \
            if need_txt else None
        for g in layout.groups:
            rows = slice(g.start, g.start + g.count * g.vid_len)
            window = lambda x: x[rows].unflatten(0, (g.count, g.vid_len))  # noqa: E731
            k = torch.cat([window(k_v), k_t[g.txt_index]], dim=1)
            v = torch.cat([window(v_v), v_t[g.txt_index]], dim=1)
            q = torch.cat([window(q_v), q_t[g.txt_index]], dim=1) if need_txt else window(q_v)
            o = self._attend(q, k, v).flatten(2)  # (count, seq, inner)
            out_v.index_copy_(0, layout.perm[rows], o[:, : g.vid_len].flatten(0, 1))
            if need_txt:
                # A sample's windows are adjacent in a group: sum each sample's text outputs.
                for txt_start, first, last in g.txt_segments:
                    out_t[txt_start: txt_start + o.shape[1] - g.vid_len] += \
                        o[first:last, g.vid_len:].sum(0, dtype=torch.float32)
        out_v = self.proj_out["vid"](out_v)
        if not need_txt:
            return out_v, None
        out_t = (out_t / layout.txt_windows[:, None]).to(txt.dtype)
        return out_v, self.proj_out["txt"](out_t)
