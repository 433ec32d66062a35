"""The elastic split's live latency model (`plan.split_model`) and the controller's vetoes,
on synthetic traces (pure Python): hand-checked predictions, a move refused because the
role giving devices would break its SLO, a move refused because it would not help, a
move made when the model says it helps, and no model data = the controller as before."""
import math

import pytest

from jaxpd.plan.controller import Signals, Split, SplitController
from jaxpd.plan.split_model import SplitModel

SLO_TTFT, SLO_TPOT = 1.0, 0.1


def controller(split=Split(4, 4), **kw) -> SplitController:
    options = dict(sustain_s=30, dwell_s=120, smoothing_s=10, min_samples=20)
    options.update(kw)
    return SplitController(split, SLO_TTFT, SLO_TPOT, **options)


def replay(c, trace):
    return [d for d in (c.observe(s) for s in trace) if d is not None]


def measured(t, ttft_p90, tpot_p90, slots, queue=None, prefill=None, ttft=None, n=5):
    """A window in which `n` requests measured TPOT and, given `queue`, `n` more measured
    their queue wait, prefill and TTFT means."""
    prefill_known = queue is not None
    return Signals(t, ttft_p90_s=ttft_p90, tpot_p90_s=tpot_p90, slot_occupancy=slots,
                   ttft_mean_s=ttft, queue_mean_s=queue, prefill_mean_s=prefill,
                   num_prefilled=n if prefill_known else 0, num_tpot=n)


def fed_model(**kw) -> SplitModel:
    model = SplitModel(SLO_TPOT, occupancy_high=0.9, smoothing_s=10, min_samples=20, **kw)
    for t in range(10):        # steady: 5 requests a second, the same every window
        model.observe(measured(t, 0.5, 0.05, 0.4, queue=0.3, prefill=0.3, ttft=0.7))
    return model


# ---- the model's predictions ----------------------------------------------------------

def test_decode_factor_scales_tpot_by_efficiency_and_occupancy_by_devices():
    # TPOT 0.5x its SLO, slots 0.4 / 0.9 = 0.44x: TPOT is the pressure now.
    assert fed_model().factor("decode", 4, 3) == pytest.approx(4 / 3)       # ideal
    assert fed_model().factor("decode", 4, 2) == pytest.approx(2.0)
    # Half-efficient devices: TPOT grows only (4/3) ** 0.5 = 1.155x, so the slots (which
    # are per shard, exactly 4/3 fewer) take over: 0.44 * 4/3 / 0.5.
    assert fed_model(efficiency=0.5).factor("decode", 4, 3) == pytest.approx(
        0.4 / 0.9 * 4 / 3 / 0.5)
    assert fed_model().factor("decode", 4, 4) == pytest.approx(1.0)


def test_prefill_factor_reads_the_queue_as_m_d_1_and_saturates():
    model = fed_model()
    # W = S = 0.3 s, TTFT 0.7 s (R = 0.1): rho = 2W / (S + 2W) = 2/3.
    assert model.utilisation() == pytest.approx(2 / 3)
    # 4 -> 3 devices: S' = 0.4, rho' = 8/9, W' = rho' S' / (2 (1 - rho')) = 1.6;
    # (1.6 + 0.4 + 0.1) / 0.7 = 3: the queue, not the compute, makes it 3x.
    assert model.factor("prefill", 4, 3) == pytest.approx(3.0)
    assert model.factor("prefill", 2, 1) == math.inf             # rho' = 4/3: cannot keep up
    # 4 -> 5: S' = 0.24, rho' = 8/15, W' = 0.128 / (14/15) = 0.1371...
    assert model.factor("prefill", 4, 5) == pytest.approx((0.128 / (14 / 15) + 0.24 + 0.1)
                                                          / 0.7)
    assert model.factor("prefill", 4, 4) == pytest.approx(1.0)


def test_nothing_is_predicted_before_min_samples_requests():
    model = SplitModel(SLO_TPOT, min_samples=20)
    for t in range(3):                              # 15 requests: not yet
        model.observe(measured(t, 0.5, 0.05, 0.4, queue=0.3, prefill=0.3, ttft=0.7))
    assert model.factor("decode", 4, 3) is None and model.factor("prefill", 4, 3) is None
    model.observe(measured(3, 0.5, 0.05, 0.4, queue=0.3, prefill=0.3, ttft=0.7))
    assert model.factor("decode", 4, 3) == pytest.approx(4 / 3)
    assert model.factor("prefill", 4, 3) == pytest.approx(3.0)
    # Windows that measured no prefill leave its inputs (and count) alone.
    model.observe(measured(4, None, 0.05, 0.4))
    assert model.num_prefilled == 20 and model.queue_s.value == pytest.approx(0.3)


