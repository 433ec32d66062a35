"""No handoff stall: in one process, a request's KV pages leave the prefill devices
before the prefill loop dispatches its next batch (`transfer.device_put`), so a long
prefill never sits between a short request's first and second token.

Order of programs and copies is what is checked, never wall time."""
import threading

import jax
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.transfer import device_put as device_put_module
from jaxpd.transfer.connector import KVHandoff
from jaxpd.transfer.device_put import DevicePutConnector
from tests.engine_fixtures import XlaCompiles, assert_all_pages_free, reference


def _devices(*arrays) -> set:
    return {d for x in arrays for d in x.sharding.device_set}


def _pages(device, num_pages: int = 2):
    x = jax.device_put(np.arange(3 * num_pages * 4, dtype=np.float32).reshape(3, num_pages, 4),
                       device)
    return x, x + 1


@pytest.mark.parametrize("stage", [True, False])
def test_send_stages_pages_on_the_decode_devices(stage):
    prefill, staging, other = (jax.sharding.SingleDeviceSharding(d) for d in jax.devices()[:3])
    connector = DevicePutConnector(stage=stage)
    connector.stage_on(staging)
    k, v = _pages(jax.devices()[0])
    connector.send(KVHandoff("r", 20, 7, k, v))
    h = connector.receive(timeout=1)
    # Staged: what the decode side receives is already off the prefill device.
    assert _devices(h.k, h.v) == ({jax.devices()[1]} if stage else {jax.devices()[0]})
    pk, pv, stats = connector.place(h, staging)
    if stage:
        assert pk is h.k and pv is h.v           # already on its shard: nothing moves
    pk, pv, stats = connector.place(h, other)
    assert _devices(pk, pv) == {jax.devices()[2]}
    np.testing.assert_array_equal(np.asarray(pk), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(pv), np.asarray(v))
    assert stats.num_bytes == k.nbytes + v.nbytes
    assert prefill.device_set.isdisjoint(_devices(pk, pv))


class _CopySpy:
    """Stands in for `jax` inside `transfer.device_put`: records every copy it issues
    (thread, source devices, target devices, pages), in order, into `events`."""

    def __init__(self, events: list):
        self.events = events

    def device_put(self, xs, sharding):
        self.events.append(("copy", threading.current_thread().name, _devices(*xs),
                            set(sharding.device_set), xs[0].shape[1]))
        return jax.device_put(xs, sharding)

    def __getattr__(self, name):
        return getattr(jax, name)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["prefill=1,decode=1", "prefill=2,decode=2"])
def test_a_short_handoff_leaves_before_the_next_long_prefill(tiny_hf_model, monkeypatch, mesh):
    """At the library's defaults (warm-up, kept executables): transformers' tokens, no
    program compiled by a request, and the copies of the requests' pages in order."""
    path, hf_model = tiny_hf_model
    short, long = [5, 9, 11, 3], list(range(3, 103))          # 1 page; 7 pages of 16
    expected = reference(hf_model, [short, long], [6, 6])
    events: list = []
    monkeypatch.setattr(device_put_module, "jax", _CopySpy(events))
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "1")      # off for the rest of the suite
    with LLM(path, mesh=mesh, max_model_len=160, slots_per_shard=4) as llm, \
            XlaCompiles(on_request_threads=True) as xla:
        events.clear()                                  # warm-up's own copies
        engine = llm.engine
        prefill_devices = set(engine.meshes.prefill.devices.flat)
        decode_devices = set(engine.meshes.decode.devices.flat)
        prefill = engine.prefill_cache or engine.prefill_runner   # the cache, when on
        run = prefill.run

        def spy_run(tokens, *args):
            events.append(("prefill", tokens.shape[1]))
            return run(tokens, *args)

        monkeypatch.setattr(prefill, "run", spy_run)
        greedy = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 2
        first = llm.submit(llm.make_request(prompt_token_ids=short, sampling_params=greedy[0]))
        while first.state.name == "WAITING":      # its prefill batch has been taken
            threading.Event().wait(0.001)
        second = llm.submit(llm.make_request(prompt_token_ids=long, sampling_params=greedy[1]))
        outs = [llm._wait(first), llm._wait(second)]
        assert [o.token_ids for o in outs] == expected
        assert_all_pages_free(llm)
        assert xla.count == 0

    prefills = [i for i, e in enumerate(events) if e[0] == "prefill"]
    copies = [e for e in events if e[0] == "copy"]
    assert [events[i][1] for i in prefills] == [16, 128]
    # Every copy that reads the prefill devices is issued by the prefill loop, onto
    # decode devices; the short request's comes before the long prefill's dispatch.
    off_prefill = [e for e in copies if e[2] & prefill_devices]
    assert [e[4] for e in off_prefill] == [1, 7]
    assert all(e[1] == "jaxpd-prefill" and e[3] <= decode_devices for e in off_prefill)
    assert prefills[0] < events.index(off_prefill[0]) < prefills[1]
    # The decode side's place() touches decode devices only.
    placed = [e for e in copies if e[1].startswith("jaxpd-transfer")]
    assert len(placed) == 2
    assert all(e[2] <= decode_devices and e[3] <= decode_devices for e in placed)


