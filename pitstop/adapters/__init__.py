"""Per-framework adapters, one package per framework, each registering one plugin with
:func:`pitstop.core.adapter.register` when imported. Each imports only its own framework.

This module holds the builtin frameworks' lazy loading: a table of a framework's root module
-> the pitstop package that registers its plugin, imported the first time an object of that
framework shows up (so ``import pitstop`` imports no framework). ``import pitstop`` wires it
into core's registry (:class:`BuiltinFinder`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from pitstop.core.adapter import (
    Adapter,
    Finder,
    Plugin,
    StatefulAdapter,
    register,
    register_adapter,
    register_finder,
    resolve,
)
from pitstop.core.errors import UnsupportedStateError

#: top-level module of an object's class -> module that registers its plugin on import
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

#: frameworks whose objects may come from the user's own modules (a dataclass registered as
#: a JAX pytree node): when one is imported, its adapter is asked about unknown objects too
AMBIENT = ("jax",)
#: frameworks with a distributed runtime: when one is imported, its plugin is loaded before
#: a manager asks which distributed job this process is a rank of
DISTRIBUTED = ("torch", "jax")

_not_built: set[str] = set()
_loaded: set[str] = set()


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


class BuiltinFinder(Finder):
    """Loads the builtin frameworks' plugins (:data:`LAZY`) on first sight."""

    def find(self, obj: Any) -> None:
        _load_for(obj)

    def find_more(self, obj: Any) -> bool:
        for root in AMBIENT:
            target = LAZY[root]
            if target not in _loaded and root in sys.modules:
                _loaded.add(target)
                module = importlib.import_module(target)
                if getattr(module, "__file__", None) is not None:
                    return True
        root = type(obj).__module__.split(".")[0]
        if root in _not_built:
            raise UnsupportedStateError(
                f"{type(obj).__module__}.{type(obj).__qualname__}: this pitstop has no {root} "
                "adapter yet; put numpy arrays (np.asarray(x)) and plain values in the state "
                "instead")
        return False

    def ambient(self) -> None:
        for root in DISTRIBUTED:
            target = LAZY[root]
            if root in sys.modules and target not in sys.modules:
                try:
                    importlib.import_module(target)
                except ImportError:
                    continue  # a broken install: found as before, when one of its objects shows up


register_finder(BuiltinFinder())

__all__ = ["Adapter", "Plugin", "StatefulAdapter", "register", "register_adapter", "resolve",
           "LAZY", "INSTALL_HINT", "BuiltinFinder"]
