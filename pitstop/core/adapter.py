"""The seam between core and the frameworks: the adapter protocol and the plugin registry.

An adapter turns a user object into a state tree and back; :class:`Adapter` declares every
member core calls, with the defaults core uses where an adapter leaves one out. A framework
registers once, with one :class:`Plugin` record (its adapters, global-RNG provider, staging
hook, exception hint, distributed coordinator, version record). Core resolves objects here
only; it names no framework and imports nothing of ``pitstop.adapters``: the builtin
frameworks are loaded on first sight by a :class:`Finder` that ``pitstop.adapters``
registers (``import pitstop`` does).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pitstop.core.runtime.coordination import Coordinator


class Adapter:
    """Turns objects of one kind into a state tree (:meth:`capture`) and back (:meth:`apply`).

    Subclass it and override :meth:`can_handle`, :meth:`capture` and :meth:`apply`; every
    other member has a default that core relies on, override it where your objects need it.
    """

    #: restore like ``load_state_dict``: a checkpoint subtree whose keys, shapes or dtypes
    #: differ from the captured one is not an error; :meth:`apply` gets the checkpoint's
    #: subtree with fresh numpy arrays (where they match, arrays are restored in place)
    replace_on_mismatch: bool = False
    #: the objects are immutable (JAX arrays, pytree nodes): :meth:`apply` returns the new
    #: object, which core puts where the old one was (a restore refuses a state whose root
    #: is such an object, since it has nowhere to go)
    rebuilds: bool = False
    #: array leaves of this adapter record a layout (a sharding) that the manifest keeps
    #: (``layouts``); core asks the leaves only when an adapter of the state sets this
    records_layout: bool = False

    def can_handle(self, obj: Any) -> bool:
        """Whether this adapter captures ``obj``; asked in registration order."""
        return False

    def capture(self, obj: Any) -> Any:
        """``obj`` as a state tree: arrays by reference (ArrayLeaf / np.ndarray), no copies;
        small state as JSON-able values."""
        raise NotImplementedError(f"{type(self).__name__}.capture")

    def apply(self, obj: Any, tree: Any) -> Any:
        """Put a restored ``tree`` back into ``obj``, in place (or, for an adapter that
        :attr:`rebuilds`, return the new object)."""
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def check(self, obj: Any, tree: Any) -> None:
        """Refuse a restore before any byte reaches a live object: raise
        :class:`pitstop.IncompatibleTargetError` (core adds the key path) when :meth:`apply`
        would refuse ``tree``, the checkpoint's subtree for ``obj`` with every array as a
        :class:`pitstop.core.tree.ArraySpec` (shape and dtype, no data). Default: accept."""

    def caveats(self, obj: Any) -> Iterable[str]:
        """What :meth:`capture` cannot make exact for ``obj``, with the fix; asked at every
        save, said once per distinct message. Default: none."""
        return ()

    def replaceable(self, obj: Any) -> Iterable[Any]:
        """Top-level keys of the captured dict whose entry may differ from the checkpoint's
        in shape, dtype or kind (a module's extra state): read fresh and handed to
        :meth:`apply` instead of refused. Default: none."""
        return ()

    def type_tag(self, obj: Any) -> str | None:
        """A name for ``obj``'s type recorded in the checkpoint's structure; a restore
        refuses an object whose tag differs from the saved one. Default: None (not recorded)."""
        return None

    def frameworks(self, obj: Any) -> Iterable[str]:
        """Names of further plugins whose frameworks wrote ``obj`` (Keras objects captured
        by the TensorFlow adapter): the manifest records their versions too. Default: none."""
        return ()

    def skeleton(self, obj: Any, copy: Callable[[Any], Any]) -> Any:
        """A copy of ``obj`` for ``load(target=...)`` to fill without touching ``obj``
        (``copy`` copies a nested value), or None to share ``obj``. Default: None."""
        return None


class _Completed(Adapter):
    """An adapter that does not subclass :class:`Adapter` (duck-typed): its members, and the
    defaults for those it lacks."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.can_handle = inner.can_handle  # type: ignore[method-assign]
        self.capture = inner.capture  # type: ignore[method-assign]
        self.apply = inner.apply  # type: ignore[method-assign]
        for name in _OPTIONAL:
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))


