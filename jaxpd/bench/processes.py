"""The bench's multi-process deployment: a router in front of one prefill and one decode
worker process, each pinned to its own CPUs, which the bench starts and stops itself.

On CPU, isolation means cores: one process's XLA:CPU devices share one thread pool, so
an in-process `prefill=P,decode=D` mesh still runs a long prefill on the cores its
decode steps need. Here the prefill worker runs on `prefill_cpus` only and the decode
worker on `decode_cpus` only (`python -m jaxpd.launch --cpus`, which also sizes XLA's
thread pool), with KV pages moved between them by the JAX transfer server, as a real
deployment does. The router runs in the bench process (it only relays), and the requests
are the same ones every other backend serves.

    python -m jaxpd.bench --mesh prefill=1,decode=1 --compare colocated=2 \\
        --deployment processes --prompt_lens 32:3,896:1 --output_lens 64 --rate 4
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Sequence

from jaxpd.bench.driver import BenchRequest, FrontendBackend
from jaxpd.bench.workers import start_all

READY_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Deployment:
    """Meshes and CPU sets of the two worker processes."""
    prefill_mesh: str = "prefill=1"
    decode_mesh: str = "decode=1"
    prefill_cpus: str = "0"
    decode_cpus: str = "1"
    kv_transport: str = "transfer_server"
    # A prefill role spanning this many processes (`engine.multihost`), and how its
    # KV leaves it (`--kv_offers`).
    prefill_processes: int = 1
    kv_offers: str = "shards"

    @property
    def name(self) -> str:
        via = "" if self.kv_transport == "transfer_server" else f",{self.kv_transport}"
        spread = (f" over {self.prefill_processes} processes, kv {self.kv_offers}"
                  if self.prefill_processes > 1 else "")
        return (f"processes({self.prefill_mesh}{spread}@cpu{self.prefill_cpus},"
                f"{self.decode_mesh}@cpu{self.decode_cpus}{via})")


def cpu_ranges(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the `--cpus` spelling)."""
    out, ids = [], sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def make_deployment(mesh: str, prefill_cpus: str | None, decode_cpus: str | None,
                    allowed: Sequence[int] | None = None,
                    kv_transport: str = "transfer_server") -> Deployment:
    """The deployment for `mesh` ("prefill=P,decode=D[xT]") and CPU sets. Unset CPU
    sets split the CPUs this process may use: the first half (rounded up) for prefill,
    the rest for decode. ValueError naming the flag when a set is empty, names CPUs this
    process may not use, or the two overlap (isolation is the point of the deployment)."""
    from jaxpd.sharding.cpu_devices import parse_cpus
    from jaxpd.sharding.spec import parse_mesh_spec
    spec = parse_mesh_spec(mesh)
    if spec.colocated or not (spec.has_prefill and spec.has_decode):
        raise ValueError(f"--process_mesh must be 'prefill=P,decode=D', got {mesh!r}")
    prefill_mesh, decode_mesh = str(spec).split(",", 1)
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if prefill_cpus is None and decode_cpus is None:
        if len(allowed) < 2:
            raise ValueError(f"--deployment processes pins prefill and decode to separate "
                             f"CPUs; this process may use only {allowed}: pass "
                             f"--prefill_cpus and --decode_cpus")
        half = len(allowed) - len(allowed) // 2
        prefill_cpus, decode_cpus = cpu_ranges(allowed[:half]), cpu_ranges(allowed[half:])
    elif prefill_cpus is None or decode_cpus is None:
        raise ValueError("--prefill_cpus and --decode_cpus: give both or neither")
    sets = {}
    for flag, text in (("prefill_cpus", prefill_cpus), ("decode_cpus", decode_cpus)):
        try:
            sets[flag] = parse_cpus(text, set(allowed))
        except ValueError as e:
            raise ValueError(f"--{flag}: {e}") from None
    if sets["prefill_cpus"] & sets["decode_cpus"]:
        raise ValueError(f"--prefill_cpus {prefill_cpus!r} and --decode_cpus {decode_cpus!r} "
                         f"overlap on CPUs {sorted(sets['prefill_cpus'] & sets['decode_cpus'])}")
    return Deployment(prefill_mesh, decode_mesh, cpu_ranges(sets["prefill_cpus"]),
                      cpu_ranges(sets["decode_cpus"]), kv_transport)


