"""Metric definitions checked on hand-made timelines with exact expected numbers."""
import math
import threading

import pytest

from jaxpd.metrics import (LatencyHistogram, RequestTimeline, find_goodput, format_table,
                           meets_slo, run_report, slo_attainment, summarize)


def timeline(arrival, tokens, finish=None, **kwargs):
    return RequestTimeline(arrival_s=arrival, token_times_s=tokens,
                           finish_s=tokens[-1] if finish is None else finish, **kwargs)


def test_ttft_tpot_itl_e2e_exclude_first_token_from_tpot():
    t = timeline(1.0, [1.5, 1.6, 1.8, 2.1], finish=2.2)
    assert t.ttft == pytest.approx(0.5)
    # (2.1 - 1.5) / 3, not (2.1 - 1.0) / 4: prefill is TTFT's business.
    assert t.tpot == pytest.approx(0.2)
    assert t.itls == pytest.approx([0.1, 0.2, 0.3])
    assert t.e2e == pytest.approx(1.2)
    assert t.num_tokens == 4


def test_single_token_has_no_tpot_and_no_itls():
    t = timeline(0.0, [0.3])
    assert t.ttft == pytest.approx(0.3)
    assert t.tpot is None
    assert t.itls == []


def test_no_token_has_no_ttft_and_fails_slo():
    t = RequestTimeline(arrival_s=0.0, token_times_s=[], finish_s=0.5)
    assert t.ttft is None and t.tpot is None
    assert not meets_slo(t, slo_ttft_s=10.0, slo_tpot_s=10.0)


def test_timeline_is_immutable_and_stores_a_tuple():
    t = timeline(0.0, [0.1, 0.2])
    assert t.token_times_s == (0.1, 0.2)
    with pytest.raises(AttributeError):
        t.finish_s = 3.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(arrival_s=1.0, token_times_s=[0.5], finish_s=1.0), "precedes arrival"),
    (dict(arrival_s=0.0, token_times_s=[0.5, 0.4], finish_s=1.0), "non-decreasing"),
    (dict(arrival_s=0.0, token_times_s=[0.5], finish_s=0.4), "finish_s"),
    (dict(arrival_s=math.nan, token_times_s=[0.5], finish_s=1.0), "arrival_s"),
    (dict(arrival_s=0.0, token_times_s=[0.5], finish_s=1.0, queue_s=-1.0), "queue_s"),
    (dict(arrival_s=0.0, token_times_s=[0.5], finish_s=1.0, transfer_bytes=-1),
     "transfer_bytes"),
])
def test_timeline_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RequestTimeline(**kwargs)


