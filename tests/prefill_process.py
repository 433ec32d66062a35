"""A prefill-only jaxpd process for multi-process tests.

argv: model_dir decode_control_address requests.json mode
mode "normal": submit, wait until every offer is acked, exit 0.
mode "die_after_offer": submit, wait until every request is offered, then SIGKILL
itself before the decode side can pull (a prefill process dying mid-transfer).
"""
import json
import os
import signal
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"


def main() -> None:
    model_dir, decode_control, spec_file, mode = sys.argv[1:5]
    from jaxpd.config import EngineConfig
    from jaxpd.engine.engine import Engine
    from jaxpd.request import Request
    from jaxpd.sampling_params import SamplingParams
    from jaxpd.models import checkpoint
    from jaxpd.transfer.transfer_server import TransferServerSender

    with open(spec_file) as f:
        specs = json.load(f)
    connector = TransferServerSender(decode_control_address=decode_control)
    engine = Engine(checkpoint.load(model_dir), EngineConfig(mesh="prefill=2", max_model_len=160),
                    connector=connector)
    for s in specs:
        engine.submit(Request(s["id"], s["prompt"], SamplingParams(**s["params"])))
    deadline = time.monotonic() + 60
    while len(engine.requests) and time.monotonic() < deadline:   # handed off -> forgotten here
        time.sleep(0.01)
    if mode == "die_after_offer":
        os.kill(os.getpid(), signal.SIGKILL)
    while connector.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.shutdown()
    print(json.dumps(engine.stats().as_dict()), flush=True)


if __name__ == "__main__":
    main()
