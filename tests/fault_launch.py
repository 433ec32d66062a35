"""`python -m jaxpd.launch` with a fault injected, for multi-process failure tests.

argv[1] is the fault, the rest go to the launcher:
  die_before_offer:N   SIGKILL this process in its N-th KV send, before offering
                       (either transport)
  die_after_offer:N    SIGKILL right after the N-th offer, before the decode side pulls
                       (over the gRPC stream: right after the N-th stream completed)
  die_on_ack:N         SIGKILL when the N-th ack arrives: the decode side has pulled,
                       the sender never learns it
  die_mid_kv_stream:N  (a decode worker on the gRPC stream) SIGKILL once the header of
                       the N-th inbound KV stream has arrived, its pages still in flight
"""
import os
import signal
import sys


def main() -> None:
    fault, rest = sys.argv[1], sys.argv[2:]
    kind, nth = fault.split(":")
    nth = int(nth)
    from jaxpd.transfer.grpc_stream import GrpcReceiver, GrpcSender
    from jaxpd.transfer.transfer_server import TransferServerSender

    calls = {"n": 0}

    def dying(original):
        def send(self, handoff):
            calls["n"] += 1
            if calls["n"] == nth and kind == "die_before_offer":
                os.kill(os.getpid(), signal.SIGKILL)
            original(self, handoff)
            if calls["n"] == nth and kind == "die_after_offer":
                os.kill(os.getpid(), signal.SIGKILL)
        return send

    original_ack = TransferServerSender._on_ack
    acks = {"n": 0}

    def on_ack(self, ack):
        acks["n"] += 1
        if acks["n"] == nth and kind == "die_on_ack":
            os.kill(os.getpid(), signal.SIGKILL)
        original_ack(self, ack)

    original_serve = GrpcReceiver._serve
    streams = {"n": 0}

    def serve(self, messages, context):
        streams["n"] += 1
        if streams["n"] == nth and kind == "die_mid_kv_stream":
            next(messages)                   # the header: the sender is mid-stream
            os.kill(os.getpid(), signal.SIGKILL)
        return original_serve(self, messages, context)

    GrpcReceiver._serve = serve
    TransferServerSender.send = dying(TransferServerSender.send)
    GrpcSender.send = dying(GrpcSender.send)     # die_* faults over the gRPC stream
    TransferServerSender._on_ack = on_ack
    from absl import app
    from jaxpd.serving import launch

    launch.define_flags()
    sys.argv = ["jaxpd.launch"] + rest
    app.run(launch.main)


if __name__ == "__main__":
    main()
