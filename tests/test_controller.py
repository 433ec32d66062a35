"""The elastic split's controller on synthetic signal traces (pure Python): it moves
devices when one role is sustainedly over its SLO and the other has room, not on noise,
never within its dwell time, never below a role's minimum, and says why."""
import pytest

from jaxpd.plan.controller import Signals, Split, SplitController

SLO_TTFT, SLO_TPOT = 1.0, 0.1


def controller(**kw) -> SplitController:
    options = dict(sustain_s=30, dwell_s=120, smoothing_s=10)
    options.update(kw)
    return SplitController(Split(4, 4), SLO_TTFT, SLO_TPOT, **options)


def prefill_overloaded(t):   # long prompts: TTFT 2x its SLO, decode half idle
    return Signals(t, ttft_p90_s=2.0, predicted_ttft_s=2.5, tpot_p90_s=0.03, slot_occupancy=0.3)


def decode_overloaded(t):    # long answers: TPOT 1.8x, slots full, prefill idle
    return Signals(t, ttft_p90_s=0.2, tpot_p90_s=0.18, slot_occupancy=1.0)


def calm(t):
    return Signals(t, ttft_p90_s=0.3, tpot_p90_s=0.04, slot_occupancy=0.4)


def replay(c, trace):
    return [d for d in (c.observe(s) for s in trace) if d is not None]


def test_sustained_prefill_overload_moves_one_device_to_prefill_and_says_why():
    c = controller()
    decisions = replay(c, [calm(t) for t in range(0, 120)] +
                       [prefill_overloaded(t) for t in range(120, 220)])
    assert len(decisions) == 1
    d = decisions[0]
    assert (d.old, d.new, d.direction) == (Split(4, 4), Split(5, 3), "to_prefill")
    # Smoothing takes a few seconds to cross `high`, then it must hold for sustain_s.
    assert 150 <= d.t <= 170
    assert d.reason.startswith("prefill at ") and "decode -> prefill" in d.reason
    assert c.split == Split(5, 3)


def test_sustained_decode_overload_moves_one_device_to_decode():
    c = controller()
    decisions = replay(c, [decode_overloaded(t) for t in range(0, 200)])
    assert [(d.new, d.direction) for d in decisions] == [(Split(3, 5), "to_decode")]
    assert decisions[0].t >= 120                    # not before the first dwell


def test_noise_shorter_than_sustain_never_switches():
    c = controller()
    trace = []
    for t in range(0, 1200):          # 20 s bursts of prefill overload every minute
        trace.append(prefill_overloaded(t) if t % 60 < 20 else calm(t))
    assert replay(c, trace) == []
    assert c.split == Split(4, 4)


def test_one_huge_spike_does_not_switch():
    c = controller()
    trace = [calm(t) for t in range(0, 200)] + [Signals(200, ttft_p90_s=30.0)] + \
        [calm(t) for t in range(201, 400)]
    assert c.pressures(trace[200])[0] == 30.0
    assert replay(c, trace) == []


def test_dwell_time_blocks_switching_back_until_it_has_passed():
    c = controller()
    trace = [prefill_overloaded(t) for t in range(0, 200)] + \
        [decode_overloaded(t) for t in range(200, 600)]
    decisions = replay(c, trace)
    assert [d.direction for d in decisions][:2] == ["to_prefill", "to_decode"]
    assert decisions[1].t - decisions[0].t >= 120
    assert all(b.t - a.t >= 120 for a, b in zip(decisions, decisions[1:]))


def test_both_overloaded_is_not_a_resplit():
    c = controller()
    both = [Signals(t, ttft_p90_s=3.0, tpot_p90_s=0.3, slot_occupancy=1.0) for t in range(400)]
    assert replay(c, both) == []


def test_never_below_min_devices():
    c = SplitController(Split(2, 6), SLO_TTFT, SLO_TPOT, step=1, min_devices=2,
                        sustain_s=10, dwell_s=20)
    decisions = replay(c, [decode_overloaded(t) for t in range(0, 1000)])
    assert decisions == [] and c.split == Split(2, 6)
    c = SplitController(Split(4, 4), SLO_TTFT, SLO_TPOT, step=2, min_devices=2,
                        sustain_s=10, dwell_s=20)
    decisions = replay(c, [prefill_overloaded(t) for t in range(0, 1000)])
    assert [d.new for d in decisions] == [Split(6, 2)]       # one step of 2, then the floor


