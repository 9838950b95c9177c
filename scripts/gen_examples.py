"""Write the example workflows into example_workflows/ (editor format, API twins in api/) from
``example_workflows.py`` beside it; with ``--thumbnails`` also each template's ``<name>.jpg``.

    .venv/bin/python scripts/gen_examples.py                 # the workflows (after node changes)
    .venv/bin/python scripts/gen_examples.py --thumbnails    # and the thumbnails (minutes)

A thumbnail is the result of running its workflow in process, with the conformance kit's tiny
models (the released weights are multi-GB downloads) at THUMB_RESOLUTION on the CPU, on a
synthetic input drawn here, so the same command gives the same pictures anywhere; its JPEG
comment is ``example_workflows.thumbnail_stamp`` (tests find thumbnails older than their workflow).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from example_workflows import (EXAMPLE_IMAGE, EXAMPLE_VIDEO, EXAMPLES, THUMB_WIDTH, Example,
                               files, thumbnail_stamp, ui_workflow)

ROOT = Path(__file__).resolve().parent.parent
THUMB_RESOLUTION = 192
THUMB_INPUT_SIZE, THUMB_FRAMES = (128, 96), 9  # (width, height) of the drawn input


def _scene(t: float):
    """A small landscape (sky, sun, hills), the sun moving with ``t`` in [0, 1]: uint8 HWC."""
    import numpy as np

    width, height = THUMB_INPUT_SIZE
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    sky = np.stack([90 + 100 * y / height, 150 + 60 * y / height, 235 - 40 * y / height], -1)
    sun_x, sun_y = width * (0.25 + 0.5 * t), height * 0.3
    sun = ((x - sun_x) ** 2 + (y - sun_y) ** 2) < (height * 0.12) ** 2
    pixels = np.where(sun[..., None], np.array([255, 215, 90], np.float32), sky)
    for base, amp, freq, colour in ((0.62, 0.10, 2.0, (70, 140, 70)),
                                    (0.78, 0.07, 3.5, (40, 100, 50))):
        ridge = height * (base + amp * np.sin(freq * np.pi * x / width + 1.3 * base))
        pixels = np.where((y > ridge)[..., None], np.array(colour, np.float32), pixels)
    return pixels.clip(0, 255).astype(np.uint8)


def _thumb_inputs(folder: Path) -> None:
    """The inputs the examples load, drawn: the image and a clip (no audio)."""
    from fractions import Fraction

    import av
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_scene(0.5)).save(folder / EXAMPLE_IMAGE)
    with av.open(str(folder / EXAMPLE_VIDEO), "w") as out:
        stream = out.add_stream("libx264", rate=Fraction(24))
        stream.width, stream.height, stream.pix_fmt = *THUMB_INPUT_SIZE, "yuv444p"
        stream.options = {"crf": "0"}  # lossless: the same frames in anywhere
        for i in range(THUMB_FRAMES):
            frame = av.VideoFrame.from_ndarray(_scene(i / (THUMB_FRAMES - 1)), format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, 24)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def _tiny_models(conformance: Path, folder: Path) -> None:
    """The conformance kit's tiny 3B DiT and VAE (configs in the metadata, as the loaders
    read them) and its 64-wide text embeddings, in ``folder``."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("dit3b_tiny", "vae_tiny"):
        config = json.loads((conformance / name / "config.json").read_text())
        save_file(load_file(conformance / name / "weights.safetensors"),
                  folder / f"{name}.safetensors",
                  metadata={"config": json.dumps(config["constructor_kwargs"])})
    e2e = load_file(conformance / "pipeline" / "e2e_video_9f.safetensors")
    save_file({"pos": e2e["inputs.txt_pos"].contiguous(),
               "neg": e2e["inputs.txt_neg"].contiguous()}, folder / "text_64.safetensors")


def _thumb_sets(example: Example) -> list[str]:
    sets = []
    for node in example.nodes:
        # The CPU in fp32 on every machine: the same pictures wherever they are made.
        if node.type in ("SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel"):
            model = "dit3b_tiny" if node.type == "SeedVR2LoadDiTModel" else "vae_tiny"
            sets += [f"{node.id}.model={model}.safetensors", f"{node.id}.device=cpu",
                     f"{node.id}.dtype=fp32"]
            if node.values.get("blocks_to_swap"):
                sets.append(f"{node.id}.blocks_to_swap=2")  # the tiny DiT has 4 blocks
        elif node.type in ("SeedVR2VideoUpscaler", "SeedVR2UpscaleVideoFile",
                           "SeedVR2UpscaleVideo"):
            sets += [f"{node.id}.resolution={THUMB_RESOLUTION}", f"{node.id}.batch_size=5",
                     f"{node.id}.devices=cpu"]
    return sets


def _result_picture(path: Path):
    """The saved result as a PIL image: the image, or a video's middle frame."""
    from PIL import Image

    if path.suffix.lower() != ".mp4":
        return Image.open(path).convert("RGB")
    import av

    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return Image.fromarray(frames[len(frames) // 2])


def thumbnails(conformance: Path, folder: Path, work: Path) -> list[Path]:
    """Run every example (see above) and write ``<name>.jpg`` into ``folder``."""
    from PIL import Image

    from seedvr2.workflow.host import HeadlessHost
    from seedvr2.workflow.run import run_workflow

    models, inputs = work / "models", work / "input"
    _tiny_models(Path(conformance), models)
    _thumb_inputs(inputs)
    written = []
    for example in EXAMPLES:
        host = HeadlessHost(model_dir=models, input_dir=inputs, output_dir=work / example.name,
                            quiet=True)
        result = run_workflow(ui_workflow(example), _thumb_sets(example), host=host)
        saved = next(p for p in result.files if p.suffix.lower() in (".png", ".mp4"))
        picture = _result_picture(saved)
        height = round(THUMB_WIDTH * picture.height / picture.width)
        target = folder / f"{example.name}.jpg"
        picture.resize((THUMB_WIDTH, height), Image.Resampling.LANCZOS).save(
            target, quality=90, optimize=False, comment=thumbnail_stamp(example))
        written.append(target)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/gen_examples.py",
        description="Write the example workflows (editor format, and API twins in api/); with "
                    "--thumbnails also run each one and write its <name>.jpg thumbnail.")
    parser.add_argument("folder", nargs="?", type=Path,
                        default=ROOT / "example_workflows")
    parser.add_argument("--thumbnails", action="store_true",
                        help="run every example with the conformance kit's tiny models and "
                             "save its result as <name>.jpg")
    parser.add_argument("--conformance", type=Path,
                        default=os.environ.get("SEEDVR2_CONFORMANCE") or
                        ROOT / "tests" / "conformance",
                        help="the conformance kit folder (default: $SEEDVR2_CONFORMANCE, else "
                             "the repository's tests/conformance)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    folder = args.folder
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
        print(folder / name)
    if args.thumbnails:
        if not (args.conformance / "index.json").is_file():
            parser.error(f"--thumbnails needs the conformance kit: none at {args.conformance} "
                         f"(--conformance DIR)")
        with tempfile.TemporaryDirectory() as work:
            for path in thumbnails(args.conformance, folder, Path(work)):
                print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
