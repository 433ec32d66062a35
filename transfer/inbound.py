"""The receiving side of a transfer as objects the decode loop can poll.

`InboundQueue` wraps a `KVReceiver`: each new transfer it receives (a request-level
handoff, or the first part of a layer-wise one) becomes an `Inbound`; the later parts
of a layer-wise transfer go to their own `Inbound` as they arrive, whether or not it
has a slot yet. The decode loop only asks:

    inbound.start(sharding, expect)   # its slot is reserved: move the pages there
    inbound.poll(now)                 # PENDING | Placed(k, v, ...) | TransferError
    inbound.end()                     # never mind (cancelled, stale, superseded)

Pages move on the caller's transfer threads (`executor`), never on the decode thread;
the layers of a layer-wise transfer are joined once all have arrived. A part out of
order, overdue by `part_timeout_s`, or whose pages do not fit `expect` fails the
transfer with a `TransferError`: the caller prefills the request again.

A handoff is a peer's word. Before it becomes an `Inbound` (before any slot, page or
device op), `HandoffSpec.check` holds what it announces against what this side
computes itself: its pages against `num_tokens`, its `first_page` and this pool's
page size (padded as `KVHandoff` says); layers, page shape and dtype; `num_tokens` against what a slot can ever
hold; its first token against the vocabulary. One that fails is discarded and handed back to the
caller as a `Rejected` (with the request it names, so the caller can fail it).
"""
from __future__ import annotations

import dataclasses
import time
from concurrent import futures

import jax
import jax.numpy as jnp

from jaxpd.sizes import coarse_ceil
from jaxpd.transfer.connector import KVHandoff, KVReceiver, TransferError
from jaxpd.validation import check_request_id

PENDING = "pending"


class HandoffRejected(TransferError):
    """A handoff whose announcement contradicts this side's own numbers: refused
    before anything is reserved or moved; its request is prefilled again."""


class ModelMismatch(HandoffRejected):
    """A handoff whose KV another model computed (its fingerprint is not this pool's):
    refused before any pull; its request is prefilled again here, by this model."""


class HandoffNeverFits(HandoffRejected):
    """A handoff of more tokens than a decode slot here can ever hold: its request is
    aborted with this reason (waiting would block admission for good)."""


