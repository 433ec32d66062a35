"""Penalties, min_p and log-probabilities on device.

The sampler against numpy references on random logits (one compiled call holds every
kind of row), the wire form of log-probabilities, then the engine end to end against
transformers: greedy tokens with a repetition penalty equal to `generate`'s, presence
and frequency penalties equal to a numpy loop over the model's logits, log-probabilities
equal to a full forward's, requests with different options mixed in one batch without a
new program, on one and two decode shards, through preemption, and across a router,
a prefill worker and a decode worker.
"""
from __future__ import annotations

import time

import jax
import msgpack
import numpy as np
import pytest

from jaxpd.engine.programs.penalties import apply_penalties, prefill_context
from jaxpd.engine.programs.sampler import SamplingArrays, sample
from jaxpd.request import Request, State, logprobs_from_wire
from jaxpd.sampling_params import SamplingParams
from tests.engine_fixtures import XlaCompiles, assert_all_pages_free
from tests.hf_fixtures import hf_greedy, hf_logits

V = 40


def np_penalised(logits, counts, prompt, r, presence, frequency):
    """The rule, element by element: repetition over prompt or output (a positive logit
    / r, a negative one * r), then frequency * count and presence * (count > 0)."""
    out = logits.copy()
    for b, v in np.ndindex(out.shape):
        if prompt[b, v] or counts[b, v]:
            out[b, v] = out[b, v] / r[b] if out[b, v] > 0 else out[b, v] * r[b]
        out[b, v] -= frequency[b] * counts[b, v] + presence[b] * (counts[b, v] > 0)
    return out


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def arrays(rows: list[dict]) -> SamplingArrays:
    """Sampling arrays with each row's fields set from `rows` (SamplingParams names)."""
    s = SamplingArrays.empty(len(rows))
    for i, row in enumerate(rows):
        for name, value in row.items():
            getattr(s, {"logprobs": "num_logprobs"}.get(name, name))[i] = value
    return s


# ---- the sampler on random logits ------------------------------------------------------

def test_penalties_match_a_numpy_reference_and_leave_neutral_rows_untouched():
    rng = np.random.default_rng(0)
    rows = [dict(), dict(repetition_penalty=1.5), dict(repetition_penalty=0.7),
            dict(presence_penalty=0.5), dict(frequency_penalty=0.4),
            dict(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.3), dict()]
    s = arrays(rows)
    logits = (rng.standard_normal((len(rows), V)) * 3).astype(np.float32)
    counts = (rng.integers(0, 4, (len(rows), V)) * (rng.random((len(rows), V)) < 0.3)
              ).astype(np.int32)
    prompt = rng.random((len(rows), V)) < 0.3
    out = np.asarray(jax.jit(apply_penalties)(logits, s, counts, prompt))
    expected = np_penalised(logits, counts, prompt, s.repetition_penalty, s.presence_penalty,
                            s.frequency_penalty)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[[0, 6]], logits[[0, 6]])          # bit for bit
    # The sign rule: a repetition penalty above 1 lowers every seen logit, positive or
    # negative, and leaves unseen ones alone.
    seen = prompt[1] | (counts[1] > 0)
    assert np.all(out[1][seen & (logits[1] != 0)] < logits[1][seen & (logits[1] != 0)])
    np.testing.assert_array_equal(out[1][~seen], logits[1][~seen])
    # Presence: once per token whatever its count; frequency: once per occurrence.
    counted = counts[3] > 0
    np.testing.assert_allclose(out[3][counted], logits[3][counted] - 0.5, rtol=1e-6)
    np.testing.assert_allclose(out[4], logits[4] - 0.4 * counts[4], rtol=1e-6, atol=1e-6)


def test_prefill_context_counts_the_output_after_the_prompt_and_skips_padding():
    tokens = np.array([[5, 6, 5, 7, 9, 0, 0, 0],
                       [3, 3, 4, 2, 2, 2, 0, 0]], np.int32)
    counts, prompt = jax.jit(prefill_context, static_argnums=3)(
        tokens, np.array([5, 6], np.int32), np.array([5, 3], np.int32), V)
    want_counts = np.zeros((2, V), np.int32)
    want_counts[1, 2] = 3                                 # a recompute's output so far
    want_prompt = np.zeros((2, V), bool)
    want_prompt[0, [5, 6, 7, 9]] = True
    want_prompt[1, [3, 4]] = True
    np.testing.assert_array_equal(np.asarray(counts), want_counts)
    np.testing.assert_array_equal(np.asarray(prompt), want_prompt)


