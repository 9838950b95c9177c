"""The ``seedvr2`` command (also ``python -m seedvr2``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from .errors import InputError, SeedVR2Error
from .options import spoken_as_cli

DESCRIPTION = ("SeedVR2 one-step video and image super-resolution. Also runs as "
               "'python -m seedvr2'; 'seedvr2 COMMAND --help' explains a command.")


def _say(text: str) -> None:
    """One line of results on stdout. Printing never fails a job that succeeded: a reader that
    went away (``| head``) silences the rest (later lines and the flush at exit), as Unix tools
    do, and characters stdout's encoding lacks (``PYTHONIOENCODING=ascii``) print as '?'."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        print(text.encode(encoding, "replace").decode(encoding), flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _fail(message, status: int = 1) -> int:
    """An error line on stderr; returns the exit status to give."""
    print(f"error: {message}", file=sys.stderr)
    return status


def _inspect(args) -> int:
    from .loading import CheckpointError, describe

    status = 0
    for path in args.files:
        try:
            info = describe(path)
        except CheckpointError as e:
            status = _fail(e)
            continue
        if args.json:
            _say(json.dumps(info))
            continue
        _say(info["file"])
        if info["kind"] == "dit":
            mm = f", mm_layers {info['mm_layers']}" if info["mm_layers"] is not None else ""
            _say(f"  DiT, {info['family'].upper()} family: vid_dim {info['vid_dim']}, "
                 f"{info['heads']} heads x {info['head_dim']}, {info['num_layers']} layers{mm}, "
                 f"txt_in_dim {info['txt_in_dim']}, {info['mlp_type']} MLP")
        else:
            _say(f"  VAE: block_out_channels {info['block_out_channels']}, "
                 f"latent_channels {info['latent_channels']}, "
                 f"norm_num_groups {info['norm_num_groups']}")
        _say(f"  {info['format']}, dtype {'/'.join(info['dtypes'])}, "
             f"{info['parameters']:,} parameters in {info['tensors']} tensors")
    return status


def _quantize(args) -> int:
    from .loading.weight_files import CheckpointError
    from .loading.quantize import quantize_file

    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(unit="tensor", desc=f"{args.type:>10}")

    def progress(done: int, total: int):
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    try:
        summary = quantize_file(args.input, args.output, args.type, keep=args.keep,
                                overwrite=args.overwrite, progress=progress)
    except (CheckpointError, ValueError, FileExistsError) as e:
        return _fail(e)
    finally:
        if bar is not None:
            bar.close()
    if not args.quiet:
        _say(f"{summary.output}: {summary.kind.upper()} as {summary.target}, "
             f"{summary.quantized} tensors quantised, {summary.kept} kept; "
             f"{summary.input_bytes / 2**20:,.0f} MiB -> {summary.output_bytes / 2**20:,.0f} MiB")
    return 0


# Videos a folder input picks up besides the kinds we write (and BMP, which we only read).
_READ_ONLY_VIDEOS = {".avi", ".ts", ".gif"}


def _output_suffix(src: Path) -> str:
    """One rule for files and folders: kinds we write keep theirs; other videos MP4, BMP PNG."""
    from .io import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS

    ext = src.suffix.lower()
    if ext in VIDEO_EXTENSIONS or ext in IMAGE_EXTENSIONS and ext != ".bmp":
        return src.suffix
    return ".png" if ext == ".bmp" else ".mp4"


def _default_output(src, resolution: int) -> str:
    """NAME_seedvr2_<resolution>p.EXT by the input; a sequence: a PNG folder beside its folder."""
    from .io.reader import is_sequence_pattern

    src = Path(src)
    if is_sequence_pattern(src):
        folder = src.parent.resolve()
        return f"{folder.with_name(f'{folder.name}_seedvr2_{resolution}p')}{os.sep}"
    return str(src.with_name(f"{src.stem}_seedvr2_{resolution}p{_output_suffix(src)}"))