def test_inputs_are_smoothed_over_trace_time():
    model = SplitModel(SLO_TPOT, smoothing_s=10, min_samples=1)
    model.observe(measured(0, None, 0.02, 0.0))
    model.observe(measured(10, None, 0.12, 0.0))            # one time constant later
    assert model.tpot_p90_s.value == pytest.approx(0.02 + 0.1 * (1 - math.exp(-1)))
    for t in range(11, 200):
        model.observe(measured(t, None, 0.12, 0.0))
    assert model.tpot_p90_s.value == pytest.approx(0.12)


def test_bad_model_settings_are_refused():
    with pytest.raises(ValueError, match="efficiency"):
        SplitModel(SLO_TPOT, efficiency=1.5)
    with pytest.raises(ValueError, match="min_samples"):
        SplitModel(SLO_TPOT, min_samples=0)
    with pytest.raises(ValueError, match="role"):
        fed_model().factor("router", 4, 3)
    with pytest.raises(ValueError, match="num_prefilled"):
        Signals(0, num_prefilled=-1)


# ---- the controller consults it -------------------------------------------------------

def test_a_move_that_would_break_the_giving_roles_slo_is_vetoed_and_says_why():
    # Prefill 2x its SLO; decode has room at 0.55x, but on 2 devices: giving one of them
    # doubles its TPOT to 1.1x.
    c = controller(Split(6, 2))
    trace = [measured(t, 2.0, 0.055, 0.2) for t in range(300)]
    assert replay(c, trace) == []
    assert c.split == Split(6, 2) and c.decisions == []
    veto = c.vetoes[0]
    assert veto.wanted == Split(7, 1) and veto.t >= 120
    assert "decode would be at 1.10x its SLO with 1 device(s) fewer" in veto.reason
    assert "prefill=7,decode=1: prefill -, decode 1.10x" in veto.reason   # no prefill data
    assert str(veto).startswith("hold prefill=6,decode=2 (not prefill=7,decode=1): decode")
    # Each veto restarts the sustain time: one per sustain_s, not one per observation.
    assert 4 <= c.num_vetoes <= 6 and len(c.vetoes) == c.num_vetoes


def test_the_same_trace_without_model_data_moves_as_before():
    trace = [measured(t, 2.0, 0.055, 0.2, n=0) for t in range(300)]
    c = controller(Split(6, 2))
    decisions = replay(c, trace)
    assert [d.new for d in decisions] == [Split(7, 1)] and not c.vetoes
    assert "predicted" not in decisions[0].reason
    # Data, but fewer requests than min_samples: the very same decisions, same reasons.
    few = [measured(t, 2.0, 0.055, 0.2, n=1) if t < 19 else measured(t, 2.0, 0.055, 0.2, n=0)
           for t in range(300)]
    again = replay(controller(Split(6, 2)), few)
    assert [(d.t, d.new, d.reason) for d in again] == [(d.t, d.new, d.reason)
                                                       for d in decisions]


def test_a_move_is_made_when_the_model_says_it_helps():
    # Prefill 1.5x: its queue (W 0.8 s against S 0.3 s: rho 0.84) makes the TTFT; decode
    # at 0.3x can spare one of 4 devices (0.4x after). One more prefill device: rho 0.67,
    # TTFT mean 1.2 -> 0.59 s, so 1.5x -> 0.73x.
    c = controller()
    trace = [measured(t, 1.5, 0.03, 0.2, queue=0.8, prefill=0.3, ttft=1.2)
             for t in range(200)]
    decisions = replay(c, trace)
    assert [d.new for d in decisions] == [Split(5, 3)] and not c.vetoes
    reason = decisions[0].reason
    assert reason.startswith("prefill at 1.50x its SLO and decode at 0.30x")
    assert "; predicted prefill=5,decode=3: prefill 0.73x, decode 0.40x" in reason


def test_a_move_that_would_not_help_the_receiving_role_is_vetoed():
    # TTFT 2 s of which queue and prefill are 0.11 s: the rest (transfer, a wait for the
    # decode side) does not shrink with prefill's devices: rho 1/6 -> 2/15, W' 0.006 s,
    # S' 0.08 s, so a device would cut 2.00x to 1.98x only.
    c = controller()
    trace = [measured(t, 2.0, 0.03, 0.2, queue=0.01, prefill=0.1, ttft=2.0)
             for t in range(200)]
    assert replay(c, trace) == [] and c.split == Split(4, 4)
    assert "prefill would only go from 2.00x to 1.98x its SLO with 1 device(s) more" in \
        c.vetoes[0].reason


