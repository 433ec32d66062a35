"""Simulator behaviour on hand-checkable cases, and the latency-model fits."""
import numpy as np
import pytest

from jaxpd.metrics import find_goodput, slo_attainment
from jaxpd.plan.simulator import (DecodeModel, PrefillModel, fit_decode, fit_prefill,
                             simulate_colocated, simulate_disaggregated)
from jaxpd.bench.workload import WorkloadRequest, make_workload

# Prefill: 10 ms fixed + 1 ms per prompt token. Decode: a flat 20 ms step.
PREFILL = PrefillModel(a=0.01, b=0.001, c=0.0)
DECODE = DecodeModel(a=0.02, b=0.0, c=0.0)


def request(index, arrival_s, prompt_len, output_len):
    return WorkloadRequest(arrival_s=arrival_s, prompt_len=prompt_len, output_len=output_len,
                           index=index)


def disaggregated(workload, prefill=PREFILL, decode=DECODE, num_prefill_instances=1,
                  num_decode_instances=1, max_prefill_batch=4, max_decode_batch=8,
                  transfer_s_per_token=0.0):
    return simulate_disaggregated(workload, prefill, decode, num_prefill_instances,
                                  num_decode_instances, max_prefill_batch, max_decode_batch,
                                  transfer_s_per_token)


def colocated(workload, prefill=PREFILL, decode=DECODE, num_instances=1,
              max_prefill_batch=4, max_decode_batch=8):
    return simulate_colocated(workload, prefill, decode, num_instances, max_prefill_batch,
                              max_decode_batch)


def test_latency_models():
    assert PrefillModel(0.5, 0.01, 0.001).batch_time([10, 20]) == pytest.approx(
        0.5 + 0.01 * 30 + 0.001 * 500)
    assert DecodeModel(0.5, 0.01, 0.001).step_time([100, 300]) == pytest.approx(
        0.5 + 0.01 * 2 + 0.001 * 400)
    with pytest.raises(ValueError, match="PrefillModel.b"):
        PrefillModel(0.0, -1.0, 0.0)
    with pytest.raises(ValueError, match="DecodeModel.c"):
        DecodeModel(0.0, 0.0, float("nan"))


def test_one_request_disaggregated():
    [t] = disaggregated([request(0, 1.0, prompt_len=100, output_len=4)],
                        transfer_s_per_token=1e-4)
    # Prefill 0.01 + 100 * 0.001 = 0.11 s, transfer 100 * 1e-4 = 0.01 s.
    assert t.ttft == pytest.approx(0.12)
    assert t.token_times_s == pytest.approx([1.12, 1.14, 1.16, 1.18])
    assert t.tpot == pytest.approx(0.02)
    assert t.finish_s == pytest.approx(1.18)
    assert (t.queue_s, t.prefill_s, t.transfer_s) == pytest.approx((0.0, 0.11, 0.01))


def test_one_request_colocated():
    [t] = colocated([request(0, 1.0, prompt_len=100, output_len=4)])
    assert t.ttft == pytest.approx(0.11)
    assert t.tpot == pytest.approx(0.02)
    assert t.transfer_s is None


def test_decode_step_grows_with_context():
    decode = DecodeModel(a=0.01, b=0.001, c=1e-5)
    [t] = colocated([request(0, 0.0, prompt_len=100, output_len=3)], decode=decode)
    # Step k attends over the prompt and the k tokens emitted so far.
    assert t.itls == pytest.approx([0.01 + 0.001 + 101e-5, 0.01 + 0.001 + 102e-5])


def test_single_output_token_skips_transfer_and_decode():
    [t] = disaggregated([request(0, 0.0, prompt_len=100, output_len=1)],
                        transfer_s_per_token=1.0)
    assert t.token_times_s == pytest.approx([0.11])
    assert t.finish_s == pytest.approx(0.11)
    assert t.transfer_s is None


def test_simultaneous_arrivals_share_a_prefill_batch():
    workload = [request(0, 0.0, 100, 2), request(1, 0.0, 200, 2)]
    together = disaggregated(workload, max_prefill_batch=2)
    assert [t.ttft for t in together] == pytest.approx([0.31, 0.31])  # 0.01 + 0.3
    one_at_a_time = disaggregated(workload, max_prefill_batch=1)
    assert [t.queue_s for t in one_at_a_time] == pytest.approx([0.0, 0.11])
    assert [t.ttft for t in one_at_a_time] == pytest.approx([0.11, 0.32])


def test_least_loaded_routing_spreads_over_prefill_instances():
    workload = [request(0, 0.0, 100, 2), request(1, 0.0, 100, 2)]
    timelines = disaggregated(workload, num_prefill_instances=2, max_prefill_batch=1)
    assert [t.queue_s for t in timelines] == [0.0, 0.0]
    assert [t.ttft for t in timelines] == pytest.approx([0.11, 0.11])


def test_full_decode_batch_makes_arrivals_wait():
    workload = [request(0, 0.0, 10, 3), request(1, 0.0, 10, 3)]
    [first, second] = disaggregated(workload, max_decode_batch=1)
    # Both first tokens at 0.03 (one prefill batch); the second request's decode
    # starts when the first leaves the batch after its 2 steps.
    assert first.token_times_s == pytest.approx([0.03, 0.05, 0.07])
    assert second.token_times_s == pytest.approx([0.03, 0.09, 0.11])


