"""How an array is laid out across devices, in a form that crosses a process boundary.

The JAX transfer server moves *per-device buffers*, not logical arrays: the receiver
must pull exactly the sender's per-shard layout, or it gets the wrong numbers with no
error (seen with jax 0.10.2: another mesh axis with the same shard count). So the
sender describes each array's sharding as a plain dict (msgpack-able), the receiver
rebuilds the same mesh shape over its own first N devices, pulls into that, and only
then reshards locally.

The wire-format version and the transfer errors live in `jaxpd.transfer.wire` (no
jax); they are re-exported here for the modules that already import them from here.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpd.transfer.wire import (WIRE_VERSION, LayoutMismatchError,  # noqa: F401  (re-exported)
                                 TransferError, WireVersionError, check_wire_version)

# A PartitionSpec entry in plain form: replicated, one mesh axis, or several.
SpecEntry = None | str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """Shape, dtype and sharding of one array, independent of concrete devices.

    `mesh_shape`/`axis_names` describe the mesh positionally: shard i of the sender
    lands on device i (in mesh order) of the receiver's rebuilt mesh.
    `spec` has one entry per array dimension (padded with None).
    """
    shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    spec: tuple[SpecEntry, ...]
    num_shards: int

    def __post_init__(self):
        if len(self.mesh_shape) != len(self.axis_names):
            raise ValueError(f"mesh_shape {self.mesh_shape} and axis_names "
                             f"{self.axis_names} differ in length")
        if len(self.spec) != len(self.shape):
            raise ValueError(f"spec {self.spec} needs one entry per dimension of {self.shape}")
        for entry in self.spec:
            for axis in _axes_of(entry):
                if axis not in self.axis_names:
                    raise ValueError(f"spec {self.spec} names axis {axis!r}, "
                                     f"mesh has {self.axis_names}")

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def nbytes(self) -> int:
        """Logical size: what `jax.Array.nbytes` reports (replicas not counted)."""
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, for msgpack."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "mesh_shape": list(self.mesh_shape),
            "axis_names": list(self.axis_names),
            "spec": [list(e) if isinstance(e, tuple) else e for e in self.spec],
            "num_shards": self.num_shards,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArrayLayout:
        try:
            return cls(
                shape=tuple(int(n) for n in d["shape"]),
                dtype=str(d["dtype"]),
                mesh_shape=tuple(int(n) for n in d["mesh_shape"]),
                axis_names=tuple(str(a) for a in d["axis_names"]),
                spec=tuple(tuple(e) if isinstance(e, list) else e for e in d["spec"]),
                num_shards=int(d["num_shards"]),
            )
        except (KeyError, TypeError) as e:
            raise LayoutMismatchError(f"malformed layout {d!r}: {e}") from e


def _axes_of(entry: SpecEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _plain_spec(spec: PartitionSpec, ndim: int) -> tuple[SpecEntry, ...]:
    """P('x') and P('x', None) mean the same; compare them as equal."""
    entries = [e if e is None or isinstance(e, str) else tuple(e) for e in spec]
    return tuple(entries + [None] * (ndim - len(entries)))


def describe(x: jax.Array) -> ArrayLayout:
    """The layout of a concrete, fully addressable array."""
    if not x.is_fully_addressable:
        raise LayoutMismatchError("only fully addressable arrays can be described; "
                                  "a multi-host array has shards this process cannot send")
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return ArrayLayout(
            shape=tuple(x.shape), dtype=jnp.dtype(x.dtype).name,
            mesh_shape=tuple(mesh.devices.shape), axis_names=tuple(mesh.axis_names),
            spec=_plain_spec(sharding.spec, x.ndim), num_shards=len(x.addressable_shards))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return ArrayLayout(
            shape=tuple(x.shape), dtype=jnp.dtype(x.dtype).name, mesh_shape=(1,),
            axis_names=("_single",), spec=(None,) * x.ndim, num_shards=1)
    raise LayoutMismatchError(
        f"cannot describe {type(sharding).__name__}; put the array on a NamedSharding")


def rebuild_sharding(layout: ArrayLayout,
                     devices: Sequence[jax.Device] | None = None) -> NamedSharding:
    """The same mesh shape and spec over the first `layout.num_devices` of `devices`."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < layout.num_devices:
        raise LayoutMismatchError(
            f"sender's layout needs {layout.num_devices} devices (mesh "
            f"{dict(zip(layout.axis_names, layout.mesh_shape))}), this side has "
            f"{len(devices)}; the pull must match the sender's per-shard layout exactly")
    mesh_devices = np.array(devices[:layout.num_devices]).reshape(layout.mesh_shape)
    return NamedSharding(Mesh(mesh_devices, layout.axis_names), PartitionSpec(*layout.spec))


def shape_dtype_struct(layout: ArrayLayout,
                       devices: Sequence[jax.Device] | None = None) -> jax.ShapeDtypeStruct:
    """What to ask a pull for: the sender's layout on this side's devices."""
    return jax.ShapeDtypeStruct(layout.shape, jnp.dtype(layout.dtype),
                                sharding=rebuild_sharding(layout, devices))


def check_layout(expected: ArrayLayout, actual: ArrayLayout) -> None:
    """Raise `LayoutMismatchError` naming every field where the two differ."""
    diffs = [f"{f.name}: expected {getattr(expected, f.name)!r}, got {getattr(actual, f.name)!r}"
             for f in dataclasses.fields(ArrayLayout)
             if getattr(expected, f.name) != getattr(actual, f.name)]
    if diffs:
        raise LayoutMismatchError("layout mismatch; " + "; ".join(diffs))
