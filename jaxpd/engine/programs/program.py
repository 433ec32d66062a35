"""`Program`: one jitted program an engine serves, with the arguments a call passes it.

A runner builds a `Program` with the same argument builder its serving call uses, so
what `jaxpd.export` lowers (its `abstract_args`) is what warm-up compiles and a request
runs: same shapes, dtypes and shardings, same donated state.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

# Which attention core a program runs: "reference", "native", "pallas_gpu",
# "pallas_tpu", or "none" for programs without attention (page moves, penalties).
NO_KERNEL = "none"


@dataclasses.dataclass(frozen=True)
class Program:
    """`fn` (jitted) called with `args`: arrays on the mesh (params, pools, inputs put
    where the serving call puts them; large inputs may be `jax.ShapeDtypeStruct`s with
    their shardings, for lowering only) and host numpy inputs (which the program places
    by its `shard_map` specs: `host_sharding`). `kernel`: its attention core.
    `note`: records in the runner's `CompileCounter` what its serving call records, for
    a program compiled ahead of its first call (`warmup.compile_programs`).
    `install`: puts an executable of this program where its serving call runs it (the
    runner's `executable_cache.Executables` table, under the key the call computes); None: the
    call runs `fn`, so compiling ahead must fill jax's own cache.
    `carried`: (argument, output) index pairs of the state a call returns for the next
    call to take back (pools, penalty counts, previous tokens), whose layouts must be
    one (`check_carried`)."""
    name: str
    fn: Callable
    args: tuple
    kernel: str = NO_KERNEL
    host_sharding: jax.sharding.Sharding | None = None
    note: Callable[[], None] | None = None
    install: Callable[[object], None] | None = None
    carried: tuple[tuple[int, int], ...] = ()

    def abstract_args(self) -> tuple:
        """`args` as `jax.ShapeDtypeStruct`s with their shardings (what lowering needs)."""
        def spec(x):
            sharding = getattr(x, "sharding", None) or self.host_sharding
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
        return jax.tree.map(spec, self.args)


# `Program.carried` of the usual shapes: a program whose first two arguments come back
# as its first two outputs (a page insert, the penalty update), and a prefill with
# context taking (params, k_pool, v_pool, ...) and returning (tokens, logprobs,
# k_pool, v_pool).
FIRST_TWO_IN_PLACE = ((0, 0), (1, 1))
POOLS_AFTER_PARAMS = ((1, 2), (2, 3))


class LayoutMismatch(ValueError):
    """A program returns state in another layout than the one its next call takes."""


def check_carried(program: Program, executable) -> None:
    """Raise `LayoutMismatch` naming the program and the argument where `executable`
    (`program` compiled or loaded) returns carried state (`Program.carried`) laid out
    otherwise than it takes it back: an executable refuses an argument of another
    layout, so the state's next call would fail in a request instead of at start."""
    if not program.carried:
        return
    ins, _ = executable.input_shardings
    outs = executable.output_shardings
    for arg, out in program.carried:
        takes, returns = ins[arg], outs[out]
        if not takes.is_equivalent_to(returns, len(np.shape(program.args[arg]))):
            raise LayoutMismatch(
                f"program {program.name}: argument {arg} is taken as {takes}, but output "
                f"{out}, which the next call takes back as that argument, comes out as "
                f"{returns}")


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """One entry of the serving set (`warmup.serving_programs`): `warm` runs it once
    through the runner's serving call (compiling it); `build` makes its `Program`(s)
    for lowering. `background`: compiled on first demand while serving (prefix
    programs), not at warm-up; still served, so still exported. `ahead`: `build`'s
    programs are the very jitted functions `warm` calls, with the arguments it passes,
    so compiling them ahead (`warmup.compile_programs`) compiles what the serving call
    runs, and warm-up need not run it. `run_once`: warm-up runs it all the same, after
    compiling: an XLA:CPU executable's first run sets up its kernels at several times a
    later run's cost, and a program of the decode thread would put that in the gap
    between two tokens of every stream running then."""
    describe: str
    warm: Callable[[], object]
    build: Callable[[], list[Program]]
    background: bool = False
    ahead: bool = True
    run_once: bool = False
