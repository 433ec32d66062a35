"""One role's mesh across processes (and hosts): JAX multi-controller, a leader and followers.

`jax.distributed` joins the processes of a role into one global mesh; every process
must then dispatch the same programs, with the same inputs, in the same order. Process
0, the **leader**, runs the engine as a single process would (scheduler, connector,
router registration). Each **follower** builds the same runner on the same global mesh
and replays the leader's runner calls, which the leader publishes as a numbered
sequence of small messages (the *plan*: a prefill batch's tokens, lengths and sampling
rows; which pages to cut, `multihost.prefill`; a decode role's steps, page inserts,
penalty contexts and migrations' page cuts, `multihost.decode`) through the key-value
store of the coordination service that `jax.distributed` already runs. No port or
protocol of our own, and the store's blocking get is exactly a follower's wait for its
next step.

Trust: the coordination service and the collectives (gloo on CPU) carry no
authentication of their own (launch/MULTI_HOST.md: keep them on a private network). With
a cluster token every plan is signed (HMAC-SHA256 over its sequence number and body) and
a follower refuses one that is not; without a token the coordinator must be on loopback
(the launcher enforces it). A follower also checks every message's shape before it acts.

Liveness: a follower (`Follower`) writes `beat acked` (a counter and the last plan it
finished) every `BEAT_S`; the leader's `FollowerWatch` calls `on_lost` with the reason
when a follower's beat stops for `dead_s`, or when it is behind and has finished nothing
for `stuck_s`. A follower stops when the leader says so, or when the coordination
service (hosted by the leader) is gone.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import threading
import time
from typing import Callable

import ml_dtypes
import msgpack
import numpy as np


BEAT_S = 0.5
KEPT_TIMES = 1 << 16
_PLAN, _BEAT, _MODEL = "jaxpd/plan/", "jaxpd/beat/", "jaxpd/model"
# How long a follower waits for its leader's fingerprint: the leader loads the same
# checkpoint first, and a large one takes minutes to read.
MODEL_WAIT_S = 600.0
# How long a leader that refuses a follower lets it print its reason and exit first.
COMPARED_GRACE_S = 1.0
_DTYPES = {"int32": np.int32, "float32": np.float32, "bool": np.bool_,
           "bfloat16": ml_dtypes.bfloat16}
_MAX_ELEMENTS = 1 << 24   # a plan array larger than this is not one we send (pages: their own cap)


class PlanError(ValueError):
    """A plan message that is forged, corrupt, or not one a leader sends."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in its role: `num_processes` 1 is a single process."""
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), "
                             f"got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator:
            raise ValueError("coordinator (host:port) is needed with num_processes > 1")

    @property
    def multi(self) -> bool:
        return self.num_processes > 1

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def initialize(group: ProcessGroup) -> None:
    """Join the role's processes (`jax.distributed`); the coordinator, hosted by process
    0, listens on exactly `group.coordinator` (jax's default is every interface). On CPU
    the collectives between processes go through gloo. Before any jax backend is used."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id,
                               coordinator_bind_address=group.coordinator)


def _client():
    from jax._src import distributed     # the store jax.distributed runs; no public name
    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialised")
    return distributed.global_state.client


def pack_array(a: np.ndarray) -> list:
    """An array as a plan field: [dtype name, shape, C-order bytes]."""
    return [a.dtype.name, list(a.shape), np.ascontiguousarray(a).tobytes()]


def unpack_array(value, name: str, max_elements: int = _MAX_ELEMENTS) -> np.ndarray:
    """A plan field `name` back as an array, checked (a known dtype, at most
    `max_elements`, bytes matching the shape); `PlanError` otherwise."""
    if not (isinstance(value, list) and len(value) == 3):
        raise PlanError(f"plan field {name}: not an array")
    dtype, shape, data = value
    if dtype not in _DTYPES or not isinstance(data, bytes) or not isinstance(shape, list) or \
            not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in shape):
        raise PlanError(f"plan field {name}: bad dtype, shape or data")
    size = int(np.prod(shape, dtype=np.int64))
    if size > max_elements or size * np.dtype(_DTYPES[dtype]).itemsize != len(data):
        raise PlanError(f"plan field {name}: {len(data)} bytes do not make {dtype}{shape}")
    return np.frombuffer(data, _DTYPES[dtype]).reshape(shape).copy()


class PlanChannel:
    """The numbered plan messages of one role: the leader `publish`es, followers
    `receive` in order. `key`: the cluster token's bytes (signs and checks), or None."""

    WINDOW = 64          # plans kept in the store behind the slowest follower's ack

    def __init__(self, group: ProcessGroup, key: bytes | None, client=None):
        self.group, self.client = group, client or _client()
        self._key = hashlib.sha256(b"jaxpd-plan|" + key).digest() if key else None
        self._lock = threading.Lock()    # publish: the prefill loop, and acks (reclaims)
        self.seq = 0                     # the next message's number
        self._kept_from = 0              # plans below this are deleted from the store
        self.sent_bytes = self.sent_messages = 0
        # Publish times: the latest `KEPT_TIMES` (a decode role publishes every step).
        self.publish_s: collections.deque[float] = collections.deque(maxlen=KEPT_TIMES)
        self.by_op: dict[str, list] = {}   # op -> [messages, bytes, publish times]
        # The leader's answer to its engine failing (`Engine.fail`): a mesh across
        # processes cannot go on once a program failed on it (set by the worker).
        self.on_failure: Callable[[BaseException], None] | None = None
        # A prefill role's per-shard KV offers (`engine.multihost.shard_offers`): the leader's
        # `Board`, a follower's `Offerer`; None: the leader sends gathered pages.
        self.offers = None

    def _mac(self, seq: int, body: bytes, domain: bytes = b"") -> bytes:
        if self._key is None:
            return b""
        return hmac.new(self._key, domain + seq.to_bytes(8, "little") + body,
                        hashlib.sha256).digest()

    def seal(self, domain: bytes, n: int, body: bytes) -> bytes:
        """`body` signed (as plans are) for `open` on another process of the role."""
        return self._mac(n, body, domain + b"|") + body

    def open(self, domain: bytes, n: int, data: bytes) -> bytes:
        """The body of what `seal(domain, n, body)` made; PlanError if it is not signed
        with this role's cluster token."""
        size = 32 if self._key is not None else 0
        mac, body = data[:size], data[size:]
        if not hmac.compare_digest(mac, self._mac(n, body, domain + b"|")):
            raise PlanError(f"{domain.decode()} {n} is not signed with this role's cluster token")
        return body

    def publish(self, message: dict) -> None:
        with self._lock:
            self._publish(message)

    def _publish(self, message: dict) -> None:
        start = time.perf_counter()
        body = msgpack.packb(message, use_bin_type=True)
        data = self._mac(self.seq, body) + body
        self.client.key_value_set_bytes(f"{_PLAN}{self.seq}", data)
        if self.seq and self.seq % self.WINDOW == 0:    # what every follower has done
            upto = min(min(self.acked().values(), default=-1) + 1, self.seq - self.WINDOW)
            for old in range(self._kept_from, upto):
                self.client.key_value_delete(f"{_PLAN}{old}")
            self._kept_from = max(self._kept_from, upto)
        self.seq += 1
        self.sent_bytes += len(data)
        self.sent_messages += 1
        self.publish_s.append(time.perf_counter() - start)
        counts = self.by_op.setdefault(message["op"], [0, 0, collections.deque(maxlen=KEPT_TIMES)])
        counts[0], counts[1] = counts[0] + 1, counts[1] + len(data)
        counts[2].append(self.publish_s[-1])

    def receive(self, stop: threading.Event, poll_ms: int = 500) -> dict | None:
        """The next message (checked), or None once `stop` is set. Raises PlanError for a
        forged or malformed one, and jax's runtime error when the coordinator is gone."""
        while not stop.is_set():
            try:
                data = self.client.blocking_key_value_get_bytes(f"{_PLAN}{self.seq}", poll_ms)
            except Exception as e:            # jax's runtime error type moved across versions
                if "DEADLINE_EXCEEDED" in str(e):
                    continue
                raise
            size = 32 if self._key is not None else 0
            mac, body = data[:size], data[size:]
            if not hmac.compare_digest(mac, self._mac(self.seq, body)):
                raise PlanError(f"plan {self.seq} is not signed with this role's cluster token")
            try:
                message = msgpack.unpackb(body, raw=False)
            except (ValueError, msgpack.UnpackException) as e:
                raise PlanError(f"plan {self.seq} does not decode: {e}") from None
            if not isinstance(message, dict) or not isinstance(message.get("op"), str):
                raise PlanError(f"plan {self.seq} has no op")
            self.seq += 1
            return message
        return None

    def check_model(self, fingerprint: str, timeout_s: float = MODEL_WAIT_S) -> None:
        """Every process of a role must compute with the same weights. Each publishes
        its `models.fingerprint` (signed); a follower compares the leader's with its
        own, the leader every follower's, and a process whose checkpoint differs
        raises PlanError naming both, before it builds or dispatches anything -- so
        neither side waits for the other in a collective that would never match."""
        pid = self.group.process_id
        self.client.key_value_set_bytes(f"{_MODEL}/{pid}",
                                        self.seal(b"model", pid, fingerprint.encode()),
                                        allow_overwrite=True)
        others = range(1, self.group.num_processes) if self.group.is_leader else (0,)
        for other in others:
            theirs = self._fingerprint_of(other, timeout_s)
            if not self.group.is_leader:
                self.client.key_value_set_bytes(f"{_MODEL}/compared/{pid}", b"1",
                                                allow_overwrite=True)
            if theirs == fingerprint:
                continue
            if self.group.is_leader:
                self._await_comparison(other)
                raise PlanError(
                    f"follower process {other}'s checkpoint differs from this leader's (model "
                    f"fingerprint {theirs[:12]}, the leader's {fingerprint[:12]}): every "
                    f"process of a role must load the same model files")
            raise PlanError(
                f"refusing to join: this follower's checkpoint differs from its leader's "
                f"(model fingerprint {fingerprint[:12]}, the leader's {theirs[:12]}): every "
                f"process of a role must load the same model files")

    def _await_comparison(self, pid: int, timeout_s: float = 10.0) -> None:
        """A leader that stops takes the coordination service with it, and a follower
        still connected to it then aborts without saying why: so the leader stops only
        once the follower has compared too (and is on its way out, naming both), or
        `timeout_s` after it did not."""
        try:
            self.client.blocking_key_value_get_bytes(f"{_MODEL}/compared/{pid}",
                                                     int(timeout_s * 1000))
        except Exception:                 # jax's runtime error type moved across versions
            return
        time.sleep(COMPARED_GRACE_S)

    def _fingerprint_of(self, pid: int, timeout_s: float) -> str:
        try:
            data = self.client.blocking_key_value_get_bytes(f"{_MODEL}/{pid}",
                                                            int(timeout_s * 1000))
        except Exception as e:            # jax's runtime error type moved across versions
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            raise PlanError(f"process {pid} published no model fingerprint in "
                            f"{timeout_s:g} s") from None
        return self.open(b"model", pid, data).decode(errors="replace")

    # ---- liveness -------------------------------------------------------------------
    def beat(self, count: int, acked: int) -> None:
        self.client.key_value_set_bytes(f"{_BEAT}{self.group.process_id}",
                                        f"{count} {acked}".encode(), allow_overwrite=True)

    def beats(self) -> dict[int, tuple[int, int]]:
        """Each follower's last (beat, acked plan); (-1, -1) before its first beat."""
        out = {}
        for pid in range(1, self.group.num_processes):
            try:
                count, acked = self.client.key_value_try_get_bytes(f"{_BEAT}{pid}").split()
                out[pid] = (int(count), int(acked))
            except Exception:                 # not written yet
                out[pid] = (-1, -1)
        return out

    def acked(self) -> dict[int, int]:
        return {pid: acked for pid, (_, acked) in self.beats().items()}

    def summary(self) -> str:
        if not self.sent_messages:
            return "plan: no messages"
        def line(messages: int, sent: int, seconds) -> str:
            us = np.asarray(seconds) * 1e6
            return (f"{messages} messages, {sent} bytes ({sent / messages:.0f} per message), "
                    f"publish p50 {np.percentile(us, 50):.0f} us, p99 "
                    f"{np.percentile(us, 99):.0f} us")
        ops = "; ".join(f"{op}: {line(*counts)}" for op, counts in sorted(self.by_op.items()))
        return f"plan: {line(self.sent_messages, self.sent_bytes, self.publish_s)} ({ops})"