_OPTIONAL = ("replace_on_mismatch", "rebuilds", "records_layout", "check", "caveats",
             "replaceable", "type_tag", "frameworks", "skeleton")


def _complete(adapter: Any) -> Adapter:
    return adapter if isinstance(adapter, Adapter) else _Completed(adapter)


def has_state_dict_methods(obj: Any) -> bool:
    """Whether ``obj``'s class defines ``state_dict()`` and ``load_state_dict()``: asked of
    the class, since an object that makes attributes up on access (flax ``nnx.Rngs`` answers
    any name with a random stream) has them without being torch-style state."""
    kind = type(obj)
    return callable(getattr(kind, "state_dict", None)) and callable(
        getattr(kind, "load_state_dict", None))


class StatefulAdapter(Adapter):
    """Any object with ``state_dict()`` and ``load_state_dict()`` (torch style)."""

    def can_handle(self, obj: Any) -> bool:
        return has_state_dict_methods(obj)

    def capture(self, obj: Any) -> Any:
        return obj.state_dict()

    def apply(self, obj: Any, tree: Any) -> None:
        obj.load_state_dict(tree)


@dataclass(frozen=True)
class RNGProvider:
    """How to read and set one framework's global generators (JSON-able state)."""

    name: str
    #: top-level module that must already be imported for this provider to be used
    module: str
    get_state: Callable[[], Any]
    set_state: Callable[[Any], None]


@dataclass(frozen=True)
class Plugin:
    """Everything one framework gives core, registered once with :func:`register`."""

    #: the plugin's name (``"torch"``); an adapter's :meth:`Adapter.frameworks` names plugins
    name: str
    #: top-level modules whose versions the manifest records (``writer["frameworks"]``)
    #: when an adapter of this plugin captured part of the state
    modules: tuple[str, ...] = ()
    #: asked before every adapter registered earlier, in this order
    adapters: tuple[Any, ...] = ()
    #: asked after every adapter registered earlier, in this order (broad ones)
    fallbacks: tuple[Any, ...] = ()
    #: the framework's global random generators, for :class:`pitstop.RNG`
    rng: RNGProvider | None = None
    #: called with every new staging buffer (a uint8 numpy array), e.g. to page-lock it
    staging_hook: Callable[[Any], None] | None = None
    #: turns an exception that ended training into a hint (or None), said when a signal's
    #: save could not happen because training died first
    exception_hint: Callable[[BaseException], str | None] | None = None
    #: the distributed job this process is a rank of, as a Coordinator (None: not one)
    coordinator: Callable[[], Coordinator | None] | None = None
    #: ``(rank, ranks)`` of this process in the framework's distributed job, or None
    rank: Callable[[], tuple[int, int] | None] | None = None
    #: further ``writer["frameworks"]`` entries and modules whose versions to record (the
    #: Keras backend), asked when an adapter of this plugin captured part of the state
    writer_info: Callable[[], tuple[dict[str, str], tuple[str, ...]]] | None = None


class Finder:
    """Loads the plugin an object's framework needs, the first time one is seen; registered
    with :func:`register_finder` (``pitstop.adapters`` registers the builtin frameworks')."""

    def find(self, obj: Any) -> None:
        """Before any adapter is asked about ``obj``: load its framework's plugin (an
        ImportError says what to install)."""

    def find_more(self, obj: Any) -> bool:
        """No adapter handles ``obj``: load further plugins and return True to ask again, or
        raise UnsupportedStateError where ``obj``'s framework has no adapter."""
        return False

    def ambient(self) -> None:
        """Load the plugins of frameworks already imported that can tell this process's
        distributed job (their coordinators are asked next)."""