class PulledConnector(DevicePutConnector):
    """A connector whose peer pulls (as the transfer server's does): `wait_pulled` is
    recorded; it answers `still_waiting` (0: everything pulled)."""

    def __init__(self, events: list, still_waiting: int):
        super().__init__()
        self.events, self.still_waiting = events, still_waiting

    def send(self, handoff):
        self.events.append(("send", handoff.num_tokens))
        super().send(handoff)

    def wait_pulled(self, timeout: float) -> int:
        self.events.append(("wait", timeout))
        return self.still_waiting


@pytest.mark.slow
@pytest.mark.parametrize("wait_ms,still_waiting", [(150.0, 1), (0.0, 0)])
def test_each_prefill_batch_first_waits_for_the_last_handoffs_pulls(tiny_hf_model, monkeypatch,
                                                                    wait_ms, still_waiting):
    """With a sender whose peer pulls from this process (the transfer server across
    processes), the next batch is dispatched only after `wait_pulled` for the handoffs
    before it; one that ran out of time is counted. 0 ms: no wait at all."""
    path, hf_model = tiny_hf_model
    short, long = [5, 9, 11, 3], list(range(3, 103))
    expected = reference(hf_model, [short, long], [4, 4])
    events: list = []
    connector = PulledConnector(events, still_waiting)
    with LLM(path, mesh="prefill=1,decode=1", max_model_len=160, slots_per_shard=4,
             handoff_wait_ms=wait_ms, connector=connector, warmup=False) as llm:
        prefill = llm.engine.prefill_cache or llm.engine.prefill_runner
        run = prefill.run

        def spy_run(tokens, *args):
            events.append(("prefill", tokens.shape[1]))
            return run(tokens, *args)

        monkeypatch.setattr(prefill, "run", spy_run)
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        first = llm.submit(llm.make_request(prompt_token_ids=short, sampling_params=greedy))
        while first.state.name == "WAITING":
            threading.Event().wait(0.001)
        second = llm.submit(llm.make_request(prompt_token_ids=long, sampling_params=greedy))
        assert [llm._wait(first).token_ids, llm._wait(second).token_ids] == expected
        assert_all_pages_free(llm)
        expired = llm.stats()["handoff_waits_expired"]
    if wait_ms == 0:
        assert ("prefill", 16) in events and not [e for e in events if e[0] == "wait"]
        return
    assert events == [("wait", 0.15), ("prefill", 16), ("send", 4),
                      ("wait", 0.15), ("prefill", 128), ("send", 100)]
    assert expired == 2 * still_waiting
