"""Paged attention: per-step metadata and the device-specific backends behind one interface."""

from fastgen.attention.backend import AttentionBackend, select_backend
from fastgen.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