def test_occupancy_alone_is_decode_pressure():
    c = controller()
    s = Signals(0, tpot_p90_s=None, slot_occupancy=0.99, page_occupancy=0.2)
    assert c.pressures(s) == (0.0, pytest.approx(1.1))


@pytest.mark.parametrize("kwargs,match", [
    (dict(ttft_p90_s=float("nan")), "ttft_p90_s"), (dict(tpot_p90_s=-1.0), "tpot_p90_s"),
    (dict(slot_occupancy=1.5), "slot_occupancy"), (dict(page_occupancy=-0.1), "page_occupancy")])
def test_bad_signals_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Signals(0.0, **kwargs)


def test_bad_settings_and_out_of_order_signals_are_refused():
    with pytest.raises(ValueError, match="low < high"):
        SplitController(Split(4, 4), 1.0, 0.1, low=1.0, high=0.5)
    with pytest.raises(ValueError, match="min_devices"):
        SplitController(Split(1, 7), 1.0, 0.1, min_devices=2)
    with pytest.raises(ValueError, match="slo_ttft_s"):
        SplitController(Split(4, 4), 0.0, 0.1)
    c = controller()
    c.observe(calm(10))
    with pytest.raises(ValueError, match="out of order"):
        c.observe(calm(5))


# ---- `python -m jaxpd.plan --live`: the controller fed from /metrics ----------------

def _scrape(ttfts, tpots, slots_active, metrics=None):
    """A /metrics text as a router renders it, after observing these latencies."""
    from jaxpd.outputs import RequestMetrics
    from jaxpd.serving.prometheus import ServingMetrics
    metrics = metrics or ServingMetrics()
    for ttft, tpot in zip(ttfts, tpots):
        metrics.observe(RequestMetrics(queue_s=None, prefill_s=None, transfer_s=0.0,
                                       transfer_bytes=0, ttft_s=ttft, tpot_s=tpot, itl_s=[],
                                       e2e_s=None, num_preemptions=0))
    return metrics, metrics.render({"slots_active": slots_active, "slots_total": 16,
                                    "pages_used": 10, "pages_total": 100, "queue_waiting": 3})


def test_window_quantile_sees_only_the_window():
    from jaxpd.plan.live import parse_metrics, window_quantile
    m, first = _scrape([0.05] * 100, [0.01] * 100, 4)
    _, second = _scrape([3.0] * 10, [0.01] * 10, 4, m)
    before, _ = parse_metrics(first)
    after, values = parse_metrics(second)
    # Over all time the p90 TTFT is small; in the window it is the 3 s requests.
    assert window_quantile(None, after["jaxpd_ttft_seconds"], 0.9) < 1.0
    assert 2.0 <= window_quantile(before["jaxpd_ttft_seconds"], after["jaxpd_ttft_seconds"],
                                  0.9) <= 5.0
    assert window_quantile(after["jaxpd_ttft_seconds"], after["jaxpd_ttft_seconds"], 0.9) is None
    assert values["jaxpd_slots_total"] == 16


def test_live_recommends_a_move_from_scraped_metrics_without_acting():
    from jaxpd.plan.live import run_live
    m, _ = _scrape([], [], 0)
    texts = []
    for i in range(12):         # TTFT 3x the SLO throughout; decode mostly idle
        texts.append(_scrape([3.0] * 5, [0.02] * 5, 4, m)[1])
    lines, clock = [], iter(range(0, 1200, 10))
    c = SplitController(Split(4, 4), SLO_TTFT, SLO_TPOT, sustain_s=30, dwell_s=60,
                        smoothing_s=5)
    decisions = run_live("http://router/metrics", c, 10.0, len(texts), say=lines.append,
                         fetch=lambda url, it=iter(texts): next(it), clock=lambda: next(clock),
                         sleep=lambda s: None)
    assert [d.new for d in decisions] == [Split(5, 3)]
    assert any(line.startswith("recommend prefill=5,decode=3 (from prefill=4,decode=4)")
               for line in lines)
    assert "slots 25%" in lines[1] and "queue 3" in lines[1]


@pytest.mark.parametrize("text", ["prefill=4", "prefill=0,decode=8", "decode=4,prefill=x",
                                  "prefill=4,decode=4,extra=1"])
def test_live_split_is_checked(text):
    from jaxpd.plan.live import parse_split
    with pytest.raises(ValueError, match="--live_split"):
        parse_split(text)