def worker_flags(deployment: Deployment, model_dir: str, options: dict,
                 compile_ahead: bool = True) -> list[list[str]]:
    """Launcher arguments of the prefill and decode workers for engine `options`
    (max_model_len, slots_per_shard, max_prefill_batch, prefix caching)."""
    common = ["--model", model_dir, "--host", "127.0.0.1", "--port", "0",
              "--max_model_len", str(options["max_model_len"]),
              "--kv_transport", deployment.kv_transport]
    if not compile_ahead:
        common.append("--nowarmup")
    for key in ("slots_per_shard", "max_prefill_batch", "prefix_extend_below",
                "handoff_wait_ms", "attention_impl"):
        if key in options:
            common += [f"--{key}", str(options[key])]
    cache = options.get("enable_prefix_caching")
    if cache is not None:               # else each worker's default
        common.append("--enable_prefix_caching" if cache else "--noenable_prefix_caching")
    prefill = common + ["--role", "prefill", "--mesh", deployment.prefill_mesh,
                        "--cpus", deployment.prefill_cpus]
    n = deployment.prefill_processes
    if n > 1:                  # the leader first: its address is the prefill worker's
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{s.getsockname()[1]}"
        prefill += ["--num_processes", str(n), "--coordinator", coordinator,
                    "--kv_offers", deployment.kv_offers]
    prefills = [prefill + ["--process_id", str(i)] for i in range(n)] if n > 1 else [prefill]
    return prefills + [common + ["--role", "decode", "--mesh", deployment.decode_mesh,
                                 "--cpus", deployment.decode_cpus]]


def settle_workers(router, timeout_s: float = 300.0) -> None:
    """Wait until no worker of `router`'s deployment compiles in the background (the
    prefix cache's programs its warm-up asked for: `engine.compile.background`)."""
    deadline = time.monotonic() + timeout_s
    while any(info.get("compiles_pending", 0) for workers in router.stats()["workers"].values()
              for info in workers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers still compiling after {timeout_s:g} s")
        time.sleep(0.2)


class ProcessesBackend(FrontendBackend):
    """A `Router` in this process in front of the deployment's two pinned workers,
    started (and warmed up: every bucket compiled) before any clock starts."""

    def __init__(self, model_dir: str, deployment: Deployment, engine_options: dict,
                 warmup_requests: Sequence[BenchRequest] = (),
                 warm_prompt_lens: Sequence[int] = (), compile_ahead: bool = True):
        from jaxpd.serving.router import Router, RouterConfig
        self.name = deployment.name
        self.options = dict(engine_options)
        self.front = None
        self.children, addresses = start_all(
            worker_flags(deployment, model_dir, self.options, compile_ahead))
        prefill, decode = [a for a in addresses if a is not None]
        try:
            config = RouterConfig(
                max_model_len=self.options["max_model_len"],
                prefix_extend_below=self.options.get("prefix_extend_below", 256))
            self.front = Router(model_dir, config, prefill=(prefill,), decode=(decode,))
            self._wait_ready()
            if compile_ahead:
                self.warm(warmup_requests, warm_prompt_lens)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.front.ready() and len(self.front.live_workers()) == 2:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: the router did not see both workers live within "
                           f"{READY_TIMEOUT_S:.0f} s: {self.front.live_workers()}")

    def prefill_shapes(self, prompt_lens: Sequence[int]) -> list[tuple[int, int]]:
        from jaxpd.engine.scheduling.buckets import batch_buckets
        sizes = batch_buckets(self.options.get("max_prefill_batch", 8))
        return [(n, size) for n in sorted(set(prompt_lens)) for size in sizes]

    def counters(self) -> dict:
        return self.front.stats()

    def settle(self) -> None:
        settle_workers(self.front)

    def counters_delta(self, before: dict, after: dict) -> dict:
        return {k: (v - before[k] if isinstance(v, int) and isinstance(before.get(k), int)
                    else v) for k, v in after.items()}

    def close(self) -> None:
        if self.front is not None:
            self.front.shutdown()
        for child in self.children:
            child.close()