class FollowerWatch:
    """The leader's view of its followers (`jaxpd-followers` thread): `on_lost(reason)`
    once, when one has not beaten for `dead_s` (`start_s` before its first beat: it may
    still be loading the model), or is behind the plan and has finished nothing for
    `stuck_s` (a compile counts as finishing nothing: keep it generous)."""

    def __init__(self, channel: PlanChannel, on_lost: Callable[[str], None],
                 dead_s: float = 5.0, stuck_s: float = 120.0, start_s: float = 300.0):
        self.channel, self.on_lost = channel, on_lost
        self.dead_s, self.stuck_s, self.start_s = dead_s, stuck_s, start_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxpd-followers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        now = time.monotonic()
        seen = {pid: ((-1, -1), now, now) for pid in range(1, self.channel.group.num_processes)}
        while not self._stop.wait(BEAT_S):
            now = time.monotonic()
            for pid, (count, acked) in self.channel.beats().items():
                (last_count, last_acked), beat_at, progress_at = seen[pid]
                beat_at = now if count != last_count else beat_at
                behind = acked < self.channel.seq - 1
                progress_at = now if acked != last_acked or not behind else progress_at
                seen[pid] = ((count, acked), beat_at, progress_at)
                reason = None
                if now - beat_at > (self.dead_s if count >= 0 else self.start_s):
                    reason = (f"follower process {pid} has not answered for {now - beat_at:.1f} s "
                              f"(dead or cut off)")
                elif now - progress_at > self.stuck_s:
                    reason = (f"follower process {pid} is {self.channel.seq - 1 - acked} plans "
                              f"behind and has finished none for {now - progress_at:.1f} s")
                if reason is not None:
                    self._stop.set()
                    self.on_lost(reason)
                    return

    def stop(self) -> None:
        self._stop.set()


class Follower:
    """A follower process: `start` beating as soon as it has joined (the leader's
    watch counts from the first beat), then `run` the leader's plan."""

    def __init__(self, channel: PlanChannel):
        self.channel = channel
        self.acked = -1
        self._done = threading.Event()

    def start(self) -> Follower:
        threading.Thread(target=self._beat, name="jaxpd-beat", daemon=True).start()
        return self

    def _beat(self) -> None:
        count = 0
        while not self._done.wait(BEAT_S):
            try:
                self.channel.beat(count, self.acked)
            except Exception:                 # coordinator gone: `run` will say so
                return
            count += 1

    def close(self) -> None:
        self._done.set()

    def run(self, replay: Callable[[dict], None], stop: threading.Event) -> str:
        """Replay the plan (`replay(message)` for each: `multihost.prefill.PrefillReplay`, or
        `multihost.decode.DecodeReplay`) until the leader says stop ("stopped") or
        `stop` is set ("interrupted"). Raises PlanError for a bad plan, and jax's
        runtime error when the coordinator is gone."""
        while True:
            msg = self.channel.receive(stop)
            if msg is None:
                return "interrupted"
            if msg["op"] == "stop":
                return "stopped"
            replay(msg)
            self.acked = self.channel.seq - 1
