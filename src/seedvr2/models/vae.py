"""The causal 3-D video VAE of SeedVR2 (official ``VideoAutoencoderKLWrapper``, video_vae_v3).

    video (B, 3, 4n+1, H, W) in [-1, 1]  --encoder-->  mean, logvar: (B, 16, n+1, H/8, W/8)
    latent (B, 16, t, h, w)              --decoder-->  video (B, 3, 4(t-1)+1, 8h, 8w)

The SD image VAE inflated to 3-D with time-causal convolutions, so frame 0 is encoded like a still
image and a clip can run in temporal chunks (:class:`~.vae_blocks.CausalCache`). Architecture,
causality, the pipeline's 0.9152 latent scaling: docs/models.md, "The causal video VAE"."""

from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..errors import InputError, UsageError
from .config import VAEConfig
from .vae_paths import TODAY, VaePaths
from .vae_blocks import (NORM_EPS, CausalCache, CausalConv3d, DownEncoderBlock3D, FrameGroupNorm,
                         UNetMidBlock3D, UpDecoderBlock3D, down_kinds, norm_act_conv, run_layers,
                         up_kinds)

LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0


class _Coder(nn.Module):
    """The encoder's and decoder's shared tail: their ``layers()``, then norm, SiLU, conv_out."""

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        return norm_act_conv(self.conv_norm_out, self.conv_out,
                             run_layers(self.layers(), x, cache), cache)


class Encoder(_Coder):
    """Video ``(B, in_channels, T, H, W)`` -> posterior moments ``(B, 2*latent, t, h, w)``."""

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        widths, groups = list(config.block_out_channels), config.norm_num_groups
        self.conv_in = CausalConv3d(config.in_channels, widths[0], 3, padding=1)
        kinds = down_kinds(len(widths), config.temporal_scale_num)
        self.down_blocks = nn.ModuleList(
            DownEncoderBlock3D(widths[max(i - 1, 0)], widths[i], config.layers_per_block, groups,
                               downsample=kinds[i]) for i in range(len(widths)))
        self.mid_block = UNetMidBlock3D(widths[-1], groups)
        self.conv_norm_out = FrameGroupNorm(groups, widths[-1], eps=NORM_EPS)
        self.conv_out = CausalConv3d(widths[-1], 2 * config.latent_channels, 3, padding=1)

    def layers(self) -> List[nn.Module]:
        """The layers before the output norm, in order (exact tiling walks them too)."""
        return [self.conv_in, *(layer for block in self.down_blocks for layer in block.layers()),
                *self.mid_block.layers()]


class Decoder(_Coder):
    """Latent ``(B, latent, t, h, w)`` -> video ``(B, out_channels, T, H, W)``."""

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        widths, groups = list(reversed(config.block_out_channels)), config.norm_num_groups
        self.conv_in = CausalConv3d(config.latent_channels, widths[0], 3, padding=1)
        self.mid_block = UNetMidBlock3D(widths[0], groups)
        kinds = up_kinds(len(widths), config.temporal_scale_num)
        self.up_blocks = nn.ModuleList(
            UpDecoderBlock3D(widths[max(i - 1, 0)], widths[i], config.layers_per_block + 1,
                             groups, upsample=kinds[i]) for i in range(len(widths)))
        self.conv_norm_out = FrameGroupNorm(groups, widths[-1], eps=NORM_EPS)
        self.conv_out = CausalConv3d(widths[-1], config.out_channels, 3, padding=1)

    def layers(self) -> List[nn.Module]:
        return [self.conv_in, *self.mid_block.layers(),
                *(layer for block in self.up_blocks for layer in block.layers())]


