"""jax API differences across the versions setup.cfg allows; each shim names the
versions that need it. Everything else in the package calls jax directly."""
from __future__ import annotations

import jax

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# jax < 0.8: `with_sharding_constraint(x, PartitionSpec)` inside a shard_map body
# resolves the spec against the legacy `with mesh:` context only, not the body's
# abstract mesh, and fails "requires a non-empty mesh" (flax's logical constraints
# in models/llama.py hit this in the decode step). Entering the mesh while the
# body traces gives it the mesh that jax >= 0.8 takes from the shard_map itself.
_MESH_IN_BODY = JAX_VERSION < (0, 8)


def shard_map(f, *, mesh, in_specs, out_specs, axis_names=frozenset(), check_vma=True):
    """`jax.shard_map`, manual over `axis_names` (the other mesh axes stay GSPMD's).
    `check_vma=False` for a body jax cannot type (a Pallas kernel's outputs)."""
    def with_mesh(*args):
        with mesh:
            return f(*args)
    body = with_mesh if _MESH_IN_BODY else f
    if not hasattr(jax, "shard_map"):
        # jax 0.6.0: only the experimental one, which names the GSPMD axes (`auto`)
        # instead of the manual ones, and whose replication check rejects the decode
        # step ("Primitive reduce requires varying manual axes to match").
        from jax.experimental.shard_map import shard_map as experimental_shard_map
        return experimental_shard_map(body, mesh=mesh, in_specs=in_specs,
                                      out_specs=out_specs, check_rep=False,
                                      auto=frozenset(mesh.axis_names) - set(axis_names))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(axis_names), check_vma=check_vma)