def test_summarize_exact_percentiles():
    stats = summarize(float(v) for v in range(101))  # 0..100: percentile p is p itself
    assert stats == {"mean": 50.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert all(type(v) is float for v in stats.values())


def test_summarize_interpolates_and_handles_empty():
    assert summarize([1.0, 2.0, 3.0, 4.0])["p50"] == pytest.approx(2.5)
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_meets_slo_bounds_are_inclusive_and_single_token_passes_tpot():
    t = timeline(0.0, [0.5, 0.7, 0.9])  # ttft 0.5, tpot 0.2
    assert meets_slo(t, slo_ttft_s=0.5, slo_tpot_s=0.2)
    assert not meets_slo(t, slo_ttft_s=0.49, slo_tpot_s=0.2)
    assert not meets_slo(t, slo_ttft_s=0.5, slo_tpot_s=0.19)
    assert meets_slo(timeline(0.0, [0.5]), slo_ttft_s=0.5, slo_tpot_s=0.0)


def test_slo_attainment_fraction():
    timelines = [
        timeline(0.0, [0.1, 0.2]),         # meets both
        timeline(0.0, [2.0, 2.1]),         # TTFT miss
        timeline(0.0, [0.1, 0.9]),         # TPOT miss
        timeline(0.0, [0.1]),              # one token: TPOT trivially met
    ]
    assert slo_attainment(timelines, slo_ttft_s=1.0, slo_tpot_s=0.5) == 0.5
    with pytest.raises(ValueError):
        slo_attainment([], 1.0, 1.0)


class StepAttainment:
    """Attainment 1.0 up to `knee` req/s, 0.5 above; records every probed rate."""

    def __init__(self, knee):
        self.knee = knee
        self.probes = []

    def __call__(self, rate):
        self.probes.append(rate)
        return 1.0 if rate <= self.knee else 0.5


def test_find_goodput_bisects_to_the_knee():
    f = StepAttainment(knee=5.0)
    # [1, 17] -> 9 F, 5 P, 7 F, 6 F, 5.5 F, 5.25 F; gap 0.25 <= 0.05 * 5: stop at 5.
    assert find_goodput(f, lo=1.0, hi=17.0) == 5.0
    assert f.probes == [17.0, 1.0, 9.0, 5.0, 7.0, 6.0, 5.5, 5.25]


def test_find_goodput_result_is_a_passing_rate_within_tolerance():
    f = StepAttainment(knee=7.3)
    rate = find_goodput(f, lo=0.5, hi=100.0, rel_tol=0.01)
    assert rate <= 7.3 and rate >= 7.3 / 1.01 - 1e-9


def test_find_goodput_edges():
    assert find_goodput(StepAttainment(knee=50.0), lo=1.0, hi=20.0) == 20.0
    assert find_goodput(StepAttainment(knee=0.5), lo=1.0, hi=20.0) is None
    assert find_goodput(lambda rate: 0.9, lo=1.0, hi=20.0, target=0.9) == 20.0
    f = StepAttainment(knee=5.0)
    assert find_goodput(f, lo=1.0, hi=17.0, max_iters=1) == 1.0  # 9 fails, stop
    with pytest.raises(ValueError, match="lo"):
        find_goodput(f, lo=0.0, hi=1.0)
    with pytest.raises(ValueError, match="target"):
        find_goodput(f, lo=1.0, hi=2.0, target=1.5)


def test_histogram_prometheus_text():
    h = LatencyHistogram(bounds=[0.1, 1.0])
    for x in (0.05, 0.1, 0.5, 3.0):
        h.observe(x)
    assert h.count == 4 and h.sum == pytest.approx(3.65)
    assert h.render("jaxpd_ttft_seconds", "Time to first token.") == (
        "# HELP jaxpd_ttft_seconds Time to first token.\n"
        "# TYPE jaxpd_ttft_seconds histogram\n"
        'jaxpd_ttft_seconds_bucket{le="0.1"} 2\n'
        'jaxpd_ttft_seconds_bucket{le="1.0"} 3\n'
        'jaxpd_ttft_seconds_bucket{le="+Inf"} 4\n'
        "jaxpd_ttft_seconds_sum 3.65\n"
        "jaxpd_ttft_seconds_count 4\n")


def test_histogram_empty_escaping_and_validation():
    text = LatencyHistogram(bounds=[1.0]).render("x", "a\\b\nc")
    assert text.splitlines() == ["# HELP x a\\\\b\\nc", "# TYPE x histogram",
                                 'x_bucket{le="1.0"} 0', 'x_bucket{le="+Inf"} 0',
                                 "x_sum 0.0", "x_count 0"]
    with pytest.raises(ValueError, match="increasing"):
        LatencyHistogram(bounds=[1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        LatencyHistogram(bounds=[1.0, math.inf])
    with pytest.raises(ValueError, match="metric name"):
        LatencyHistogram().render("bad-name", "")


def test_histogram_is_thread_safe():
    h = LatencyHistogram(bounds=[0.5])
    threads = [threading.Thread(target=lambda: [h.observe(0.25) for _ in range(2000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.count == 8000 and h.sum == pytest.approx(2000.0)
    assert 'x_bucket{le="0.5"} 8000' in h.render("x", "")


def test_run_report_shape_and_values():
    timelines = [timeline(0.0, [0.1, 0.2, 0.3]), timeline(1.0, [1.5], finish=1.6)]
    report = run_report("prefill=1,decode=1", timelines, duration_s=2.0,
                        slo_ttft_s=0.2, slo_tpot_s=0.2, goodput_req_s=3.5)
    assert set(report) == {"name", "ttft_s", "tpot_s", "itl_s", "e2e_s", "output_tok_s",
                           "req_s", "slo_attainment", "goodput_req_s", "num_requests",
                           "handoff_gap_s", "later_itl_s"}
    assert report["name"] == "prefill=1,decode=1"
    assert report["ttft_s"]["mean"] == pytest.approx(0.3)
    assert report["tpot_s"] == pytest.approx({"mean": 0.1, "p50": 0.1, "p90": 0.1,
                                              "p99": 0.1})
    assert report["itl_s"]["p50"] == pytest.approx(0.1)
    assert report["handoff_gap_s"]["p50"] == pytest.approx(0.1)   # only the first has gaps
    assert report["later_itl_s"]["mean"] == pytest.approx(0.1)
    assert report["e2e_s"]["p50"] == pytest.approx(0.45)
    assert report["output_tok_s"] == 2.0 and report["req_s"] == 1.0
    assert report["slo_attainment"] == 0.5
    assert report["goodput_req_s"] == 3.5 and report["num_requests"] == 2


def test_run_report_empty_run():
    report = run_report("empty", [], duration_s=1.0, slo_ttft_s=1.0, slo_tpot_s=1.0)
    assert report["num_requests"] == 0 and report["slo_attainment"] is None
    assert report["ttft_s"]["p99"] is None
    with pytest.raises(ValueError, match="duration_s"):
        run_report("x", [], duration_s=0.0, slo_ttft_s=1.0, slo_tpot_s=1.0)


def test_format_table_puts_runs_side_by_side():
    a = run_report("colocated=2", [timeline(0.0, [0.25, 0.35])], 1.0, 1.0, 1.0)
    b = run_report("prefill=1,decode=1", [timeline(0.0, [0.5, 0.52])], 1.0, 1.0, 1.0,
                   goodput_req_s=4.0)
    lines = format_table([a, b]).splitlines()
    assert lines[0].split() == ["metric", "colocated=2", "prefill=1,decode=1"]
    rows = {line.rsplit(maxsplit=2)[0].strip(): line.split()[-2:] for line in lines[2:]}
    assert rows["TTFT p50 (ms)"] == ["250.0", "500.0"]
    assert rows["TPOT mean (ms)"] == ["100.0", "20.0"]
    assert rows["goodput req/s"] == ["-", "4.00"]
    assert rows["1st->2nd token gap p50 (ms)"] == ["100.0", "20.0"]
    assert rows["later ITL p99 (ms)"] == ["-", "-"]
    assert rows["SLO attainment %"] == ["100.0", "100.0"]
    # Columns line up: every row is as wide as the header.
    assert len({len(line) for line in lines}) == 1
