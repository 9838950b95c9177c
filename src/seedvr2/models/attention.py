"""Windowed joint attention of the NaDiT: each window's video tokens then its sample's text tokens,
windows of equal length in one SDPA call, a text token's output the mean over its windows; Ulysses
sequence parallelism plugs in (:class:`SequenceParallel`). docs/models.md."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .norm import RMSNorm, rms_norm
from .packing import Packing
from .rope import apply_rotary
from .streams import PerStream


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


# The module FlashAttention-3 (the flash_attn_3 package, built for Hopper) installs.
FLASH_ATTN_3_MODULE = "flash_attn_interface"


def auto_backend(q: torch.Tensor) -> str:
    """What ``auto`` runs for ``q``: FlashAttention-3 (built for Hopper only) on compute
    capability 9.x in fp16/bf16 when its package is findable, else SDPA (which picks its own
    fused kernel); a package that fails to run falls back to SDPA with a warning."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return "sdpa"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return "sdpa"
    return "flash_attn_3" if importlib.util.find_spec(FLASH_ATTN_3_MODULE) else "sdpa"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           backend: str = "sdpa") -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(head_dim), of q/k/v (batch, seq, heads, head_dim)."""
    if backend == "auto":
        backend = auto_backend(q)
    if backend == "sdpa":
        return _sdpa(q, k, v)
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        raise InputError(f"{backend} needs CUDA tensors in fp16/bf16")
    return BACKENDS[backend](q, k, v)


class SequenceParallel(Protocol):
    """What the NaDiT needs from a sequence-parallel strategy (Ulysses all-to-all; see
    ``seedvr2.distributed.sequence``): a rank's video tokens are one contiguous row range."""

    def shard(self, vid: torch.Tensor, packing: Packing) -> tuple[torch.Tensor, Packing]:
        """All video rows (Nv, dim) -> this rank's rows, and a packing whose ``per_token``
        yields this rank's video rows (everything else about it describes the whole call)."""

    def gather(self, vid: torch.Tensor, packing: Packing) -> torch.Tensor:
        """This rank's video rows -> all video rows, on every rank."""

    def head_range(self, heads: int) -> slice:
        """The heads this rank attends for."""

    def scatter_heads(self, qkv: torch.Tensor, packing: Packing) -> torch.Tensor:
        """(n_local, 3, heads, head_dim) -> (Nv, 3, heads/N, head_dim): every token, own heads."""

    def gather_heads(self, vid: torch.Tensor, txt: Optional[torch.Tensor]):
        """Attention outputs of own heads: vid (Nv, heads/N·head_dim), txt (Nt, ...) or None
        -> vid (n_local, heads·head_dim), txt (Nt, heads·head_dim) or None, heads in order."""


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
        # (device, dtype) -> the kernel "auto" chose there: decided once per placement, not
        # per window group (finding a package walks sys.path).
        self._auto_choice: tuple = (None, "sdpa")
        self.sequence_parallel: Optional[SequenceParallel] = None

    def _project(self, x: torch.Tensor, stream: str) -> torch.Tensor:
        """(N, dim) -> (N, 3, heads, head_dim) raw q, k, v."""
        return self.proj_qkv[stream](x).unflatten(-1, (3, self.heads, self.head_dim))

    def _qkv(self, qkv: torch.Tensor, stream: str, cis: torch.Tensor | None, dtype: torch.dtype):
        """(N, 3, h, head_dim) -> q, k, v each (N, h, head_dim); q/k normed and rotated in fp32."""
        q, k, v = qkv.unbind(1)
        q = rms_norm(q, self.eps, self.norm_q[stream].weight)
        k = rms_norm(k, self.eps, self.norm_k[stream].weight)
        if cis is not None:
            q, k = apply_rotary(q, cis), apply_rotary(k, cis)
        return q.to(dtype), k.to(dtype), v

    def kernel_for(self, q: torch.Tensor) -> str:
        """The attention kernel this layer runs for ``q`` (``auto`` resolved)."""
        if self.backend != "auto":
            return self.backend
        where = (q.device, q.dtype)
        if self._auto_choice[0] != where:
            self._auto_choice = (where, auto_backend(q))
        return self._auto_choice[1]

    def _attend(self, q, k, v):
        kernel = self.kernel_for(q)
        try:
            return attend(q, k, v, kernel)
        except torch.OutOfMemoryError:
            raise  # the backend works; this call needs less memory, not another kernel
        except Exception as e:  # missing package, unsupported GPU/shape: keep working on SDPA
            warnings.warn(f"attention backend {kernel} unavailable ({e}); using sdpa")
            self.backend = "sdpa"
            return attend(q, k, v)

    def forward(self, vid: torch.Tensor, txt: torch.Tensor, packing: Packing,
                window_rule: tuple, need_txt: bool = True):
        """vid (Nv, dim), txt (Nt, dim) -> attention outputs (Nv, dim), (Nt, dim) or None;
        ``window_rule``: (window method, window count). Sequence-parallel: this rank's vid rows."""
        out_v, out_t = self._window_attention(self._project(vid, "vid"), self._project(txt, "txt"),
                                              packing, window_rule, need_txt, vid.dtype)
        out_v = self.proj_out["vid"](out_v)
        if not need_txt:
            return out_v, None
        return out_v, self.proj_out["txt"](out_t)

    # Kept out of torch.compile graphs: the layout, RoPE tables and per-group loop depend on
    # the resolution through Python values (a recompile per block and resolution); the
    # token-wise work around it is what compiling speeds up, and it stays shape-polymorphic.
    @torch.compiler.disable
    def _window_attention(self, qkv_v: torch.Tensor, qkv_t: torch.Tensor, packing: Packing,
                          window_rule: tuple, need_txt: bool, dtype: torch.dtype):
        """Projected q/k/v (N, 3, heads, head_dim) of both streams -> attention outputs before
        the output projection: vid (Nv, heads·head_dim), txt (Nt, heads·head_dim) or None."""
        layout = packing.layout(*window_rule)
        sp = self.sequence_parallel
        # Video tokens in window order, so each group's windows are contiguous rows.
        cis_v = self.rope.video_rotation(layout, packing.txt_lens_tensor())
        cis_t = self.rope.text_rotation(packing.txt_positions()) if self.rope.rotates_text else None
        if sp is None:
            heads = self.heads
        else:
            own = sp.head_range(self.heads)
            heads = own.stop - own.start
            qkv_v = sp.scatter_heads(qkv_v, packing)  # every token, own heads
            qkv_t = qkv_t[:, :, own]
        q_v, k_v, v_v = self._qkv(qkv_v[layout.perm], "vid", cis_v, dtype)
        q_t, k_t, v_t = self._qkv(qkv_t, "txt", cis_t, dtype)

        inner = heads * self.head_dim
        out_v = torch.empty(layout.perm.shape[0], inner, dtype=dtype, device=qkv_v.device)
        out_t = torch.zeros(qkv_t.shape[0], inner, dtype=torch.float32, device=qkv_t.device) \
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
        if need_txt:
            out_t = (out_t / layout.txt_windows[:, None]).to(dtype)
        if sp is not None:
            out_v, out_t = sp.gather_heads(out_v, out_t)  # own tokens, every head
        return out_v, out_t