def test_a_partial_cure_of_ten_percent_or_more_is_allowed():
    # Decode 2x its SLO on 4 devices: a fifth brings it to 1.6x, still over, but a
    # fifth better; the next move is the dwell time's business.
    c = controller()
    trace = [measured(t, 0.2, 0.2, 0.3, queue=0.0, prefill=0.1, ttft=0.2)
             for t in range(200)]
    decisions = replay(c, trace)
    assert [d.new for d in decisions] == [Split(3, 5)]
    assert "decode 1.60x" in decisions[0].reason


def test_a_prefill_that_could_not_keep_up_is_predicted_unbounded():
    # Decode overloaded, prefill at 0.4x but busy (W = S: rho 2/3) on 2 devices:
    # on 1 it could not keep up.
    c = controller(Split(2, 6))
    trace = [measured(t, 0.4, 0.2, 0.3, queue=0.15, prefill=0.15, ttft=0.35)
             for t in range(200)]
    assert replay(c, trace) == []
    assert "prefill would be at infx its SLO" in c.vetoes[0].reason


def test_the_driver_logs_a_veto():
    from jaxpd.plan.driver import ElasticDriver
    c = controller(Split(6, 2), sustain_s=0, dwell_s=0, smoothing_s=1, min_samples=1)
    said, calls = [], []
    scrapes = _Scrapes()
    windows = iter([scrapes.text() for _ in range(3)])
    driver = ElasticDriver(c, lambda: next(windows), calls.append, calls.append,
                           lambda: c.split, say=said.append, clock=iter(range(3)).__next__)
    counted = []
    driver = ElasticDriver(c, lambda: next(windows), calls.append, calls.append,
                           lambda: c.split, say=said.append, clock=iter(range(3)).__next__,
                           count=lambda **kw: counted.append(kw))
    assert [driver.tick() for _ in range(3)] == [None, None, None] and calls == []
    assert said and said[0].startswith("elastic: hold prefill=6,decode=2 (not prefill=7,")
    assert counted == [{"split_vetoes": 1}] * len(said) and c.num_vetoes == len(said)


# ---- efficiency learnt from moves -----------------------------------------------------

def _after_move(model, t0, prefill_s, tpot_s, windows=4):
    for t in range(t0, t0 + windows):      # 5 requests a window: 20 after 4 windows
        model.observe(measured(t, 0.5, tpot_s, 0.4, queue=0.1, prefill=prefill_s, ttft=0.5))


def test_a_move_teaches_the_model_how_each_role_scaled():
    model = fed_model()                                   # prefill 0.3 s, TPOT 0.05 s
    model.moved((4, 4), (2, 6))
    # Prefill lost half its devices and took sqrt(2) longer; decode gained 1.5x and
    # got 1.5 ** 0.5 faster: both scaled with efficiency 0.5.
    _after_move(model, 10, 0.3 * 2 ** 0.5, 0.05 / 1.5 ** 0.5, windows=3)
    assert model.learnt == [] and model.efficiency == 1.0  # 15 requests: not enough yet
    _after_move(model, 13, 0.3 * 2 ** 0.5, 0.05 / 1.5 ** 0.5, windows=1)
    assert sorted(model.learnt) == pytest.approx([0.5, 0.5], abs=0.02)
    assert model.efficiency == pytest.approx((1 + 0.5 + 0.5) / 3, abs=0.02)
    # A role that got no faster with more devices measures 0; one slower is clipped.
    _after_move(model, 14, 0.3 * 2 ** 0.5, 0.05 / 1.5 ** 0.5, windows=100)   # settled
    model.moved((2, 6), (1, 7))
    _after_move(model, 114, 0.3 * 2 ** 0.5 * 0.9, 0.05 / 1.5 ** 0.5 * 1.2)
    assert model.learnt[-2:] == [0.0, 0.0]
    assert model.efficiency == pytest.approx((1 + 0.5 + 0.5) / 5, abs=0.02)


def test_a_move_that_did_not_happen_teaches_nothing():
    c = controller(Split(4, 4))
    for t in range(10):
        c.observe(measured(t, 0.5, 0.05, 0.4, queue=0.3, prefill=0.3, ttft=0.7))
    c.model.moved((4, 4), (3, 5))
    c.restore(Split(4, 4))                                # the re-split was refused
    for t in range(10, 20):
        c.observe(measured(t, 0.5, 0.2, 0.4, queue=0.3, prefill=0.9, ttft=1.3))
    assert c.split == Split(4, 4) and c.model.learnt == [] and c.model.efficiency == 1.0