_adapters: list[Adapter] = []
_generic: list[Adapter] = [StatefulAdapter()]
_plugins: dict[str, Plugin] = {}
#: adapter -> the plugin that registered it
_plugin_of: dict[Adapter, Plugin] = {}
_finders: list[Finder] = []
#: global-RNG providers by name (python, numpy and every registered framework's)
rng_providers: dict[str, RNGProvider] = {}
#: called with every new staging buffer; plugins add theirs (the live list: a manager keeps it)
staging_hooks: list[Callable[[Any], None]] = []
#: exception hints of every registered plugin
exception_hints: list[Callable[[BaseException], str | None]] = []


def register_adapter(adapter: Any, *, first: bool = True) -> Adapter:
    """Add an adapter; ``first`` puts it before those already registered. One that does not
    subclass :class:`Adapter` gets its defaults; returns the adapter as registered."""
    done = _complete(adapter)
    if first:
        _adapters.insert(0, done)
    else:
        _adapters.append(done)
    return done


def unregister_adapter(adapter: Any) -> None:
    """Remove an adapter :func:`register_adapter` added (as passed or as returned)."""
    _adapters[:] = [a for a in _adapters
                    if a is not adapter and getattr(a, "inner", None) is not adapter]


def register(plugin: Plugin) -> None:
    """Register a framework's plugin (again: nothing more happens)."""
    if plugin.name in _plugins:
        return
    _plugins[plugin.name] = plugin
    for adapter in reversed(plugin.adapters):
        _plugin_of[register_adapter(adapter)] = plugin
    for adapter in plugin.fallbacks:
        _plugin_of[register_adapter(adapter, first=False)] = plugin
    if plugin.rng is not None:
        rng_providers[plugin.rng.name] = plugin.rng
    if plugin.staging_hook is not None and plugin.staging_hook not in staging_hooks:
        staging_hooks.append(plugin.staging_hook)
    if plugin.exception_hint is not None and plugin.exception_hint not in exception_hints:
        exception_hints.append(plugin.exception_hint)


def register_finder(finder: Finder) -> None:
    """Add a finder, asked about every object before and after the adapters."""
    if finder not in _finders:
        _finders.append(finder)


def resolve(obj: Any) -> Adapter | None:
    """The adapter for ``obj``, or None when it is a plain value or array."""
    for finder in _finders:
        finder.find(obj)
    for a in _adapters:
        if a.can_handle(obj):
            return a
    for a in _generic:
        if a.can_handle(obj):
            return a
    for finder in _finders:
        if finder.find_more(obj):
            return resolve(obj)
    return None


def frameworks_of(adapters: Any) -> dict[str, str]:
    """The frameworks (and their versions) whose adapters are among ``adapters``, plus numpy:
    what the manifest's ``writer`` records as ``frameworks``. A plugin's ``writer_info``
    adds its entries (Keras: its backend). Called once per distinct set of adapters (the
    manager keeps the answers), never per object."""
    out: dict[str, str] = {}
    names: list[str] = []
    plugins: list[Plugin] = []
    for a in adapters:
        # a plugin an adapter captured for another (keras), or the adapter's own
        plugin = _plugins.get(a) if isinstance(a, str) else _plugin_of.get(a)
        if plugin is not None and plugin not in plugins:
            plugins.append(plugin)
            names.extend(m for m in plugin.modules if m not in names)
    names.sort()
    for plugin in plugins:
        if plugin.writer_info is not None:
            extra, more = plugin.writer_info()
            out.update(extra)
            names.extend(m for m in more if m not in names)
    for name in names + ["numpy"]:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if isinstance(version, str):
            out[name] = version
    return out


def ambient_coordinator() -> Any:
    """The distributed job this process is a rank of, as a pitstop Coordinator (the first
    registered plugin that knows one); None in a one-process job."""
    for finder in _finders:
        finder.ambient()
    for plugin in list(_plugins.values()):
        if plugin.coordinator is not None:
            coord = plugin.coordinator()
            if coord is not None:
                return coord
    return None


def ambient_rank() -> tuple[int, int]:
    """``(rank, ranks)`` of this process in its distributed job; ``(0, 1)`` alone."""
    for finder in _finders:
        finder.ambient()
    for plugin in list(_plugins.values()):
        if plugin.rank is not None:
            found = plugin.rank()
            if found is not None:
                return found
    return 0, 1
