"""`python -m jaxpd.launch` with a fault injected, for multi-process failure tests.

argv[1] is the fault, the rest go to the launcher:
  die_before_offer:N   SIGKILL this process in its N-th KV send, before offering
  die_after_offer:N    SIGKILL right after the N-th offer, before the decode side pulls
"""
import os
import signal
import sys


def main() -> None:
    fault, rest = sys.argv[1], sys.argv[2:]
    kind, nth = fault.split(":")
    nth = int(nth)
    from transfer.transfer_server import TransferServerConnector

    original = TransferServerConnector.send
    calls = {"n": 0}

    def send(self, handoff):
        calls["n"] += 1
        if calls["n"] == nth and kind == "die_before_offer":
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, handoff)
        if calls["n"] == nth and kind == "die_after_offer":
            os.kill(os.getpid(), signal.SIGKILL)

    TransferServerConnector.send = send
    from absl import app
    from jaxpd import launch

    launch.define_flags()
    sys.argv = ["jaxpd.launch"] + rest
    app.run(launch.main)


if __name__ == "__main__":
    main()
