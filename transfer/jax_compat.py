"""`jax.experimental.transfer` differences across the jax versions setup.cfg allows.

Same in jax 0.6.0 .. 0.10.2 (checked): `start_transfer_server(client, address,
transport_addresses, max_num_parallel_copies=, transfer_size=)`, `server.address()`,
`server.connect(address).pull(uuid, specs)`, `Array.is_ready()`.
Differs: below, and `TransferConnection._poison_connection` (jax >= 0.8 only; the
caller looks it up with getattr; without it a stuck pull stays pending inside the
server, though no thread waits on it).
"""
from __future__ import annotations

import inspect

# jax < 0.10.1: `TransferServer.await_pull(uuid, arrays)` takes no timeout, so the
# server would keep an offer nobody pulls (a cancelled, discarded or expired handoff)
# until the process exits. TransferServerSender then ends such offers itself, at
# its own TTL, by pulling them from its own server ("reclaim"; seen working on 0.6.0
# and 0.8.3: a uuid can be pulled once, so the pull consumes the offer).
MIN_JAX_FOR_OFFER_TTL = "0.10.1"


def unavailable_reason() -> str | None:
    """Why this jax has no `jax.experimental.transfer` server API, or None. Checks the
    API only; a backend may still fail to start one."""
    try:
        from jax.experimental import transfer as jax_transfer
        jax_transfer.start_transfer_server  # noqa: B018 -- absent on some jaxlibs
    except (ImportError, AttributeError) as e:
        return f"no jax.experimental.transfer.start_transfer_server ({e})"
    return None


def await_pull_takes_timeout() -> bool:
    """Whether `TransferServer.await_pull` can expire an offer by itself."""
    try:
        from jax.experimental import transfer as jax_transfer
        params = inspect.signature(jax_transfer.TransferServer.await_pull).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return False          # cannot tell: end offers ourselves, which is always safe
    return "timeout" in params
