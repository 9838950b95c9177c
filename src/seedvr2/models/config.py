"""Model configurations with the official constructor key names, resolved by :func:`dit_config` /
:func:`vae_config` from a shipped name, a conformance ``config.json`` or an official config
verbatim; a key no official config has raises ``ConfigError`` (docs/models.md, "The DiT")."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from ..errors import SeedVR2Error


class ConfigError(SeedVR2Error, ValueError):
    """A model configuration that no official SeedVR2 model has."""


def _need(config, kind: str, cond: bool, name: str, expected: str) -> None:
    if not cond:
        raise ConfigError(f"{kind} config field {name!r} = {getattr(config, name)!r}: "
                          f"expected {expected}")


DIT_3B = "3b"  # models/dit_v2 in the official repository
DIT_7B = "7b"  # models/dit

# Keys that exist only in one family's constructor: they tell the families apart.
_ONLY_3B = {"mm_layers", "patch_type", "rope_type", "rope_dim", "msa_type", "mca_type",
            "txt_in_norm", "txt_in_norm_scale_factor", "txt_proj_type", "vid_out_norm"}
_ONLY_7B = {"qk_rope", "shared_qkv", "shared_mlp", "temporal_window_size", "temporal_shifted"}


@dataclass
class DiTConfig:
    """NaDiT constructor arguments (both families). ``family`` is derived, not an official key."""

    vid_in_channels: int = 33
    vid_out_channels: int = 16
    vid_dim: int = 2560
    txt_in_dim: int = 5120
    txt_dim: Optional[int] = None
    emb_dim: Optional[int] = None
    heads: int = 20
    head_dim: int = 128
    expand_ratio: int = 4
    norm: Optional[str] = "fusedrms"
    norm_eps: float = 1e-5
    ada: str = "single"
    qk_bias: bool = False
    qk_norm: Optional[str] = "fusedrms"
    patch_size: tuple = (1, 2, 2)
    num_layers: int = 32
    block_type: Any = "mmdit_sr"
    mlp_type: str = "normal"
    window: Optional[list] = None
    window_method: Optional[list] = None
    # 3B family (models/dit_v2)
    mm_layers: Optional[int] = None
    patch_type: str = "v1"
    rope_type: Optional[str] = "rope3d"
    rope_dim: Optional[int] = None
    msa_type: Any = None  # inert ("None" string in the official YAML)
    mca_type: Any = None  # inert
    txt_in_norm: Optional[str] = None  # inert unless txt_in_dim is a list
    txt_in_norm_scale_factor: float = 0.01  # inert
    txt_proj_type: Optional[str] = "linear"
    vid_out_norm: Optional[str] = None
    # 7B family (models/dit)
    qk_rope: Optional[bool] = None
    shared_qkv: bool = False
    shared_mlp: bool = False
    temporal_window_size: Optional[int] = None  # inert for the window block used by SeedVR2
    temporal_shifted: bool = False  # inert
    family: str = field(default=DIT_3B, metadata={"derived": True})

    def __post_init__(self):
        self.txt_dim = self.vid_dim if self.txt_dim is None else self.txt_dim
        self.emb_dim = 6 * self.vid_dim if self.emb_dim is None else self.emb_dim
        self.patch_size = tuple(self.patch_size) if not isinstance(self.patch_size, int) \
            else (self.patch_size,) * 3
        if isinstance(self.block_type, str):
            self.block_type = [self.block_type] * self.num_layers
        if self.window is None:
            self.window = [(4, 3, 3)] * self.num_layers
        self.window = [tuple(w) for w in self.window]
        if self.window_method is None:
            self.window_method = ["720pwin_by_size_bysize", "720pswin_by_size_bysize"] * (
                self.num_layers // 2) + ["720pwin_by_size_bysize"] * (self.num_layers % 2)
        if self.family == DIT_3B and self.rope_dim is None:
            self.rope_dim = self.head_dim // 2
        self._validate()

    def _validate(self):
        need = functools.partial(_need, self, "DiT")
        need(self.family in (DIT_3B, DIT_7B), "family", "'3b' or '7b'")
        need(self.txt_dim == self.vid_dim, "txt_dim", f"equal to vid_dim ({self.vid_dim})")
        need(self.emb_dim == 6 * self.vid_dim, "emb_dim", f"6 * vid_dim = {6 * self.vid_dim}")
        need(self.patch_size == (1, 2, 2), "patch_size", "[1, 2, 2]")
        need(isinstance(self.txt_in_dim, int), "txt_in_dim", "an int (list form is unused)")
        need(self.ada == "single", "ada", "'single'")
        need(self.norm == "fusedrms", "norm", "'fusedrms'")
        need(self.qk_norm == "fusedrms", "qk_norm", "'fusedrms'")
        need(not self.qk_bias, "qk_bias", "False")
        need(len(self.block_type) == self.num_layers and set(self.block_type) <= {"mmdit_sr"},
             "block_type", f"{self.num_layers} x 'mmdit_sr'")
        need(len(self.window) == self.num_layers, "window", f"{self.num_layers} entries")
        need(len(self.window_method) == self.num_layers
             and set(self.window_method) <= set(WINDOW_METHODS),
             "window_method", f"{self.num_layers} entries from {sorted(WINDOW_METHODS)}")
        if self.family == DIT_3B:
            need(self.mlp_type == "swiglu", "mlp_type", "'swiglu' for the 3B family")
            need(self.rope_type == "mmrope3d", "rope_type", "'mmrope3d'")
            need(self.mm_layers is not None and 0 <= self.mm_layers <= self.num_layers,
                 "mm_layers", f"an int in [0, {self.num_layers}]")
            need(self.vid_out_norm in (None, "fusedrms"), "vid_out_norm", "'fusedrms' or None")
            need(self.txt_proj_type == "linear", "txt_proj_type", "'linear'")
            need(self.patch_type == "v1", "patch_type", "'v1'")
        else:
            need(self.mlp_type == "normal", "mlp_type", "'normal' for the 7B family")
            need(self.qk_rope is True, "qk_rope", "True")
            need(not self.shared_qkv and not self.shared_mlp, "shared_qkv",
                 "False (no released 7B model shares weights)")

    @property
    def mlp_hidden_dim(self) -> int:
        if self.mlp_type == "swiglu":  # rounded to a multiple of 256 as the official SwiGLU does
            return 256 * math.ceil(int(2 * self.vid_dim * self.expand_ratio / 3) / 256)
        return self.vid_dim * self.expand_ratio

    def to_dict(self) -> dict:
        """Official constructor kwargs (JSON-serialisable), without derived fields."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("derived"):
                continue
            if self.family == DIT_3B and f.name in _ONLY_7B or \
                    self.family == DIT_7B and f.name in _ONLY_3B:
                continue
            value = getattr(self, f.name)
            out[f.name] = [list(v) for v in value] if f.name == "window" else \
                list(value) if isinstance(value, tuple) else value
        return out


