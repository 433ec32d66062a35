"""Authentication of the internal plane: who may call a role, the router's internal
port, the KV control and stream services.

Two schemes, either or both:
- **mTLS** (`--tls_cert/--tls_key/--tls_ca`): grpc's own SSL credentials; servers
  require a client certificate signed by the CA, clients verify the server's.
- **a cluster token** (`--cluster_token_file`, or `JAXPD_CLUSTER_TOKEN` in the
  environment; `--cluster_token` works but shows in `ps`): sent as call metadata
  `x-jaxpd-cluster-token` on every internal call, compared in constant time by a
  server interceptor before the request body is even decoded.

With neither, a server may listen on loopback only, unless the user passes
`--insecure_internal` (then it logs a warning). Health checks (`grpc.health.v1`)
carry no data and are exempt from the token so probes need no secret; with mTLS
every call needs a certificate.

Plain Python (grpc only): the router imports it, and so do the transfer connectors.
"""
from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import os
import socket
from typing import Any, Callable, Sequence

import grpc

TOKEN_METADATA = "x-jaxpd-cluster-token"
TOKEN_ENV = "JAXPD_CLUSTER_TOKEN"
MIN_TOKEN_LEN = 16
_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)

_log = logging.getLogger(__name__)


class AuthConfigError(ValueError):
    """The auth flags contradict each other, or a listen address is open without auth."""


