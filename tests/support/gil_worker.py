"""A prefill worker process, pinned to one core, whose prefills hold the GIL, for the
heartbeat tests: `python gil_worker.py MODEL ROUTER HOLD_S SIDECAR(0|1)`.

Each prefill first holds the GIL for at least HOLD_S seconds in one C call that burns
CPU, as jaxlib does when it serializes a compiled program into the persistent
compilation cache: no Python thread of the process runs meanwhile. Prints its address
once registered, and "held the GIL for S s" after each hold."""
import os
import re
import sys
import threading
import time

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"


def hold_gil(seconds: float) -> float:
    """Hold the GIL for at least `seconds` in one regular-expression match (the `re`
    engine never lets it go), burning CPU; returns how long it held it."""
    n = 12
    while True:                        # the match time doubles with each character
        started = time.perf_counter()
        re.match(r"(x+x+)+y", "x" * n)
        took = time.perf_counter() - started
        if took >= seconds:
            return took
        n += 1 if took > seconds / 8 else 2


def main():
    model, router, hold_s, sidecar = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    from jaxpd.engine.loops.prefill_loop import PrefillLoop
    from jaxpd.llm import LLM
    from jaxpd.serving.role_server import RoleServer, RoleService, make_connector
    from tests.support.internal_plane import AUTH

    original = PrefillLoop._start

    def busy_start(self, batch):
        print(f"held the GIL for {hold_gil(hold_s):.2f} s", flush=True)
        return original(self, batch)
    PrefillLoop._start = busy_start
    connector, _ = make_connector("prefill", "grpc", "127.0.0.1", AUTH)
    llm = LLM(model, mesh="prefill=1", max_model_len=128, slots_per_shard=2, warmup=False,
              connector=connector)
    server = RoleServer(RoleService(llm.engine, "", "grpc"), "127.0.0.1", 0, AUTH)
    server.start()
    server.register_with(router, heartbeat_s=0.2, sidecar_beats=sidecar == "1")
    print(f"worker on {server.address}", flush=True)
    threading.Event().wait(600)        # until the test kills it


if __name__ == "__main__":
    main()
