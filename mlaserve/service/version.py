"""The server's version: the installed distribution's, else the source tree's `__version__`.

Its own module so that `mlaserve --version` and `--help` answer without importing the app (and
with it torch and the engine)."""

from __future__ import annotations

import importlib.metadata

import mlaserve

__all__ = ["server_version"]


def server_version() -> str:
    try:
        return importlib.metadata.version("mlaserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return mlaserve.__version__
