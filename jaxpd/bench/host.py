"""The host a result was measured on, named in every table the benches print: the CPU
model, the cores this process may use, and the SIMD extensions that decide which
kernels run (jaxpd's native kernels and llama.cpp's alike). Plain Python, no jax."""
from __future__ import annotations

import os
import platform

# The CPU flags (as /proc/cpuinfo spells them) that change which kernels run, in the
# order a reader compares them.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512vbmi", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, flags) of the first processor listed in `path`; ("unknown", set())
    where it cannot be read (not Linux)."""
    model, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or "unknown", flags


def describe_host(path: str = "/proc/cpuinfo") -> dict:
    """The host as a result records it: CPU model, vendor-neutral ISA flags present,
    cores this process may run on."""
    model, flags = cpu_info(path)
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count())
    return {"cpu_model": model, "isa": [f for f in ISA_FLAGS if f in flags], "cores": cores,
            "machine": platform.machine()}


def host_line(host: dict) -> str:
    """One line naming the host, printed above every table."""
    isa = ",".join(host["isa"]) or "no AVX2"
    return f"host: {host['cpu_model']}, {host['cores']} cores, {host['machine']} ({isa})"


def has_avx512(host: dict) -> bool:
    return "avx512f" in host["isa"]
