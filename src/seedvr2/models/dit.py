"""NaDiT: the SeedVR2 diffusion transformer, both released families (docs/models.md).

Samples' latent grids flattened and concatenated (native-resolution packing, no padding):

    vid (Σ T·H·W, 33) --patchify 1x2x2--> tokens (Σ T·H/2·W/2, dim) ─┐
    txt (Σ L, txt_in_dim) --Linear--> (Σ L, dim) ─────────────────────┤ num_layers × MMDiTBlock
    timestep (B,) --sinusoid + MLP--> emb (B, 6·dim) ─────────────────┘
    --> [3B: RMSNorm + output modulation] --> Linear --> unpatchify --> (Σ T·H·W, 16)

Output: the predicted velocity in the same packing."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError
from .attention import ATTENTION_BACKENDS, SequenceParallel
from .block import MMDiTBlock
from .config import DIT_3B, DiTConfig
from .embedding import PATCH, PatchIn, PatchOut, TimestepEmbedding
from .modulation import ATTN, SCALE, SHIFT, embedding_slot
from .norm import RMSNorm
from .packing import Packing
from .rope import share_equal_tables


class OutputModulation(nn.Module):
    """3B output head modulation (``vid_out_ada``): ``x·(scale_e + out_scale) + shift_e +
    out_shift`` with the embedding's *attention-slot* values (the reference's output head reads
    a cached embedding keyed like the blocks' first slot; the released model trained so)."""

    def __init__(self, dim: int):
        super().__init__()
        self.out_shift = nn.Parameter(torch.zeros(dim))
        self.out_scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, emb: torch.Tensor, packing: Packing) -> torch.Tensor:
        shift = packing.per_token((embedding_slot(emb, ATTN, SHIFT) + self.out_shift).to(x.dtype), "vid")
        scale = packing.per_token((embedding_slot(emb, ATTN, SCALE) + self.out_scale).to(x.dtype), "vid")
        return x * scale + shift


class NaDiT(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = cfg = config
        dim = cfg.vid_dim
        self.vid_in = PatchIn(cfg.vid_in_channels, dim)
        self.txt_in = nn.Linear(cfg.txt_in_dim, dim)
        self.emb_in = TimestepEmbedding(max(cfg.vid_dim, cfg.txt_dim), cfg.emb_dim)
        self.blocks = nn.ModuleList(MMDiTBlock(cfg, i) for i in range(cfg.num_layers))
        self.has_output_norm = cfg.family == DIT_3B and cfg.vid_out_norm is not None
        if self.has_output_norm:
            self.vid_out_norm = RMSNorm(dim, cfg.norm_eps)
            self.vid_out_ada = OutputModulation(dim)
        self.vid_out = PatchOut(dim, cfg.vid_out_channels)
        self.sequence_parallel: SequenceParallel | None = None

    def set_attention_backend(self, backend: str):
        """``auto`` / ``sdpa`` / ``flash_attn_2`` / ``flash_attn_3`` / ``sageattn_2``."""
        if backend not in ATTENTION_BACKENDS:
            raise InputError(f"attention_backend {backend!r}: expected one of "
                             f"{list(ATTENTION_BACKENDS)}")
        for block in self.blocks:
            block.attn.backend = backend

    def set_sequence_parallel(self, strategy: SequenceParallel | None):
        """Install (``None``: remove) a sequence-parallel strategy: between input embeddings
        and output projection each rank holds its shard of the video tokens, and attention
        exchanges tokens for heads (``attention.SequenceParallel``)."""
        self.sequence_parallel = strategy
        for block in self.blocks:
            block.attn.sequence_parallel = strategy

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        share_equal_tables(self)  # device moves copy each table; keep equal ones shared
        return self

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, vid_shape: torch.Tensor,
                txt_shape: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        thw, txt_lens = self._check_inputs(vid, txt, vid_shape, txt_shape, timestep)
        packing = Packing([(t, h // PATCH, w // PATCH) for t, h, w in thw], txt_lens, vid.device)
        dtype = self.vid_in.proj.weight.dtype
        x_v = self.vid_in(vid.to(dtype), thw)
        x_t = self.txt_in(txt.to(dtype))
        emb = self.emb_in(timestep.reshape(-1).expand(len(thw)))
        sp = self.sequence_parallel
        if sp is not None:
            x_v, packing = sp.shard(x_v, packing)
        for block in self.blocks:
            x_v, x_t = block(x_v, x_t, emb, packing)
        if self.has_output_norm:
            x_v = self.vid_out_norm(x_v)
            x_v = self.vid_out_ada(x_v, emb, packing)
        if sp is not None:
            x_v = sp.gather(x_v, packing)
        return self.vid_out(x_v, thw)

    def _check_inputs(self, vid, txt, vid_shape, txt_shape, timestep):
        cfg = self.config
        if vid.dim() != 2 or vid.shape[1] != cfg.vid_in_channels:
            raise InputError(f"vid: expected shape (tokens, {cfg.vid_in_channels}), "
                             f"got {tuple(vid.shape)}")
        if txt.dim() != 2 or txt.shape[1] != cfg.txt_in_dim:
            raise InputError(f"txt: expected shape (tokens, txt_in_dim={cfg.txt_in_dim}), got "
                             f"{tuple(txt.shape)}; text embeddings must match the DiT's width")
        if vid_shape.dim() != 2 or vid_shape.shape[1] != 3:
            raise InputError(f"vid_shape: expected (batch, 3) rows [T, H, W], "
                             f"got {tuple(vid_shape.shape)}")
        if txt_shape.dim() != 2 or txt_shape.shape[1] != 1 or txt_shape.shape[0] != vid_shape.shape[0]:
            raise InputError(f"txt_shape: expected ({vid_shape.shape[0]}, 1) to match vid_shape, "
                             f"got {tuple(txt_shape.shape)}")
        if timestep.numel() not in (1, vid_shape.shape[0]):
            raise InputError(f"timestep: expected 1 or {vid_shape.shape[0]} values, "
                             f"got {timestep.numel()}")
        # Shapes are host facts: pass them as CPU tensors (on a GPU each .tolist() would wait
        # for the device to drain; the pipeline passes CPU tensors).
        thw = [tuple(r) for r in vid_shape.tolist()]
        txt_lens = [r[0] for r in txt_shape.tolist()]
        for i, (t, h, w) in enumerate(thw):
            if min(t, h, w) < 1 or h % PATCH or w % PATCH:
                raise InputError(f"vid_shape[{i}] = {[t, h, w]}: latent T, H, W must be positive "
                                 f"and H, W even (the DiT patches 1x2x2)")
        if sum(t * h * w for t, h, w in thw) != vid.shape[0]:
            raise InputError(f"vid has {vid.shape[0]} rows but vid_shape describes "
                             f"{sum(t * h * w for t, h, w in thw)} latent positions")
        if min(txt_lens) < 1 or sum(txt_lens) != txt.shape[0]:
            raise InputError(f"txt has {txt.shape[0]} rows but txt_shape describes "
                             f"{sum(txt_lens)} tokens (each sample needs at least one)")
        return thw, txt_lens
