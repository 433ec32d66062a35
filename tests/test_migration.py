"""Live migration of decoding requests between decode engines (`engine.kv.migration`): a
request cut out of one engine's pool goes on at another from its next token, through a
real KV connector (the gRPC stream), with the same tokens as if it had not moved
(greedy and seeded), no prefill of its prompt there, and no page held on either side.
A forged migration handoff installs nothing and leaves the engine serving."""
import dataclasses
import logging
import re
import signal
import time

import grpc
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.engine.kv.migration import MOVED, moved, take_decoding
from jaxpd.request import Request, State
from jaxpd.serving.migration import MigrationOutbox
from jaxpd.serving.role_rpc import ROLE_SERVICE
from jaxpd.serving.role_server import RoleServer, RoleService
from jaxpd.serving.router import Router
from jaxpd.serving.router_config import RouterConfig
from jaxpd.transfer.connector import KVHandoff, TransferError
from jaxpd.transfer.grpc_stream import GrpcReceiver, GrpcSender
from jaxpd.transfer.wire import WIRE_VERSION, pack, unpack
from tests.engine_fixtures import assert_all_pages_free, mixed_prompts
from tests.fake_runner import FakeReceiver, InlineExecutor
from tests.fake_runner import pages as fake_pages
from tests.hf_fixtures import hf_greedy
from tests.support.decode_env import LAYERS, PAGE_SIZE, assert_no_page_held, make
from tests.support.decode_env import run as run_env
from tests.support.internal_plane import AUTH, TOKEN, wait_until
from tests.support.moving_decode_worker import MovingDecodeWorker

MAX_MODEL_LEN = 96
OPTIONS = dict(max_model_len=MAX_MODEL_LEN, slots_per_shard=4, migrate_on_drain=True)


@pytest.fixture(scope="module")
def engines(tiny_hf_model):
    """(source: a prefill and a decode mesh in one process; target: a decode-only
    engine taking KV over the gRPC stream; the sender the source's moves use)."""
    path, _ = tiny_hf_model
    receiver = GrpcReceiver(address="127.0.0.1:0")
    source = LLM(path, mesh="prefill=1,decode=1", **OPTIONS, warmup=False)
    target = LLM(path, mesh="decode=1", connector=receiver, **OPTIONS, warmup=False)
    sender = GrpcSender()
    yield source, target, receiver.address, sender
    sender.close()
    target.shutdown()
    source.shutdown()


def _params(i: int, max_tokens: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, seed=100 + i,
                          repetition_penalty=1.2, ignore_eos=True)


