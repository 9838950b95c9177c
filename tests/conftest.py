"""Shared test fixtures. The conformance kit (``tests/conformance``, or ``$SEEDVR2_CONFORMANCE``)
is the contract: when it is missing the session stops at start with one error, instead of every
test failing or skipping on its own."""

from __future__ import annotations

import json
import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # example_workflows: the examples, described once


def custom_node_import(folder: Path) -> str:
    """Python code importing ``folder`` as ComfyUI imports a custom-node folder: the package
    is ``module``, its name ``spec.name``."""
    return (f"import importlib, importlib.util, sys\n"
            f"path = {str(folder)!r}\n"
            f"name = path.replace('.', '_x_')  # as ComfyUI's load_custom_node names it\n"
            f"spec = importlib.util.spec_from_file_location(name, path + '/__init__.py')\n"
            f"module = importlib.util.module_from_spec(spec)\n"
            f"sys.modules[spec.name] = module\n"
            f"spec.loader.exec_module(module)\n")


VENDORED_CONFORMANCE = REPO / "tests" / "conformance"


def conformance_dir() -> Path:
    """The conformance kit: ``$SEEDVR2_CONFORMANCE`` when set, else the copy in the repository."""
    return Path(os.environ.get("SEEDVR2_CONFORMANCE") or VENDORED_CONFORMANCE)


def pytest_configure(config):
    # Checked once, before collection: without the kit nearly every test would fail, each with
    # the same message.
    path = conformance_dir()
    if not (path / "index.json").is_file():
        source = "$SEEDVR2_CONFORMANCE" if os.environ.get("SEEDVR2_CONFORMANCE") else \
            "the repository's copy"
        raise pytest.UsageError(
            f"conformance kit not found at {path} ({source}; expected index.json there). "
            f"A complete checkout has it in tests/conformance; unset SEEDVR2_CONFORMANCE or "
            f"point it at a kit folder")
    _share_the_cores()


def _share_the_cores():
    """In one of several test processes (pytest-xdist), torch here gets its share of the cores:
    two processes of two threads on two cores spin against each other. Only this process: the
    jobs tests spawn keep torch's default threads (test_determinism relies on that), and tests
    that compare thread counts pin them (``torch_threads``)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


@pytest.fixture(scope="session")
def conformance() -> Path:
    return conformance_dir()


@pytest.fixture
def torch_threads(request):
    """The test runs with torch on ``request.param`` CPU threads (parametrize it indirectly):
    comparisons whose summation order depends on the thread count pin the counts they are
    checked at, whatever OMP_NUM_THREADS the suite runs with."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def load_case(family_dir: Path, name: str) -> dict:
    return load_file(family_dir / "cases" / f"{name}.safetensors")


def dit_output(model, case: dict):
    """A DiT's output on a conformance case's inputs."""
    import torch

    with torch.no_grad():
        return model(case["inputs.vid"], case["inputs.txt"], case["inputs.vid_shape"],
                     case["inputs.txt_shape"], case["inputs.timestep"])


def relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------------------------------------
# float tolerances
#
# Two evaluations of the same maths (chunked or not, 1 or 2 threads, AVX2 or AVX-512, another
# kernel or implementation) differ only in the order their sums are rounded. Each rounding errs
# by at most u·|partial sum| (u = eps/2, the unit roundoff of the dtype) with a random sign, so
# the errors add in quadrature: over a sum of n terms and L such sums in sequence, about
# sqrt(n·L)·u·M, M being the magnitude of the values (we take max|reference|, an upper bound
# of the typical partial sum). ROUNDING_SIGMAS = λ = 4 standard deviations (Higham & Mary 2019,
# "A new approach to probabilistic rounding error analysis": exceeded with probability at most
# 2·exp(-λ²/2) ≈ 7e-4 per output even if every partial sum were as large as M; most are far
# smaller, so the measured errors sit 30-300x below these bounds). A real defect (a wrong frame
# in a cache, a dropped tile, a mis-scaled weight) is at least 1e-2 of M, far above them.

ROUNDING_SIGMAS = 4


def rounding_bound(reference, *, terms: int, layers: int = 1, dtype=None) -> float:
    """Largest |difference| expected between two roundings of the same computation (see
    above). ``reference``: a tensor (its max |value| is M) or M itself; ``terms``: the length
    of the longest sum behind one output; ``layers``: how many such sums are chained; ``dtype``:
    the precision the sums round in (default: the reference's, float32 for a number)."""
    import torch

    if isinstance(reference, torch.Tensor):
        dtype = dtype or reference.dtype
        reference = reference.detach().abs().max().float().item()
    u = torch.finfo(dtype or torch.float32).eps / 2
    return ROUNDING_SIGMAS * (terms * layers) ** 0.5 * u * reference


