"""The base of every error the library raises on purpose.

A :class:`SeedVR2Error` is a refusal, not a bug: its message names the thing at fault (the file, the
node, the option, the frame) and, where there is one, the fix. The command line prints it as one
line and exits non-zero; the ComfyUI nodes show it as the node's error. Any other exception reaching
a user is a defect, and the property-based hostile tests look for exactly that. Each subclass also
derives from the builtin error it always was (``ValueError`` for bad input, ``RuntimeError`` for a
failure on the way), so callers catching those still do. A builtin raised by name is left only where
it cannot happen (tests/test_code_shape.py counts)."""

from __future__ import annotations


class SeedVR2Error(Exception):
    """An error of ours, raised on purpose; the message names the thing and the fix."""


class InputError(SeedVR2Error, ValueError):
    """An input the library cannot use (frames, a tensor, a node's input, an argument's value);
    the message names it and what it must be."""


class UsageError(SeedVR2Error, TypeError):
    """The library called wrongly: an argument of the wrong type, or two that exclude each other."""


class OutputExists(SeedVR2Error, FileExistsError):
    """An output that is already there while ``overwrite`` is off; nothing was replaced, and a
    finished output that could not be moved into place is kept (the message says where)."""