def _wait(pred, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _mirror(target: LLM, migrant_request: Request) -> Request:
    """What a router does: register at the target a mirror of the request as its client
    has it (prompt + every token so far)."""
    mirror = Request.from_wire(migrant_request.to_wire(), State.TRANSFERRING)
    target.engine.register(mirror)
    return mirror


# The router test below checks the same through the serving path; this one isolates
# the engine's part (run it with -m matrix).
@pytest.mark.matrix
@pytest.mark.slow
def test_migrated_requests_finish_elsewhere_token_identically(engines):
    source, target, address, sender = engines
    prompts = mixed_prompts(4, 256, seed=5)
    max_tokens = [32 - i for i in range(len(prompts))]
    requests = [source.submit(source.make_request(prompt_token_ids=p,
                                                  sampling_params=_params(i, n)))
                for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    _wait(lambda: all(len(r.output_ids) >= 3 for r in requests))
    source.engine.pause_threads()          # mid-stream; `take_decoding` resumes them
    assert not any(r.is_final for r in requests)
    prefilled = source.stats()["prefill_tokens"]
    migrants = take_decoding(source.engine)
    assert {m.request.request_id for m in migrants} == {r.request_id for r in requests}
    assert all(len(m.request.output_ids) < n for m, n in zip(migrants, max_tokens))
    assert_all_pages_free(source)          # every page of a moved request is back
    assert source.stats()["migrations_out"] == len(requests)
    before = target.stats()
    mirrors = []
    for m in migrants:
        mirrors.append(_mirror(target, m.request))
        sender.send(dataclasses.replace(m.handoff, destination=address))
    outputs = [target._wait(r) for r in mirrors]
    # The same tokens as the source engine makes when nothing moves (greedy and seeded;
    # greedy against transformers: the router test below).
    by_id = {m.request.request_id: i for i, m in enumerate(migrants)}
    unmoved = source.generate(prompt_token_ids=prompts,
                              sampling_params=[_params(i, n) for i, n in enumerate(max_tokens)])
    for m, out in zip(migrants, outputs):
        i = [r.request_id for r in requests].index(m.request.request_id)
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens[i]
        assert out.token_ids[:len(m.request.output_ids)] == m.request.output_ids
        assert out.token_ids == unmoved[i].token_ids, by_id
    after = target.stats()
    # Not prefilled at the target, nor again at the source: the KV moved.
    assert after["prefill_tokens"] == before["prefill_tokens"]
    assert after["local_prefills"] == before["local_prefills"]
    assert after["transfers"] - before["transfers"] == len(migrants)
    assert after["transfer_failures"] == before["transfer_failures"]
    assert source.stats()["prefill_tokens"] - prefilled == sum(map(len, prompts))  # `unmoved`
    assert_all_pages_free(target)
    assert_all_pages_free(source)
    assert len(source.engine.requests) == 0


@pytest.mark.slow
def test_a_forged_migration_installs_nothing(engines):
    source, target, address, sender = engines
    cfg = target.model_config
    before = target.stats()
    shape = (cfg.num_layers, 1, target.config.page_size, cfg.num_kv_heads, cfg.head_dim)
    pages = np.zeros(shape, np.float32)
    prompt = list(range(3, 13))
    forged = KVHandoff("nobody-registered-this", len(prompt), 5, pages, pages,
                       {"request_id": "nobody-registered-this"}, fingerprint=target.fingerprint)
    rejected = lambda: target.stats()["handoffs_rejected"] - before["handoffs_rejected"]
    sender.send(dataclasses.replace(forged, destination=address))
    _wait(lambda: rejected() >= 1)
    # A registered request, and KV of the wrong length for it, then of another model.
    # One at a time: the first refusal sends the request back to prefill, after which
    # a handoff for it is stale rather than refused, so the order must be known.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    victim = Request("victim-1", prompt, params, state=State.TRANSFERRING)
    victim.output_ids = [7, 8]
    target.engine.register(victim)
    wire = victim.to_wire(num_tokens=len(prompt) + 1)
    for i, bad in enumerate((dataclasses.replace(forged, request_id="victim-1", payload=wire,
                                                 num_tokens=len(prompt) - 4),
                             dataclasses.replace(forged, request_id="victim-1", payload=wire,
                                                 num_tokens=len(prompt) + 1,
                                                 fingerprint="0" * 64))):
        sender.send(dataclasses.replace(bad, destination=address))
        _wait(lambda: rejected() >= 2 + i)
    stats = target.stats()
    assert stats["handoffs_model_mismatch"] - before["handoffs_model_mismatch"] == 1
    assert stats["transfers"] == before["transfers"]     # nothing was placed
    assert target.failure() is None
    # The registered request was never decoded from forged pages: prefilled again here
    # from its prompt and output (greedy: the tokens the model makes after them).
    out = target._wait(victim)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.token_ids[:2] == [7, 8]
    assert target.stats()["transfers"] == before["transfers"]
    assert_all_pages_free(target)


# ---- behind a router: a drained decode worker's requests move on -------------------


def _worker(path, role: str, router_address: str | None, **options):
    """(llm, server, service) of a role worker on the gRPC KV stream, registered with
    the router at `router_address` (None: not yet)."""
    if role == "prefill":
        connector, kv_address = GrpcSender(auth=AUTH), ""
    else:
        connector = GrpcReceiver(address="127.0.0.1:0", auth=AUTH)
        kv_address = connector.address
    llm = LLM(path, mesh=f"{role}=1", connector=connector, max_model_len=MAX_MODEL_LEN,
              slots_per_shard=4, **options, warmup=False)
    service = RoleService(llm.engine, kv_address, "grpc")
    if role == "decode":
        service.migration = MigrationOutbox(llm.engine, AUTH)
    server = RoleServer(service, "127.0.0.1", 0, AUTH)
    server.start()
    if router_address is not None:
        server.register_with(router_address, heartbeat_s=0.2)
    return llm, server, service


def _forged_migrate_calls(address: str, kv_address: str, moved_id: str) -> None:
    """`Migrate` is peer input: authenticated, its fields checked, and it sends only a
    handoff the worker holds (a request moved already, or never held, is NOT_FOUND)."""
    def call(body, channel):
        method = channel.unary_unary(f"/{ROLE_SERVICE}/Migrate", request_serializer=pack,
                                     response_deserializer=unpack)
        with pytest.raises(grpc.RpcError) as e:
            method({"wire_version": WIRE_VERSION, **body}, timeout=10)
        return e.value.code()

    good = {"request_id": moved_id, "destination": kv_address}
    with AUTH.channel(address) as channel:
        assert call(good, channel) == grpc.StatusCode.NOT_FOUND
        for bad in ({"destination": kv_address}, {**good, "request_id": "x\x00\x1b"},
                    {**good, "destination": 7}, {**good, "destination": "h" * 10_000}):
            assert call(bad, channel) == grpc.StatusCode.INVALID_ARGUMENT
        assert call({**good, "epoch": 2}, channel) == grpc.StatusCode.FAILED_PRECONDITION
    with grpc.insecure_channel(address) as channel:
        assert call(good, channel) == grpc.StatusCode.UNAUTHENTICATED


def _killed_target(procs, path, router_address: str):
    """A decode worker process (8 free slots: the router's first choice over a 4-slot
    one) that SIGKILLs itself once the header of its first inbound KV stream has
    arrived: a migration target killed mid-move. Returns it once it has joined."""
    p = procs.start(["--role", "decode", "--mesh", "decode=1", "--model", path, "--port", "0",
                     "--host", "127.0.0.1", "--http_port", "-1", "--router", router_address,
                     "--kv_transport", "grpc", "--max_model_len", str(MAX_MODEL_LEN),
                     "--slots_per_shard", "8", "--heartbeat_s", "0.2", "--nowarmup"],
                    fault="die_mid_kv_stream:1", env={"JAXPD_CLUSTER_TOKEN": TOKEN})
    procs.wait_line(p, r"decode worker on (\S+)")
    return p


@pytest.mark.slow
def test_a_drained_decode_worker_migrates_its_streams_behind_a_router(tiny_hf_model, procs,
                                                                      caplog):
    """Router, a prefill worker and two decode workers in one process, and a third
    decode worker process: the first decode worker drains (what SIGTERM and a role
    switch run) while its requests stream. The process, the router's first choice, is
    killed as the first move's pages reach it; the requests whose move fails there are
    prefilled again (counted, the reason logged), the others move to the second decode
    worker. Every request finishes with the tokens it would have had, the prefill
    worker never prefills the moved ones again, and no page is held anywhere."""
    path, hf_model = tiny_hf_model
    # Patient: a busy test machine must not drop a worker for a late heartbeat.
    router = Router(path, RouterConfig(max_model_len=MAX_MODEL_LEN, heartbeat_s=1.0,
                                       lease_s=60.0, stall_timeout_s=60.0,
                                       prefix_routing=False), auth=AUTH)
    made = []
    try:
        address = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
        made.append(_worker(path, "prefill", address))
        made.append(_worker(path, "decode", address, migrate_on_drain=True))
        made.append(_worker(path, "decode", None, migrate_on_drain=True))  # joins later
        wait_until(lambda: len(router.live_workers()) == 2, timeout=60)
        (prefill, _, _), (drained, _, outbox_of), (target, _, _) = made
        # The cold workers compile as shapes first arrive: a pass over prompts of the
        # same lengths first, so that no request finishes while another waits on one.
        warm = [router.submit(router.make_request(prompt_token_ids=p,
                                                  sampling_params=_params(i, 4)))
                for i, p in enumerate(mixed_prompts(4, 256, seed=10))]
        assert all(router._wait(r).finish_reason == "length" for r in warm)
        warm_prefilled = prefill.stats()["prefill_tokens"]
        prompts = mixed_prompts(4, 256, seed=9)
        max_tokens = [64 - i for i in range(len(prompts))]
        params = [_params(i, n) for i, n in enumerate(max_tokens)]
        requests = [router.submit(router.make_request(prompt_token_ids=p, sampling_params=q))
                    for p, q in zip(prompts, params)]
        wait_until(lambda: all(len(r.output_ids) >= 3 for r in requests), timeout=120)
        drained.engine.pause_threads()      # mid-stream until the drain resumes them
        assert not any(r.is_final for r in requests)
        doomed = _killed_target(procs, path, address)
        made[2][1].register_with(address, heartbeat_s=0.2)
        wait_until(lambda: len(router.live_workers()) == 4, timeout=120)
        prefilled = prefill.stats()["prefill_tokens"]
        assert prefilled - warm_prefilled == sum(map(len, prompts))
        outbox = outbox_of.migration
        with caplog.at_level(logging.WARNING, logger="jaxpd.serving.router"):
            outbox.drain(time.monotonic() + 120)
            outputs = [router._wait(r) for r in requests]
        assert doomed.wait(timeout=60) == -signal.SIGKILL
        # Every request moved once, or failed to (the killed target): nothing was
        # left held or dropped.
        failed = [m.group(1) for m in (re.search(r"moving (\S+) from .* failed \((.*)\)",
                                                 rec.getMessage()) for rec in caplog.records)
                  if m]
        assert outbox.num_failed == len(failed) >= 1
        assert outbox.num_sent + outbox.num_failed == len(requests) and outbox.num_dropped == 0
        assert all("StatusCode.UNAVAILABLE" in rec.getMessage() for rec in caplog.records
                   if "moving" in rec.getMessage())
        counts = router.counters.snapshot()
        assert counts["migrations"] == outbox.num_sent
        assert counts["migration_fallbacks"] == outbox.num_failed and counts["aborted"] == 0
        for i, out in enumerate(outputs):
            assert out.finish_reason == "length" and len(out.token_ids) == max_tokens[i]
            if i % 2 == 0:
                assert out.token_ids == hf_greedy(hf_model, prompts[i], max_tokens[i])
        # Seeded requests that moved drew what they draw unmoved (at the target).
        again = [router.submit(router.make_request(prompt_token_ids=prompts[i],
                                                   sampling_params=params[i]))
                 for i in range(1, len(prompts), 2)]
        for i, r in zip(range(1, len(prompts), 2), again):
            if requests[i].request_id not in failed:
                assert router._wait(r).token_ids == outputs[i].token_ids
        # The prefill worker computed again only the requests whose move failed (their
        # prompt and output so far; once more if it computed one for the dead target).
        moved_back = [r for r in requests if r.request_id in failed]
        redone = prefill.stats()["prefill_tokens"] - prefilled - sum(
            len(prompts[i]) for i in range(1, len(prompts), 2))
        assert sum(len(r.prompt_ids) for r in moved_back) < redone <= \
            2 * sum(r.num_tokens for r in moved_back)
        assert target.stats()["transfers"] >= len(requests)
        assert drained.stats()["migrations_out"] == len(requests)
        assert outbox.num_held == 0 and drained.engine.is_idle()
        for llm in (drained, target):
            assert_all_pages_free(llm)
        cache = prefill.engine.prefill_cache
        assert cache is None or cache.allocator.num_used == 0
        _forged_migrate_calls(made[1][1].address, made[2][2].kv_address, requests[0].request_id)
    finally:
        router.shutdown()
        for llm, server, service in made:
            server.stop(0)
            if service.migration is not None:
                service.migration.close()
            llm.shutdown()


# ---- a move whose KV was sent but never landed ------------------------------------------

class _PullFails(FakeReceiver):
    """Handoffs arrive; placing the pages of one marked as a migration fails (its
    source is gone before the pull)."""

    def place(self, handoff, sharding):
        if moved(handoff.payload):
            raise TransferError("pull failed: the offer's process is gone")
        return super().place(handoff, sharding)


def test_a_migration_whose_pull_fails_counts_as_a_failed_move_and_prefills_again(caplog):
    """At the target, a moved request's KV that fails to arrive after the drained
    worker sent it is a failed migration (counted, logged with the reason, kept on
    the request for its Decode stream), not an ordinary transfer failure, and the
    request is prefilled again there; an ordinary handoff's failure still counts as
    one. No page stays held."""
    env = make(InlineExecutor(), remote=True, receiver=_PullFails())
    params = SamplingParams(max_tokens=6)
    moving = Request.from_wire(Request("moving-1", [1, 2, 3, 4, 5], params).to_wire())
    moving.output_ids = [6, 7]                       # the client has seen two tokens
    env.requests.register(moving)
    n = moving.num_tokens - 1                        # its KV: all but the last token
    kv = fake_pages(LAYERS, -(-n // PAGE_SIZE), 1.0, PAGE_SIZE)
    env.receiver.push(KVHandoff("moving-1", n, 7, kv, kv,
                                {**moving.to_wire(num_tokens=n), MOVED: True}))
    with caplog.at_level(logging.WARNING, logger="jaxpd.engine.loops.decode_loop"):
        run_env(env, lambda: moving.state is State.WAITING)
    counts = env.stats.snapshot()
    assert counts["migration_failures"] == 1 and counts["transfer_failures"] == 0
    assert "pull failed" in moving.move_failure
    assert any("migration of moving-1 failed" in rec.getMessage() and
               "pull failed" in rec.getMessage() for rec in caplog.records)
    assert env.requests.prefill_inbox.get_nowait() is moving     # prefilled again here
    assert moving.output_ids == [6, 7]
    # An ordinary handoff (no mark; a forged mark that is not True is none) still
    # places, and one that fails counts as an ordinary transfer failure.
    plain = Request.from_wire(Request("plain-1", [1, 2, 3], params).to_wire())
    env.requests.register(plain)
    kv = fake_pages(LAYERS, 1, 1.0, PAGE_SIZE)
    env.receiver.push(KVHandoff("plain-1", 3, 40, kv, kv, {**plain.to_wire(), MOVED: "yes"}))
    run_env(env, lambda: plain.is_final)
    assert plain.output_ids == [40 + i for i in range(6)] and plain.move_failure is None
    assert_no_page_held(env)


@pytest.mark.parametrize("move_failure", [None, "TransferError: pull failed", "bad\x00reason"])
def test_a_migration_that_never_lands_is_a_failed_move_at_the_router(caplog, move_failure):
    """Behind a router: the drained worker accepts Migrate (KV sent) and the target
    then says the KV never landed and it prefilled the request again: counted as a
    failed migration (with the target's reason in the log), not as a move the source
    could not send (`migration_fallbacks`) nor a lost stream, and the client's stream
    goes on. A target that says so in unprintable text is a malformed peer: its
    stream is cut (the request aborts: no other decode worker is left)."""
    from jaxpd.default_model import default_model_dir
    workers = [MovingDecodeWorker(move_failure=move_failure) for _ in range(2)]
    router = Router(default_model_dir(), RouterConfig(max_model_len=512, lease_s=120.0))
    try:
        address = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
        for w in workers:
            w.register(address)
        wait_until(lambda: len(router.workers.live("decode")) == 2, 20)
        with caplog.at_level(logging.WARNING, logger="jaxpd.serving.router"):
            r = router.submit(router.make_request(prompt_token_ids=[5, 6, 7],
                                                  sampling_params=SamplingParams(max_tokens=5)))
            out = router._wait(r)
        counts = router.counters.snapshot()
        source = next(w for w in workers if w.migrate_calls)
        target = next(w for w in workers if w is not source)
        [call] = source.migrate_calls
        assert call["request_id"] == r.request_id
        assert call["destination"] == target.info.kv_address
        assert counts["migrations"] == 1 and counts["migration_fallbacks"] == 0
        if move_failure == "bad\x00reason":
            assert r.state is State.ABORTED and counts["migration_failures"] == 0
            return
        assert out.token_ids == [7, 7, 8, 8, 8] and out.finish_reason == "length"
        assert counts["decode_failovers"] == 0 and counts["aborted"] == 0
        assert counts["migration_failures"] == int(move_failure is not None)
        logged = [rec.getMessage() for rec in caplog.records
                  if "failed after its KV was sent" in rec.getMessage()]
        assert logged == ([] if move_failure is None else [
            f"moving {r.request_id} from {source.info.address} to {target.info.address} "
            f"failed after its KV was sent ({move_failure}); {target.info.address} "
            f"prefilled it again"])
    finally:
        router.shutdown()
        for w in workers:
            w.close()