@pytest.fixture(scope="module")
def mixed():
    """One jitted `sample` over rows of every kind, and what it returned."""
    rng = np.random.default_rng(1)
    rows = ([dict(temperature=1.0, min_p=0.2, seed=i) for i in range(200)]
            + [dict(temperature=0.8, min_p=1.0, seed=i) for i in range(20)]
            + [dict(logprobs=n) for n in (0, 1, 5, 20)]
            + [dict(temperature=0.7, logprobs=3, repetition_penalty=1.4, seed=9)]
            + [dict(repetition_penalty=1.5, frequency_penalty=0.5, logprobs=2),
               dict(presence_penalty=1.0), dict()])
    s = arrays(rows)
    logits = rng.standard_normal((len(rows), V)).astype(np.float32)
    counts = (rng.integers(0, 3, (len(rows), V)) * (rng.random((len(rows), V)) < 0.2)
              ).astype(np.int32)
    prompt = rng.random((len(rows), V)) < 0.2
    penalised = [i for i, row in enumerate(rows) if any(k.endswith("penalty") for k in row)]
    counts[penalised, logits[penalised].argmax(-1)] = 2    # the top token was seen
    positions = np.arange(len(rows), dtype=np.int32)
    run = jax.jit(lambda logits, s, positions, counts, prompt:
                  sample(logits, s, positions, lambda: (counts, prompt)))
    tokens, logprobs = jax.device_get(run(logits, s, positions, counts, prompt))
    greedy_rows = SamplingArrays.empty(len(rows))
    plain, plain_logprobs = jax.device_get(run(logits, greedy_rows, positions, counts, prompt))
    return dict(rows=rows, s=s, logits=logits, counts=counts, prompt=prompt, tokens=tokens,
                logprobs=logprobs, plain=plain, plain_logprobs=plain_logprobs,
                penalised=penalised)


def test_min_p_never_draws_a_token_below_its_threshold(mixed):
    tokens, logits = mixed["tokens"][:200], mixed["logits"][:200]
    probs = np.exp(np_log_softmax(logits))                # temperature 1
    assert np.all(probs[np.arange(200), tokens] >= 0.2 * probs.max(-1) - 1e-6)
    assert np.mean(tokens != logits.argmax(-1)) > 0.2     # it does sample


def test_min_p_one_draws_the_greedy_token(mixed):
    np.testing.assert_array_equal(mixed["tokens"][200:220], mixed["logits"][200:220].argmax(-1))


def test_penalised_rows_follow_the_reference_and_neutral_rows_stay_plain_greedy(mixed):
    s, logits = mixed["s"], mixed["logits"]
    expected = np_penalised(logits, mixed["counts"], mixed["prompt"], s.repetition_penalty,
                            s.presence_penalty, s.frequency_penalty)
    greedy = [i for i, row in enumerate(mixed["rows"]) if "temperature" not in row]
    np.testing.assert_array_equal(mixed["tokens"][greedy], expected[greedy].argmax(-1))
    penalised = [i for i in mixed["penalised"] if i in greedy]
    assert np.all(mixed["tokens"][penalised] != logits[penalised].argmax(-1))
    # Every row greedy and neutral: exactly argmax, no log-probabilities computed.
    np.testing.assert_array_equal(mixed["plain"], logits.argmax(-1))
    assert not np.any(mixed["plain_logprobs"].top_values)


def test_logprobs_are_the_raw_log_softmax_top_n_best_first(mixed):
    lp = mixed["logprobs"]
    for i, row in enumerate(mixed["rows"]):
        if "logprobs" not in row:
            continue
        ref = np_log_softmax(mixed["logits"][i])          # before penalties and temperature
        n = row["logprobs"]
        token, top = lp.of_row(i, _asking(n))
        assert len(top) == n
        assert token == pytest.approx(ref[mixed["tokens"][i]], abs=1e-5)
        assert [t for t, _ in top] == np.argsort(-ref)[:n].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(ref)[::-1][:n], atol=1e-5)


def _asking(n: int) -> Request:
    return Request("r", [1], SamplingParams(logprobs=n))


# ---- log-probabilities on the wire --------------------------------------------------------

