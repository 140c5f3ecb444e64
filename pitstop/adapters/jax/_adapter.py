"""JAX objects in a pitstop state: arrays (sharded ones too), typed PRNG keys, pytree nodes,
Flax NNX modules, and ``jax.ShapeDtypeStruct`` restore targets.

JAX values are immutable: each adapter here ``rebuilds`` (the core puts the object ``apply``
returns where the old one was, rebuilding tuples above it). Containers the core knows
(dicts, lists, tuples, namedtuples such as Optax states) are walked by the core; any other
registered pytree node (a ``jax.tree_util.register_dataclass`` class, a Flax
``struct.dataclass`` such as ``TrainState``, a ``FrozenDict``, an NNX ``Variable``) is saved
as a dict of its children under their pytree key names and rebuilt from the live object's
own tree definition, so static fields (``apply_fn``, ``tx``) come from the target, as with
Orbax. An NNX module (or ``nnx.Optimizer``) is the exception: it is mutable, and is updated
in place (``nnx.update``), so the user's model object is the restored one.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pitstop.adapters.jax._leaf import JaxArrayLeaf
from pitstop.core.adapter import Adapter
from pitstop.core.errors import IncompatibleTargetError, UnsupportedStateError
from pitstop.core.tree import ArraySpec

KEY_DATA, IMPL = "key_data", "impl"


def is_typed_key(x: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``) or its ShapeDtypeStruct."""
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and \
        jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _impl_name(x: Any) -> str:
    impl = getattr(x.dtype, "_impl", None)
    name = getattr(impl, "name", None)
    if isinstance(name, str):
        return name
    return str(jax.random.key_impl(x))


def _is_node(obj: Any) -> bool:
    """A registered pytree node (not a leaf, not a container the core walks itself), one
    without children (a dataclass of static fields only) included."""
    try:
        kids, treedef = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)
    except Exception:  # noqa: BLE001 - an object whose flatten fails is not ours to save
        return False
    return not (treedef.num_nodes == 1 and len(kids) == 1  # type: ignore[attr-defined]
                and kids[0] is obj)