def sum_lengths(model) -> tuple[int, int]:
    """(terms, layers) of a network for :func:`rounding_bound`: the longest sum one of its
    convolutions or linear layers computes (inputs x kernel size), and how many it has."""
    import torch

    lengths = [m.weight[0].numel() for m in model.modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d))]
    return max(lengths), len(lengths)


def network_bound(module, reference) -> float:
    """:func:`rounding_bound` for an output of ``module`` (its convolutions and linear layers
    give the sum length and the layer count)."""
    terms, layers = sum_lengths(module)
    return rounding_bound(reference, terms=terms, layers=layers)


def dit_sum_lengths(model, case: dict) -> tuple[int, int]:
    """(terms, layers) of a DiT call on ``case``: its linear layers, and per block two
    attention sums (scores over head_dim, then over keys: at most every video token of the
    call, patched 2x2, plus the text tokens)."""
    terms, layers = sum_lengths(model)
    keys = len(case["inputs.vid"]) // 4 + len(case["inputs.txt"])
    return max(terms, keys), layers + 2 * len(model.blocks)


def dit_bound(model, case: dict, reference) -> float:
    """:func:`rounding_bound` for a DiT output (or a tap inside it) on ``case``: 1e-4 to 7e-4
    for the tiny DiTs' cases (magnitudes 3.6-5.1); an independent port measured <= 2.2e-6
    against the goldens (conformance README section 10)."""
    terms, layers = dit_sum_lengths(model, case)
    return rounding_bound(reference, terms=terms, layers=layers)


def low_precision_bound(dtype, layers: int) -> float:
    """rel-L2 bound of a bf16/fp16 run against float32 through ``layers`` layers. CPU kernels
    accumulate in float32, so per layer the error is two roundings to the low precision, each
    of relative rms at most u (unit roundoff, eps/2): the weights' (averaged over a sum it stays
    ~u of the output) and the output's. Independent across layers they add in quadrature:
    2·sqrt(layers)·u; rel-L2 is itself an rms, so no further margin is added. A structural or
    casting bug gives O(1) errors."""
    import torch

    return 2 * layers ** 0.5 * torch.finfo(dtype).eps / 2


def constructor_kwargs(family_dir: Path) -> dict:
    return json.loads((family_dir / "config.json").read_text())["constructor_kwargs"]


