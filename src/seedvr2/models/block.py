"""One NaDiT transformer block ("mmdit_sr"): joint window attention, then an MLP, each
pre-normalised (RMSNorm without gain), modulated by the timestep embedding and gated."""

from __future__ import annotations

import torch
from torch import nn

from .attention import WindowAttention
from .config import DIT_3B, DiTConfig
from .mlp import GeluMLP, SwiGLU
from .modulation import ATTN, MLP, Modulation
from .norm import rms_norm
from .packing import Packing
from .rope import MMRoPE3d, PixelRoPE3d
from .streams import PerStream


class MMDiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig, index: int):
        super().__init__()
        dim = cfg.vid_dim
        is_3b = cfg.family == DIT_3B
        shared = is_3b and index >= cfg.mm_layers
        # The 3B's last block only updates video: text enters its attention normalised but
        # unmodulated, and its text output is never used (the released model discards it).
        self.video_only = is_3b and index == cfg.num_layers - 1
        self.eps = cfg.norm_eps
        self.window_method = cfg.window_method[index]
        self.window = cfg.window[index]
        rope = MMRoPE3d(cfg.rope_dim, cfg.head_dim) if is_3b else PixelRoPE3d(cfg.head_dim)
        self.attn = WindowAttention(dim, cfg.heads, cfg.head_dim, cfg.norm_eps, shared, rope)
        mlp = SwiGLU if cfg.mlp_type == "swiglu" else GeluMLP
        self.mlp = PerStream(lambda: mlp(dim, cfg.mlp_hidden_dim), shared, self.video_only)
        self.ada = PerStream(lambda: Modulation(dim), shared, self.video_only)

    def _sublayer_in(self, x, emb, stream, slot, packing):
        shift, scale, gate = (packing.per_token(v.to(x.dtype), stream)
                              for v in self.ada[stream].values(emb, slot))
        return torch.addcmul(shift, rms_norm(x, self.eps).to(x.dtype), scale), gate

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, emb: torch.Tensor,
                packing: Packing) -> tuple[torch.Tensor, torch.Tensor]:
        """vid (Nv, dim), txt (Nt, dim), emb (B, 6·dim) -> updated vid, txt."""
        rule = (self.window_method, self.window)
        h_v, gate_v = self._sublayer_in(vid, emb, "vid", ATTN, packing)
        if self.video_only:
            h_t = rms_norm(txt, self.eps).to(txt.dtype)
            a_v, _ = self.attn(h_v, h_t, packing, rule, need_txt=False)
            vid = torch.addcmul(vid, a_v, gate_v)
            h_v, gate_v = self._sublayer_in(vid, emb, "vid", MLP, packing)
            return torch.addcmul(vid, self.mlp["vid"](h_v), gate_v), txt

        h_t, gate_t = self._sublayer_in(txt, emb, "txt", ATTN, packing)
        a_v, a_t = self.attn(h_v, h_t, packing, rule)
        vid, txt = torch.addcmul(vid, a_v, gate_v), torch.addcmul(txt, a_t, gate_t)
        h_v, gate_v = self._sublayer_in(vid, emb, "vid", MLP, packing)
        h_t, gate_t = self._sublayer_in(txt, emb, "txt", MLP, packing)
        return (torch.addcmul(vid, self.mlp["vid"](h_v), gate_v),
                torch.addcmul(txt, self.mlp["txt"](h_t), gate_t))