def _children(obj: Any) -> tuple[list[Any], list[Any], Any]:
    """``(names, children, treedef)`` of one pytree node, one level deep; two children whose
    key names print alike (an attribute ``x`` and a dict key ``"x"``) are refused."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    names = [_name(path[-1]) if path else i for i, (path, _child) in enumerate(pairs)]
    if len(set(map(str, names))) != len(names):
        texts = [str(n) for n in names]
        twice = next(t for i, t in enumerate(texts) if t in texts[:i])
        raise UnsupportedStateError(
            f"this {type(obj).__name__} has two children named {twice!r} (its pytree keys "
            f"{[str(p[-1]) for p, _c in pairs if p and str(_name(p[-1])) == twice]}); pitstop "
            "saves children by name, so rename one")
    return names, [child for _path, child in pairs], treedef


def _name(entry: Any) -> Any:
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            value = getattr(entry, attr)
            return value if isinstance(value, (str, int)) else str(value)
    return str(entry)


def _graph_node(obj: Any) -> bool:
    """A mutable Flax NNX object (a module, ``nnx.Optimizer``, ``nnx.Rngs``): saved as
    ``nnx.state(obj)`` and updated in place."""
    nnx = _nnx()
    if nnx is None:
        return False
    base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None) or nnx.Module
    return isinstance(obj, base)


def _nnx() -> Any:
    import sys

    if "flax.nnx" not in sys.modules:
        return None  # never imported here: no NNX object can be in the state
    from flax import nnx

    return nnx


class JaxAdapter(Adapter):
    """See the module docstring."""

    rebuilds = True
    #: its array leaves record their ``NamedSharding`` in the manifest's ``layouts``
    records_layout = True

    def can_handle(self, obj: Any) -> bool:
        if isinstance(obj, jax.Array | jax.ShapeDtypeStruct):
            return True
        if isinstance(obj, np.ndarray | np.generic):
            return False
        return _graph_node(obj) or _is_node(obj)

    # ------------------------------------------------------------------ save
    def capture(self, obj: Any) -> Any:
        if isinstance(obj, jax.ShapeDtypeStruct):
            if is_typed_key(obj):
                data = jax.eval_shape(jax.random.key_data, obj)
                sharding = getattr(obj, "sharding", None)
                if sharding is not None:  # (eval_shape drops it: restore where asked)
                    data = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
                return {KEY_DATA: JaxArrayLeaf(None, spec=data), IMPL: _impl_name(obj)}
            return JaxArrayLeaf(None, spec=obj)
        if isinstance(obj, jax.Array):
            if isinstance(obj, jax.core.Tracer):
                raise UnsupportedStateError(
                    "this is a traced value (inside jax.jit, grad or vmap); save concrete "
                    "arrays, outside the transformed function")
            if obj.is_deleted():
                # a restore target needs only its shape, dtype and sharding; a save of it
                # fails at the snapshot, naming the entry
                return JaxArrayLeaf(obj)
            if is_typed_key(obj):
                return {KEY_DATA: _start_copy(jax.random.key_data(obj)), IMPL: _impl_name(obj)}
            return _start_copy(obj)
        if _graph_node(obj):
            return _nnx().state(obj)
        names, kids, _treedef = _children(obj)
        return dict(zip(names, kids, strict=True))

    def skeleton(self, obj: Any, copy: Any) -> Any:
        """A copy of ``obj`` for ``load(target=obj)`` to fill, leaving ``obj`` as it is: an
        NNX object cloned, a pytree node rebuilt around copies of its children."""
        if isinstance(obj, jax.Array | jax.ShapeDtypeStruct):
            return obj  # immutable: rebuilt anyway
        if _graph_node(obj):
            return _nnx().clone(obj)
        _names, kids, treedef = _children(obj)
        return treedef.unflatten([copy(k) for k in kids])

    def type_tag(self, obj: Any) -> str | None:
        """The type name a pytree node is recorded with (its class's qualified name, not its
        module: a class of a script's ``__main__`` is the same class imported elsewhere)."""
        if isinstance(obj, jax.Array | jax.ShapeDtypeStruct):
            return None
        return type(obj).__qualname__

    # ------------------------------------------------------------------ restore
    def replaceable(self, obj: Any) -> list[Any]:
        """Scalar children of a pytree node: a Flax ``TrainState.step`` is a Python int in a
        fresh state and a 0-d array once a jitted step has run, and either restores into
        the other (as Orbax does), never refused and never left behind."""
        if isinstance(obj, jax.Array | jax.ShapeDtypeStruct) or _graph_node(obj):
            return []
        names, kids, _treedef = _children(obj)
        return [n for n, k in zip(names, kids, strict=True) if _scalar(k)]

    def check(self, obj: Any, tree: Any) -> None:
        kind = "typed PRNG key" if is_typed_key(obj) else None
        if isinstance(obj, jax.Array | jax.ShapeDtypeStruct):
            saved_key = isinstance(tree, dict) and set(tree) == {KEY_DATA, IMPL}
            if kind and not saved_key:
                raise IncompatibleTargetError(
                    "the target is a typed PRNG key (jax.random.key) but the checkpoint holds "
                    f"{'a raw array (e.g. a uint32 jax.random.PRNGKey)' if isinstance(tree, ArraySpec) else 'no key'} "
                    "here; restore into the kind of key that was saved (jax.random.wrap_key_data"
                    " turns raw key data into a typed key)")
            if not kind and saved_key:
                raise IncompatibleTargetError(
                    f"the checkpoint holds a typed PRNG key ({tree[IMPL]}) here but the target "
                    "is a plain array; restore into a typed key (jax.random.key(0, impl="
                    f"{tree[IMPL]!r}))")
            if kind and saved_key and tree[IMPL] != _impl_name(obj):
                raise IncompatibleTargetError(
                    f"the checkpoint holds a {tree[IMPL]} PRNG key here, the target a "
                    f"{_impl_name(obj)} one; restore into a key of the saved implementation")

    def apply(self, obj: Any, tree: Any) -> Any:
        """The new object for ``obj`` (``obj`` itself when the checkpoint held nothing)."""
        if isinstance(obj, jax.Array | jax.ShapeDtypeStruct):
            if isinstance(tree, dict) and KEY_DATA in tree:
                data = tree[KEY_DATA]
                data = data.restored if isinstance(data, JaxArrayLeaf) else data
                if data is None:
                    return obj
                key = jax.random.wrap_key_data(data, impl=tree[IMPL])
                sharding = getattr(obj, "sharding", None)
                return key if sharding is None else jax.device_put(key, sharding)
            if isinstance(tree, JaxArrayLeaf):
                return obj if tree.restored is None else tree.restored
            return obj
        if _graph_node(obj):
            _nnx().update(obj, tree)
            return obj
        names, kids, treedef = _children(obj)
        if not isinstance(tree, dict):
            return obj
        new = [_scalar_like(tree.get(n, k), k) for n, k in zip(names, kids, strict=True)]
        if all(a is b for a, b in zip(new, kids, strict=True)):
            return obj  # nothing of it was restored (strict=False): the same object
        return treedef.unflatten(new)


def _scalar(x: Any) -> bool:
    if isinstance(x, bool | int | float | np.generic):
        return True
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and len(x.shape) == 0 \
        and not is_typed_key(x)


def _scalar_like(value: Any, live: Any) -> Any:
    """A scalar read fresh from the checkpoint (a 0-d numpy array, or a Python number) as a
    JAX array where the live child was one (or a ShapeDtypeStruct of one, as its dtype
    says), so a resumed run holds what the uninterrupted run held."""
    if isinstance(live, jax.ShapeDtypeStruct) and isinstance(value, np.ndarray | int | float):
        return jax.numpy.asarray(value, dtype=live.dtype)
    if isinstance(value, np.ndarray) and value.ndim == 0 and isinstance(live, jax.Array):
        return jax.numpy.asarray(value)
    return value


def _start_copy(array: Any) -> JaxArrayLeaf:
    """The leaf of a live array, its device-to-host copy started now: the snapshot, moments
    later, reads host memory (a no-op on CPU, where the buffer is host memory already)."""
    leaf = JaxArrayLeaf(array)
    try:
        array.copy_to_host_async()
    except Exception:  # noqa: BLE001 - an optimisation only: the snapshot copies anyway
        pass
    return leaf
