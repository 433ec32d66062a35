"""Errors that cross layers (plain Python: importing this loads no jax)."""
from __future__ import annotations


class QueueFull(RuntimeError):
    """Admission control said no: too many requests are waiting."""


class DuplicateRequest(ValueError):
    """A request id already in flight in this engine."""
