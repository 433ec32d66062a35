"""Run exported programs on this machine's device against reference exports.

    python -m jaxpd.export.execute --programs DIR --reference DIR [--match REGEX]

Both directories are `jaxpd.export` outputs of the same model, mesh and dtype: DIR
with the platform's kernel (`--attention_impl auto` or a Pallas one), the reference
with `--attention_impl reference`. Each program present in both (and matching
`--match`) is deserialized and called with the same random inputs: floats normal
with scale 0.05 (weights, pools, sampling floats), integers 0 or 1 (tokens, page
ids, positions, slots: valid for every program, so a kernel never reads past a
pool), booleans at random. Prints a table: the largest float difference relative to
the reference's largest magnitude, the share of equal integer outputs (sampled
tokens can flip on near ties), and the time per call. Exit 1 when a float output
differs beyond the dtype's tolerance.

Runs single-device exports (mesh `colocated=1`: what one lent device holds); a
multi-device export needs as many devices here and is refused.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import numpy as np

# Relative tolerance on float outputs: the Pallas kernels reorder the softmax's sums
# (and the TPU one computes K and V in bfloat16).
TOLERANCE = {"float32": 2e-3, "bfloat16": 5e-2}


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    kernel: str
    rel_error: float       # max |out - ref| / max |ref| over float outputs
    int_agree: float       # share of equal integer/bool outputs (1.0 when none)
    ms: float              # one call of the program, after a first (compiling) call
    ref_ms: float
    ok: bool


def load(directory: str) -> dict:
    with open(os.path.join(directory, "summary.json")) as f:
        return json.load(f)


def random_inputs(exported, rng: np.random.Generator):
    """Arguments for `exported.call`: one random array per input, as the module says."""
    import jax
    import jax.numpy as jnp

    leaves = []
    for aval in exported.in_avals:
        dtype = np.dtype(aval.dtype)
        if dtype == np.bool_:
            x = rng.random(aval.shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            x = rng.integers(0, 2, aval.shape).astype(dtype)
        else:
            x = (rng.standard_normal(aval.shape) * 0.05).astype(np.float32)
        leaves.append(jnp.asarray(x, dtype=aval.dtype))
    return jax.tree.unflatten(exported.in_tree, leaves)


def _timed(exported, args, kwargs) -> tuple[list, float]:
    import jax

    call = jax.jit(exported.call)
    jax.block_until_ready(call(*args, **kwargs))            # compiles
    start = time.perf_counter()
    out = jax.block_until_ready(call(*args, **kwargs))
    return jax.tree.leaves(out), (time.perf_counter() - start) * 1e3


def compare(name: str, kernel: str, program, reference, dtype: str, seed: int = 0) -> Row:
    """Call `program` and `reference` (deserialized `Exported`s) on the same inputs."""
    args, kwargs = random_inputs(program, np.random.default_rng(seed))
    out, ms = _timed(program, args, kwargs)
    ref, ref_ms = _timed(reference, args, kwargs)
    if len(out) != len(ref):
        raise RuntimeError(f"{name}: {len(out)} outputs, its reference {len(ref)}")
    worst, equal, total = 0.0, 0, 0
    for a, b in zip(out, ref):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16":
            a, b = a.astype(np.float32), b.astype(np.float32)
            scale = float(np.abs(b).max(initial=0.0)) or 1.0
            worst = max(worst, float(np.abs(a - b).max(initial=0.0)) / scale)
        else:
            equal += int((a == b).sum())
            total += a.size
    return Row(name, kernel, worst, equal / total if total else 1.0, ms, ref_ms,
               worst <= TOLERANCE[dtype])


def execute(programs: str, reference: str, match: str | None = None, seed: int = 0,
            progress=lambda msg: None) -> list[Row]:
    """`compare` every program of the `programs` export that the `reference` export
    also has (names matching `match`). ValueError when the two exports differ in
    platform, mesh or dtype, or need more devices than this machine has."""
    import jax
    from jax import export

    from jaxpd.export import register_pytrees

    register_pytrees()
    mine, ref = load(programs), load(reference)
    for key in ("platform", "mesh", "dtype"):
        if mine[key] != ref[key]:
            raise ValueError(f"the exports differ in {key}: {mine[key]!r} vs {ref[key]!r}")
    if mine["platform"] == "cpu":
        # Programs with the native kernels call FFI targets this process must register.
        from jaxpd.models import native_attention
        native_attention.available()
        native_attention.quant_available()
    theirs = {p["name"]: p for p in ref["programs"]}
    rows = []
    for p in mine["programs"]:
        if p["name"] not in theirs or (match and not re.search(match, p["name"])):
            continue
        if p.get("num_devices", 1) > len(jax.devices()):
            raise ValueError(f"{p['name']} was exported for {p['num_devices']} devices; "
                             f"this machine has {len(jax.devices())}")
        progress(f"running {p['name']}")
        with open(os.path.join(programs, p["file"]), "rb") as f:
            program = export.deserialize(f.read())
        with open(os.path.join(reference, theirs[p["name"]]["file"]), "rb") as f:
            reference_program = export.deserialize(f.read())
        rows.append(compare(p["name"], p["kernel"], program, reference_program, mine["dtype"],
                            seed))
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"{'program':<36} {'kernel':<11} {'rel err':>9} {'ints eq':>8} {'ms':>8} "
             f"{'ref ms':>8}  ok"]
    for r in rows:
        lines.append(f"{r.name:<36} {r.kernel:<11} {r.rel_error:>9.2e} {r.int_agree:>8.3f} "
                     f"{r.ms:>8.2f} {r.ref_ms:>8.2f}  {'ok' if r.ok else 'MISMATCH'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxpd.export.execute",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", required=True, help="a jaxpd.export output directory")
    p.add_argument("--reference", required=True,
                   help="the same export with --attention_impl reference")
    p.add_argument("--match", default=None, help="only programs whose name matches (regex)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        rows = execute(args.programs, args.reference, args.match, args.seed,
                       progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"python -m jaxpd.export.execute: error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("python -m jaxpd.export.execute: error: no program in common", file=sys.stderr)
        return 2
    print(table(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