def _folder_jobs(src: Path, output: str | None) -> tuple[Path, list[tuple[Path, Path]]]:
    """The output folder and (input, output) pairs of a folder input; InputError when there is
    nothing to do, the output folder is a file, or two inputs would write one output."""
    from .io import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS

    media = VIDEO_EXTENSIONS.keys() | IMAGE_EXTENSIONS.keys() | _READ_ONLY_VIDEOS
    inputs = sorted(p for p in src.iterdir() if p.suffix.lower() in media
                    and not p.name.startswith(".") and p.is_file())  # hidden: our temporaries
    if not inputs:
        raise InputError(f"{src}: no video or image files in this folder (for an image "
                         f"sequence give a pattern such as {src}{os.sep}%05d.png)")
    out_dir = Path(output) if output else src.with_name(src.name + "_seedvr2")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} is a file; a folder input writes one output per file "
                         f"into a folder: give -o a folder path")
    jobs = [(p, out_dir / f"{p.stem}{_output_suffix(p)}") for p in inputs]
    targets: dict[Path, Path] = {}
    for source, target in jobs:
        if target in targets:
            raise InputError(f"{targets[target].name} and {source.name} would both be written "
                             f"to {target}; rename one of them")
        targets[target] = source
    return out_dir, jobs


@contextlib.contextmanager
def _warnings_as_messages():
    """Library warnings as one line each, like the errors (not Python's file:line and source);
    each text once, though the files are checked before the models load and opened again."""
    import warnings

    shown = set()

    def show(message, category, filename, lineno, file=None, line=None):
        if str(message) not in shown:
            shown.add(str(message))
            print(f"warning: {message}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


class _Terminated(BaseException):
    """SIGTERM (timeout, docker stop, Slurm) raised in the main thread, so every open writer
    unwinds and removes its temporary output exactly as for Ctrl-C."""


@contextlib.contextmanager
def _sigterm_unwinds():
    def handler(signum, frame):
        raise _Terminated()
    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (the CLI called from a thread): leave it be
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Bars:
    """tqdm bars per phase plus overall frames; silent with --quiet. When stderr is no terminal
    (a log file, a pipe), where cursor movements are garbage, plain lines (_PlainProgress)."""

    LABELS = {"encode": "VAE encode", "dit": "DiT", "decode": "VAE decode", "frames": "frames"}

    def __init__(self, enabled: bool):
        self.enabled, self.bars = enabled, {}
        self.plain = _PlainProgress(sys.stderr) if enabled and not sys.stderr.isatty() else None

    def __call__(self, phase: str, done: int, total: int):
        if not self.enabled:
            return
        if self.plain is not None:
            self.plain(phase, done, total)
            return
        from tqdm import tqdm

        bar = self.bars.get(phase)
        if bar is None or bar.total != total:
            bar = self.bars[phase] = tqdm(total=total, desc=f"{self.LABELS.get(phase, phase):>10}",
                                          position=len(self.bars), leave=phase == "frames",
                                          unit=_unit(phase, 1))
        bar.update(done - bar.n)

    def close(self):
        for bar in self.bars.values():
            bar.close()
        self.bars = {}
        if self.plain is not None:
            self.plain.close()


def _unit(phase: str, count: int) -> str:
    return ("frame" if phase == "frames" else "batch") + \
        ("" if count == 1 else "s" if phase == "frames" else "es")


class _PlainProgress:
    """A line per phase as its run of batches ends, one when all frames are out, with time left."""

    def __init__(self, stream):
        import time

        self.clock = time.monotonic
        self.stream, self.pending = stream, None  # pending: the phase running, not yet written
        self.start = self.clock()

    def __call__(self, phase: str, done: int, total: int):
        if phase == "frames":  # interleaved with decode; only the end is worth a line
            if done >= total:
                self.close()
                self._line(phase, done, total)
            return
        if self.pending is not None and self.pending[0] != phase:
            self._line(*self.pending)
        self.pending = (phase, done, total)

    def close(self):
        if self.pending is not None:
            self._line(*self.pending)

    def _line(self, phase: str, done: int, total: int):
        self.pending = None
        left = (self.clock() - self.start) / done * (total - done) if 0 < done < total else 0
        print(f"{_Bars.LABELS.get(phase, phase)}: {done}/{total} {_unit(phase, total)}"
              f"{f', about {left:.0f} s left' if left else ''}", file=self.stream, flush=True)


def _summary(path: Path, stats, seconds: float) -> str:
    """Frames, speed, batch size, per phase time and memory peaks, overall peaks, the estimate."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    device = f", peak device memory {stats.peak_device_bytes / 2**20:,.0f} MiB" \
        if stats.peak_device_bytes else ""
    estimate = "".join(f", estimated {n / 2**20:,.0f} MiB on {d}" for d, n in stats.estimated_bytes.items()
                       if d.startswith("cuda"))
    fps = stats.frames / seconds if seconds else 0.0
    batch = f"batch_size {stats.batch_size}{' (auto)' if stats.batch_size_auto else ''}; " \
        if stats.batch_size else ""
    batch += _reuse(stats) + _cuts(stats)
    return (f"{path}: {stats.frames} frames in {seconds:.1f}s ({fps:.2f} frames/s); {batch}"
            f"{stats.describe_phases()}; peak RSS {rss:,.0f} MiB{device}{estimate}")


def _reuse(stats) -> str:
    return f"{stats.batches_reused} of {stats.batches_total} batches reused from a previous " \
           f"run; " if stats.batches_total else ""


def _cuts(stats) -> str:
    from .pipeline.cuts import describe_cuts

    return "" if stats.scene_cuts is None else describe_cuts(stats.scene_cuts) + "; "


def _ranks_summary(path: Path, stats, seconds: float) -> str:
    """Several processes: frames and time (the writer's), batches reused, ranks lost."""
    lost = ", ".join(f"rank {r} ({'killed by signal ' + str(-c) if c < 0 else f'exit code {c}'})"
                     for r, c in sorted(stats.ranks_lost.items()))
    lost = f"; without {lost} from then on: the others computed its batches" if lost else ""
    frames = f"{stats.frames} frames in " if stats.frames else "done in "
    return f"{path}: {frames}{seconds:.1f}s; {_reuse(stats)}{_cuts(stats)}".rstrip("; ") + lost


def _upscale(args) -> int:
    from .options import OPTIONS, OptionError, resolve_options

    try:  # once: the facade takes these, resolved
        opts = resolve_options(**{name: getattr(args, name) for name in OPTIONS
                                  if getattr(args, name) is not None})
    except OptionError as e:
        return _fail(e, 2)
    src = Path(args.input)
    made_folder = None  # the topmost folder this run created: removed again if left empty
    if src.is_dir():
        try:
            out_dir, jobs = _folder_jobs(src, args.output)
        except (ValueError, OSError) as e:
            return _fail(e, 2)
        if not out_dir.is_dir():
            made_folder = out_dir
            while not made_folder.parent.exists():
                made_folder = made_folder.parent
            try:
                out_dir.mkdir(parents=True)
            except OSError as e:
                _remove_empty_folders(out_dir, made_folder)
                return _fail(f"cannot create the output folder {out_dir}: {e.strerror or e}")
    else:
        # A string keeps a trailing "/" (a PNG sequence folder), which Path would drop.
        jobs = [(src, args.output or _default_output(src, opts.resolution))]
    try:
        with _sigterm_unwinds(), _warnings_as_messages():
            if args.dry_plan:
                return _dry_plan(opts, jobs, args.dit)
            return _upscale_jobs(args, opts, jobs)
    finally:
        if made_folder is not None:  # every input failed: leave no empty folder behind
            _remove_empty_folders(out_dir, made_folder)


def _dry_plan(opts, jobs: list, dit) -> int:
    from .loading.registry import DEFAULT_DIT, KNOWN_FILES
    from .pipeline.cuts import describe_file_plan

    known = KNOWN_FILES.get(Path(dit or DEFAULT_DIT).name)
    family = known.family if known is not None else "7b" if "7b" in str(dit).lower() else "3b"
    for source, _ in jobs:
        try:
            _say(describe_file_plan(source, opts, family))
        except (ValueError, OSError) as e:
            return _fail(e)
    return 0


def _remove_empty_folders(folder: Path, top: Path) -> None:
    """Remove ``folder`` and its parents up to ``top`` (all created by this run) while empty."""
    with contextlib.suppress(OSError):  # rmdir fails on a folder that holds anything
        while True:
            folder.rmdir()
            if folder == top:
                return
            folder = folder.parent


def _what_was_kept(target) -> str:
    """A stopped job's message end: no half-written output; a file job's verified pieces kept."""
    from .io.temporaries import RESUME_JOURNAL, resume_folder

    if target is not None and (resume_folder(target) / RESUME_JOURNAL).is_file():
        return (f"the output was not written; its finished pieces are kept in "
                f"{resume_folder(target)}: run the same command again to continue")
    return "the output was not written and nothing was kept"


def _upscale_jobs(args, opts, jobs: list) -> int:
    bars = _Bars(not args.quiet)
    reached = []  # the outputs in turn: a signal stops the job of the last one
    try:
        runnable, failed = _checked_jobs(args, opts, jobs, reached)
        if runnable:
            failed += _run_jobs(args, opts, runnable, bars, reached)
    except (SeedVR2Error, ValueError) as e:
        bars.close()
        return _fail(e)
    except (KeyboardInterrupt, _Terminated) as e:
        bars.close()
        interrupted = isinstance(e, KeyboardInterrupt)
        print(f"{'interrupted' if interrupted else 'terminated (SIGTERM)'}; "
              f"{_what_was_kept(reached[-1] if reached else None)}", file=sys.stderr)
        return 130 if interrupted else 128 + signal.SIGTERM
    return _report_failures(failed, jobs)


def _checked_jobs(args, opts, jobs: list, reached: list) -> tuple[list, list]:
    """(the jobs that can run, the inputs that cannot), before the models load (a wrong path
    costs no loading); a bad file in a folder is reported and the others still run."""
    from .api import check_file_job

    runnable, failed = [], []
    for source, target in jobs:
        reached.append(target)
        try:
            check_file_job(source, target, opts, args.codec, args.overwrite,
                           [s for s, _ in jobs])
        except (ValueError, OSError) as e:
            _fail(e)
            failed.append(source)
        else:
            runnable.append((source, target))
    return runnable, failed


def _run_jobs(args, opts, runnable: list, bars, reached: list) -> list:
    """Upscale the checked jobs in turn, a summary line each; returns the inputs that failed."""
    import time

    from .api import load_models, process_devices, upscale_file
    from .distributed import in_distributed_launch
    from .pipeline.runner import JobStats

    # One process: models load once for all inputs. Several: each worker loads its own.
    several = in_distributed_launch() or len(process_devices(opts, args.dit, args.vae)[0]) > 1
    dit, vae = args.dit, args.vae
    if not several:
        models = load_models(dit, vae, opts=opts, model_dir=args.model_dir)
        dit, vae = models.dit, models.vae
    failed = []
    for source, target in runnable:
        reached.append(target)
        stats, start = JobStats(), time.perf_counter()
        try:
            out = upscale_file(source, target, dit, vae, model_dir=args.model_dir,
                               overwrite=args.overwrite, codec=args.codec, progress=bars,
                               stats=stats, opts=opts)
        except (ValueError, OSError, RuntimeError) as e:
            bars.close()
            _fail(e)
            failed.append(source)
            continue
        bars.close()
        if not args.quiet and out is not None:
            summary = _ranks_summary if several else _summary
            _say(summary(out, stats, time.perf_counter() - start))
    return failed


def _report_failures(failed: list, jobs: list) -> int:
    """The exit status; with several inputs, a last line naming the ones that failed."""
    if failed and len(jobs) > 1:
        written = "; the others were written" if len(failed) < len(jobs) else ""
        print(f"error: {len(failed)} of {len(jobs)} inputs failed: "
              f"{', '.join(p.name for p in failed)}{written}", file=sys.stderr)
    return 1 if failed else 0


def _run_workflow(args) -> int:
    from .workflow.errors import WorkflowError, WorkflowInterrupted
    from .workflow.host import HeadlessHost
    from .workflow.run import run_workflow

    host = HeadlessHost(model_dir=args.model_dir, input_dir=args.input_dir,
                        output_dir=args.output_dir, quiet=args.quiet)
    try:
        result = run_workflow(args.workflow, args.set or (), host=host, server=args.server,
                              timeout=args.timeout)
    except WorkflowInterrupted as e:
        return _fail(e, 130)
    except WorkflowError as e:
        return _fail(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if not args.quiet:
        for path in result.files:
            _say(str(path))
    return 0


def _number(kind, auto: bool = False):
    """An argparse type: a plain decimal ``kind`` (options.plain_number), or with ``auto`` auto."""
    from .options import plain_number

    def parse(text: str):
        return "auto" if auto and text.strip().lower() == "auto" else plain_number(kind, text)
    # argparse names it in its error message: "invalid int or auto value: 'lots'"
    parse.__name__ = kind.__name__ + (" or auto" if auto else "")
    return parse


MODEL_FILES_HELP = (
    "Model files: a DiT (default {dit}) and a VAE (default {vae}) in the model folder: "
    "--model-dir, else $SEEDVR2_MODEL_DIR, else ~/.cache/seedvr2/models (ComfyUI: "
    "models/SEEDVR2). Registered files that are missing are downloaded there (sha256-checked); "
    "a path to any other weight file works too. The official text embeddings come with the "
    "package.")


# Short placeholders keep each flag on one help line.
METAVARS = {int: "N", float: "X", str: "VALUE"}


def _option_flag(group, opt):
    kwargs = dict(default=None, help=f"{opt.help} (default: {opt.default})")
    if opt.type is not bool and not opt.choices:
        kwargs["metavar"] = METAVARS[opt.type]
    if opt.type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif opt.accepts_auto:
        kwargs["type"] = _number(opt.type, auto=True)
    else:
        kwargs["type"] = _number(opt.type) if opt.type in (int, float) else opt.type
        if opt.choices:
            kwargs["choices"] = opt.choices
    group.add_argument(opt.flag, dest=opt.name, **kwargs)


def _add_upscale_flags(parser: argparse.ArgumentParser):
    """By the option table's areas; the flags that are no option join theirs (files, models)."""
    from .loading.registry import DEFAULT_DIT, DEFAULT_VAE
    from .options import AREAS, OPTIONS

    groups = {area: parser.add_argument_group(area) for area in AREAS}
    files = groups["input and output"]
    files.add_argument("input", help="video, image, sequence pattern or folder")
    files.add_argument("-o", "--output", metavar="PATH", help="output file (or folder for a folder input); "
                       "default: INPUT_seedvr2_<resolution>p next to the input")
    files.add_argument("--codec", choices=("h264", "h265", "vp9"), default="h264",
                       help="video codec: h264 (8-bit), h265 (10-bit) or vp9 (keeps alpha in "
                       ".mkv); .webm outputs are always VP9")
    files.add_argument("--overwrite", action="store_true", help="replace an existing output")
    files.add_argument("--dry-plan", action="store_true",
                       help="print the scene cuts, batches, work and time estimate; load no model")
    models = groups["models"]
    models.description = MODEL_FILES_HELP.format(dit=DEFAULT_DIT, vae=DEFAULT_VAE)
    models.add_argument("--dit", metavar="FILE", help="DiT: registered file name (looked up in "
                        "--model-dir) or path")
    models.add_argument("--vae", metavar="FILE", help="VAE: registered file name or path")
    models.add_argument("--model-dir", metavar="FOLDER", help="folder with the model files")
    for area, names in AREAS.items():
        for name in names:
            _option_flag(groups[area], OPTIONS[name])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seedvr2", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (_add_inspect, _add_quantize, _add_upscale, _add_run_workflow):
        add_command(sub)
    return parser


def _add_quiet_verbose(p: argparse.ArgumentParser, quiet_help: str) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help=quiet_help)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging")


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="show the model family, size and dtype of weight files")
    p.add_argument("files", nargs="+", help="safetensors or .pth/.pt weight files")
    p.add_argument("--json", action="store_true", help="one JSON object per file")
    p.set_defaults(run=_inspect)


def _add_quantize(sub) -> None:
    p = sub.add_parser("quantize", help="convert a weight file to GGUF, fp8, int8, mxfp8 or nvfp4 "
                       "(small tensors, norms, biases and in/out projections stay unquantised)",
                       description="Convert a weight file to GGUF, fp8, int8, mxfp8 or nvfp4. "
                       "The safetensors types are ComfyUI's layouts, written for what ComfyUI "
                       "computes in them: the DiT's linear layers. A VAE is refused for them "
                       "(ComfyUI builds the SeedVR2 VAE with manual_cast, which reads no "
                       "comfy_quant marker): keep it in fp16, or use a GGUF type, which this "
                       "loader reads. A file holding NaN or infinite values is refused.")
    p.add_argument("input", help="any weight file the loader reads (safetensors, .pth, GGUF)")
    p.add_argument("output", help="output file: .gguf for the GGUF types, .safetensors otherwise")
    p.add_argument("--type", required=True,
                   help="Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/BF16/F16 (GGUF), fp8_e4m3fn/fp8_e5m2 "
                        "(per-tensor scale), int8 (per-output-channel scale), int8_convrot "
                        "(int8 of Hadamard-rotated weights), mxfp8 (e4m3, a power-of-two scale "
                        "per 32) or nvfp4 (e2m1, an e4m3 scale per 16): the safetensors types "
                        "in ComfyUI's layouts, for DiTs only")
    p.add_argument("--keep", action="append", default=[], metavar="PREFIX",
                   help="keep tensors under this key prefix unquantised, e.g. blocks.35 "
                        "(repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(run=_quantize)


def _add_upscale(sub) -> None:
    summary = ("upscale a video, an image, an image sequence (pattern like frames/%05d.png) "
               "or every media file in a folder")
    # The help line is %-formatted by argparse, the description is not.
    p = sub.add_parser("upscale", help=summary.replace("%", "%%"),
                       usage="%(prog)s [options] input",
                       description=summary[0].upper() + summary[1:] + ". The flags are grouped "
                       "by area; 'models' says which files are needed and where they go.")
    _add_quiet_verbose(p, "no progress bars or summary")
    _add_upscale_flags(p)
    p.set_defaults(run=_upscale)


def _add_run_workflow(sub) -> None:
    p = sub.add_parser("run-workflow", help="run a ComfyUI workflow (editor or API format) "
                       "without the editor: in this process, or on a running ComfyUI server")
    p.add_argument("workflow", help="workflow .json (as saved by the editor, or API format)")
    p.add_argument("--set", action="append", metavar="NODE.INPUT=VALUE",
                   help="override an input; NODE is a node id, title or type; VALUE is JSON or "
                   "a string (repeatable), e.g. --set 3.resolution=1440")
    p.add_argument("--server", metavar="URL", help="run on this ComfyUI server (e.g. "
                   "http://127.0.0.1:8188) and download its outputs")
    p.add_argument("--model-dir", help="model folder for in-process runs (default: "
                   "$SEEDVR2_MODEL_DIR or ~/.cache/seedvr2/models)")
    p.add_argument("--input-dir", default=".", help="where LoadImage/LoadVideo file names are "
                   "found in-process, and where --server uploads missing inputs from (default: "
                   "the current folder)")
    p.add_argument("--output-dir", default="output", help="where outputs are saved or "
                   "downloaded (default: ./output)")
    p.add_argument("--timeout", type=float, help="with --server: give up after this many seconds")
    _add_quiet_verbose(p, "no progress bars or file list")
    p.set_defaults(run=_run_workflow)


def main(argv=None) -> int:
    # Help and messages name options as this command's flags (--batch-size, not batch_size).
    with spoken_as_cli():
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else
                            logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
        # huggingface_hub prints through a handler of its own; passed on to ours as well,
        # every line of it would appear twice.
        logging.getLogger("huggingface_hub").propagate = False
    try:
        if args.command == "run-workflow":  # its messages name node inputs, not our flags
            return args.run(args)
        with spoken_as_cli():
            return args.run(args)
    except SeedVR2Error as e:  # a refusal no command caught on its way: still one line
        return _fail(e)
