"""The decode loop on a numpy `FakeRunner` (`make`): one inbound queue from a given
receiver (default a `FakeReceiver` the test pushes handoffs into), run until a
condition holds (`run`), and the page accounting checked (`assert_no_page_held`)."""
from __future__ import annotations

import time
import types

from jaxpd.engine.loops.decode_loop import DecodeLoop
from jaxpd.engine.scheduling.registry import Limits, Requests
from jaxpd.engine.scheduling.inboxes import Routing
from jaxpd.engine.scheduling.scheduler import DecodeScheduler
from jaxpd.stats import StatsCounter
from jaxpd.transfer.inbound import HandoffSpec, InboundQueue
from tests.fake_runner import FakeReceiver, FakeRunner

LAYERS, PAGE_SIZE = 2, 4
MAX_PAGES_PER_SLOT = 8
MAX_MODEL_LEN = MAX_PAGES_PER_SLOT * PAGE_SIZE
VOCAB = 1000                           # the fake model counts mod 1000


def make(pool, slots=2, pages_per_shard=17, num_shards=1, part_timeout_s=30.0, remote=False,
         receiver=None, runner=None, fingerprint=""):
    """A decode loop over `slots` slots a shard and its parts, as a namespace: loop,
    runner, scheduler, stats, requests, receiver. `remote`: handoffs come from another
    process (payload: the wire form), checked against `fingerprint`."""
    stats = StatsCounter()
    requests = Requests(stats, 64, Limits(VOCAB, MAX_MODEL_LEN - 1, MAX_MODEL_LEN),
                        Routing(has_prefill=not remote, has_decode=True, local_prefill=False))
    runner = runner or FakeRunner(num_shards, slots, pages_per_shard, PAGE_SIZE, LAYERS)
    scheduler = DecodeScheduler(num_shards, slots, pages_per_shard, PAGE_SIZE)
    receiver = receiver or FakeReceiver()
    spec = HandoffSpec(num_layers=LAYERS, page_size=PAGE_SIZE, page_shape=(PAGE_SIZE, 1, 2),
                       dtype="float32", vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN,
                       max_pages=min(MAX_PAGES_PER_SLOT, pages_per_shard - 1),
                       fingerprint=fingerprint)
    queue = InboundQueue(receiver, pool, part_timeout_s, spec, remote=remote)
    loop = DecodeLoop(runner, scheduler, [queue], requests, stats,
                      max_pages_per_slot=MAX_PAGES_PER_SLOT)
    return types.SimpleNamespace(loop=loop, runner=runner, scheduler=scheduler, stats=stats,
                                 requests=requests, receiver=receiver)


def run(env, until, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "not reached in time"
        env.loop.iterate(receive_timeout=None)


def assert_no_page_held(env) -> None:
    run(env, lambda: env.loop.idle)
    for alloc in env.scheduler.allocators:
        assert alloc.num_used == 0 and alloc.num_free == alloc.capacity
    assert all(s is None for s in env.scheduler.slots)