WINDOW_METHODS = ("720pwin_by_size_bysize", "720pswin_by_size_bysize")


@dataclass
class VAEConfig:
    """VideoAutoencoderKL(Wrapper) constructor arguments (official names)."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple = ("DownEncoderBlock3D",) * 4
    up_block_types: tuple = ("UpDecoderBlock3D",) * 4
    block_out_channels: tuple = (128, 256, 512, 512)
    layers_per_block: int = 2
    act_fn: str = "silu"
    latent_channels: int = 16
    norm_num_groups: int = 32
    temporal_scale_num: int = 2
    inflation_mode: str = "pad"
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    spatial_downsample_factor: int = 8
    temporal_downsample_factor: int = 4
    attention: bool = True
    # Accepted, no effect on inference.
    sample_size: int = 32
    scaling_factor: float = 0.18215  # the model's own field; the pipeline uses 0.9152
    force_upcast: bool = True
    slicing_up_num: int = 0
    gradient_checkpoint: bool = False
    time_receptive_field: str = "full"
    slicing_sample_min_size: int = 4
    freeze_encoder: bool = False

    def __post_init__(self):
        self.down_block_types = tuple(self.down_block_types)
        self.up_block_types = tuple(self.up_block_types)
        self.block_out_channels = tuple(self.block_out_channels)
        n = len(self.block_out_channels)
        need = functools.partial(_need, self, "VAE")
        need(self.down_block_types == ("DownEncoderBlock3D",) * n, "down_block_types",
             f"{n} x 'DownEncoderBlock3D'")
        need(self.up_block_types == ("UpDecoderBlock3D",) * n, "up_block_types",
             f"{n} x 'UpDecoderBlock3D'")
        need(self.act_fn == "silu", "act_fn", "'silu'")
        need(self.inflation_mode == "pad", "inflation_mode", "'pad'")
        need(self.attention, "attention", "True")
        need(all(c % self.norm_num_groups == 0 for c in self.block_out_channels),
             "norm_num_groups", "a divisor of every block_out_channels entry")
        need(0 <= self.temporal_scale_num < n, "temporal_scale_num", f"in [0, {n - 1}]")
        need(self.spatial_downsample_factor == 2 ** (n - 1), "spatial_downsample_factor",
             f"2 ** (len(block_out_channels) - 1) = {2 ** (n - 1)}")
        need(self.temporal_downsample_factor == 2 ** self.temporal_scale_num,
             "temporal_downsample_factor", f"2 ** temporal_scale_num = {2 ** self.temporal_scale_num}")

    def to_dict(self) -> dict:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}


# -- resolution of user-given configs ---------------------------------------------------------

_CONFIG_FILES = {"3b": "dit_3b.json", "7b": "dit_7b.json", "vae": "vae.json"}
_IGNORED_KEYS = {"__object__"}


def configs_dir() -> Path:
    """The shipped ``configs/`` folder: in the package (wheel) or at the repository root."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[1] / "configs", here.parents[3] / "configs"):
        if candidate.is_dir():
            return candidate
    raise ConfigError(f"shipped configs/ folder not found near {here.parents[1]}")


