"""A worker process's life (`python -m jaxpd.launch --role prefill|decode`): build its
engine, serve the Worker service (`role_server`), register with the router, and, on
the router's command, switch role (`role_switch`), until stopped."""
from __future__ import annotations

import threading
import time

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.serving.migration import MigrationOutbox
from jaxpd.serving.role_server import RoleServer, RoleService, kv_options, make_connector
from jaxpd.serving.role_switch import RoleSwitch, other_mesh


class _Interrupted(Exception):
    """A stop signal arrived while the worker was still starting."""


def serve_role(role: str, model: str | None, host: str, port: int, router: str | None,
               transport: str, stop: threading.Event, say, llm_options: dict,
               auth: InternalAuth = NO_AUTH, heartbeat_s: float = 1.0,
               http_port: int = -1, group=None, follower_timeout_s: float = 5.0,
               kv_offer_hosts: tuple[str, ...] = (), kv_offers: str = "shards",
               shutdown_timeout_s: float = 5.0, wait_for_compiles: bool = True) -> int:
    """Run a prefill or decode worker process until `stop` is set; 1 if the router
    refused it, or its engine failed. `http_port` >= 0: GET /health and /metrics there
    (0: a free port, printed), as on the router and a single process. `group`: this
    process's place in a prefill or decode mesh spanning processes (`engine.multihost`): process 0
    serves as the worker, the others follow it (a prefill role's offer their own KV shards,
    `engine.multihost.shard_offers`, unless `kv_offers` is "gather"). `kv_offer_hosts`:
    `TransferServerOptions.offer_hosts`. Once stopped, calls in flight may run
    `shutdown_timeout_s` before they are cut (the router fails them over);
    `wait_for_compiles` False leaves a background compile running (the caller ends the
    process with `os._exit`)."""
    from jaxpd.engine.multihost.plan_channel import PlanError
    from jaxpd.llm import LLM

    plan = None
    if group is not None and group.multi:
        from jaxpd.engine.multihost import shard_offers
        from jaxpd.engine.multihost.plan_channel import PlanChannel
        from jaxpd.serving.follower import follow_leader
        plan = PlanChannel(group, auth.token.encode() if auth.token else None)
        if role == "prefill" and kv_offers == "shards" and shard_offers.applies(
                transport, llm_options.get("kv_transfer_dtype")):
            if not group.is_leader:
                auth.check_bind(host, f"the {role} follower's KV transfer server")
            plan.offers = shard_offers.Board(plan) if group.is_leader else \
                shard_offers.Offerer(plan, kv_options(host))
        if not group.is_leader:
            return follow_leader(role, model, plan, stop, say, llm_options)
    auth.check_bind(host, f"the {role} worker")
    # A decode worker's running requests move out with their KV when it drains unless
    # told not to, on a mesh spanning processes too (its followers replay each cut).
    migrate = llm_options.get("migrate_on_drain") is not False
    llm_options = dict(llm_options, migrate_on_drain=migrate)   # warms the take programs
    connector, kv_address = make_connector(role, transport, host, auth, kv_offer_hosts)
    watch = None
    if plan is not None:
        from jaxpd.engine.multihost.plan_channel import BEAT_S, FollowerWatch
        from jaxpd.serving.follower import mesh_failed, role_lost
        watch = FollowerWatch(plan, role_lost(role), dead_s=follower_timeout_s)
        plan.on_failure = mesh_failed(role_lost(role), follower_timeout_s + 4 * BEAT_S)
    def progress(message: str) -> None:
        if stop.is_set():            # stopped while loading or compiling: stop between steps
            raise _Interrupted
        say(message)
    try:
        llm = LLM(model, connector=connector, progress=progress, plan=plan, **llm_options)
        if plan is not None:
            from jaxpd.serving.follower import weights_note
            say(f"jaxpd {role} leader 0/{plan.group.num_processes} of the mesh "
                f"{llm.config.mesh}{weights_note(llm)}")
    except PlanError as e:
        # Its mesh's processes disagree (another checkpoint): no program can run on it,
        # and jax's exit would wait for a follower that is gone.
        watch.stop()
        role_lost(role)(str(e))
    except _Interrupted:
        say(f"jaxpd {role} worker stopped while starting")
        if watch is not None:
            watch.stop()
            plan.publish({"op": "stop"})   # followers are between the same two steps
        return 0
    service = RoleService(llm.engine, kv_address, transport)
    server = RoleServer(service, host, port, auth)

    def outbox(engine, new_role: str):
        """A decode worker's running requests move out with their KV as it drains, sent
        as a prefill worker sends KV on this transport."""
        if not migrate or new_role != "decode":
            return None
        return MigrationOutbox(
            engine, auth, one_device=transport == "transfer_server",
            make_sender=lambda: make_connector("prefill", transport, host, auth,
                                               kv_offer_hosts)[0])

    service.migration = outbox(llm.engine, role)
    service.decode_peers = server.tell_draining
    current, http = [llm], None

    def rebuild(new_role: str):
        """The engine of `new_role` on this process's devices (`RoleSwitch`)."""
        conn, address = make_connector(new_role, transport, host, auth, kv_offer_hosts)
        options = dict(llm_options, mesh=other_mesh(str(current[0].config.mesh), new_role))
        new = LLM(model, connector=conn, progress=say, **options)
        current[0] = new
        if service.migration is not None:
            service.migration.close()       # the old engine's: drained already
        service.migration = outbox(new.engine, new_role)
        if http is not None:
            http.service.attach(new)
        say(f"jaxpd worker {server.address} is now a {new_role} worker (mesh "
            f"{new.config.mesh}, kv {transport} {address or 'sender'})")
        return new.engine, address

    if plan is None:                 # a mesh across processes keeps its role
        service.switcher = RoleSwitch(service, rebuild)
    try:
        if http_port >= 0:
            from jaxpd.serving.http import HttpServer, OpenAIService
            http = HttpServer(OpenAIService(role), host, http_port, openai_routes=False)
            http.service.attach(llm)
            say(f"jaxpd {role} worker HTTP (/health, /metrics) on http://{host}:{http.port}")
        server.start()
        if router:
            server.register_with(router, heartbeat_s, on_refused=lambda _: stop.set())
        processes = f", {group.num_processes} processes" if plan is not None else ""
        say(f"jaxpd {role} worker on {server.address} (mesh {llm.config.mesh}{processes}, "
            f"kv {transport} {kv_address or 'sender'}, auth: {auth.describe()}, model "
            f"{llm.fingerprint[:12]})")
        # Timed: the signal handler that sets `stop` runs only once the main thread
        # wakes, and the signal may have landed on another thread.
        while not stop.wait(0.2):
            pass
    finally:
        if watch is not None:
            watch.stop()
        if http is not None:
            http.service.draining = True
        why = f"this {service.role} worker is shutting down"
        peers = server.announce_draining(why)        # the router stops choosing it now
        # With no other decode worker to go to, its requests finish here instead (up to
        # the grace period) rather than be cut out for a move nobody can take.
        if service.migration is not None and service.error is None and peers != 0:
            outbox = service.migration
            outbox.drain(time.monotonic() + shutdown_timeout_s, why)
            s = current[0].stats()
            say(f"jaxpd decode worker drained: {outbox.num_sent} requests moved out, "
                f"{outbox.num_failed} moves failed, {outbox.num_dropped} dropped unasked; "
                f"{s.slots_active} slots and {s.pages_used} pages still in use")
        server.stop(shutdown_timeout_s)
        if http is not None:
            http.stop(0)
        current[0].shutdown(wait_for_compiles=wait_for_compiles)
    if plan is not None:
        say(f"jaxpd {role} leader {plan.summary()}")
    if server.refused is not None:
        say(f"jaxpd {service.role} worker stopped: {server.refused}")
        return 1
    return 0
