"""``export_orbax`` beside Orbax's own save, structure by structure: what Orbax's restore
without a target (``StandardCheckpointer().restore(path)``, ``CheckpointManager.restore(step)``)
reads back from pitstop's export is what it reads back from Orbax's own checkpoint of the
same state (arrays compared by value: the export stores numpy arrays), or the export refuses,
naming the entry and the fix."""

from __future__ import annotations

import collections
import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_helpers import tree_bits

import pitstop

ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")
from pitstop.adapters.jax import export_orbax  # noqa: E402

NT = collections.namedtuple("NT", "a b")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Node:
    x: jax.Array
    y: int = dataclasses.field(metadata=dict(static=True), default=1)


PARAMS = {"w": jnp.arange(4.0).reshape(2, 2), "b": jnp.zeros(2)}
#: name -> state; every one is read back by Orbax without a target
READ_BACK = {
    "dict": {"w": jnp.ones(3), "nested": {"a": jnp.arange(2)}},
    "list": {"l": [jnp.ones(2), jnp.zeros(3)], "ld": [{"a": jnp.ones(1)}]},
    "none_leaf": {"w": jnp.ones(2), "n": None},
    "empty_containers": {"w": jnp.ones(2), "d": {}, "l": []},
    "python_scalars": {"i": 7, "f": 0.5, "b": True},
    "scalars_0d": {"np": np.float32(2.5), "jax": jnp.array(3)},
    "typed_key": {"k": jax.random.key(3)},
    "raw_key": {"k": jax.random.PRNGKey(3)},
    "bfloat16": {"w": jnp.ones(3, jnp.bfloat16)},
    "int_keys": {"d": {1: jnp.ones(2)}},
    "list_root": [jnp.ones(2), jnp.zeros(2)],
    "dataclass_node": {"d": Node(jnp.ones(2))},
}
#: name -> (state, words of the refusal); target= (or tuples_as_lists=) writes each
REFUSED = {
    "optax_adam": ({"params": PARAMS, "opt": optax.adam(1e-3).init(PARAMS)}, "'opt'"),
    "namedtuple": ({"o": NT(jnp.ones(2), jnp.zeros(2))}, "'o'"),
    "tuple_with_none": ({"t": (jnp.ones(2), None)}, "'t'"),
}


def shown(tree):
    """Structure (None a leaf) and each leaf's bits, arrays by value whatever their type."""
    host = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and not
                        jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)
    return (jax.tree_util.tree_structure(host, is_leaf=lambda x: x is None),
            [b if b[0] == "key" else b[1:] for b in tree_bits(host)])


def through_both(tmp_path: Path, state, **kw):
    own, mine = os.path.abspath(tmp_path / "own"), tmp_path / "mine"
    with ocp.StandardCheckpointer() as c:
        c.save(own, state)
    with pitstop.CheckpointManager(tmp_path / "p", memory_tier=False) as mgr:
        mgr.save(1, state).wait()
    path = export_orbax(tmp_path / "p", 1, mine, **kw)
    return ocp.StandardCheckpointer().restore(own), path


@pytest.mark.parametrize("name", sorted(READ_BACK))
def test_orbax_reads_the_export_without_a_target_as_its_own(tmp_path, name):
    theirs, path = through_both(tmp_path, READ_BACK[name])
    assert shown(ocp.StandardCheckpointer().restore(path)) == shown(theirs)
    with ocp.CheckpointManager(tmp_path / "mine") as omgr:
        assert shown(omgr.restore(1)) == shown(theirs)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_tuple_of_a_jax_state_needs_target_and_then_matches_orbax(tmp_path, name):
    state, words = REFUSED[name]
    with pytest.raises(pitstop.UnsupportedStateError, match=f"{words}.*namedtuple.*"
                       "Structure mismatch.*target=.*tuples_as_lists=True"):
        through_both(tmp_path, state)
    assert not (tmp_path / "mine").exists()  # refused before Orbax wrote anything
    theirs, path = through_both(tmp_path / "t", state, target=state)
    assert shown(ocp.StandardCheckpointer().restore(path)) == shown(theirs)
    abstract = jax.eval_shape(lambda: state)
    with ocp.CheckpointManager(tmp_path / "t" / "mine") as omgr:
        assert shown(omgr.restore(1)) == shown(theirs)
        back = omgr.restore(1, args=ocp.args.StandardRestore(abstract))  # no Structure mismatch
    assert shown(back) == shown(state)
    if name != "tuple_with_none":  # what the refusal spares: a namedtuple written as a list
        export_orbax(tmp_path / "p", 1, tmp_path / "lists", tuples_as_lists=True)
        with ocp.CheckpointManager(tmp_path / "lists") as omgr, \
                pytest.raises(ValueError, match="Structure mismatch"):
            omgr.restore(1, args=ocp.args.StandardRestore(abstract))


def test_plain_tuples_as_lists_and_empty_arrays(tmp_path):
    state = {"t": (jnp.ones(2), jnp.zeros(1))}
    theirs, path = through_both(tmp_path, state, tuples_as_lists=True)
    assert shown(ocp.StandardCheckpointer().restore(path)) == shown(theirs)
    empty = {"w": jnp.ones(2), "e": jnp.zeros((0, 3))}
    with pitstop.CheckpointManager(tmp_path / "e", memory_tier=False) as mgr:
        mgr.save(1, empty).wait()
    with pytest.raises(ValueError, match="zero size"):
        with ocp.StandardCheckpointer() as c:  # Orbax's own save refuses it
            c.save(os.path.abspath(tmp_path / "own_e"), empty)
    for kw in ({}, {"target": empty}):
        with pytest.raises(pitstop.UnsupportedStateError, match="'e'.*empty array.*key="):
            export_orbax(tmp_path / "e", 1, tmp_path / "oe", **kw)
