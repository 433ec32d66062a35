"""Router + prefill + decode processes on 127.0.0.1 where the prefill worker dies:
before, between or after the parts of a layer-wise transfer, before its offer, after
it, or on its ack. The decode side holds a slot (and maybe some of a request's layers)
when it happens; the request is prefilled again and finishes with the same tokens.
(Split from test_router.py, sharing its helpers in tests/support, so that xdist's
one-file-per-worker scheduling has two halves to balance.)
"""
import signal
import time

import pytest

from jaxpd.serving.role_rpc import RoleClient
from tests.support.deployments import (LAYERWISE, PATIENT_ROUTER, deployment, generate_all,
                                       router_model)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tiny_hf_model):
    return router_model(tiny_hf_model)


# Fault points x transports, each once (a CI minute each): before the first part is
# offered and after it, on both transports between them.
@pytest.mark.parametrize("fault,transport", [("die_before_offer:2", "transfer_server"),
                                             ("die_after_offer:2", "grpc")])
def test_prefill_worker_killed_between_layer_parts_requests_still_finish(model, procs, fault,
                                                                         transport):
    """The decode side holds a slot with some of a request's layers when the prefill
    worker dies: the request is prefilled again and finishes with the same tokens."""
    path, prompts, max_tokens, expected, long_tokens, expected_long = model
    addr, _, workers = deployment(procs, path, prefill_fault=fault, extra=LAYERWISE,
                                   transport=transport, router_extra=PATIENT_ROUTER)
    outs = generate_all(addr, prompts, max_tokens)
    assert workers[0].wait(timeout=60) == -signal.SIGKILL
    assert [list(o.token_ids) for o in outs] == expected, (
        [(o.finish_reason, o.metrics.abort_reason) for o in outs], procs.tails())
    decode = RoleClient(procs.wait_line(workers[1], r"decode worker on (\S+)").group(1))
    deadline = time.monotonic() + 30
    while decode.info(timeout=10)["free_slots"] != 8:      # every slot given back
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # The request caught between parts failed its transfer and was prefilled again.
    assert decode.info(timeout=10)["transfer_failures"] >= 1


# (The gRPC stream with a dying prefill worker: the layer-wise test above.)
@pytest.mark.parametrize("fault,transport", [("die_before_offer:3", "transfer_server"),
                                             ("die_after_offer:3", "transfer_server"),
                                             ("die_on_ack:3", "transfer_server")])
def test_prefill_worker_killed_requests_still_finish(model, procs, fault, transport):
    path, prompts, max_tokens, expected, long_tokens, expected_long = model
    addr, _, workers = deployment(procs, path, prefill_fault=fault, transport=transport,
                                   router_extra=PATIENT_ROUTER)
    outs = generate_all(addr, prompts, max_tokens)
    assert workers[0].wait(timeout=60) == -signal.SIGKILL
    # The requests the dead worker held were prefilled again on the decode worker.
    assert [list(o.token_ids) for o in outs] == expected, (
        [(o.finish_reason, o.metrics.abort_reason) for o in outs], procs.tails())
