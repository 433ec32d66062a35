"""The processes of a prefill or decode role whose mesh spans several
(`engine.multihost`): what a follower process does all its life, and what the leader
does when it loses one."""
from __future__ import annotations

import os
import sys
import threading
import time


def role_lost(role: str):
    """The leader's answer to a lost follower: its mesh can run no program, and one in
    flight may never return, so the role stops at once, saying why (the router fails
    its requests over as for any dead worker)."""
    def lost(reason: str) -> None:
        print(f"jaxpd {role} role stopped: {reason}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    return lost


def mesh_failed(lost, wait_s: float):
    """The leader's answer to its engine failing (`PlanChannel.on_failure`): a program
    on a mesh across processes failed, most often a collective whose peer died. The
    follower watch names a dead follower within its timeout (`wait_s`: and it stops
    the role then); whatever else it was, the role stops with the error. Requests are
    not aborted here: the router fails them over when the worker goes."""
    def failed(error: BaseException) -> None:
        time.sleep(wait_s)
        first = next(iter(str(error).splitlines()), repr(error))
        lost(f"a program on its mesh failed ({first[:300]})")
    return failed


# A follower outlives its own SIGTERM this long, waiting for its leader's stop: the
# processes of a role are usually stopped together, and the leader may be mid-batch
# (or mid-warm-up), which needs every process until it ends.
FOLLOWER_GRACE_S = 60.0


def follow_leader(role: str, model: str | None, plan, stop: threading.Event, say,
                  llm_options: dict, grace_s: float = FOLLOWER_GRACE_S) -> int:
    """A follower process: the same engine on the same global mesh, replaying the
    leader's programs until it says stop (0), `grace_s` after `stop` is set (0), or
    until it cannot be followed (1)."""
    from jaxpd.engine.multihost.plan_channel import Follower, PlanError
    from jaxpd.llm import LLM

    group = plan.group
    follower = Follower(plan).start()
    give_up = threading.Event()

    def after_grace() -> None:
        stop.wait()
        give_up.wait(grace_s)
        give_up.set()
    threading.Thread(target=after_grace, name="jaxpd-follower-grace", daemon=True).start()
    try:
        llm = LLM(model, progress=lambda _: None, plan=plan, **llm_options)
        say(f"jaxpd {role} follower {group.process_id}/{group.num_processes} of the mesh "
            f"{llm.config.mesh} led by process 0 ({group.coordinator}){weights_note(llm)}")
        outcome = llm.engine.follow(follower, give_up)
    except PlanError as e:
        print(f"jaxpd {role} follower {group.process_id} stopped: {e}", file=sys.stderr,
              flush=True)
        os._exit(1)
    except Exception as e:                   # the coordinator (the leader) is gone
        print(f"jaxpd {role} follower {group.process_id} stopped: the leader is gone "
              f"({str(e).splitlines()[0][:200]})", file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        follower.close()
    offers = f" ({plan.offers.summary()})" if plan.offers is not None else ""
    say(f"jaxpd {role} follower {group.process_id} {outcome}{offers}")
    if outcome != "stopped":       # the leader still runs: no shutdown barrier to meet
        sys.stdout.flush()
        os._exit(0)
    return 0


def weights_note(llm) -> str:
    """", it read 52% of the weights (its shards)": what a process of a mesh spanning
    several read of the checkpoint (nothing for checkpoints not read by shard)."""
    if llm.weights_read is None:
        return ""
    read, total = llm.weights_read
    return f", it read {100 * read / total:.0f}% of the weights (its shards)"