@pytest.mark.parametrize("top_k", [True, False])
def test_both_top_n_paths_agree_with_numpy(monkeypatch, top_k):
    """`lax.top_k` (new jax) and the stable sort (jax 0.6, see `_TOP_K_IN_SHARD_MAP`)."""
    from jaxpd.engine.programs import sampler
    monkeypatch.setattr(sampler, "_TOP_K_IN_SHARD_MAP", top_k)
    raw = np.random.default_rng(3).normal(size=(5, 300)).astype(np.float32)
    raw[0, 7] = raw[0, 9] = raw[0].max() + 1       # a tie: the lower id first
    tokens = np.array([7, 0, 299, 5, 17], np.int32)
    got = jax.jit(sampler._logprobs, static_argnums=2)(raw, tokens, 20)
    log_p = raw - np.log(np.exp(raw - raw.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - raw.max(-1, keepdims=True)
    order = np.argsort(-log_p, axis=-1, kind="stable")[:, :20]
    assert np.array_equal(np.asarray(got.top_ids), order)
    np.testing.assert_allclose(got.top_values, np.take_along_axis(log_p, order, -1), atol=1e-5)
    np.testing.assert_allclose(got.sampled, log_p[np.arange(5), tokens], atol=1e-5)


def test_logprobs_ride_the_wire_form_and_the_first_tokens_apart():
    params = SamplingParams(max_tokens=4, logprobs=2)
    r = Request("w", [1, 2, 3], params, state=State.PREFILLING)
    first = (-0.25, ((7, -0.25), (9, -1.5)))
    r.append_token(7, 0.0, first)
    handoff = msgpack.unpackb(msgpack.packb(r.to_wire(num_tokens=3)))
    assert handoff["output_ids"] == [] and "logprobs" not in handoff
    assert logprobs_from_wire([handoff["next_logprobs"]], 1, 2) == [first]
    r.append_token(9, 0.0, (-1.0, ((8, -0.5), (9, -1.0))))
    # Output already streamed keeps its log-probabilities where it was streamed from: a
    # failover's wire form does not resend them (the mirror holds placeholders).
    mirror = Request.from_wire(msgpack.unpackb(msgpack.packb(r.to_wire())))
    assert mirror.output_ids == [7, 9] and len(mirror.logprobs) == 2
    assert all(np.isnan(lp) and top == () for lp, top in mirror.logprobs)
    assert "next_logprobs" not in r.to_wire()
    assert "logprobs" not in Request("w", [1], SamplingParams()).to_wire()
    nan = logprobs_from_wire([[float("nan"), []]], 1, 2)[0]    # a token without them
    assert np.isnan(nan[0]) and nan[1] == ()


# ---- end to end ---------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 5, 6, 9, 11], [40, 41, 40, 41, 40], [100, 3, 17, 100, 3, 200, 17, 9],
           [9, 9, 9, 250, 12, 13]]
MAX_TOKENS = 14
LONG_PROMPT = list(range(30, 48))           # a bucket of 32 tokens


def generate(llm, params: list[SamplingParams | Request], prompts=PROMPTS) -> list[Request]:
    """Submit every (prompt, params) -- or request -- at once (they share batches); wait
    for all."""
    requests = [llm.submit(sp if isinstance(sp, Request) else
                           llm.make_request(prompt_token_ids=p, sampling_params=sp))
                for p, sp in zip(prompts, params)]
    deadline = time.monotonic() + 120
    while not all(r.is_final for r in requests):
        assert time.monotonic() < deadline, requests
        time.sleep(0.005)
    assert all(r.finish_reason == "length" for r in requests), requests
    return requests


def greedy(**options) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **options)


def hf_penalised(hf, prompt, n, repetition=1.0, presence=0.0, frequency=0.0) -> list[int]:
    """Greedy tokens of the numpy rule over transformers' logits, one forward a token."""
    out = []
    for _ in range(n):
        logits = hf_logits(hf, prompt + out)[-1:]
        counts = np.bincount(out, minlength=logits.shape[1])[None].astype(np.int32)
        seen = np.isin(np.arange(logits.shape[1]), prompt)[None]
        out.append(int(np_penalised(logits, counts, seen, [repetition], [presence],
                                    [frequency]).argmax()))
    return out


def hf_generate_repetition(hf, prompt, n, r) -> list[int]:
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                          repetition_penalty=r)
    return out[0, len(prompt):].tolist()


def assert_logprobs_match_a_full_forward(hf, r: Request) -> None:
    """Each token's log-probability and top `logprobs` equal those of transformers'
    logits over prompt + output (1e-4), best first; exactly N pairs a token."""
    n = r.params.logprobs
    assert len(r.logprobs) == len(r.output_ids)
    ref = np_log_softmax(hf_logits(hf, r.prompt_ids + r.output_ids)[len(r.prompt_ids) - 1:-1])
    for j, (token, (sampled, top)) in enumerate(zip(r.output_ids, r.logprobs)):
        assert len(top) == n
        assert sampled == pytest.approx(ref[j, token], abs=1e-4)
        ids, values = [t for t, _ in top], [v for _, v in top]
        # The argsort's top n, up to float near-ties between neighbours.
        np.testing.assert_allclose(values, np.sort(ref[j])[::-1][:n], atol=1e-4)
        np.testing.assert_allclose(ref[j, ids], values, atol=1e-4)


