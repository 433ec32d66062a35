"""Mesh specs, disjoint device meshes per role, logical-axis -> mesh-axis rules."""
from sharding.mesh import MeshSpec, Meshes, build_meshes, parse_mesh_spec
from sharding.rules import logical_rules, named_shardings

__all__ = ["MeshSpec", "Meshes", "build_meshes", "parse_mesh_spec", "logical_rules",
           "named_shardings"]
