"""(first draft, replaced below)"""
from __future__ import annotations

import contextlib
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))


@contextlib.contextmanager
def capable_gpu(capability):
    import gpu_checks

    with gpu_checks.cpu_as_blackwell():
        yield
