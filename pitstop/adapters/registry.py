"""Maps a user object to the adapter that turns it into a state tree and back.

An adapter is a small protocol (STYLE: one small protocol per seam)::

    can_handle(obj) -> bool
    capture(obj) -> tree          # arrays by reference (ArrayLeaf / np.ndarray), no copies
    apply(obj, tree) -> None      # put a restored tree back into obj, in place

and, optionally::

    check(obj, tree) -> None      # refuse a restore before any byte reaches a live object
    caveats(obj) -> list[str]     # what capture cannot make exact, and the fix
    replace_on_mismatch = True    # restore behaves like load_state_dict: replace, not match
    replaceable(obj) -> keys      # entries of the captured dict that may differ in shape

``check`` gets the checkpoint's subtree for ``obj`` with every array as a
:class:`pitstop.core.tree.ArraySpec` (shape and dtype, no data) and every value decoded; it
raises :class:`pitstop.IncompatibleTargetError` (the core adds the key path) when ``apply``
would refuse that tree: the restore then stops with the target untouched. ``caveats`` is
asked at every save; the manager warns once per distinct message (at the first save that
shows it), so nothing resumes wrong in silence. With ``replace_on_mismatch`` set, a
checkpoint subtree whose keys, shapes or dtypes differ from the captured one is not an
error: ``apply`` gets the checkpoint's subtree with fresh numpy arrays, as
``load_state_dict`` would get a loaded state dict; where they match, arrays are restored
in place as usual. ``replaceable`` names top-level keys of the captured dict whose entry may
differ from the checkpoint's in shape, dtype or kind (a module's extra state, a quantization
observer's buffers that its own ``load_state_dict`` resizes): such an entry is read fresh
from the checkpoint and put into the tree ``apply`` gets, instead of being refused.

Framework adapters are imported lazily, the first time an object of that framework shows
up, so ``import pitstop`` imports no framework. Objects with ``state_dict()`` /
``load_state_dict()`` need no adapter at all.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, Protocol


class Adapter(Protocol):
    """The required part of an adapter; ``check``, ``caveats`` and ``replace_on_mismatch``
    are optional (see the module docstring)."""

    def can_handle(self, obj: Any) -> bool: ...

    def capture(self, obj: Any) -> Any: ...

    def apply(self, obj: Any, tree: Any) -> None: ...


#: top-level module of an object's class -> module that registers its adapters on import
LAZY: dict[str, str] = {
    "torch": "pitstop.adapters.torch",
    "tensorflow": "pitstop.adapters.tf",
    "keras": "pitstop.adapters.keras",
    "jax": "pitstop.adapters.jax",
    "jaxlib": "pitstop.adapters.jax",
    "flax": "pitstop.adapters.jax",
    "optax": "pitstop.adapters.jax",
}
INSTALL_HINT = {"torch": "torch", "tensorflow": "tf", "keras": "keras", "jax": "jax",
                "jaxlib": "jax", "flax": "jax", "optax": "jax"}

#: callables turning an exception that ended training into a hint (or None), used when a
#: signal's save could not happen because training died first (e.g. a DataLoader worker
#: killed by a signal sent to the whole process group); framework adapters add theirs
exception_hints: list[Callable[[BaseException], str | None]] = []

_adapters: list[Adapter] = []
_not_built: set[str] = set()
#: called with every new staging buffer (a uint8 numpy array), e.g. to page-lock it for
#: asynchronous device-to-host copies; framework adapters append to it on import
staging_hooks: list[Any] = []
_loaded: set[str] = set()


def register_adapter(adapter: Adapter, *, first: bool = True) -> None:
    """Add an adapter; ``first`` puts it before those already registered."""
    if first:
        _adapters.insert(0, adapter)
    else:
        _adapters.append(adapter)


def _load_for(obj: Any) -> None:
    for cls in type(obj).__mro__:
        root = (cls.__module__ or "").split(".")[0]
        target = LAZY.get(root)
        if target and target not in _loaded:
            _loaded.add(target)
            try:
                module = importlib.import_module(target)
                if getattr(module, "__file__", None) is None:
                    # a folder without code (a namespace package): the adapter is planned
                    _not_built.add(root)
                    continue
            except ModuleNotFoundError as e:
                if e.name and e.name.startswith("pitstop"):
                    _not_built.add(root)  # that adapter is not built yet
                    continue
                raise ImportError(
                    f"pitstop needs its {root} support for {type(obj).__name__}: "
                    f"pip install 'pitstop[{INSTALL_HINT[root]}]'") from e


def has_state_dict_methods(obj: Any) -> bool:
    """Whether ``obj``'s class defines ``state_dict()`` and ``load_state_dict()``: asked of
    the class, since an object that makes attributes up on access (flax ``nnx.Rngs`` answers
    any name with a random stream) has them without being torch-style state."""
    kind = type(obj)
    return callable(getattr(kind, "state_dict", None)) and callable(
        getattr(kind, "load_state_dict", None))


class StatefulAdapter:
    """Any object with ``state_dict()`` and ``load_state_dict()`` (torch style)."""

    def can_handle(self, obj: Any) -> bool:
        return has_state_dict_methods(obj)

    def capture(self, obj: Any) -> Any:
        return obj.state_dict()

    def apply(self, obj: Any, tree: Any) -> None:
        obj.load_state_dict(tree)


_generic: list[Adapter] = [StatefulAdapter()]


#: frameworks whose objects may come from the user's own modules (a dataclass registered as
#: a JAX pytree node): when one is imported, its adapter is asked about unknown objects too
AMBIENT = ("jax",)


def resolve(obj: Any) -> Adapter | None:
    """The adapter for ``obj``, or None when it is a plain value or array."""
    _load_for(obj)
    for a in _adapters:
        if a.can_handle(obj):
            return a
    for a in _generic:
        if a.can_handle(obj):
            return a
    for root in AMBIENT:
        target = LAZY[root]
        if target not in _loaded and root in sys.modules:
            _loaded.add(target)
            module = importlib.import_module(target)
            if getattr(module, "__file__", None) is not None:
                return resolve(obj)
    root = type(obj).__module__.split(".")[0]
    if root in _not_built:
        from pitstop.core.errors import UnsupportedStateError
        raise UnsupportedStateError(
            f"{type(obj).__module__}.{type(obj).__qualname__}: this pitstop has no {root} "
            "adapter yet; put numpy arrays (np.asarray(x)) and plain values in the state instead")
    return None


#: the adapter package (pitstop.adapters.<name>) -> the modules whose versions it records
_FRAMEWORK_MODULES = {"torch": ("torch",), "tf": ("tensorflow",), "keras": ("keras",),
                      "jax": ("jax", "flax", "optax")}


def frameworks_of(adapters: Any) -> dict[str, str]:
    """The frameworks (and their versions) whose adapters are among ``adapters``, plus numpy:
    what the manifest's ``writer`` records as ``frameworks``. Keras adds its backend
    (``"keras.backend"``) and that backend's version. Called once per distinct set of
    adapters (the manager keeps the answers), never per object."""
    out: dict[str, str] = {}
    names: list[str] = []
    for a in adapters:
        if isinstance(a, str):  # a framework an adapter captured for another (keras)
            names.extend(m for m in _FRAMEWORK_MODULES.get(a, ()) if m not in names)
            continue
        parts = type(a).__module__.split(".")
        if len(parts) > 2 and parts[:2] == ["pitstop", "adapters"]:
            names.extend(m for m in _FRAMEWORK_MODULES.get(parts[2], ()) if m not in names)
    names.sort()
    if "keras" in names:
        keras = sys.modules.get("keras")
        try:
            backend = str(keras.backend.backend()) if keras is not None else None
        except Exception:  # noqa: BLE001 - informational only
            backend = None
        if backend:
            out["keras.backend"] = backend
            if backend in ("tensorflow", "torch", "jax") and backend not in names:
                names.append(backend)
    for name in names + ["numpy"]:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if isinstance(version, str):
            out[name] = version
    return out


def ambient_coordinator() -> Any:
    """The distributed job this process is a rank of, as a pitstop Coordinator:
    ``torch.distributed`` initialized with several ranks, or JAX's distributed runtime with
    several processes; None in a one-process job (nothing is imported to find out)."""
    td = sys.modules.get("torch.distributed")
    if td is not None and td.is_available() and td.is_initialized() and \
            td.get_world_size() > 1:
        from pitstop.adapters.torch.distributed import ProcessGroupCoordinator
        return ProcessGroupCoordinator()
    jd = sys.modules.get("jax._src.distributed")
    if jd is not None and getattr(getattr(jd, "global_state", None), "client", None) is not None:
        from pitstop.adapters.jax.distributed import JaxCoordinator
        coord = JaxCoordinator()
        return coord if coord.world_size > 1 else None
    return None


def ambient_rank() -> tuple[int, int]:
    """``(rank, ranks)`` of this process in its distributed job; ``(0, 1)`` alone."""
    td = sys.modules.get("torch.distributed")
    if td is not None and td.is_available() and td.is_initialized():
        return td.get_rank(), td.get_world_size()
    jd = sys.modules.get("jax._src.distributed")
    if jd is not None and getattr(getattr(jd, "global_state", None), "client", None) is not None:
        state = jd.global_state
        return int(state.process_id), int(state.num_processes)
    return 0, 1
