"""torch.compile settings, applied per DiT block and to the VAE's encoder and decoder.

Blocks of one kind share their graphs, and BlockSwap's hooks and the window attention stay outside
them, so a new resolution recompiles once; ``fullgraph`` applies to the VAE only. A failing compile
falls back to eager with one warning; running out of memory is re-raised. CUDA-graph modes are
refused (weights move between calls). See docs/memory.md, ``compile``."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..options import OptionError

BACKENDS = ("inductor", "cudagraphs", "eager", "aot_eager")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    mode: str = "default"
    fullgraph: bool = False
    dynamic: str = "auto"  # "auto" = static first, dynamic after a shape change
    cache_size_limit: int = 64
    recompile_limit: int = 128

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise OptionError(f"compile backend {self.backend!r}: expected one of "
                              f"{', '.join(BACKENDS)}")
        if self.backend == "cudagraphs" or (self.backend == "inductor" and self.mode in CUDA_GRAPH_MODES):
            what = "compile_backend cudagraphs" if self.backend == "cudagraphs" else \
                f"compile_mode {self.mode}"
            raise OptionError(
                f"{what} records CUDA graphs, which replay fixed weight addresses: DiT blocks "
                f"share one compiled function and BlockSwap/offloading move weights to new "
                f"addresses, so the graphs would be re-recorded on every call. Use compile_mode "
                f"max-autotune-no-cudagraphs (the same kernel tuning) or default, with "
                f"compile_backend inductor")

    @classmethod
    def from_options(cls, opts) -> "CompileSettings | None":
        if not opts.compile:
            return None
        return cls(opts.compile_backend, opts.compile_mode, opts.compile_fullgraph, opts.compile_dynamic)

    def kwargs(self) -> dict:
        dynamic = {"auto": None, "true": True, "false": False}[self.dynamic]
        mode = None if self.mode == "default" or self.backend != "inductor" else self.mode
        return dict(backend=self.backend, mode=mode, fullgraph=self.fullgraph, dynamic=dynamic)


def _compile_forward(module: nn.Module, settings: CompileSettings, shared: dict):
    """Route ``module.forward`` through its class's forward compiled once per class
    (``shared``): modules of one structure (the DiT blocks) share graphs."""
    eager = module.forward
    function = type(module).forward
    if function not in shared:
        shared[function] = torch.compile(function, **settings.kwargs())
    compiled = shared[function]

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        if module._compile_failed:
            return eager(*args, **kwargs)
        try:
            return compiled(module, *args, **kwargs)
        except Exception as e:  # a compiler problem must not stop the run
            if is_out_of_memory(e):
                raise  # not a compiler problem: keep the compiled path for the next run
            module._compile_failed = True
            warnings.warn(f"torch.compile ({settings.backend}) failed for {type(module).__name__}, "
                          f"running eager: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return eager(*args, **kwargs)

    module._compile_failed = False
    module.forward = forward


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is or wraps (as Dynamo and Inductor do) an out-of-memory error."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False


def apply_compile(dit: nn.Module | None, vae: nn.Module | None, settings: CompileSettings | None):
    """Compile each DiT block's forward and the VAE encoder/decoder forwards, in place."""
    if settings is None:
        return
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                settings.cache_size_limit)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   settings.recompile_limit)
    shared: dict = {}
    if dit is not None:
        block_settings = settings
        if settings.fullgraph:
            warnings.warn("compile_fullgraph: DiT blocks break the graph at their window "
                          "attention by design, so fullgraph applies to the VAE only")
            block_settings = dataclasses.replace(settings, fullgraph=False)
        for block in dit.blocks:
            _compile_forward(block, block_settings, shared)
    if vae is not None:
        _compile_forward(vae.encoder, settings, shared)
        _compile_forward(vae.decoder, settings, shared)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`apply_compile` compiled ``module``'s forward (callbacks stay outside)."""
    return hasattr(module, "_compile_failed")