class VideoAutoencoder(nn.Module):
    """The SeedVR2 causal video VAE, with the official checkpoint's keys (``quant_conv`` /
    ``post_quant_conv`` only where the config enables them; the released model does not). Inputs are
    cast to the parameter dtype (not moved), contiguous channels-first; without autograd the
    in-place fast paths run (with it, the same maths out of place)."""

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        self.config = config
        self.latent_channels = config.latent_channels
        self.spatial_factor = config.spatial_downsample_factor
        self.temporal_factor = config.temporal_downsample_factor
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        latent2 = 2 * config.latent_channels
        self.quant_conv = CausalConv3d(latent2, latent2, 1) if config.use_quant_conv else None
        self.post_quant_conv = (CausalConv3d(config.latent_channels, config.latent_channels, 1)
                                if config.use_post_quant_conv else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv_in.weight.dtype

    # -- convolution settings (options vae_cudnn_benchmark, vae_channels_last, ...) ----------

    cudnn_benchmark = False
    paths: VaePaths = TODAY

    def set_conv_settings(self, *, cudnn_benchmark: bool, paths: VaePaths = TODAY) -> None:
        """``cudnn_benchmark``: cuDNN times its algorithms for each new convolution shape while
        this VAE runs (see :meth:`conv_settings`); ``paths``: the kernels its convolutions,
        norms and causal caches run on (``vae_paths.choose_paths``; default today's)."""
        self.cudnn_benchmark = bool(cudnn_benchmark)
        self.paths = paths
        for module in self.modules():
            if isinstance(module, CausalConv3d):
                module.paths = paths

    def new_cache(self, park=None) -> CausalCache:
        """A fresh causal cache for one clip and direction on this VAE's paths (see CausalCache)."""
        return CausalCache(paths=self.paths, park=park)

    @contextlib.contextmanager
    def conv_settings(self):
        """Within this block cuDNN benchmarks when this VAE asks for it (off: the flag as it is),
        the process-wide flag restored after, so other models keep their setting (jobs run one
        at a time per process: nothing else reads it meanwhile)."""
        if not self.cudnn_benchmark:
            yield
            return
        before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            yield
        finally:
            torch.backends.cudnn.benchmark = before

    # -- encoding ---------------------------------------------------------------------------

    def encode_posterior(self, video: Tensor) -> Tuple[Tensor, Tensor]:
        """Posterior moments ``(mean, logvar)``, each ``(B, 16, n + 1, H/8, W/8)``, of ``video``
        ``(B, 3, 4n + 1, H, W)`` in [-1, 1] (an image: ``T = 1``); ``logvar`` in [-30, 20]."""
        self.check_video(video)
        with self.conv_settings():
            return self.posterior(self.encoder(video.to(self.dtype).contiguous()))

    def posterior(self, moments: Tensor) -> Tuple[Tensor, Tensor]:
        """``(mean, logvar)`` from the encoder's output (through ``quant_conv``, pointwise),
        ``logvar`` clamped; tiled encodes clamp each tile (a blend of clamped values stays in)."""
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = moments.chunk(2, dim=1)
        return mean.contiguous(), logvar.clamp(LOGVAR_MIN, LOGVAR_MAX)

    def encode(self, video: Tensor) -> Tensor:
        """The posterior mean (mode) of ``video``: ``(B, 16, n + 1, H/8, W/8)``, channels-first,
        *unscaled* (docs/models.md, "Scaling and names"); arguments as :meth:`encode_posterior`.
        The official pipeline samples instead: :meth:`sample_posterior`."""
        return self.encode_posterior(video)[0]

    @staticmethod
    def sample_posterior(mean: Tensor, logvar: Tensor, generator: Optional[torch.Generator] = None,
                         *, noise: Optional[Tensor] = None) -> Tensor:
        """A draw ``mean + exp(logvar / 2) * eps`` from the diagonal Gaussian posterior: ``eps`` is
        ``noise``, else drawn in float32 on ``generator``'s device (a seed gives the same latent in
        any model dtype), moved to ``mean``'s device and dtype."""
        if noise is None:
            device = generator.device if generator is not None else mean.device
            noise = torch.randn(mean.shape, generator=generator, device=device, dtype=torch.float32)
        if noise.shape != mean.shape:
            raise InputError(f"noise must have the shape of mean {tuple(mean.shape)}, "
                             f"got {tuple(noise.shape)}")
        return mean + torch.exp(0.5 * logvar) * noise.to(device=mean.device, dtype=mean.dtype)

    # -- decoding ---------------------------------------------------------------------------

    def decode(self, latent: Tensor) -> Tensor:
        """Video ``(B, 3, 4(t - 1) + 1, 8h, 8w)`` from an unscaled latent ``(B, 16, t, h, w)``,
        always 5-D, nominally in [-1, 1] (not clamped)."""
        self.check_latent(latent)
        z = latent.to(self.dtype).contiguous()
        with self.conv_settings():
            if self.post_quant_conv is not None:
                z = self.post_quant_conv(z)
            return self.decoder(z)

    def forward(self, video: Tensor) -> Tensor:
        """Reconstruction through the posterior mean: ``decode(encode(video))``."""
        return self.decode(self.encode(video))

    # -- argument checks (public: tiled and sliced runs validate with them) ------------------

    def check_video(self, video: Tensor) -> None:
        """Raise ``UsageError``/``InputError`` unless ``video`` is a valid input of :meth:`encode`:
        ``(B, in_channels, 4n + 1, H, W)``, H and W positive multiples of the spatial factor."""
        hint = " (for single images add a time axis: video.unsqueeze(2))" \
            if isinstance(video, Tensor) and video.ndim == 4 else ""
        _check_5d(video, "video", "(B, C, T, H, W)", hint)
        _, channels, frames, height, width = video.shape
        if channels != self.config.in_channels:
            raise InputError(f"video must have {self.config.in_channels} channels at dim 1 of "
                             f"(B, C, T, H, W), got {channels} (shape {tuple(video.shape)})")
        f = self.temporal_factor
        if frames < 1 or (frames - 1) % f:
            raise InputError(f"video frame count T must be {f}n+1 (1, {f + 1}, {2 * f + 1}, "
                             f"...), got T={frames}")
        s = self.spatial_factor
        if height % s or width % s or height == 0 or width == 0:
            raise InputError(f"video height and width must be positive multiples of {s}, "
                             f"got H={height}, W={width}")

    def check_latent(self, latent: Tensor) -> None:
        """Raise ``UsageError``/``InputError`` (naming the fix) unless ``latent`` is a valid
        input of :meth:`decode`: a non-empty channels-first ``(B, latent_channels, t, h, w)``."""
        _check_5d(latent, "latent", "(B, C, t, h, w) channels-first")
        if latent.shape[1] != self.latent_channels:
            raise InputError(f"latent must have {self.latent_channels} channels at dim 1 of "
                             f"(B, C, t, h, w), got {latent.shape[1]} (shape "
                             f"{tuple(latent.shape)}; channels-last latents need "
                             f"permute(0, 4, 1, 2, 3))")
        if 0 in latent.shape[2:]:
            raise InputError(f"latent must have non-empty t, h, w, got shape "
                             f"{tuple(latent.shape)}")


def _check_5d(value, name: str, layout: str, hint: str = "") -> None:
    if not isinstance(value, Tensor):
        raise UsageError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.ndim != 5:
        raise InputError(f"{name} must be 5-D {layout}, got shape {tuple(value.shape)}{hint}")


__all__ = ["VideoAutoencoder", "Encoder", "Decoder", "CausalCache"]
