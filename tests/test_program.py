"""`Program.carried`: state a program returns in another layout than it takes is
refused when the program is compiled or loaded (at start), never at a request."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.engine.compile.executable_cache import KeptExecutables
from jaxpd.engine.programs.program import (FIRST_TWO_IN_PLACE, LayoutMismatch, Program,
                                          check_carried)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


def _state_program(mesh, returned_spec, carried=((0, 0),)):
    """A program that takes [8, 16] counts split over dp and returns them as
    `returned_spec` lays them out."""
    taken = NamedSharding(mesh, P("dp"))
    fn = jax.jit(lambda counts, x: (counts + x, x), donate_argnums=(0,),
                 out_shardings=(NamedSharding(mesh, returned_spec), taken))
    counts = jax.device_put(np.zeros((8, 16), np.int32), taken)
    x = jax.device_put(np.ones((8, 16), np.int32), taken)
    return Program("counts_update", fn, (counts, x), carried=carried)


def test_state_returned_in_its_own_layout_passes(mesh):
    program = _state_program(mesh, P("dp"))
    executable = KeptExecutables(None).compile(program)
    counts, _ = executable(*program.args)
    # What the kept executable returns, it takes back.
    executable(counts, program.args[1])


def test_state_returned_in_another_layout_is_refused_naming_program_and_argument(mesh):
    program = _state_program(mesh, P("dp", "tp"))
    with pytest.raises(LayoutMismatch, match=r"program counts_update: argument 0 .* output 0"):
        KeptExecutables(None).compile(program)
    # Without the check, the next call through the executable is what fails.
    executable = program.fn.lower(*program.abstract_args()).compile()
    counts, _ = executable(*program.args)
    with pytest.raises(ValueError, match="disagree"):
        executable(counts, program.args[1])


def test_only_the_pairs_named_are_checked(mesh):
    # Output 1 comes back split over dp as argument 1 is taken; output 0 is not carried.
    program = _state_program(mesh, P("dp", "tp"), carried=((1, 1),))
    check_carried(program, program.fn.lower(*program.abstract_args()).compile())


def test_a_page_insert_is_checked_on_both_pools(mesh):
    pool = NamedSharding(mesh, P(None, "dp", None, "tp"))
    other = NamedSharding(mesh, P(None, "dp"))
    fn = jax.jit(lambda k, v: (k * 2, v * 2), out_shardings=(pool, other))
    arrays = tuple(jax.device_put(jnp.zeros((2, 4, 2, 2)), pool) for _ in range(2))
    with pytest.raises(LayoutMismatch, match="argument 1"):
        KeptExecutables(None).compile(Program("insert", fn, arrays, carried=FIRST_TWO_IN_PLACE))
