"""Per-page checksums of KV pages: crc32 of each page's host bytes.

The transfer server's data plane moves bytes that the authenticated control plane
never sees: a pull in another layout returns wrong numbers without an error (see
`transfer.layout`), and its bulk-transport sockets take no token. So the sender puts
one checksum per page of k and v in its `Offer` (control plane), and the receiver
recomputes them over the pulled arrays before the pages go anywhere near the pool; a
mismatch is a `ChecksumMismatchError` (a `TransferError`): the request is prefilled
again, never decoded from pages nobody vouched for.

Why crc32 of host bytes (as the gRPC stream already does), page by page over all
layers: it is position-sensitive (a moved shard or page changes it), needs no compile,
and on CPU the bytes are already in host memory. Measured alternatives: a weighted
sum in a jitted jnp function costs no device -> host copy on an accelerator, but
compiles once per distinct page count (~300 ms each on CPU, on both sides: a TTFT
spike for every new prompt length until all are seen); a sampled subset would miss a
single damaged page. The price on an accelerator is the device -> host copy of the
whole KV on each side, which is why `TransferServerOptions.verify_checksums` is on by
default only on CPU. crc32 is not a MAC: it catches damage and mix-ups, and tampering
by someone on the data plane who cannot also rewrite the Offer; an authenticated peer
that lies is out of its reach (see `transfer_server`).
"""
from __future__ import annotations

import zlib

import numpy as np

from jaxpd.transfer.wire import TransferError


class ChecksumMismatchError(TransferError):
    """Pages arrived whose contents are not the ones the sender vouched for."""


def page_checksums(x) -> tuple[int, ...]:
    """crc32 of each page of `x` [L, P, ...]: page p's bytes of layer 0, then layer 1, ..."""
    a = np.asarray(x)            # gathers shards to host; no copy for a CPU array
    if a.ndim < 2:
        raise ValueError(f"pages must be [L, P, ...], got shape {a.shape}")
    a = np.ascontiguousarray(a)
    sums = []
    for p in range(a.shape[1]):
        crc = 0
        for layer in range(a.shape[0]):
            crc = zlib.crc32(a[layer, p].reshape(-1).view(np.uint8), crc)
        sums.append(crc)
    return tuple(sums)


def check_page_checksums(name: str, x, expected: tuple[int, ...], what: str) -> None:
    """Raise `ChecksumMismatchError` naming the first page of `x` whose checksum is not
    the announced one."""
    got = page_checksums(x)
    bad = [p for p, (a, b) in enumerate(zip(got, expected)) if a != b]
    if len(got) != len(expected) or bad:
        first = bad[0] if bad else min(len(got), len(expected))
        raise ChecksumMismatchError(
            f"{what}: {name} page {first} (of {len(got)}) does not hold the bytes the sender "
            f"checksummed ({len(bad)} pages differ): damaged in transit, or pulled in "
            f"another layout")
