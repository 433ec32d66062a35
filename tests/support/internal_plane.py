"""The internal plane in one process: its cluster token (`AUTH`), a role worker serving
a real engine over gRPC (`start_worker`), and a bounded wait."""
import time

from jaxpd.auth import InternalAuth

TOKEN = "cluster-token-for-tests-0123456789"
AUTH = InternalAuth(token=TOKEN)


def wait_until(predicate, timeout=10.0):
    """Poll `predicate` until it holds; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


MAX_MODEL_LEN = 128


def start_worker(path, mesh="decode=1", auth=AUTH):
    """(llm, started RoleServer) of a worker on a one-role mesh, gRPC KV."""
    from jaxpd.llm import LLM
    from jaxpd.serving.role_server import RoleServer, RoleService

    llm = LLM(path, mesh=mesh, max_model_len=MAX_MODEL_LEN, slots_per_shard=2, warmup=False)
    server = RoleServer(RoleService(llm.engine, "", "grpc"), "127.0.0.1", 0, auth)
    server.start()
    return llm, server

