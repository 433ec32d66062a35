"""The host's memory as this process sees it: what is available (`available_bytes`, the
KV budget's base on CPU), what this process holds (`rss_bytes`), and giving back what a
stopped engine freed (`give_back`). Plain Python: no jax.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os


def _kib_field(path: str, key: str) -> int | None:
    """The "key: N kB" line of a /proc file in bytes; None where it is unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """Memory the host can give new allocations without swapping, in bytes: the
    kernel's MemAvailable (page cache it can drop counts as available); where that is
    unreadable, free physical pages (fewer: nothing of the cache counts); None where
    neither is known."""
    found = _kib_field(meminfo, "MemAvailable")
    if found is not None:
        return found
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def rss_bytes(status: str = "/proc/self/status") -> int | None:
    """This process's resident set (VmRSS), in bytes; None where it is unknown."""
    return _kib_field(status, "VmRSS")


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's `malloc_trim`, or None (another C library)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def give_back() -> None:
    """Collect the garbage a stopped engine left (reference cycles included), then
    return the free memory at the top and in the middle of the C heap to the OS:
    glibc keeps what XLA's compiles and small buffers freed in its arenas, where
    the process's resident set still counts it and nothing else on the host can use
    it. A no-op for the heap where the C library is not glibc."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
