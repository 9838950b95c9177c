"""Architecture detection from tensor names and shapes alone. What the weights cannot tell (window
settings, the VAE's GroupNorm group count) takes the official default; a JSON ``config`` entry in
the file's metadata overrides everything."""

from __future__ import annotations

import re

from ..models.config import shipped_config
from .source import CheckpointError

Shapes = dict[str, tuple[int, ...]]


def model_kind(shapes: Shapes) -> str | None:
    """"dit", "vae" or None for a file that is neither (ComfyUI's folders hold other families'
    files): ``vid_in`` is SeedVR2's alone, and image VAEs (SD, SDXL, Flux) share the VAE's
    tensor names but not its 3-D (5-dimensional) convolutions."""
    if "vid_in.proj.weight" in shapes and any(k.startswith("blocks.") for k in shapes):
        return "dit"
    if len(shapes.get("encoder.conv_in.weight", ())) == 5 and "decoder.conv_out.weight" in shapes:
        return "vae"
    return None


def describe_unknown(shapes: Shapes) -> str:
    sample = ", ".join(sorted(shapes)[:4])
    return (f"not a SeedVR2 model: expected DiT keys (vid_in.proj.weight, blocks.N.attn...) or "
            f"VAE keys (encoder.conv_in.weight, decoder.conv_out.weight); found {len(shapes)} "
            f"tensors such as {sample}")


def _shape_of(shapes: Shapes, kind: str):
    """``shape(key, ndim)``: a tensor's shape, checked to have ``ndim`` non-zero dimensions."""
    def shape(key: str, ndim: int) -> tuple[int, ...]:
        if key not in shapes:
            raise CheckpointError(f"missing tensor {key!r}, which every SeedVR2 {kind} has")
        found = tuple(shapes[key])
        if len(found) != ndim or 0 in found:
            raise CheckpointError(f"tensor {key!r} has shape {list(found)}; expected {ndim} "
                                  f"non-zero dimensions")
        return found
    return shape


def detect_dit(shapes: Shapes) -> dict:
    """Constructor kwargs of the NaDiT these tensors belong to."""
    shape = _shape_of(shapes, "DiT")

    blocks = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k))})
    if blocks != list(range(len(blocks))):
        raise CheckpointError(f"DiT blocks are not numbered 0..N-1 (found {blocks[:8]}...)")
    num_layers = len(blocks)
    vid_dim, patch_in = shape("vid_in.proj.weight", 2)
    stream0 = "vid" if "blocks.0.attn.proj_qkv.vid.weight" in shapes else "all"
    head_dim = shape(f"blocks.0.attn.norm_q.{stream0}.weight", 1)[0]
    heads = shape(f"blocks.0.attn.proj_qkv.{stream0}.weight", 2)[0] // (3 * head_dim)
    swiglu = f"blocks.0.mlp.{stream0}.proj_in_gate.weight" in shapes
    hidden = shape(f"blocks.0.mlp.{stream0}.proj_in.weight", 2)[0]
    common = dict(
        vid_in_channels=patch_in // 4, vid_out_channels=shape("vid_out.proj.weight", 2)[0] // 4,
        vid_dim=vid_dim, txt_in_dim=shape("txt_in.weight", 2)[1], txt_dim=vid_dim,
        emb_dim=shape("emb_in.proj_out.weight", 2)[0], heads=heads, head_dim=head_dim,
        num_layers=num_layers, patch_size=[1, 2, 2], norm="fusedrms", norm_eps=1e-5,
        ada="single", qk_bias=False, qk_norm="fusedrms", block_type=["mmdit_sr"] * num_layers,
    )
    defaults = shipped_config("3b" if swiglu else "7b")
    windows = dict(window=[list(defaults["window"][0])] * num_layers,
                   window_method=(defaults["window_method"][:2] * num_layers)[:num_layers])
    if swiglu:
        mm_layers = next((i for i in blocks
                          if f"blocks.{i}.attn.proj_qkv.vid.weight" not in shapes), num_layers)
        ratio = next((r for r in range(1, 17)
                      if 256 * -(-int(2 * vid_dim * r / 3) // 256) == hidden), None)
        if ratio is None:
            raise CheckpointError(f"SwiGLU hidden size {hidden} matches no expand_ratio for "
                                  f"vid_dim {vid_dim}")
        freqs = shapes.get("blocks.0.attn.rope.rope.freqs")
        if freqs is not None:
            shape("blocks.0.attn.rope.rope.freqs", 1)
        # Any rope_dim with the buffer's length gives the same result when the file carries the
        # buffer (angles use its values); the official rope_dim equals head_dim.
        rope_dim = head_dim if freqs is None or (head_dim // 3) // 2 == freqs[0] else 6 * freqs[0]
        return dict(common, **windows, mlp_type="swiglu", expand_ratio=ratio,
                    mm_layers=mm_layers, rope_type="mmrope3d", rope_dim=rope_dim,
                    vid_out_norm="fusedrms" if "vid_out_norm.weight" in shapes else None,
                    txt_in_norm="fusedln", msa_type="None")
    return dict(common, **windows, mlp_type="normal", expand_ratio=hidden // vid_dim,
                qk_rope=True, shared_qkv=False, shared_mlp=False)


def detect_vae(shapes: Shapes) -> dict:
    shape = _shape_of(shapes, "VAE")
    channels = []
    while f"encoder.down_blocks.{len(channels)}.resnets.0.conv1.weight" in shapes:
        channels.append(shape(f"encoder.down_blocks.{len(channels)}.resnets.0.conv1.weight", 5)[0])
    if not channels:
        raise CheckpointError("VAE has no encoder.down_blocks.0.resnets.0.conv1.weight")
    layers = sum(1 for k in shapes if re.fullmatch(r"encoder\.down_blocks\.0\.resnets\.\d+\.conv1\.weight", k))
    # Temporal down-sampling convs have kernel depth 3; spatial-only ones have depth 1.
    temporal = sum(1 for i in range(len(channels))
                   if f"encoder.down_blocks.{i}.downsamplers.0.conv.weight" in shapes
                   and shape(f"encoder.down_blocks.{i}.downsamplers.0.conv.weight", 5)[2] == 3)
    defaults = shipped_config("vae")
    n = len(channels)
    return dict(
        in_channels=shape("encoder.conv_in.weight", 5)[1],
        out_channels=shape("decoder.conv_out.weight", 5)[0],
        latent_channels=shape("decoder.conv_in.weight", 5)[1],
        block_out_channels=channels, layers_per_block=layers,
        down_block_types=["DownEncoderBlock3D"] * n, up_block_types=["UpDecoderBlock3D"] * n,
        norm_num_groups=defaults["norm_num_groups"], temporal_scale_num=temporal,
        spatial_downsample_factor=2 ** (n - 1), temporal_downsample_factor=2 ** temporal,
        use_quant_conv="quant_conv.weight" in shapes,
        use_post_quant_conv="post_quant_conv.weight" in shapes,
        act_fn="silu", inflation_mode="pad",
    )
