"""Where fastgen keeps what it builds and converts on disk (one root for every cache)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fastgen keeps converted models, native libraries and compiled graphs:
    `$FASTGEN_CACHE`, else `$XDG_CACHE_HOME/fastgen`, else `~/.cache/fastgen`. The folder is not
    created here."""
    if explicit := os.environ.get("FASTGEN_CACHE"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fastgen"