@dataclasses.dataclass(frozen=True)
class InternalAuth:
    """How this process authenticates internal calls, as a server and as a client.

    `token`: the shared cluster secret (None: none). `tls_cert`, `tls_key`, `tls_ca`:
    PEM bytes of this process's certificate chain, its key, and the CA that signs its
    peers (all three, or none). `insecure`: the user asked for an unauthenticated plane
    on a non-loopback address.
    """
    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_ca: bytes | None = None
    tls_server_name: str | None = None
    insecure: bool = False

    def __post_init__(self):
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(x is not None for x in tls) and not all(x is not None for x in tls):
            raise AuthConfigError("mTLS needs all of --tls_cert, --tls_key and --tls_ca")
        if self.token is not None:
            if len(self.token) < MIN_TOKEN_LEN:
                raise AuthConfigError(f"cluster token must be at least {MIN_TOKEN_LEN} "
                                      f"characters, got {len(self.token)}")
            if not self.token.isprintable() or not self.token.isascii():
                raise AuthConfigError("cluster token must be printable ASCII")

    @classmethod
    def from_options(cls, *, cluster_token: str | None = None,
                     cluster_token_file: str | None = None, tls_cert: str | None = None,
                     tls_key: str | None = None, tls_ca: str | None = None,
                     tls_server_name: str | None = None, insecure: bool = False,
                     environ=os.environ) -> "InternalAuth":
        """From flag values (file paths for the TLS parts); the token from the flag,
        else the file, else `JAXPD_CLUSTER_TOKEN`. OSError for an unreadable file."""
        if cluster_token and cluster_token_file:
            raise AuthConfigError("give one of --cluster_token and --cluster_token_file")
        token = cluster_token or None
        if cluster_token_file:
            with open(cluster_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        if token is None:
            token = environ.get(TOKEN_ENV) or None
        read = lambda path: None if not path else open(path, "rb").read()
        return cls(token=token, tls_cert=read(tls_cert), tls_key=read(tls_key),
                   tls_ca=read(tls_ca), tls_server_name=tls_server_name or None,
                   insecure=insecure)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def enabled(self) -> bool:
        """Some scheme authenticates callers."""
        return self.tls or self.token is not None

    def describe(self) -> str:
        parts = (["mTLS"] if self.tls else []) + (["cluster token"] if self.token else [])
        return " + ".join(parts) or "none"

    # ---- servers ------------------------------------------------------------------

    def check_bind(self, host: str, what: str) -> None:
        """Refuse to listen beyond loopback without auth (unless `insecure`)."""
        if self.enabled or is_loopback(host):
            return
        if not self.insecure:
            raise AuthConfigError(
                f"{what} would listen on {host} with no authentication: give a cluster "
                f"token ({TOKEN_ENV} or --cluster_token_file) or --tls_cert/--tls_key/"
                f"--tls_ca, or pass --insecure_internal to accept that anyone who reaches "
                f"{host} can drive this process")
        _log.warning("%s listens on %s with no authentication (--insecure_internal)", what, host)

    def server_interceptors(self) -> tuple[grpc.ServerInterceptor, ...]:
        """Pass these to `grpc.server(..., interceptors=...)`."""
        return (_TokenInterceptor(self.token),) if self.token is not None else ()

    def aio_server_interceptors(self) -> tuple[grpc.aio.ServerInterceptor, ...]:
        """Pass these to `grpc.aio.server(..., interceptors=...)`: the same check."""
        return (_AioTokenInterceptor(self.token),) if self.token is not None else ()

    def add_port(self, server: grpc.Server | grpc.aio.Server, address: str) -> int:
        """Bind `address` with this scheme's credentials; returns the port (OSError when
        it cannot bind)."""
        try:
            if self.tls:
                creds = grpc.ssl_server_credentials(((self.tls_key, self.tls_cert),),
                                                    root_certificates=self.tls_ca,
                                                    require_client_auth=True)
                port = server.add_secure_port(address, creds)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        return port

    # ---- clients ------------------------------------------------------------------

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel whose every call carries this process's credentials."""
        creds, options = self._client_credentials(options)
        if creds is not None:
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token is not None:
            channel = grpc.intercept_channel(channel, _TokenClientInterceptor(self.token))
        return channel

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()
                    ) -> grpc.aio.Channel:
        """An asyncio channel with this process's TLS credentials (make it on the loop
        that uses it); every call on it passes `metadata` for the token."""
        creds, options = self._client_credentials(options)
        if creds is not None:
            return grpc.aio.secure_channel(address, creds, options=options)
        return grpc.aio.insecure_channel(address, options=options)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata an `aio_channel` call carries."""
        return ((TOKEN_METADATA, self.token),) if self.token is not None else ()

    def _client_credentials(self, options: Sequence[tuple[str, Any]]):
        options = list(options)
        if not self.tls:
            return None, options
        creds = grpc.ssl_channel_credentials(root_certificates=self.tls_ca,
                                             private_key=self.tls_key,
                                             certificate_chain=self.tls_cert)
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return creds, options


NO_AUTH = InternalAuth()


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and 'localhost'; anything else (0.0.0.0, a name, an interface
    address) counts as reachable from outside."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback
                       for a in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


# ---- the token on the wire ----------------------------------------------------------

def _deny(handler: grpc.RpcMethodHandler, message: str, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED without decoding the
    request (no deserializer: the caller's bytes are never parsed); a coroutine for a
    `grpc.aio` server (`aio`)."""
    if aio:
        async def abort(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    else:
        def abort(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(abort, request_deserializer=None,
                response_serializer=handler.response_serializer)


def _refusal(token: bytes, details: grpc.HandlerCallDetails) -> str | None:
    """Why a call is refused for its token (None: it may proceed)."""
    if details.method.startswith(_EXEMPT_PREFIXES):
        return None
    sent = dict(details.invocation_metadata or ()).get(TOKEN_METADATA)
    if sent is None:
        return f"this internal service needs the cluster token (metadata {TOKEN_METADATA})"
    if isinstance(sent, str):
        sent = sent.encode("utf-8", "replace")
    if not hmac.compare_digest(sent, token):
        return "wrong cluster token"
    return None


class _TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        refusal = None if handler is None else _refusal(self._token, details)
        return handler if refusal is None else _deny(handler, refusal, aio=False)


class _AioTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation: Callable,
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        refusal = None if handler is None else _refusal(self._token, details)
        return handler if refusal is None else _deny(handler, refusal, aio=True)


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor,
                              grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor,
                              grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._pair = (TOKEN_METADATA, token)

    def _with_token(self, details):
        metadata = list(details.metadata or ()) + [self._pair]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


@dataclasses.dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any
