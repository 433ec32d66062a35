"""Mesh specs, disjoint device meshes per role, logical-axis -> mesh-axis rules.

The exports load lazily (module `__getattr__`): `jaxpd.sharding.spec` is plain Python,
so parsing a spec (the launcher before jax starts, the router, config validation)
loads no jax; the meshes and rules load it when first used.
"""
from jaxpd.lazy import lazy_exports

_EXPORTS = {
    "MeshSpec": "jaxpd.sharding.spec", "parse_mesh_spec": "jaxpd.sharding.spec",
    "Meshes": "jaxpd.sharding.mesh", "build_meshes": "jaxpd.sharding.mesh",
    "logical_rules": "jaxpd.sharding.rules", "named_shardings": "jaxpd.sharding.rules",
    "replicated_over_tp": "jaxpd.sharding.rules",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
