"""The library's version (also pyproject.toml's); a module of its own so that any layer can
read it without importing the package root, which sits above every layer."""

__version__ = "0.1.0"
