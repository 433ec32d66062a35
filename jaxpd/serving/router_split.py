"""`--role router --elastic`: the split controller acting on a multi-process deployment
by switching one worker's role at a time.

The router's /metrics (the served requests' TTFT and TPOT, and the sums below) feed the
same `SplitController` and `ElasticDriver` as an elastic mesh in one process; here the
split is counted in workers, `Split(prefill workers, decode workers)`, and a decision
moves one worker (`Router.switch_role`: it drains, rebuilds for the other role on the
same devices, and re-registers at its next epoch). Which one: the surplus role's least
loaded live worker -- to decode, the prefill worker with the fewest router calls open
and the shortest queue; to prefill, the decode worker with the most free slots, then
the fewest calls open. The last live worker of a role never moves. A switch that fails
is a refused decision: the driver re-reads the split and keeps watching.

`deployment_totals` is what the router adds to its stats so that its /metrics carry
the deployment's occupancy (decode workers' slots and pages, prefill workers' queue), its
split (devices per role) and its workers' engine counters summed (prefix-cache hits, KV
moved, ...; the router's own counters, such as requests finished, take precedence). A
sum drops when a worker leaves, which Prometheus reads as a counter reset. The workers'
answers are a peer's input: anything but a non-negative number counts as nothing.
"""
from __future__ import annotations

import logging
from typing import Callable

from jaxpd.plan.controller import Split
from jaxpd.sharding.spec import parse_mesh_spec
from jaxpd.stats import COUNTERS

_log = logging.getLogger(__name__)


def _count(value) -> int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return int(value) if ok and 0 <= value < 2 ** 63 else 0


def deployment_totals(workers: dict[str, list[dict]]) -> dict:
    """Sums over the live workers' `Info` answers, by role ({"prefill": [...], ...})."""
    prefill, decode = workers.get("prefill", []), workers.get("decode", [])

    def total(ws: list[dict], key: str) -> int:
        return sum(_count(w.get(key, 0)) for w in ws)

    def devices(ws: list[dict]) -> int:
        found = 0
        for w in ws:
            try:
                found += parse_mesh_spec(w.get("mesh", "")).num_devices
            except ValueError:       # a worker's own report, not ours to trust: skip it
                pass
        return found

    counters: dict[str, int] = {}
    for w in prefill + decode:
        found = w.get("counters")
        for name, value in (found.items() if isinstance(found, dict) else ()):
            if name in COUNTERS:
                counters[name] = counters.get(name, 0) + _count(value)
    slots, pages = total(decode, "slots_total"), total(decode, "pages_total")
    return {**counters, "queue_waiting": total(prefill, "queue"),
            "slots_total": slots, "slots_active": slots - total(decode, "free_slots"),
            "pages_total": pages, "pages_used": pages - total(decode, "free_pages"),
            "prefill_devices": devices(prefill), "decode_devices": devices(decode)}


class RouterSplit:
    """The actuator of an `ElasticDriver` on a `Router` (`split`, `prepare`, `resplit`)."""

    def __init__(self, router, timeout_s: float = 600.0,
                 say: Callable[[str], None] = _log.info):
        self.router, self.timeout_s, self.say = router, timeout_s, say
        self.switched: list[tuple[str, str, dict]] = []   # (address, new role, its answer)

    def split(self) -> Split:
        """Live workers per role that the router may choose (not draining)."""
        loads = self.router.worker_loads()
        return Split(sum(w["role"] == "prefill" for w in loads),
                     sum(w["role"] == "decode" for w in loads))

    def prepare(self, prefill: int) -> None:
        """Nothing to build ahead: the worker rebuilds while it drains."""

    def resplit(self, prefill: int) -> str:
        """Move one worker so that `prefill` workers prefill; returns its address.
        ValueError when no worker can move (the decision is refused)."""
        now = self.split()
        if abs(prefill - now.prefill) != 1:
            raise ValueError(f"a router moves one worker at a time: {now} cannot become "
                             f"prefill={prefill}")
        source, target = ("prefill", "decode") if prefill < now.prefill else ("decode",
                                                                              "prefill")
        loads = [w for w in self.router.worker_loads() if w["role"] == source]
        if len(loads) < 2:
            raise ValueError(f"the last live {source} worker stays a {source} worker")
        if source == "prefill":
            pick = min(loads, key=lambda w: (w["num_calls"], w["queue"], w["address"]))
        else:
            pick = min(loads, key=lambda w: (-w["free_slots"], w["num_calls"], w["address"]))
        self.say(f"elastic: switching the {source} worker {pick['address']} to {target}")
        try:
            answer = self.router.switch_role(pick["address"], target, self.timeout_s)
        except RuntimeError as e:            # it failed to switch: keep serving as we are
            raise ValueError(str(e)) from None
        self.switched.append((pick["address"], target, answer))
        return pick["address"]