def test_long_prefill_stalls_colocated_decode_but_not_disaggregated():
    # A short request decoding for a long time; a 2000-token prompt (2.01 s of
    # prefill) arrives while it decodes.
    workload = [request(0, 0.0, prompt_len=10, output_len=200),
                request(1, 0.11, prompt_len=2000, output_len=2)]
    short_co, long_co = colocated(workload)
    short_pd, long_pd = disaggregated(workload)
    # Colocated: tokens at 0.02 + 0.02k; the step ending at 0.12 is followed by the
    # whole prefill, so one gap is 2.01 + 0.02.
    assert max(short_co.itls) == pytest.approx(2.03)
    assert long_co.ttft == pytest.approx(0.12 + 2.01 - 0.11)
    # Disaggregated: every step of the short request stays 20 ms.
    assert max(short_pd.itls) == pytest.approx(0.02)
    assert min(short_pd.itls) == pytest.approx(0.02)
    assert long_pd.ttft == pytest.approx(2.01)


def test_colocated_prefill_respects_free_decode_slots():
    workload = [request(0, 0.0, 10, 3), request(1, 0.0, 10, 3)]
    [first, second] = colocated(workload, max_decode_batch=1)
    # One slot: the second prompt is prefilled only once the first request leaves.
    assert first.token_times_s == pytest.approx([0.02, 0.04, 0.06])
    assert second.token_times_s == pytest.approx([0.08, 0.10, 0.12])


def test_results_follow_workload_order_and_are_deterministic():
    workload = make_workload(60, rate=20.0, prompt_mix="32:2,256:1", output_mix="4:1,32:1",
                             seed=5)
    runs = [disaggregated(workload, num_prefill_instances=2, num_decode_instances=2,
                          transfer_s_per_token=1e-5) for _ in range(2)]
    assert runs[0] == runs[1]
    assert [t.arrival_s for t in runs[0]] == [r.arrival_s for r in workload]
    assert [t.num_tokens for t in runs[0]] == [r.output_len for r in workload]
    co = colocated(workload, num_instances=2)
    assert [t.num_tokens for t in co] == [r.output_len for r in workload]
    assert disaggregated([]) == [] and colocated([]) == []


def test_disaggregation_wins_goodput_under_a_tight_tpot_slo():
    # Long prompts, 30 ms TPOT SLO on a ~20 ms step: one 0.5 s prefill landing among a
    # colocated request's 31 decode steps already breaks its SLO, so 2 colocated
    # instances sustain well under half the rate of 1 prefill + 1 decode instance.
    prefill = PrefillModel(a=0.0, b=0.0005, c=0.0)
    decode = DecodeModel(a=0.02, b=0.0005, c=0.0)

    def attainment(simulate):
        def at_rate(rate):
            workload = make_workload(100, rate, "1024", "32", seed=0)
            return slo_attainment(simulate(workload), slo_ttft_s=2.0, slo_tpot_s=0.03)
        return at_rate

    goodput_pd = find_goodput(attainment(
        lambda w: disaggregated(w, prefill, decode, max_prefill_batch=1,
                                max_decode_batch=32)), lo=0.1, hi=10.0)
    goodput_co = find_goodput(attainment(
        lambda w: colocated(w, prefill, decode, num_instances=2, max_prefill_batch=1,
                            max_decode_batch=32)), lo=0.1, hi=10.0)
    assert goodput_pd is not None and goodput_co is not None
    assert goodput_pd > 2 * goodput_co


def test_fit_recovers_exact_models():
    prefill = PrefillModel(a=0.005, b=2e-4, c=3e-8)
    batches = [[16], [128], [512, 512], [64, 1024, 2048], [4096], [100, 200, 300, 400]]
    fitted = fit_prefill([(lens, prefill.batch_time(lens)) for lens in batches])
    assert (fitted.a, fitted.b, fitted.c) == pytest.approx((0.005, 2e-4, 3e-8), rel=1e-6)

    decode = DecodeModel(a=0.01, b=1e-4, c=2e-7)
    contexts = [[100], [100] * 8, [2000] * 4, [50, 4000], [300] * 32, [10] * 2]
    fitted = fit_decode([(ctx, decode.step_time(ctx)) for ctx in contexts])
    assert (fitted.a, fitted.b, fitted.c) == pytest.approx((0.01, 1e-4, 2e-7), rel=1e-6)


def test_fit_clamps_negative_terms_and_refits():
    # Step time falls slightly with context: a plain fit gives c < 0.
    rng = np.random.default_rng(0)
    samples = []
    for batch in (1, 2, 4, 8, 16):
        for context in (100, 1000, 4000):
            lens = [context] * batch
            samples.append((lens, 0.01 + 1e-3 * batch - 1e-9 * batch * context
                            + 1e-6 * rng.standard_normal()))
    fitted = fit_decode(samples)
    assert fitted.c == 0.0
    assert fitted.a == pytest.approx(0.01, rel=0.1)
    assert fitted.b == pytest.approx(1e-3, rel=0.1)


def test_fit_and_simulate_validation():
    with pytest.raises(ValueError, match="at least one"):
        fit_prefill([])
    with pytest.raises(ValueError, match="empty batch"):
        fit_decode([([], 0.1)])
    with pytest.raises(ValueError, match="num_prefill_instances"):
        disaggregated([], num_prefill_instances=0)
    with pytest.raises(ValueError, match="transfer_s_per_token"):
        disaggregated([], transfer_s_per_token=-1.0)
    with pytest.raises(ValueError, match="max_decode_batch"):
        colocated([], max_decode_batch=0)
