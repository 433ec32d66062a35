"""What both ends of the transfer-server connector share: the options, this process's
JAX transfer server with a gRPC control server beside it (`Endpoint`), and the wait
on a pull (`wait_ready`). The sender is `transfer.transfer_server`, the receiver
`transfer.transfer_receiver`; the protocol is described in the former.
"""
from __future__ import annotations

import dataclasses
import datetime
import threading
import time

import jax

from jaxpd.auth import InternalAuth
from jaxpd.transfer import jax_compat
from jaxpd.transfer.control import ControlClient, ControlServer
from jaxpd.transfer.wire import TransferError

MiB = 1 << 20
PULLED = "pulled, then refused: "   # an Ack error after a completed pull: nothing to reclaim


class TransferServerUnavailable(TransferError):
    """This jax/backend has no usable `jax.experimental.transfer` server."""


class PullTimeoutError(TransferError, TimeoutError):
    """A pull did not complete in time: the offer expired, was never made, or the
    sender is unreachable."""


@dataclasses.dataclass(frozen=True)
class TransferServerOptions:
    """Knobs of the data plane and its deadlines.

    transport_addresses: bulk-transport sockets; must not be empty (jax 0.10.2 aborts
      the process on a failed internal check when it is).
    advertise_host: the host the peer should dial, when binding to 0.0.0.0 / [::].
    transfer_size: chunk size of the bulk copy; 4 MiB roughly doubles CPU loopback
      throughput over the 256 MiB default and maps far less memory.
    verify_checksums: the sender crc32s every page it offers, the receiver checks the
      pulled pages against them (`transfer.checksum`). Cost, on each side: one pass of
      crc32 over the KV's host bytes (~GB/s, no compile) -- free of copies on CPU,
      where the pages already live in host memory, but a device -> host copy of the
      whole KV on an accelerator. None (default): on when `jax.default_backend()` is
      "cpu". A receiver checks the checksums an Offer carries; an Offer without them
      (its sender has them off) is taken unchecked.
    check_offer_addresses: an Offer may only name transfer and ack addresses on the
      host it came from (a peer with the cluster token still cannot point the decode
      side at a third machine); off for senders behind address translation.
    offer_hosts: the hosts an Offer's pieces may also come from (a prefill mesh spanning
      hosts offers each host's own shards, `engine.multihost.shard_offers`): its other hosts.
    """
    transfer_address: str = "127.0.0.1:0"
    transport_addresses: tuple[str, ...] = ("127.0.0.1:0",)
    advertise_host: str | None = None
    transfer_size: int = 4 * MiB
    max_num_parallel_copies: int = 8
    offer_ttl_s: float = 60.0
    pull_timeout_s: float = 30.0
    rpc_timeout_s: float = 10.0
    max_pending: int = 64
    reclaim_timeout_s: float = 5.0
    verify_checksums: bool | None = None
    check_offer_addresses: bool = True
    offer_hosts: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.transport_addresses:
            raise ValueError("transport_addresses must not be empty, e.g. ('127.0.0.1:0',)")
        if self.transfer_size <= 0 or self.max_num_parallel_copies <= 0:
            raise ValueError("transfer_size and max_num_parallel_copies must be positive")
        for name in ("offer_ttl_s", "pull_timeout_s", "rpc_timeout_s", "reclaim_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_pending <= 0:
            raise ValueError(f"max_pending must be positive, got {self.max_pending}")

    def checksums_on(self) -> bool:
        """`verify_checksums`, with None resolved for this process's backend (at use,
        not at construction: a default instance is built when this module loads)."""
        if self.verify_checksums is None:
            return jax.default_backend() == "cpu"
        return self.verify_checksums



def start_transfer_server(options: TransferServerOptions):
    """A `jax.experimental.transfer` server, or `TransferServerUnavailable` saying why."""
    fallback = ("use jaxpd.transfer.grpc_stream's GrpcSender/GrpcReceiver instead "
                "(--kv_transport grpc)")
    reason = jax_compat.unavailable_reason()
    if reason is not None:
        raise TransferServerUnavailable(f"jax {jax.__version__} has no usable transfer "
                                        f"server: {reason}; {fallback}")
    from jax.experimental import transfer as jax_transfer
    try:
        return jax_transfer.start_transfer_server(
            jax.local_devices()[0].client, options.transfer_address,
            list(options.transport_addresses),
            max_num_parallel_copies=options.max_num_parallel_copies,
            transfer_size=options.transfer_size)
    except Exception as e:  # noqa: BLE001 -- backends fail with different types; all mean "unavailable"
        raise TransferServerUnavailable(
            f"the JAX transfer server could not start on {jax.default_backend()} "
            f"(jax {jax.__version__}): {type(e).__name__}: {e}; {fallback}") from e


def advertised(address: str, host: str | None) -> str:
    return address if host is None else f"{host}:{address.rsplit(':', 1)[1]}"


class Endpoint:
    """What both sides share: this process's transfer server and a control server."""

    def __init__(self, control_address: str, options: TransferServerOptions,
                 auth: InternalAuth, **handlers):
        self.options = options
        self._auth = auth
        self._server = start_transfer_server(options)
        self.transfer_address = advertised(self._server.address(), options.advertise_host)
        self._lock = threading.Condition()
        self._closed = False
        self._control = ControlServer(control_address, auth=auth, **handlers)
        self.control_address = advertised(self._control.address, options.advertise_host)
        self._clients: dict[str, ControlClient] = {}

    def _client(self, address: str) -> ControlClient:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = ControlClient(address, self._auth)
            return self._clients[address]

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Stop the control plane. The JAX transfer server has no stop method; it goes
        with the process."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._control.stop()
        for client in self._clients.values():
            client.close()



def wait_ready(arrays: list[jax.Array], connection, timeout: float, what: str) -> None:
    """Poll until every pulled array is ready, or poison the connection and raise.

    Polling, not a blocking wait on a helper thread: a blocked thread could never be
    ended if the pull never completes.
    """
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not all(a.is_ready() for a in arrays):
        if time.monotonic() >= deadline:
            poison = getattr(connection, "_poison_connection", None)
            if poison is not None:
                poison()
            raise PullTimeoutError(
                f"{what} did not finish in {timeout:.1f}s: the offer expired, was never "
                f"made, or the sender is gone")
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


def offer_arrays(server, uuid: int, arrays: list, ttl_s: float, expires: bool) -> None:
    """Offer `arrays` under `uuid` in `server`; `expires`: the server drops the offer
    itself after `ttl_s` (jax >= 0.10.1, `jax_compat.await_pull_takes_timeout`)."""
    if expires:
        server.await_pull(uuid, arrays, timeout=datetime.datetime.now(datetime.timezone.utc)
                          + datetime.timedelta(seconds=ttl_s))
    else:
        server.await_pull(uuid, arrays)


def reclaim_offer(server, uuid: int, specs: list, timeout_s: float) -> None:
    """End an offer nobody pulled by pulling it from our own `server` in its exact
    layout (`specs`; a uuid can be pulled once) and dropping the copy, under a
    watchdog; raises when a peer pulled it after all, or it expired."""
    connection = server.connect(server.address())
    arrays = connection.pull(uuid, specs)
    wait_ready(arrays, connection, timeout_s, f"reclaim of offer {uuid}")
    jax.block_until_ready(arrays)