@pytest.fixture(scope="module")
def llm(tiny_hf_model):
    from jaxpd import LLM
    with LLM(tiny_hf_model[0], mesh="prefill=1,decode=1", max_model_len=32, slots_per_shard=4,
             max_prefill_batch=2, warmup=True) as llm:
        yield llm


@pytest.mark.slow
def test_repetition_penalty_greedy_equals_transformers_generate(llm, tiny_hf_model):
    hf = tiny_hf_model[1]
    penalties = [1.3, 0.8, 1.6, 1.0]
    outs = generate(llm, [greedy(repetition_penalty=r) for r in penalties])
    for r, p, out in zip(penalties, PROMPTS, outs):
        assert out.output_ids == hf_generate_repetition(hf, p, MAX_TOKENS, r)
    assert any(out.output_ids != hf_greedy(hf, p, MAX_TOKENS)
               for p, out in zip(PROMPTS[:3], outs))
    assert_all_pages_free(llm)


@pytest.mark.slow
def test_presence_and_frequency_penalties_equal_the_numpy_rule(llm, tiny_hf_model):
    hf = tiny_hf_model[1]
    options = [dict(presence=0.8), dict(frequency=0.6), dict(repetition=1.2, presence=-0.4,
                                                               frequency=0.9), dict()]
    outs = generate(llm, [greedy(presence_penalty=o.get("presence", 0.0),
                                 frequency_penalty=o.get("frequency", 0.0),
                                 repetition_penalty=o.get("repetition", 1.0)) for o in options])
    for o, p, out in zip(options, PROMPTS, outs):
        assert out.output_ids == hf_penalised(hf, p, MAX_TOKENS, **o)
    assert_all_pages_free(llm)


@pytest.mark.slow
def test_a_recompute_counts_the_output_it_already_has_as_output(llm, tiny_hf_model):
    """A request that arrives with output (a preemption's recompute, a router's
    failover) is prefilled from prompt + output: the output part must be penalised as
    output (presence, frequency), not as prompt."""
    hf = tiny_hf_model[1]
    options = dict(presence=1.5, frequency=2.0)
    full = hf_penalised(hf, PROMPTS[0], MAX_TOKENS, **options)
    params = greedy(presence_penalty=1.5, frequency_penalty=2.0)
    requests = [Request.from_wire({**Request(f"recompute-{k}", PROMPTS[0], params).to_wire(),
                                   "output_ids": full[:k]}, State.WAITING) for k in (2, 5, 8, 11)]
    outs = generate(llm, requests)
    assert all(out.output_ids == full for out in outs)


@pytest.mark.slow
def test_min_p_one_samples_the_greedy_tokens(llm, tiny_hf_model):
    hf = tiny_hf_model[1]
    outs = generate(llm, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, min_p=1.0,
                                         seed=s, ignore_eos=True) for s in range(4)])
    assert [o.output_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.slow
def test_logprobs_equal_a_full_forward_with_each_requests_own_n(llm, tiny_hf_model):
    hf = tiny_hf_model[1]
    params = [greedy(logprobs=0), greedy(logprobs=20, repetition_penalty=1.5),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, logprobs=3,
                             ignore_eos=True), greedy()]
    outs = generate(llm, params)
    for out in outs[:3]:
        assert_logprobs_match_a_full_forward(hf, out)
    assert outs[3].logprobs is None
    assert outs[1].output_ids == hf_generate_repetition(hf, PROMPTS[1], MAX_TOKENS, 1.5)


@pytest.mark.slow
def test_neutral_options_beside_penalised_rows_are_plain_greedy(llm, tiny_hf_model):
    hf = tiny_hf_model[1]
    neutral = greedy(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                     min_p=0.0)
    outs = generate(llm, [greedy(), neutral, greedy(repetition_penalty=2.0, logprobs=1),
                          neutral], [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[3]])
    assert [outs[i].output_ids for i in (0, 1, 3)] == [
        hf_greedy(hf, PROMPTS[i], MAX_TOKENS) for i in (0, 1, 3)]
    assert outs[2].output_ids != outs[0].output_ids


