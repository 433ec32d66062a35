"""A worker process that changes role: `SwitchRole`, on the router's command.

The worker, in order:
1. **Drains.** New `Prefill` and `Decode` calls are refused (UNAVAILABLE, saying why;
   the router has stopped choosing this worker already and fails such a call over).
   A decode worker with a `MigrationOutbox` moves its running requests out with their
   KV (`serving.migration`), unless the router answers that no other decode worker
   could take them (`RoleService.decode_peers`). Requests it holds otherwise finish here: decode streams
   run to their end, prefills complete their handoff. What is still running after
   `drain_s` is aborted with the reason (the router fails it over: the decode side
   prefills it again).
2. **Rebuilds.** Its engine is shut down (pool, weights and connector freed) and a new
   one is built for the other role on the same devices (`other_mesh`), with a new
   connector (a decode worker's KV receiver listens on a new port).
3. **Moves to a new epoch** and answers it; its next heartbeat re-registers it with
   the new role. The router drops the old registration (`Router.admit`), so calls
   still open on it fail over; every later call names the new epoch, and a call naming
   another one is refused (FAILED_PRECONDITION). A late KV handoff meant for the old
   decode role cannot land either: the old receiver's port is closed, so the sender's
   transfer fails and the router's failure path prefills the request again.
A rebuild that fails leaves the worker failed: UNAVAILABLE to every call, health
NOT_SERVING, no heartbeat; the router drops it when its lease runs out.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from jaxpd.serving.role_rpc import ROLES, Refusal
from jaxpd.sharding.spec import parse_mesh_spec

_log = logging.getLogger(__name__)

# (role) -> (the new engine, its KV address): builds the worker's engine for a role.
Rebuild = Callable[[str], tuple[object, str]]


def other_mesh(mesh: str, role: str) -> str:
    """The single-role mesh of `role` on the devices of `mesh` (another role's):
    `prefill=N` <-> `decode=N` (N data-parallel shards); `decode=DxT` -> `prefill=D*T`."""
    spec = parse_mesh_spec(mesh)
    if spec.has_prefill == spec.has_decode or role not in ROLES:
        raise ValueError(f"a role switch needs a single-role mesh and a role in {ROLES}, "
                         f"got mesh {mesh!r} and role {role!r}")
    devices = spec.num_devices
    return f"prefill={devices}" if role == "prefill" else f"decode={devices}"


class RoleSwitch:
    """Drains and rebuilds `service` (a `RoleService`) for another role; see the module."""

    def __init__(self, service, rebuild: Rebuild, drain_s: float = 60.0):
        self.service, self.rebuild, self.drain_s = service, rebuild, drain_s
        self.draining: str | None = None     # why new calls are refused, while draining
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def handle(self, msg: dict) -> dict:
        """The `SwitchRole` RPC (blocking: it drains and rebuilds); refusals raise
        `Refusal`."""
        service = self.service
        role = msg.get("role")
        if role not in ROLES:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"role must be one of {ROLES}, got {role!r}")
        if not self._lock.acquire(blocking=False):
            raise Refusal(grpc.StatusCode.ABORTED, "a role switch is already in progress")
        try:
            service.check_epoch(msg)
            if role == service.role:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"this worker is a {role} worker already (epoch {service.epoch})")
            self.switch(role)
            if self.error is not None:
                raise Refusal(grpc.StatusCode.INTERNAL,
                              f"the switch to {role} failed: {self.error!r}")
            return {"role": service.role, "epoch": service.epoch}
        finally:
            self._lock.release()

    def switch(self, role: str) -> None:
        service, old = self.service, self.service.role
        self.draining = f"this worker is switching from {old} to {role}"
        _log.info("%s: draining", self.draining)
        deadline = time.monotonic() + self.drain_s
        migration = getattr(service, "migration", None)
        if migration is not None and service.role == "decode":
            ask = getattr(service, "decode_peers", None)
            if (ask(self.draining) if ask is not None else None) != 0:
                migration.drain(deadline, self.draining)   # its requests move out
        while not service.engine.is_idle() and time.monotonic() < deadline:
            time.sleep(0.02)
        service.engine.shutdown(f"aborted: {self.draining}")
        try:
            engine, kv_address = self.rebuild(role)
        except BaseException as e:           # the worker cannot serve: say so, stop
            self.error = e
            _log.exception("the switch from %s to %s failed", old, role)
            return
        # The epoch first, the role last: a heartbeat read in between announces the old
        # role at the new epoch (the router, draining it, sends it nothing), never the
        # new role at the old epoch.
        service.epoch += 1
        service.engine, service.kv_address = engine, kv_address
        service.role = role
        self.draining = None
        _log.info("now a %s worker (epoch %d)", role, service.epoch)
