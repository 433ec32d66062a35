"""`RouterConfig`: the router's limits and clocks, validated once, and what a worker
must match to be admitted (plain Python).
(Split from `jaxpd.serving.router`, which re-exports it.)"""
from __future__ import annotations

import dataclasses

LEASE_BEATS = 5     # heartbeats a worker may miss before it is dropped (`RouterConfig`)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The limits the router validates requests against (a worker's own limits must be
    at least as large: it is refused otherwise), what it reports as its mesh, and its
    liveness clocks. dtype "auto": the first worker admitted fixes it for the rest.

    The lease defaults to `LEASE_BEATS` heartbeats. A busy worker's beats come late,
    not never: while a long call holds its GIL its sidecar beats instead
    (`serving.heartbeat`), which it does once the worker's own beats are 1.5 heartbeats
    late, at the next quarter-heartbeat tick, over a new connection to a router that
    may itself wait for a core on a loaded host; three heartbeats would leave a
    fraction of one for all that. A worker silent for five is dead or frozen."""
    max_model_len: int = 1024
    max_prompt_len: int | None = None
    max_queued: int = 4096
    rpc_timeout_s: float = 10.0        # Reprefill and Abort; Prefill and Migrate end
                                       # with their workers' leases instead
    dtype: str = "auto"
    page_size: int = 16
    heartbeat_s: float = 1.0           # how often static workers are probed
    lease_s: float | None = None       # default: LEASE_BEATS * heartbeat_s
    stall_timeout_s: float = 5.0       # a decode stream silent this long is a lost worker
    info_timeout_s: float = 1.0        # Info fan-out of stats()
    # Score workers by the prefix their caches advertise (`RequestFlow.choose_decoder`);
    # a worker whose cache is off advertises nothing and is chosen by load alone.
    prefix_routing: bool = True
    prefix_extend_below: int = 256

    def __post_init__(self):
        if self.max_prompt_len is None:
            object.__setattr__(self, "max_prompt_len", self.max_model_len - 1)
        if self.lease_s is None:
            object.__setattr__(self, "lease_s", LEASE_BEATS * self.heartbeat_s)
        for name in ("max_model_len", "max_prompt_len", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("rpc_timeout_s", "heartbeat_s", "lease_s",
                     "stall_timeout_s", "info_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")

    mesh = "router"


def registration_mismatch(info, tokenizer: str, vocab_size: int, config: RouterConfig,
                          pinned: dict) -> str | None:
    """Why the router refuses the worker `info` (a `WorkerInfo`), naming the field, or
    None: another tokenizer, vocabulary or page size, a dtype or KV transport other than
    the deployment's (`pinned` by the first worker), or limits below the router's.
    Other weights are no refusal: the worker joins as another model version, and the
    router pairs it only with workers of the same fingerprint."""
    who = f"{info.role} worker {info.address}"
    if info.tokenizer != tokenizer:
        return (f"tokenizer: {who} serves a checkpoint with another tokenizer (digest "
                f"{info.tokenizer[:12]}, the router's is {tokenizer[:12]}): the router "
                f"tokenizes for every worker, so all must use its tokenizer files")
    same = {"vocab_size": vocab_size, "page_size": config.page_size, **pinned}
    for field, want in same.items():
        if getattr(info, field) != want:
            return f"{field}: {who} has {getattr(info, field)!r}, the deployment uses {want!r}"
    for field in ("max_model_len", "max_prompt_len"):
        if getattr(info, field) < getattr(config, field):
            return (f"{field}: {who} has {getattr(info, field)}, smaller than the router's "
                    f"{getattr(config, field)}: start the router with a "
                    f"--{field} no larger than every worker's")
    return None
