"""An elastic split in one process: `--mesh elastic=N` serves as
`prefill=P,decode=N-P`, and `resplit(engine, P')` (`LLM.resplit`) moves devices
between the two meshes while it serves.

A re-split, in order:
1. **Build beside.** The new split's meshes, weights, KV pool, runners and loops are
   built as one `Phases` object (`Engine.build_phases`, sharing the engine's requests,
   connector, counters, transfer threads and handoff queue) and compiled (`warm_up`,
   when the engine was warmed up), while the old split keeps serving: compiling costs
   no serving time. What it costs is memory: a second
   copy of the weights and a second pool, until the switch. `prepare` does this ahead
   (a controller can prepare the move it is about to make).
2. **Pause.** The engine's threads stop at a batch or step boundary; the old decode
   loop receives every handoff already sent, inserts those holding a slot and reads
   back its step in flight (`DecodeLoop.drain`).
3. **Move, recompute nothing.** Queued prompts go to the new prefill scheduler.
   Every decoding request's KV (its tokens less the last, which is fed next, as
   after a prefill) is cut from the old pool (`DecodeRunner.take`) and becomes a
   handoff to the new decode loop, oldest slot first, then the handoffs that were
   waiting for a slot; the new loop admits and places them with the same
   `jax.device_put` as a prefill's handoff, counted in `transfers`. A request whose
   KV does not fit the new pool yet waits, KV in hand, like any handoff.
4. **Swap and resume.** The engine's `phases` becomes the new object (the old pool
   and weights are freed with the old one) and the threads start again.
The pause lasts steps 2-4: a drain, one gather and one copy per decoding request.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from jaxpd.engine.scheduling.page_allocator import pages_for
from jaxpd.engine.compile.executable_cache import KeptExecutables
from jaxpd.engine.compile.warmup import warm_up
from jaxpd.request import State
from jaxpd.sharding.spec import MeshSpec
from jaxpd.transfer.connector import KVHandoff
from jaxpd.transfer.inbound import Inbound

_log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class Resplit:
    """What one re-split did."""
    old: MeshSpec
    new: MeshSpec
    moved_requests: int        # decoding requests whose KV moved to the new decode mesh
    requeued_prompts: int      # queued prompts handed to the new prefill scheduler
    build_s: float             # building and compiling it, while serving (~0 if prepared)
    pause_s: float             # serving paused: drain, move, swap


def resplit(engine, prefill: int, progress: Callable[[str], None]) -> Resplit:
    """Move devices so that the prefill mesh has `prefill` of them (see the module)."""
    with engine.resplit_lock:
        old = engine.config.mesh
        if not old.elastic:
            raise ValueError(f"resplit needs an elastic mesh (--mesh elastic=N), not {old}")
        new = old.split(prefill)
        if new == old:
            return Resplit(old, new, 0, 0, 0.0, 0.0)
        start = time.perf_counter()
        shadow = engine.prepared_splits.pop(new, None) or _build(engine, new, progress)
        engine.prepared_splits.clear()       # a split prepared for another move is stale
        built = time.perf_counter()
        with engine.lifecycle_lock:
            if engine.error is not None or not engine.pause_threads():
                raise RuntimeError(f"engine is shut down or failed; the split stays {old}")
            try:
                moved, requeued = _move(engine, shadow)
                engine.phases = shadow
                engine.connector.stage_on(engine._staging_sharding())
            except BaseException as e:
                # Half moved is not a state to serve from: fail every live request.
                engine.fail(e)
                raise
            finally:
                engine.resume_threads()
        done = time.perf_counter()
        engine.counters.add(resplits=1, resplit_moved_requests=moved)
        _log.info("re-split %s -> %s: %d decoding requests moved, %d queued prompts, "
                  "built in %.1f s, paused %.3f s", old, new, moved, requeued, built - start,
                  done - built)
        return Resplit(old, new, moved, requeued, built - start, done - built)


def prepare(engine, prefill: int, progress: Callable[[str], None]) -> float:
    """Build and compile the split with `prefill` prefill devices now, while serving, so
    that `resplit` to it only pauses for the move; returns the seconds it took. One
    prepared split is kept (it holds its own weights and pool)."""
    new = engine.config.mesh.split(prefill)
    start = time.perf_counter()
    with engine.resplit_lock:
        if new != engine.config.mesh and new not in engine.prepared_splits:
            engine.prepared_splits.clear()
            engine.prepared_splits[new] = _build(engine, new, progress)
    return time.perf_counter() - start


def _build(engine, spec: MeshSpec, progress: Callable[[str], None]):
    """`spec`'s `Phases` beside the engine's (the same handoff queue), compiled when the
    engine was."""
    phases = engine.build_phases(dataclasses.replace(engine.config, mesh=spec),
                                 inbound=engine.decode_loop.inbound)
    if engine.warmed:
        warm_up(phases, lambda msg: progress(f"{spec}: {msg}"),
                keep=KeptExecutables.for_engine(engine.fingerprint, phases.config))
    return phases


def _move(engine, shadow) -> tuple[int, int]:
    """Hand everything the old split holds to the new one (the threads are paused)."""
    prompts = engine.prefill_scheduler.take_all()
    for r in prompts:
        shadow.prefill_scheduler.add(r)
    old = engine.decode_loop
    old.drain(engine.config.kv_part_timeout_s)
    sched, page_size = old.scheduler, engine.config.page_size
    decoding = sorted(((s.request.timings.kv_ready or 0.0, i) for i, s in enumerate(sched.slots)
                       if s is not None and s.request.state is State.DECODING))
    moving = []
    for _, slot in decoding:
        r = sched.slots[slot].request
        n = r.num_tokens - 1                 # KV so far; the last token is fed next
        pages = sched.slots[slot].pages[:pages_for(n, page_size)]
        k, v = old.runner.take(sched.shard_of(slot), pages)
        if not r.transition(State.TRANSFERRING):
            continue                         # aborted meanwhile
        handoff = KVHandoff(r.request_id, n, r.output_ids[-1], k, v,
                            engine.requests.payload_of(r, n), r.destination)
        moving.append((Inbound(handoff, engine.connector, engine._transfers,
                               engine.config.kv_part_timeout_s, counted=True, remote=False), r))
    shadow.decode_loop.pending.extend(moving + list(old.pending))
    old.pending.clear()
    return len(moving), len(prompts)
