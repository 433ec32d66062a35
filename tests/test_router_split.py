"""`--role router --elastic`: the actuator that moves one worker's role at a
time (`RouterSplit`) on a fake router, the deployment totals the router's /metrics
carry, and the launcher's flags. The switch itself, driven by the controller while
requests stream, is in test_role_switch."""
import pytest

from jaxpd.plan.controller import Split, SplitController
from jaxpd.plan.driver import ElasticDriver
from jaxpd.serving.router_split import RouterSplit, deployment_totals


class FakeRouter:
    def __init__(self, workers, fail=None):
        self.workers, self.fail, self.calls = workers, fail, []

    def worker_loads(self):
        return [dict(w) for w in self.workers if not w.get("draining")]

    def switch_role(self, address, role, timeout_s):
        self.calls.append((address, role))
        if self.fail:
            raise RuntimeError(self.fail)
        for w in self.workers:
            if w["address"] == address:
                w["role"] = role
        return {"role": role, "epoch": 2}


def _worker(address, role, num_calls=0, free_slots=0, queue=0, **extra):
    return dict(address=address, role=role, num_calls=num_calls, free_slots=free_slots,
                free_pages=0, queue=queue, **extra)


def test_the_least_loaded_worker_of_the_surplus_role_moves():
    router = FakeRouter([_worker("p1", "prefill", num_calls=3), _worker("p2", "prefill", 1),
                         _worker("p3", "prefill", 1, queue=5),
                         _worker("d1", "decode", 2, free_slots=1),
                         _worker("d2", "decode", 0, free_slots=4),
                         _worker("d3", "decode", 0, free_slots=9, draining=True)])
    split = RouterSplit(router, say=lambda _: None)
    assert split.split() == Split(3, 2)                  # a draining worker is not counted
    assert split.resplit(2) == "p2"                      # fewest calls, then shortest queue
    assert split.split() == Split(2, 3)
    assert split.resplit(3) == "d2"                      # most free slots
    assert router.calls == [("p2", "decode"), ("d2", "prefill")]
    assert split.switched[0] == ("p2", "decode", {"role": "decode", "epoch": 2})


def test_no_move_that_the_deployment_cannot_take():
    router = FakeRouter([_worker("p1", "prefill"), _worker("d1", "decode"),
                         _worker("d2", "decode")])
    split = RouterSplit(router, say=lambda _: None)
    with pytest.raises(ValueError, match="the last live prefill worker stays"):
        split.resplit(0)
    with pytest.raises(ValueError, match="one worker at a time"):
        split.resplit(3)
    split.prepare(2)                                      # nothing to build ahead
    assert router.calls == []
    router.fail = "the decode worker d1 did not switch to prefill: UNAVAILABLE"
    with pytest.raises(ValueError, match="did not switch"):
        split.resplit(2)


def test_a_refused_switch_leaves_the_driver_watching_with_the_real_split():
    router = FakeRouter([_worker("p1", "prefill"), _worker("d1", "decode"),
                         _worker("d2", "decode")], fail="UNAVAILABLE: it went away")
    actuator, said = RouterSplit(router, say=lambda _: None), []
    controller = SplitController(actuator.split(), 1.0, 1.0, sustain_s=0, dwell_s=0)
    metrics = ("# TYPE jaxpd_ttft_seconds histogram\n"
               'jaxpd_ttft_seconds_bucket{le="1.0"} 0\njaxpd_ttft_seconds_bucket{le="10.0"} 5\n'
               'jaxpd_ttft_seconds_bucket{le="+Inf"} 5\njaxpd_ttft_seconds_count 5\n'
               "jaxpd_ttft_seconds_sum 40\n")
    driver = ElasticDriver(controller, lambda: metrics, actuator.prepare, actuator.resplit,
                           actuator.split, 1.0, say=said.append, clock=lambda: 0.0)
    decision = driver.tick()                              # TTFT 9 s at a 1 s SLO: to prefill
    assert decision is not None and decision.new == Split(2, 1)
    assert router.calls == [("d1", "prefill")] and "refused" in said[-1]
    assert controller.split == Split(1, 2)


def test_deployment_totals_sum_the_workers_and_count_garbage_as_nothing():
    workers = {"prefill": [{"queue": 3, "mesh": "prefill=2",
                            "counters": {"prefill_tokens": 100, "prefix_hit_tokens": 5}},
                           {"queue": 1, "mesh": "x=1", "counters": "not a dict"}],
               "decode": [{"slots_total": 8, "free_slots": 2, "pages_total": 100,
                           "free_pages": 40, "queue": 7, "mesh": "decode=2x2",
                           "counters": {"prefix_hit_tokens": 64, "transfer_bytes": 1024,
                                        "not_a_counter": 9, "prefill_tokens": "many"}},
                          {"slots_total": 4, "free_slots": 4, "pages_total": 50,
                           "free_pages": 50, "mesh": 7, "queue": True,
                           "counters": {"prefix_hit_tokens": -3, "transfers": float("nan")}}]}
    assert deployment_totals(workers) == {
        "prefill_tokens": 100, "prefix_hit_tokens": 69, "transfer_bytes": 1024,
        "transfers": 0, "queue_waiting": 4, "slots_total": 12, "slots_active": 6,
        "pages_total": 150, "pages_used": 60, "prefill_devices": 2, "decode_devices": 4}
    assert deployment_totals({})["slots_total"] == 0


def test_the_launcher_takes_elastic_on_a_router_one_worker_at_a_time():
    from absl import flags
    from jaxpd.serving.launch_flags import define_flags, elastic_error
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["launch", "--role", "router", "--elastic", "--slo_ttft_ms", "500",
        "--slo_tpot_ms", "50"])
    assert elastic_error(fv) is None
    fv.elastic_step = 2
    assert "moves one worker at a time" in elastic_error(fv)
    fv.elastic_step, fv.slo_tpot_ms = 1, 0.0
    assert "needs --slo_ttft_ms and --slo_tpot_ms" in elastic_error(fv)
    fv.slo_tpot_ms, fv.role = 50.0, "decode"
    assert "or --role router (got --mesh auto, --role decode)" in elastic_error(fv)
