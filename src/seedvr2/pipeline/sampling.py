"""The diffusion maths of SeedVR2's one-step super-resolution.

Schedule "lerp" with T = 1000: ``x_t = (1 − t/T)·x_0 + (t/T)·noise``; the DiT predicts the
velocity ``v = noise − x_0``. SeedVR2 samples in one Euler step from t = T, where the
schedule is pure noise, so ``x_0 = noise − v``; classifier-free guidance is off (scale 1),
so only the positive text embedding is used.

The DiT input per latent position is ``[x_t (16) | low-res latent (16) | mask (1) = 1]``.
The low-res latent is the VAE posterior of the resized input, scaled by 0.9152, channels-last."""

from __future__ import annotations

import torch

T = 1000.0
LATENT_SCALE = 0.9152  # vae.scaling_factor of the official config; shift 0
TEMPORAL_FACTOR, SPATIAL_FACTOR = 4, 8


def _lin(x1: float, y1: float, x2: float, y2: float):
    slope = (y2 - y1) / (x2 - x1)
    return lambda x: slope * x + (y1 - slope * x1)


_image_shift = _lin(256 * 256, 1.0, 1024 * 1024, 3.2)
_video_shift = _lin(256 * 256 * 37, 1.0, 1280 * 720 * 145, 5.0)


def timestep_transform(t: torch.Tensor, latent_thw) -> torch.Tensor:
    """Resolution-dependent timestep shift: larger inputs spend longer at high noise.
    ``latent_thw`` = (T, h, w) of the latent; the shift is linear in the pixel count (times the
    frame count for videos), ``t' = T·s·u / (1 + (s − 1)·u)`` with ``u = t/T``."""
    lt, lh, lw = (float(v) for v in latent_thw)
    frames = (lt - 1) * TEMPORAL_FACTOR + 1
    pixels = lh * SPATIAL_FACTOR * lw * SPATIAL_FACTOR
    shift = _video_shift(pixels * frames) if frames > 1 else _image_shift(pixels)
    u = t.double() / T
    return (T * shift * u / (1 + (shift - 1) * u)).to(t.dtype)


def augment_latent(latent: torch.Tensor, aug_noise: torch.Tensor, noise_scale: float) -> torch.Tensor:
    """Noise augmentation of the low-res latent (T, h, w, 16) at strength ``noise_scale``.
    Follows the official script, including its quirk: the timestep shift is computed from

    ``latent.shape[1:]`` — (h, w, 16) read as (T, h, w) — rather than the latent's (T, h, w)."""
    if noise_scale == 0:
        return latent
    t = timestep_transform(torch.tensor(T * noise_scale), latent.shape[1:]).item() / T
    return (1 - t) * latent + t * aug_noise


def make_condition(latent: torch.Tensor) -> torch.Tensor:
    """SR condition (T, h, w, 17): the low-res latent and a mask of ones."""
    return torch.cat([latent, torch.ones_like(latent[..., :1])], dim=-1)


def dit_input(x_t: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """DiT input (T, h, w, 33): the noisy latent followed by the condition."""
    return torch.cat([x_t, condition], dim=-1)


def x0_from_velocity(x_t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One Euler step from t = T to 0 with the v-prediction of the lerp schedule."""
    return x_t - v