@pytest.mark.slow
def test_mixing_options_compiles_no_new_program(llm):
    programs = lambda: {k: v for k, v in llm.stats()["compiled_programs"].items()
                        if not k.endswith(("take_pages", "_background"))}
    before = programs()
    options = [dict(), dict(repetition_penalty=1.3, logprobs=4), dict(min_p=0.3, temperature=1.0),
               dict(presence_penalty=0.5, frequency_penalty=0.2, temperature=0.5, top_k=5),
               dict(logprobs=0, top_p=0.8, temperature=1.2), dict(frequency_penalty=-1.0)]
    with XlaCompiles(on_request_threads=True) as compiles:
        for i in range(3):
            generate(llm, [SamplingParams(max_tokens=8, ignore_eos=True, seed=i, **o)
                           for o in options[i:] + options[:i]], PROMPTS + PROMPTS[:2])
    assert programs() == before
    assert compiles.count == 0
    assert_all_pages_free(llm)


@pytest.mark.slow
def test_two_decode_shards_with_preemption_keep_penalties_and_logprobs(tiny_hf_model):
    """dp=2 penalty rows, and recomputes (prompt + output prefilled again) that count
    the output already generated as output, not prompt."""
    from jaxpd import LLM
    path, hf = tiny_hf_model
    prompts = PROMPTS * 2
    n = 30
    kinds = [dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
             dict(logprobs=2), dict(), dict(repetition_penalty=1.2, frequency_penalty=0.5,
                                            logprobs=1), dict(presence_penalty=1.1),
             dict(repetition_penalty=0.9), dict(frequency_penalty=0.8)]
    with LLM(path, mesh="prefill=2,decode=2", max_model_len=48, slots_per_shard=4,
             pages_per_shard=7, warmup=False) as llm:
        outs = generate(llm, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **k)
                              for k in kinds], prompts)
        assert llm.stats()["preemptions"] > 0
        assert_all_pages_free(llm)
    for k, p, out in zip(kinds, prompts, outs):
        assert out.output_ids == hf_penalised(hf, p, n, k.get("repetition_penalty", 1.0),
                                              k.get("presence_penalty", 0.0),
                                              k.get("frequency_penalty", 0.0))
        if out.logprobs is not None:
            assert_logprobs_match_a_full_forward(hf, out)


@pytest.mark.slow
def test_router_prefill_and_decode_workers_carry_penalties_and_logprobs(tiny_hf_model):
    """The first token's log-probabilities travel in the handoff's wire form (prefill
    worker -> decode worker; whole, and on the last part of a layer-wise one), every
    token's in the Decode stream (-> router)."""
    from jaxpd import LLM
    from jaxpd.serving.role_server import RoleServer, RoleService, make_connector
    from jaxpd.serving.router import Router, RouterConfig
    path, hf = tiny_hf_model
    servers, llms = [], []
    router = None
    try:
        for role, mesh in (("prefill", "prefill=1"), ("decode", "decode=1")):
            connector, kv_address = make_connector(role, "grpc", "127.0.0.1")
            llms.append(LLM(path, mesh=mesh, connector=connector, max_model_len=32,
                            slots_per_shard=4, layerwise_min_tokens=32, layerwise_parts=2,
                            warmup=False))
            servers.append(RoleServer(RoleService(llms[-1].engine, kv_address, "grpc"),
                                      "127.0.0.1", 0))
            servers[-1].start()
        # Liveness is not under test: generous clocks, so first compiles on busy cores
        # drop nobody.
        router = Router(path, RouterConfig(max_model_len=32, heartbeat_s=1.0, lease_s=60,
                                           stall_timeout_s=60),
                        prefill=(servers[0].address,), decode=(servers[1].address,))
        deadline = time.monotonic() + 30
        while len(router.live_workers()) < 2:
            assert time.monotonic() < deadline, "workers not live"
            time.sleep(0.05)
        params = [greedy(logprobs=3, repetition_penalty=1.3), greedy(logprobs=0),
                  greedy(presence_penalty=0.8, frequency_penalty=0.3), greedy(),
                  SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)]
        outs = generate(router, params, PROMPTS + [LONG_PROMPT])
        assert router.counters.snapshot()["decode_prefills"] == 0      # prefilled remotely
        assert llms[1].stats()["transfers"] == len(params)
        assert llms[1].stats()["layerwise_transfers"] == 1             # the long prompt
    finally:
        if router is not None:
            router.shutdown()
        for s in servers:
            s.stop(0)
        for x in llms:
            x.shutdown()
    assert outs[0].output_ids == hf_generate_repetition(hf, PROMPTS[0], MAX_TOKENS, 1.3)
    assert outs[2].output_ids == hf_penalised(hf, PROMPTS[2], MAX_TOKENS, presence=0.8,
                                              frequency=0.3)
    assert outs[3].output_ids == hf_greedy(hf, PROMPTS[3], MAX_TOKENS)
    for out in outs[:2] + outs[4:]:
        assert_logprobs_match_a_full_forward(hf, out)
