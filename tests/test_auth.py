"""The internal plane's authentication: cluster token and mTLS on a bare gRPC service."""
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxpd.auth import AuthConfigError, InternalAuth, is_loopback

from certs import issue, make_ca

TOKEN = "s3cret-cluster-token-0123456789"


def _serve(auth: InternalAuth):
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=auth.server_interceptors())
    calls = []

    def echo(request, context):
        calls.append(request)
        return request
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    h = health.HealthServicer()
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    port = auth.add_port(server, "127.0.0.1:0")
    server.start()
    return server, f"localhost:{port}", calls


def _echo(channel, body=b"hi"):
    return channel.unary_unary("/t.Echo/Echo")(body, timeout=5)


def test_cluster_token_required_and_compared():
    server, address, calls = _serve(InternalAuth(token=TOKEN))
    try:
        with InternalAuth(token=TOKEN).channel(address) as ch:
            assert _echo(ch) == b"hi"
        for stranger in (InternalAuth(), InternalAuth(token="wrong-token-0123456789abc")):
            with stranger.channel(address) as ch, pytest.raises(grpc.RpcError) as e:
                _echo(ch, b"payload that must not be seen")
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert calls == [b"hi"]          # the stranger's bodies never reached the handler
        with InternalAuth().channel(address) as ch:   # health needs no token
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_mtls_needs_a_certificate_from_the_ca(tmp_path):
    ca = make_ca(str(tmp_path))
    server_pem, client_pem = issue(str(tmp_path), ca, "server"), issue(str(tmp_path), ca, "client")
    other_ca = make_ca(str(tmp_path), "other-ca")
    rogue_pem = issue(str(tmp_path), other_ca, "rogue")
    opts = lambda p: dict(tls_cert=p.cert, tls_key=p.key, tls_ca=p.ca)
    server, address, calls = _serve(InternalAuth.from_options(**opts(server_pem)))
    try:
        with InternalAuth.from_options(**opts(client_pem)).channel(address) as ch:
            assert _echo(ch) == b"hi"
        rogue = InternalAuth.from_options(tls_cert=rogue_pem.cert, tls_key=rogue_pem.key,
                                          tls_ca=server_pem.ca)
        for stranger in (InternalAuth(), rogue):
            with stranger.channel(address) as ch, pytest.raises(grpc.RpcError) as e:
                _echo(ch)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert calls == [b"hi"]
    finally:
        server.stop(0)


def test_open_bind_without_auth_is_refused_unless_insecure(caplog):
    with pytest.raises(AuthConfigError, match="insecure_internal"):
        InternalAuth().check_bind("0.0.0.0", "the decode worker")
    InternalAuth().check_bind("127.0.0.1", "the decode worker")
    InternalAuth(token=TOKEN).check_bind("0.0.0.0", "the decode worker")
    InternalAuth(insecure=True).check_bind("0.0.0.0", "the decode worker")
    assert "no authentication" in caplog.text
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_bad_auth_options_name_the_flag(tmp_path):
    with pytest.raises(AuthConfigError, match="at least 16"):
        InternalAuth(token="short")
    with pytest.raises(AuthConfigError, match="all of --tls_cert"):
        InternalAuth(tls_cert=b"x")
    with pytest.raises(AuthConfigError, match="one of --cluster_token"):
        InternalAuth.from_options(cluster_token=TOKEN, cluster_token_file="f")
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert InternalAuth.from_options(cluster_token_file=str(path)).token == TOKEN
    assert InternalAuth.from_options(environ={"JAXPD_CLUSTER_TOKEN": TOKEN}).token == TOKEN
