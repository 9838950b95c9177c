"""The ``seedvr2`` command (also ``python -m seedvr2``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _inspect(args) -> int:
    from .loading import CheckpointError, describe

    status = 0
    for path in args.files:
        try:
            info = describe(path)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
            continue
        if args.json:
            print(json.dumps(info))
            continue
        print(info["file"])
        if info["kind"] == "dit":
            mm = f", mm_layers {info['mm_layers']}" if info["mm_layers"] is not None else ""
            print(f"  DiT, {info['family'].upper()} family: vid_dim {info['vid_dim']}, "
                  f"{info['heads']} heads x {info['head_dim']}, {info['num_layers']} layers{mm}, "
                  f"txt_in_dim {info['txt_in_dim']}, {info['mlp_type']} MLP")
        else:
            print(f"  VAE: block_out_channels {info['block_out_channels']}, "
                  f"latent_channels {info['latent_channels']}, "
                  f"norm_num_groups {info['norm_num_groups']}")
        print(f"  {info['format']}, dtype {'/'.join(info['dtypes'])}, "
              f"{info['parameters']:,} parameters in {info['tensors']} tensors")
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seedvr2", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="show the model family, size and dtype of weight files")
    p.add_argument("files", nargs="+", help="safetensors or .pth/.pt weight files")
    p.add_argument("--json", action="store_true", help="one JSON object per file")
    p.set_defaults(run=_inspect)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.run(args)
