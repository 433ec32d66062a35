"""`RouterConfig`: the router's limits and clocks, validated once (plain Python).
(Split from `jaxpd.serving.router`, which re-exports it.)"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The limits the router validates requests against (a worker's own limits must be
    at least as large: it is refused otherwise), what it reports as its mesh, and its
    liveness clocks. dtype "auto": the first worker admitted fixes it for the rest."""
    max_model_len: int = 1024
    max_prompt_len: int | None = None
    max_queued: int = 1024
    rpc_timeout_s: float = 10.0
    prefill_timeout_s: float = 120.0
    dtype: str = "auto"
    page_size: int = 16
    heartbeat_s: float = 1.0           # how often static workers are probed
    lease_s: float | None = None       # default: 3 * heartbeat_s
    stall_timeout_s: float = 5.0       # a decode stream silent this long is a lost worker
    info_timeout_s: float = 1.0        # Info fan-out of stats()
    prefix_routing: bool = False       # see `RequestFlow._choose_decoder`
    prefix_extend_below: int = 256

    def __post_init__(self):
        if self.max_prompt_len is None:
            object.__setattr__(self, "max_prompt_len", self.max_model_len - 1)
        if self.lease_s is None:
            object.__setattr__(self, "lease_s", 3 * self.heartbeat_s)
        for name in ("max_model_len", "max_prompt_len", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("rpc_timeout_s", "prefill_timeout_s", "heartbeat_s", "lease_s",
                     "stall_timeout_s", "info_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")

    mesh = "router"
