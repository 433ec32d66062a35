"""Live migration out of a decode mesh: every decoding request's KV and sampling state
leave the engine as a handoff another decode engine can take, so the request goes on
there from its next token without a prefill.

`take_decoding(engine)`, in order:
1. **Pause.** The engine's threads stop at a step boundary; the decode loop reads back
   its step in flight, so each request's last token is known and its KV covers every
   token but that one (which is fed next, as after a prefill).
2. **Cut.** For each decoding request: its pages are copied out of the pool
   (`DecodeRunner.take`, padded like a prefill's handoff; on a mesh spanning processes
   the leader publishes the take for its followers to replay and gets the pages
   all-gathered, `multihost.decode`), it becomes TRANSFERRING, its slot is released
   (its pages go back to the allocator, full ones to the prefix cache) and it leaves
   this engine's registry: from here it lives where its handoff lands.
3. **Resume.** The threads start again; the pause is one gather per request.

The handoff carries the request's wire form up to its KV (`Request.to_wire`, marked
`moved`, so that the receiver counts a failure as a failed migration): prompt,
output so far, seed, sampling parameters, stop ids, the last token's log-probabilities.
That is the whole sampling state: the sampler's key for a token depends only on the
seed and the token's position, penalties are recounted from prompt + output when the
request is inserted, and the tokens still allowed follow from `max_tokens` and the
output. So the receiving engine draws the same tokens the sender would have, greedy or
seeded. The receiver checks the handoff like any other (`transfer.inbound.HandoffSpec`,
and its registered mirror must hold exactly one token more than the KV covers).
"""
from __future__ import annotations

import dataclasses
import logging

from jaxpd.engine.scheduling.page_allocator import pages_for
from jaxpd.request import Request, State
from jaxpd.transfer.connector import KVHandoff

_log = logging.getLogger(__name__)

MOVED = "moved"         # a migration handoff's wire form says so


@dataclasses.dataclass
class Migrant:
    """A decoding request cut out of its engine: `handoff` holds its KV (all its tokens
    but the last, `first_token`), `request` the object that generated them."""
    request: Request
    handoff: KVHandoff


def take_decoding(engine, request_ids: set[str] | None = None) -> list[Migrant]:
    """Cut every decoding request (those of `request_ids`, when given) out of `engine`'s
    decode mesh, oldest first (see the module). The engine keeps serving the rest.
    Raises RuntimeError when the engine is shut down or failed; a failure halfway fails
    the engine, as a half-moved pool is not a state to serve from."""
    if engine.decode_loop is None:
        raise ValueError("take_decoding needs an engine with a decode mesh")
    with engine.resplit_lock, engine.lifecycle_lock:
        if engine.error is not None or not engine.pause_threads():
            raise RuntimeError("the engine is shut down or failed: nothing migrates")
        try:
            migrants = _cut(engine, request_ids)
        except BaseException as e:
            engine.fail(e)
            raise
        finally:
            engine.resume_threads()
    if migrants:
        engine.counters.add(migrations_out=len(migrants))
        _log.info("cut %d decoding requests out for migration", len(migrants))
    return migrants


def has_decoding(engine) -> bool:
    """Whether some request decodes on `engine`'s decode mesh (a hint, read from another
    thread: `take_decoding` decides)."""
    return any(s is not None and s.request.state is State.DECODING
               for s in list(engine.decode_scheduler.slots))


def _cut(engine, request_ids: set[str] | None) -> list[Migrant]:
    """With the threads paused (the step in flight already read back)."""
    sched, runner, page_size = engine.decode_scheduler, engine.decode_runner, \
        engine.config.page_size
    decoding = sorted((s.request.timings.kv_ready or 0.0, slot)
                      for slot, s in enumerate(sched.slots)
                      if s is not None and s.request.state is State.DECODING
                      and (request_ids is None or s.request.request_id in request_ids))
    migrants = []
    for _, slot in decoding:
        r = sched.slots[slot].request
        n = r.num_tokens - 1                 # KV so far; the last token is fed next
        k, v = runner.take(sched.shard_of(slot), sched.slots[slot].pages[:pages_for(n, page_size)])
        if not r.transition(State.TRANSFERRING):
            continue                         # aborted meanwhile: the loop frees its slot
        sched.release(slot)
        engine.requests.forget(r)
        migrants.append(Migrant(r, KVHandoff(
            r.request_id, n, r.output_ids[-1], k, v, {**r.to_wire(num_tokens=n), MOVED: True},
            fingerprint=engine.fingerprint)))
    return migrants


def moved(payload) -> bool:
    """Whether a handoff's wire form says it comes from another decode worker's pool
    (a migration; only what the receiver counts a failure as depends on it)."""
    return isinstance(payload, dict) and payload.get(MOVED) is True