@pytest.fixture(scope="session")
def tiny_model_dir(conformance, tmp_path_factory) -> Path:
    """A model folder holding the tiny 3B DiT, the tiny VAE (with their configs in the metadata)
    and 64-wide text embeddings: what the pipeline tests load by path."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("models")
    for name in ("dit3b_tiny", "vae_tiny"):
        save_file(load_file(conformance / name / "weights.safetensors"), folder / f"{name}.safetensors",
                  metadata={"config": json.dumps(constructor_kwargs(conformance / name))})
    e2e = load_file(conformance / "pipeline" / "e2e_video_9f.safetensors")
    save_file({"pos": e2e["inputs.txt_pos"].contiguous(), "neg": e2e["inputs.txt_neg"].contiguous()},
              folder / "text_64.safetensors")
    return folder


@pytest.fixture(scope="session")
def tiny_options(tiny_model_dir) -> dict:
    """Options + model arguments for upscaling with the tiny models on the CPU in fp32."""
    return dict(dit=str(tiny_model_dir / "dit3b_tiny.safetensors"),
                vae=str(tiny_model_dir / "vae_tiny.safetensors"), model_dir=tiny_model_dir,
                device="cpu", dtype="fp32")


# ---------------------------------------------------------------------------------------------
# generated media

W, H, FPS, N = 64, 48, Fraction(30000, 1001), 60  # 2 seconds at 29.97 fps
SAMPLE_RATE = 48000


def clip_frame(i: int) -> np.ndarray:
    """A frame that shows its own index: brightness ramps and a white column moves."""
    frame = np.zeros((H, W, 3), np.uint8)
    frame[..., 0] = 4 * i
    frame[..., 2] = np.linspace(0, 255, W, dtype=np.uint8)
    frame[:, i % W, 1] = 255
    return frame


def make_clip(path: Path, *, container_format: str | None = None, frames: int = N) -> None:
    """H.264 (12-frame GOPs with B-frames, so seeking really seeks) + mono AAC sine."""
    import av

    with av.open(str(path), "w", format=container_format) as out:
        video = out.add_stream("libx264", rate=FPS)
        video.width, video.height, video.pix_fmt = W, H, "yuv420p"
        video.codec_context.gop_size = 12
        video.options = {"crf": "23", "x264-params": "scenecut=0:min-keyint=12"}
        audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(clip_frame(i), format="rgb24")
            frame.pts, frame.time_base = i, 1 / FPS
            out.mux(video.encode(frame))
        total = int(frames / FPS * SAMPLE_RATE)
        t = np.arange(total) / SAMPLE_RATE
        samples = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        for start in range(0, total, 1024):
            chunk = av.AudioFrame.from_ndarray(samples[None, start:start + 1024], format="flt",
                                               layout="mono")
            chunk.sample_rate, chunk.pts, chunk.time_base = SAMPLE_RATE, start, \
                Fraction(1, SAMPLE_RATE)
            out.mux(audio.encode(chunk))
        out.mux(video.encode(None))
        out.mux(audio.encode(None))


def integer_step_error(levels: int, block: int) -> float:
    """Relative rms error of one weight quantised to integers with the scale absmax / ``levels``
    shared by ``block`` weights: the rounding error is uniform over one step (rms step/sqrt(12))
    and the absmax of ``block`` Gaussian weights is below sqrt(2 ln(2 block)) of their rms."""
    import math

    return math.sqrt(2 * math.log(2 * block)) / (levels * math.sqrt(12))


def float_step_error(mantissa_bits: int) -> float:
    """Relative rms error of one weight rounded to a float format with ``mantissa_bits``: uniform
    within half a unit in the last place, 2^-(m+1), so rms 2^-(m+1)/sqrt(3) (values scaled into
    the format's normal range)."""
    return 2.0 ** -(mantissa_bits + 1) / 3 ** 0.5


def quantization_bound(weight_errors) -> float:
    """rel-L2 bound of a network's output when its quantised layers have weights with these
    relative rms errors (one entry per layer): a layer's output errs by about the same relative
    rms (the weight errors are independent, so over a sum they average like the weights do),
    and independent layers add in quadrature: sqrt(sum of squares). Measured errors are about
    half of one layer's (the residual stream dilutes each layer's share), so the bound is loose
    but derived; a decoding bug (wrong scale, nibble order, block layout) gives O(1)."""
    return sum(e * e for e in weight_errors) ** 0.5


def import_pack(name: str):
    """The pack's nodes.py, imported in this process as ComfyUI imports the folder (a package
    named ``name``), outside ComfyUI."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return sys.modules[f"{name}.nodes"]


def import_pack_beside(tmp_path: Path, registered: str, other_dirs: dict = None):
    """Import the pack as ComfyUI's classic path does (no comfy_api), from
    ``custom_nodes/ComfyUI-SeedVR2``, after ComfyUI has registered nodes: ``registered`` is
    Python run first, setting ``nodes.NODE_CLASS_MAPPINGS`` on the stand-in ``nodes`` module;
    ``other_dirs`` are other packs' folders (``LOADED_MODULE_DIRS``). Returns the pack folder
    and the finished process (its stderr holds the warnings the import logged)."""
    import subprocess
    import sys
    import textwrap

    ours = tmp_path / "custom_nodes" / "ComfyUI-SeedVR2"
    ours.parent.mkdir()
    ours.symlink_to(REPO, target_is_directory=True)
    dirs = {**{name: str(path) for name, path in (other_dirs or {}).items()},
            "ComfyUI-SeedVR2": str(ours)}
    code = textwrap.dedent(f"""
        import importlib.util, logging, sys, types
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        folder_paths = types.ModuleType("folder_paths")
        folder_paths.models_dir = {str(tmp_path / "models")!r}
        folder_paths.add_model_folder_path = lambda *args, **kwargs: None
        sys.modules["folder_paths"] = folder_paths
        nodes = types.ModuleType("nodes")
    """) + textwrap.dedent(registered) + textwrap.dedent(f"""
        nodes.LOADED_MODULE_DIRS = {dirs!r}
        sys.modules["nodes"] = nodes
        path = {str(ours)!r}
        spec = importlib.util.spec_from_file_location(path.replace(".", "_x_"),
                                                      path + "/__init__.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    """)
    return ours, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                cwd="/")


# ---------------------------------------------------------------------------------------------
# Hypothesis profiles for the property-based hostile tests (tests/hostile.py has their helpers).
# "ci", the default: few, small, derandomized examples, so a run is repeatable and the suite
# stays within CI's time. "long" (HYPOTHESIS_PROFILE=long): many random examples, for runs
# outside CI that look for new failures.

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=20, derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large])
settings.register_profile(
    "long", max_examples=1000, derandomize=False, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