# ---- from /metrics --------------------------------------------------------------------

def _request(queue, prefill, tpot=0.02):
    from jaxpd.outputs import RequestMetrics
    return RequestMetrics(queue_s=queue, prefill_s=prefill, transfer_s=0.0, transfer_bytes=0,
                          ttft_s=2.0, tpot_s=tpot, itl_s=[], e2e_s=None, num_preemptions=0)


class _Scrapes:
    """A process's /metrics, scraped again and again: each scrape after 10 more requests
    at TTFT 2 s and TPOT 0.02 s, half the slots in use (prefill 2x its SLO; decode at
    0.5 / 0.9 = 0.56x, which has room, but 2 decode devices cannot spare one: the slots
    would be full)."""

    def __init__(self):
        from jaxpd.serving.prometheus import ServingMetrics
        self.metrics = ServingMetrics()

    def text(self, queue=0.3, prefill=0.3) -> str:
        for _ in range(10):
            self.metrics.observe(_request(queue, prefill))
        return self.metrics.render({"slots_active": 8, "slots_total": 16, "pages_used": 10,
                                    "pages_total": 100, "queue_waiting": 3})


def test_live_signals_carry_the_windows_means_and_counts():
    from jaxpd.plan.live import LiveSignals, parse_metrics, window_mean
    live = LiveSignals()
    scrapes = _Scrapes()
    first = live.observe(0, scrapes.text())
    second = live.observe(1, scrapes.text(queue=0.5, prefill=0.1))
    assert first.num_prefilled == 10 and first.queue_mean_s == pytest.approx(0.3)
    assert second.queue_mean_s == pytest.approx(0.5)           # the window's, not all time's
    assert second.prefill_mean_s == pytest.approx(0.1)
    assert second.ttft_mean_s == pytest.approx(2.0) and second.num_tpot == 10
    # A request without queue and prefill times (a router's) is in TTFT's histogram only.
    scrapes.metrics.observe(_request(None, None, tpot=None))
    _, values = parse_metrics(scrapes.text())
    assert values["jaxpd_ttft_seconds_count"] == 31
    assert values["jaxpd_queue_seconds_count"] == values["jaxpd_prefill_seconds_count"] == 30
    # Counts that went back (a worker left a router's sums) are no measurement.
    assert window_mean(values, {"jaxpd_queue_seconds_count": 5.0,
                                "jaxpd_queue_seconds_sum": 1.0}, "jaxpd_queue_seconds") == \
        (None, 0)


def test_live_prints_the_predictions_and_the_veto():
    from jaxpd.plan.live import run_live
    scrapes = _Scrapes()
    texts = iter([scrapes.text() for _ in range(4)])
    lines = []
    c = controller(Split(6, 2), sustain_s=0, dwell_s=0, smoothing_s=1, min_samples=10)
    assert run_live("http://x/metrics", c, 1.0, 4, say=lines.append,
                    fetch=lambda url: next(texts), clock=iter(range(4)).__next__,
                    sleep=lambda s: None) == []
    # Half the slots of 2 decode devices: 1.11x on one.
    assert "; predicted after prefill=7,decode=1: prefill" in lines[0]
    assert "| prefill=5,decode=3: prefill" in lines[0] and "decode 1.11x" in lines[0]
    assert any(line.startswith("hold prefill=6,decode=2 (not prefill=7,decode=1): decode "
                               "would be at 1.11x its SLO") for line in lines)


def test_the_bench_lists_moves_and_vetoes_in_time_order():
    from jaxpd.bench.elastic import format_decisions
    runs = [{"name": "elastic=8", "engine_stats": {
        "resplit_decisions": [{"t_s": 30.0, "old": "prefill=4,decode=4",
                               "new": "prefill=5,decode=3", "reason": "prefill at 2.00x"}],
        "resplit_vetoes": [{"t_s": 12.5, "split": "prefill=4,decode=4",
                            "wanted": "prefill=5,decode=3", "reason": "decode would be"}]}}]
    assert format_decisions(runs).splitlines() == [
        "elastic=8: t=12.5 s held prefill=4,decode=4 (not prefill=5,decode=3): decode would be",
        "elastic=8: t=30.0 s prefill=4,decode=4 -> prefill=5,decode=3: prefill at 2.00x"]
