"""Layer-wise KV transfer: each layer group's pages leave the prefill mesh as soon as
they are computed. Same tokens as request-level, same pages, nothing leaked."""
import dataclasses
import time

import jax
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.config import EngineConfig
from jaxpd.request import State
from jaxpd.models.llama import layer_groups
from tests.engine_fixtures import (assert_all_pages_free, build_hf_model, mixed_prompts,
                                   reference, wait_idle)
from jaxpd.transfer.connector import KVHandoff, KVPart
from jaxpd.transfer.device_put import DevicePutConnector

NUM_REQUESTS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama_lw"))
    hf_model = build_hf_model("llama_gqa", path, num_layers=5)   # groups of unequal size
    prompts = mixed_prompts(NUM_REQUESTS, 256, seed=3)
    max_tokens = [4 + (5 * i) % 13 for i in range(NUM_REQUESTS)]
    return path, hf_model, prompts, max_tokens, reference(hf_model, prompts, max_tokens)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_layer_groups_cover_every_layer_once():
    assert layer_groups(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert layer_groups(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert layer_groups(2, 8) == [(0, 1), (1, 2)]          # no empty group
    for layers in range(1, 12):
        for groups in range(1, 6):
            bounds = layer_groups(layers, groups)
            assert [b for a, b in bounds][-1] == layers
            assert all(b > a for a, b in bounds)
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
            assert len({b - a for a, b in bounds}) <= 2
    with pytest.raises(ValueError, match="num_groups"):
        layer_groups(4, 0)


@pytest.mark.parametrize("field,value", [("layerwise_min_tokens", -1), ("layerwise_parts", 1),
                                         ("kv_part_timeout_s", 0.0)])
def test_config_rejects_bad_layerwise_settings(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_kv_part_validates_its_index():
    with pytest.raises(ValueError, match="part index"):
        KVPart(stream=1, index=3, count=3, layer_start=0)
    assert KVPart.from_dict(KVPart(7, 1, 3, 2).to_dict()) == KVPart(7, 1, 3, 2)
    assert KVPart.from_dict(None) is None


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["prefill=4,decode=2x2"])   # prefill=1,decode=1: test_router
def test_layerwise_greedy_matches_hf_and_request_level(tiny, mesh):
    path, _, prompts, max_tokens, expected = tiny
    # Every bucket >= 32 tokens goes layer-wise, shorter ones request-level: both at once.
    with LLM(path, mesh=mesh, max_model_len=160, slots_per_shard=4, layerwise_min_tokens=32,
             layerwise_parts=2, warmup=False) as llm:
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=[_greedy(n) for n in max_tokens])
        assert [o.token_ids for o in outs] == expected
        stats = llm.stats()
        long_prompts = sum(len(p) > 16 for p in prompts)
        assert stats["layerwise_transfers"] == long_prompts
        assert stats["transfers"] == NUM_REQUESTS
        # Only the used pages moved, layer-wise or not.
        cfg = llm.model_config
        page_bytes = cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
        for p, out in zip(prompts, outs):
            assert out.metrics.transfer_bytes == 2 * page_bytes * (-(-len(p) // 16))
        assert stats["compiled_programs"].get("prefill_blocks", 0) > 0
        assert_all_pages_free(llm)


@pytest.mark.slow
def test_first_token_that_finishes_frees_the_reserved_slot(tiny):
    """Parts went out before the first token was known; it ends the request: the
    decode side must give back the slot it reserved for the rest."""
    path, _, prompts, _, _ = tiny
    long = [p for p in prompts if len(p) > 32]
    with LLM(path, mesh="prefill=2,decode=2", max_model_len=160, slots_per_shard=2,
             layerwise_min_tokens=32, layerwise_parts=3, warmup=False) as llm:
        outs = llm.generate(prompt_token_ids=long, sampling_params=_greedy(1))
        assert all(len(o.token_ids) == 1 and o.finish_reason == "length" for o in outs)
        assert_all_pages_free(llm)
        assert llm.stats()["layerwise_transfers"] == 0


class DroppingConnector(DevicePutConnector):
    """Loses every layer-wise part with index `drop_index` of the first `times` streams."""

    def __init__(self, drop_index: int, times: int):
        super().__init__()
        self.drop_index, self.times, self.dropped = drop_index, times, []

    def send(self, handoff):
        if (handoff.part is not None and handoff.part.index == self.drop_index
                and len(self.dropped) < self.times):
            self.dropped.append(handoff.request_id)
            return
        super().send(handoff)


@pytest.mark.slow
@pytest.mark.parametrize("drop_index", [1, 2])     # a middle part; the last one
def test_a_lost_part_times_out_and_the_request_is_prefilled_again(tiny, drop_index):
    path, _, prompts, max_tokens, expected = tiny
    idx = [i for i, p in enumerate(prompts) if len(p) > 32][:3]
    connector = DroppingConnector(drop_index=drop_index, times=2)
    with LLM(path, mesh="prefill=2,decode=2", max_model_len=160, slots_per_shard=2,
             layerwise_min_tokens=32, layerwise_parts=3, kv_part_timeout_s=0.5,
             connector=connector, warmup=False) as llm:
        outs = llm.generate(prompt_token_ids=[prompts[i] for i in idx],
                            sampling_params=[_greedy(max_tokens[i]) for i in idx])
        assert [o.token_ids for o in outs] == [expected[i] for i in idx]
        stats = llm.stats()
        assert len(connector.dropped) == 2
        assert stats["transfer_failures"] == 2
        assert stats["finished"] == len(idx) and stats["aborted"] == 0
        assert_all_pages_free(llm)


@pytest.mark.slow
def test_abort_between_parts_frees_everything(tiny):
    path, _, prompts, _, _ = tiny
    long = [p for p in prompts if len(p) > 32][:4]

    class AbortingConnector(DevicePutConnector):
        """Aborts the request as soon as its first part is sent."""
        def __init__(self):
            super().__init__()
            self.llm = None

        def send(self, handoff):
            super().send(handoff)
            if handoff.part is not None and handoff.part.index == 0:
                self.llm.abort(handoff.request_id, "cancelled mid-transfer")

    connector = AbortingConnector()
    with LLM(path, mesh="prefill=2,decode=2", max_model_len=160, slots_per_shard=2,
             layerwise_min_tokens=32, layerwise_parts=3, connector=connector, warmup=False) as llm:
        connector.llm = llm
        reqs = [llm.submit(llm.make_request(prompt_token_ids=p, sampling_params=_greedy(8)))
                for p in long]
        outs = [llm._wait(r) for r in reqs]
        assert all(o.finish_reason == "abort" for o in outs)
        assert all(r.state is State.ABORTED for r in reqs)
        wait_idle(llm)
        assert_all_pages_free(llm)
        assert llm.stats()["layerwise_transfers"] == 0


@pytest.mark.slow
def test_runner_layerwise_pages_equal_fused_prefill(tiny):
    """The layer groups' pages, joined, are bit-identical to the fused program's."""
    path = tiny[0]
    with LLM(path, mesh="prefill=4,decode=4", max_model_len=160, layerwise_min_tokens=0,
             warmup=False) as llm:
        runner = llm.engine.prefill_runner
        from jaxpd.engine.programs.sampler import SamplingArrays
        rng = np.random.default_rng(0)
        tokens = rng.integers(3, 256, (2, 64)).astype(np.int32)
        lengths = np.array([64, 37], np.int32)
        sampling = SamplingArrays.empty(2)
        first, _, k, v = runner.run(tokens, lengths, sampling)
        rows = [(0, 0, 4), (1, 1, 2)]         # (row, first page, pages): the second
        # leaves its first page out, as a handoff to a decode side holding it does
        groups = layer_groups(llm.model_config.num_layers, 3)
        first_lw, _, parts = runner.run_layerwise(tokens, lengths, sampling, groups, rows)
        np.testing.assert_array_equal(np.asarray(first_lw), first)
        for j, (row, first_page, n) in enumerate(rows):
            k_ref, v_ref = runner.take_pages(k, v, row, n, first_page)
            if first_page:
                whole = runner.take_pages(k, v, row, first_page + n)[0]
                np.testing.assert_array_equal(np.asarray(k_ref), np.asarray(whole)[:, first_page:])
            k_lw = np.concatenate([np.asarray(part[j][0]) for part in parts])
            v_lw = np.concatenate([np.asarray(part[j][1]) for part in parts])
            np.testing.assert_array_equal(k_lw, np.asarray(k_ref))
            np.testing.assert_array_equal(v_lw, np.asarray(v_ref))
        jax.block_until_ready(parts)


def test_part_travels_on_both_wires_and_old_peers_are_refused():
    """The part rides in the transfer server's Offer and in the gRPC stream header;
    a peer of the previous wire version (which would read a part as a whole KV) is
    refused, never misread."""
    from jaxpd.transfer import control, grpc_stream
    from jaxpd.transfer.layout import WireVersionError, describe

    part = KVPart(stream=12345, index=1, count=3, layer_start=2)
    k = jax.numpy.arange(2 * 1 * 16 * 2 * 4, dtype=jax.numpy.float32).reshape(2, 1, 16, 2, 4)
    handoff = KVHandoff("r1", 9, -1, k, -k, {"x": 1}, None, part)
    received = grpc_stream.decode_handoff(list(grpc_stream.encode_handoff(handoff).messages(1 << 20)))
    assert received.part == part and received.first_token == -1
    np.testing.assert_array_equal(received.v, -np.asarray(k))

    offer = control.Offer(uuid=1, request_id="r1", num_tokens=9, first_token=-1, k=describe(k),
                          v=describe(k), transfer_address="a:1", ack_address="a:2", part=part)
    assert control.Offer.from_dict(control.unpack(control.pack(offer.to_dict()))).part == part
    whole = dataclasses.replace(offer, part=None)
    assert control.Offer.from_dict(whole.to_dict()).part is None
    old = dict(offer.to_dict(), wire_version=1)
    with pytest.raises(WireVersionError, match="wire version 1"):
        control.Offer.from_dict(old)


def test_pages_that_do_not_fit_the_pool_fail_the_transfer_not_the_engine():
    """E.g. the prefill side compresses KV (uint8 rows) and this side does not: the
    transfer fails with a reason naming the likely cause; the engine lives on."""
    from concurrent import futures

    import jax.numpy as jnp

    from jaxpd.transfer.connector import TransferError, TransferStats
    from jaxpd.transfer.inbound import PENDING, Inbound, Placed, wait_any

    expect = jax.ShapeDtypeStruct((4, 3, 16, 2, 8), jnp.float32)   # the pool's, for 3 pages
    packed = jnp.zeros((4, 3, 16 * 2 * 8 + 4), jnp.uint8)

    class Raw:
        def place(self, h, sharding):
            return h.k, h.v, TransferStats(0, 0.0)

        def discard(self, h):
            pass

    def placed(handoff):
        inbound = Inbound(handoff, Raw(), pool, part_timeout_s=30, counted=True, remote=False)
        inbound.start(None, expect)
        while wait_any([inbound], 5):
            pass
        return inbound.poll(time.monotonic())

    with futures.ThreadPoolExecutor(1) as pool:
        error = placed(KVHandoff("r", 40, 5, packed, packed))
        assert isinstance(error, TransferError) and "kv_transfer_dtype" in str(error)
        good = jnp.ones((4, 3, 16, 2, 8), jnp.float32)
        result = placed(KVHandoff("r", 40, 5, good, good))
        assert isinstance(result, Placed) and result.k.shape == good.shape
        part = jnp.ones((2, 3, 16, 2, 8), jnp.float32)    # a layer group of a layer-wise part
        assert placed(KVHandoff("r", 40, -1, part, part, part=KVPart(1, 0, 2, 0))) is PENDING