@dataclasses.dataclass(frozen=True)
class HandoffSpec:
    """What a handoff into one decode pool must announce, from this side's config --
    never from the sender's own counts.

    page_shape, dtype: one page of k or v as it travels (the pool's `(page_size, K, H)`
      and dtype; compressed: `(page_size*K*H + 4,)` uint8, see `transfer.compression`).
    max_pages: the most pages one slot can hold (per slot and per shard).
    fingerprint: this pool's `models.fingerprint`; a handoff must name the same (empty:
      not checked, for handoffs from this process, which share its model).
    """
    num_layers: int
    page_size: int
    page_shape: tuple[int, ...]
    dtype: str
    vocab_size: int
    max_model_len: int
    max_pages: int
    fingerprint: str = ""

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def check(self, h: KVHandoff) -> None:
        """Raise `HandoffNeverFits` or `HandoffRejected` saying what is wrong with `h`."""
        try:
            check_request_id(h.request_id)
        except ValueError as e:
            raise HandoffRejected(f"handoff names a bad request id: {e}") from None
        n = h.num_tokens
        who = f"handoff of {h.request_id!r}"
        if self.fingerprint and h.fingerprint != self.fingerprint:
            theirs = h.fingerprint[:12] if isinstance(h.fingerprint, str) else "?"
            raise ModelMismatch(
                f"{who}: fingerprint: its KV was computed by model {theirs!r}, this "
                f"decode pool serves {self.fingerprint[:12]!r}: prefill and decode must "
                f"serve the same weights, tokenizer, dtype and page size")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise HandoffRejected(f"{who}: num_tokens must be a positive integer, got {n!r}")
        # The first fed token goes at position n: the slot needs pages for n + 1.
        if n + 1 > self.max_model_len or self.pages_for(n + 1) > self.max_pages:
            raise HandoffNeverFits(
                f"{who}: {n} tokens can never fit a decode slot here (max_model_len="
                f"{self.max_model_len}, at most {self.max_pages} pages of {self.page_size})")
        shapes = [getattr(x, "shape", None) for x in (h.k, h.v)]
        dtypes = [getattr(x, "dtype", None) for x in (h.k, h.v)]
        if shapes[0] is None or dtypes[0] is None or shapes[0] != shapes[1] \
                or dtypes[0] != dtypes[1]:
            raise HandoffRejected(f"{who}: k and v must be arrays of one shape and dtype")
        shape, dtype = tuple(shapes[0]), jnp.dtype(dtypes[0]).name
        if len(shape) != 2 + len(self.page_shape) or shape[2:] != self.page_shape \
                or dtype != self.dtype:
            raise HandoffRejected(
                f"{who}: pages announced as {dtype}{list(shape)}, this pool takes "
                f"{self.dtype}[L, P, {', '.join(map(str, self.page_shape))}]: do prefill and "
                f"decode serve the same model, dtype and kv_transfer_dtype?")
        skip = h.first_page
        if isinstance(skip, bool) or not isinstance(skip, int) \
                or not 0 <= skip <= (n - 1) // self.page_size:
            # Only full pages are ever cached, and at least one page travels.
            raise HandoffRejected(f"{who}: first_page {skip!r} is not a full page of its "
                                  f"{n} tokens below the last (pages of {self.page_size})")
        if shape[1] != coarse_ceil(self.pages_for(n) - skip):
            raise HandoffRejected(f"{who}: {shape[1]} pages announced for {n} tokens from "
                                  f"page {skip}, which fill {self.pages_for(n) - skip} "
                                  f"pages of {self.page_size}, padded to "
                                  f"{coarse_ceil(self.pages_for(n) - skip)}")
        part = h.part
        first = 0 if part is None else part.layer_start
        layers = self.num_layers if part is None else part.count
        if shape[0] < 1 or first + shape[0] > self.num_layers or layers > self.num_layers \
                or (part is None and shape[0] != self.num_layers):
            raise HandoffRejected(f"{who}: layers [{first}, {first + shape[0]}) announced, "
                                  f"the model has {self.num_layers}")
        if part is None or part.is_last:
            t = h.first_token
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise HandoffRejected(f"{who}: first token {t!r} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A handoff `HandoffSpec` refused (already discarded): the caller fails the
    request it names, if that request waits for it."""
    handoff: KVHandoff
    error: HandoffRejected


@dataclasses.dataclass(frozen=True)
class Placed:
    """All of a transfer's pages, on the shard they were started for."""
    k: jax.Array           # [L, P, page_size, K, H]
    v: jax.Array
    num_bytes: int
    seconds: float


class Inbound:
    """One request's KV on its way in: one part, or the layer groups of a layer-wise
    transfer in order."""

    def __init__(self, first: KVHandoff, receiver: KVReceiver, executor: futures.Executor,
                 part_timeout_s: float, counted: bool, remote: bool):
        self.request_id = first.request_id
        self.num_tokens = first.num_tokens
        self.num_pages = first.num_pages       # pages that travel
        self.first_page = first.first_page     # the request's page they start at
        self.payload = first.payload
        self.stream = None if first.part is None else first.part.stream
        self.count = 1 if first.part is None else first.part.count
        self.counted = counted        # a transfer between meshes (not an on-mesh prefill)
        self.remote = remote          # from another process: `payload` is a wire form
        self.first_token: int | None = None
        self.ended = False
        self._receiver, self._executor = receiver, executor
        self._part_timeout_s = part_timeout_s
        self._received: list[KVHandoff] = []
        self._futures: list[futures.Future] = []
        self._start: tuple[jax.sharding.Sharding, jax.ShapeDtypeStruct] | None = None
        self._target: jax.sharding.Sharding | None = None   # when started elsewhere first
        self._deadline = 0.0
        self._error: TransferError | None = None
        self.add(first)

    @property
    def layerwise(self) -> bool:
        return self.stream is not None

    @property
    def received_all(self) -> bool:
        return len(self._received) == self.count

    def add(self, h: KVHandoff) -> None:
        """The next part of this transfer (the assembler checks it is ours)."""
        index = 0 if h.part is None else h.part.index
        count = 1 if h.part is None else h.part.count
        if self.ended or self._error is not None:
            self._receiver.discard(h)
            return
        if index != len(self._received) or count != self.count:
            # Never assemble layers out of order: fail the transfer, prefill again.
            self.fail(h, TransferError(f"part {index}/{count} of {h.request_id!r} arrived "
                                       f"after {len(self._received)}/{self.count} parts"))
            return
        if h.num_tokens != self.num_tokens or h.first_page != self.first_page:
            self.fail(h, HandoffRejected(f"part {index}/{count} of {h.request_id!r} covers "
                                         f"{h.num_tokens} tokens from page {h.first_page}, "
                                         f"the first said {self.num_tokens} from page "
                                         f"{self.first_page}"))
            return
        self._received.append(h)
        if h.part is None or h.part.is_last:
            # The part sent after the first token was sampled: its wire form is the one
            # that also holds the token's log-probabilities.
            self.first_token, self.payload = h.first_token, h.payload
        if self._start is not None:
            self._place(h)

    def fail(self, h: KVHandoff, error: TransferError) -> None:
        """A part of this transfer that cannot be used: discard it, fail the transfer."""
        self._receiver.discard(h)
        if self._error is None:
            self._error = error

    @property
    def error(self) -> TransferError | None:
        """What failed this transfer already, if anything (before `poll` says so)."""
        return self._error

    def start(self, sharding: jax.sharding.Sharding, expect: jax.ShapeDtypeStruct) -> None:
        """Move the parts received so far onto `sharding`, later ones as they come.
        `expect`: the whole KV's shape [L, P, page_size, K, H] and dtype in the pool.
        Started already (prefetched onto a staging sharding before it had a slot): the
        parts keep moving there and are copied onto `sharding` once all have arrived."""
        if self._start is not None:
            self._target = sharding
            return
        self._start = (sharding, expect)
        for h in self._received:
            self._place(h)

    @property
    def started(self) -> bool:
        return self._start is not None

    def poll(self, now: float):
        """`PENDING`, `Placed` once every part is on the shard, or the `TransferError`
        that ended it. Errors other than `TransferError` are raised: a bug, not a peer."""
        if self._error is not None:
            return self._error
        for f in self._futures:
            if f.done() and f.exception() is not None:
                if isinstance(f.exception(), TransferError):
                    return f.exception()
                raise f.exception()
        if not self.received_all:
            if self._start is not None and now > self._deadline:
                self._error = TransferError(
                    f"part {len(self._received)}/{self.count} of {self.request_id!r} not "
                    f"received within {self._part_timeout_s:.1f}s")
                return self._error
            return PENDING
        if not all(f.done() for f in self._futures):
            return PENDING
        return self._join([f.result() for f in self._futures])

    def end(self) -> None:
        """Forget this transfer: parts not yet placed, and any still to come, are
        discarded (the sender frees their pages)."""
        if not self.ended:
            self.ended = True
            for h in self._received[len(self._futures):]:
                self._receiver.discard(h)

    def _place(self, h: KVHandoff) -> None:
        self._futures.append(self._executor.submit(self._checked_place, h, *self._start))
        self._deadline = time.monotonic() + self._part_timeout_s

    def _checked_place(self, h: KVHandoff, sharding, expect: jax.ShapeDtypeStruct):
        """`receiver.place`, refusing pages that do not fit the pool (e.g. the peer
        compresses KV and this side does not): a failed transfer, never a crash. From
        another process, whatever `place` raises is a failed transfer too: it acted on a
        peer's word (an unpullable layout, a bad address, a pull too large for memory)."""
        try:
            k, v, stats = self._receiver.place(h, sharding)
        except TransferError:
            raise
        except Exception as e:
            if not self.remote:
                raise
            raise TransferError(f"placing {h.request_id!r} failed: {type(e).__name__}: {e}") from e
        for name, x in (("k", k), ("v", v)):
            layers = expect.shape[0] if h.part is None else x.shape[0]
            want = (layers, self.num_pages) + tuple(expect.shape[2:])
            if x.shape != want or x.dtype != expect.dtype:
                raise TransferError(
                    f"{h.request_id!r}: {name} pages arrived as {x.dtype}{list(x.shape)}, the "
                    f"pool needs {expect.dtype}{list(want)}: do prefill and decode serve the "
                    f"same model, dtype and kv_transfer_dtype?")
        return k, v, stats

    def _join(self, results) -> Placed | TransferError:
        if len(results) == 1:
            k, v = results[0][:2]
        else:   # layer-wise: join the groups' layers on the shard
            k = jnp.concatenate([x[0] for x in results])
            v = jnp.concatenate([x[1] for x in results])
        layers = self._start[1].shape[0]
        if k.shape[0] != layers:
            self._error = TransferError(f"the parts of {self.request_id!r} hold {k.shape[0]} "
                                        f"layers, the model has {layers}")
            return self._error
        if self._target is not None and self._target != self._start[0]:
            k, v = jax.device_put((k, v), self._target)      # staging shard -> its slot's
        return Placed(k, v, sum(x[2].num_bytes for x in results),
                      sum(x[2].seconds for x in results))


def wait_any(inbounds: list[Inbound], timeout: float) -> bool:
    """Wait up to `timeout` s for any of their pages to finish moving; False at once
    when none is moving (they wait for parts still to arrive)."""
    running = [f for i in inbounds for f in i._futures if not f.done()]
    if running:
        futures.wait(running, timeout=timeout, return_when=futures.FIRST_COMPLETED)
    return bool(running)


class InboundQueue:
    """Turns a receiver's handoffs into `Inbound`s; routes later layer-wise parts."""

    def __init__(self, receiver: KVReceiver, executor: futures.Executor,
                 part_timeout_s: float, spec: HandoffSpec, *, counted: bool = True,
                 remote: bool = False):
        self.receiver, self.spec = receiver, spec
        self.remote = remote
        self._executor, self._part_timeout_s = executor, part_timeout_s
        self._counted = counted
        self._streams: dict[tuple[str, int], Inbound] = {}   # layer-wise, still receiving

    def receive(self, timeout: float | None) -> tuple[list[Inbound], list[Rejected]]:
        """New transfers, and the new handoffs `spec` refused (discarded already),
        waiting up to `timeout` s for the first handoff (None: not at all); parts of
        known transfers are handed to them on the way (a refused one fails its
        transfer)."""
        new, rejected = [], []
        h = self.receiver.receive(timeout)
        while h is not None:
            error = self._check(h)
            if h.part is not None and h.part.index > 0:
                inbound = self._streams.get((h.request_id, h.part.stream))
                if inbound is None:
                    self.receiver.discard(h)   # its transfer ended (failed, cancelled)
                elif error is not None:
                    inbound.fail(h, error)
                else:
                    inbound.add(h)
            elif error is not None:
                self.receiver.discard(h)
                rejected.append(Rejected(h, error))
            else:
                inbound = Inbound(h, self.receiver, self._executor, self._part_timeout_s,
                                  self._counted, self.remote)
                if inbound.layerwise:
                    self._streams[(h.request_id, inbound.stream)] = inbound
                new.append(inbound)
            h = self.receiver.receive(None)
        for key in [k for k, i in self._streams.items() if i.ended or i.received_all]:
            del self._streams[key]
        return new, rejected

    def _check(self, h: KVHandoff) -> HandoffRejected | None:
        try:
            self.spec.check(h)
        except HandoffRejected as e:
            return e
        except Exception as e:  # noqa: BLE001 -- any oddity of a peer's handoff refuses it
            return HandoffRejected(f"malformed handoff: {type(e).__name__}: {e}")
        return None