def shipped_config(name: str) -> dict:
    if name not in _CONFIG_FILES:
        raise ConfigError(f"unknown config name {name!r}: expected one of {sorted(_CONFIG_FILES)}")
    return json.loads((configs_dir() / _CONFIG_FILES[name]).read_text())


def _as_dict(config, kind: str) -> dict:
    if isinstance(config, str):
        return shipped_config(config)
    if isinstance(config, (DiTConfig, VAEConfig)):
        return config.to_dict()
    if not isinstance(config, Mapping):
        raise ConfigError(f"{kind} config must be a dict or a shipped config name, "
                          f"got {type(config).__name__}")
    return dict(config)


def _check_keys(raw: dict, kind: str, allowed: set) -> dict:
    unknown = sorted(set(raw) - allowed - _IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"{kind} config has unknown key(s) {unknown}: no official SeedVR2 "
                          f"{kind} config has them (allowed: {sorted(allowed)})")
    return {k: v for k, v in raw.items() if k not in _IGNORED_KEYS}


def dit_family(raw: Mapping) -> str:
    """Which NaDiT family a raw config describes (by its ``__object__`` path or its keys)."""
    path = (raw.get("__object__") or {}).get("path", "") if isinstance(raw.get("__object__"),
                                                                       Mapping) else ""
    if "dit_v2" in path:
        return DIT_3B
    if path.endswith("models.dit.nadit"):
        return DIT_7B
    has3, has7 = bool(_ONLY_3B & raw.keys()), bool(_ONLY_7B & raw.keys())
    if has3 and has7:
        raise ConfigError(f"DiT config mixes 3B-only keys {sorted(_ONLY_3B & raw.keys())} "
                          f"and 7B-only keys {sorted(_ONLY_7B & raw.keys())}")
    if has3 or has7:
        return DIT_3B if has3 else DIT_7B
    raise ConfigError("DiT config does not say its family: expected 'mm_layers'/'rope_type' "
                      "(3B, models/dit_v2) or 'qk_rope' (7B, models/dit)")


def dit_config(config) -> DiTConfig:
    if isinstance(config, DiTConfig):
        return config
    raw = _as_dict(config, "DiT")
    family = dit_family(raw)
    names = {f.name for f in dataclasses.fields(DiTConfig) if not f.metadata.get("derived")}
    allowed = names - (_ONLY_7B if family == DIT_3B else _ONLY_3B)
    return DiTConfig(**_check_keys(raw, "DiT", allowed), family=family)


def vae_config(config) -> VAEConfig:
    if isinstance(config, VAEConfig):
        return config
    raw = _as_dict(config, "VAE")
    allowed = {f.name for f in dataclasses.fields(VAEConfig)}
    return VAEConfig(**_check_keys(raw, "VAE", allowed))