def test_plan_cli_live_scrapes_a_metrics_url(capsys):
    import http.server
    import threading

    from jaxpd.plan.planner import main
    text = _scrape([0.2] * 3, [0.02] * 3, 8)[1].encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert main(["--live", f"http://127.0.0.1:{server.server_port}/metrics",
                     "--live_split", "prefill=2,decode=6", "--live_count", "2",
                     "--live_interval_s", "0.01"]) == []
    finally:
        server.shutdown()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("t=") and "split prefill=2,decode=6" in out[0]
    assert "TTFT p90" in out[0] and "slots 50%" in out[0]


class _Serving:
    """What a serving process shows the elastic driver: its /metrics text, and a split
    that a re-split changes (or refuses to)."""

    def __init__(self, refuse: bool = False):
        from jaxpd.serving.prometheus import ServingMetrics
        self.metrics, self.split, self.refuse = ServingMetrics(), Split(4, 4), refuse
        self.calls = []

    def render(self) -> str:
        return self.metrics.render({"slots_active": 2, "slots_total": 16, "pages_used": 10,
                                    "pages_total": 100, "queue_waiting": 7})

    def prepare(self, prefill):
        self.calls.append(("prepare", prefill))

    def resplit(self, prefill):
        self.calls.append(("resplit", prefill))
        if self.refuse:
            raise ValueError("prefill must be in [1, 7]")
        self.split = Split(prefill, 8 - prefill)


@pytest.mark.parametrize("refuse", [False, True])
def test_the_elastic_driver_acts_on_the_metrics_it_renders(refuse):
    from jaxpd.plan.driver import ElasticDriver
    serving, said, now = _Serving(refuse), [], [0.0]
    c = controller(sustain_s=3, dwell_s=5, smoothing_s=1)
    driver = ElasticDriver(c, serving.render, serving.prepare, serving.resplit,
                           lambda: serving.split, interval_s=1, say=said.append,
                           clock=lambda: now[0])
    decisions = []
    for t in range(10):                 # the first move at t=5; the next not within 5 s
        now[0] = float(t)
        for _ in range(5):      # this window's requests: TTFT 3x its SLO, TPOT well under
            serving.metrics.ttft.observe(3.0)
            serving.metrics.tpot.observe(0.02)
        decisions.append(driver.tick())
    made = [d for d in decisions if d is not None]
    assert len(made) == 1 and made[0].new == Split(5, 3)
    assert serving.calls == [("prepare", 5), ("resplit", 5)]     # compiled first, then moved
    assert "prefill=4,decode=4 -> prefill=5,decode=3: prefill at" in said[0]
    if refuse:           # the controller is told the split it really has
        assert "refused: prefill must be in [1, 7]" in said[1]
        assert c.split == serving.split == Split(4, 4)
    else:
        assert c.split == serving.split == Split(5, 3)


@pytest.mark.parametrize("args,match", [
    ({"elastic": True}, "--elastic needs --mesh elastic=N"),
    ({"elastic": True, "mesh": "elastic=8", "role": "prefill"}, "without --role"),
    ({"elastic": True, "mesh": "elastic=8", "slo_ttft_ms": 500.0}, "needs --slo_ttft_ms and"),
])
def test_the_launcher_refuses_elastic_without_what_it_needs(args, match):
    from absl import flags
    from jaxpd.serving.launch_flags import define_flags, elastic_error
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["launch"])
    assert elastic_error(fv) is None
    for name, value in args.items():
        fv[name].value = value
    assert match in elastic_error(fv)
    fv.slo_ttft_ms, fv.slo_tpot_ms, fv.role, fv.mesh = 500.0, 50.0, "", "elastic=8"
    assert elastic_error(fv) is None


def test_a_window_without_ttft_is_no_news_while_prompts_wait_and_idle_when_none_do():
    c = controller(sustain_s=0, dwell_s=0, smoothing_s=1)
    c.observe(Signals(0, ttft_p90_s=3.0, slot_occupancy=0.1))
    high = c.prefill_pressure
    c.observe(Signals(5, slot_occupancy=0.1, prefill_queue=4))    # nothing finished yet
    assert c.prefill_pressure == high
    c.observe(Signals(10, slot_occupancy=0.1))                    # nothing waits either
    assert c.prefill_pressure < 0.1 * high
