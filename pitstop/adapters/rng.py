"""Random-number state: the global generators of Python, numpy and every imported framework.

Put ``pitstop.RNG()`` in the state to save and restore them all; after a restore, the next
draw of ``random``, ``np.random``, ``torch.rand`` (CPU and CUDA) ... is the one the
uninterrupted run would have made. Frameworks plug in through their plugin's ``rng`` (or
:func:`register_rng_provider`); this module imports no framework itself, and only frameworks
already in ``sys.modules`` are captured (pitstop never imports one just to save its seed).

Generator *objects* in the state work too: ``np.random.Generator``, ``np.random.RandomState``
and ``random.Random`` (adapters below), ``torch.Generator`` (torch adapter). Their state is
saved as JSON values (a few KiB at most), so it is readable and needs no pickle.
"""

from __future__ import annotations

import importlib
import logging
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from pitstop.core.adapter import Adapter, RNGProvider, register_adapter, rng_providers
from pitstop.core.errors import IncompatibleTargetError

log = logging.getLogger("pitstop")


#: every provider by name (core keeps them: a framework's plugin brings its own)
_providers = rng_providers
#: framework module -> pitstop module that registers its provider on import
LAZY_PROVIDERS: dict[str, str] = {
    "torch": "pitstop.adapters.torch",
    "tensorflow": "pitstop.adapters.tf",
    "jax": "pitstop.adapters.jax",
}


def register_rng_provider(name: str, get_state: Callable[[], Any],
                          set_state: Callable[[Any], None], *, module: str | None = None) -> None:
    """Add (or replace) the global-RNG provider ``name``; used when ``module`` is imported."""
    _providers[name] = RNGProvider(name, module or name, get_state, set_state)


def _active() -> dict[str, RNGProvider]:
    """Providers of the frameworks imported in this process (loading their adapters)."""
    for mod, target in LAZY_PROVIDERS.items():
        if mod in sys.modules and target not in sys.modules:
            try:
                importlib.import_module(target)
            except ModuleNotFoundError as e:
                if (e.name or "").startswith("pitstop"):
                    continue  # that adapter is not built yet
                _skip(mod, e)
            except Exception as e:  # noqa: BLE001 - a broken adapter must not block saving
                _skip(mod, e)
    return {n: p for n, p in _providers.items() if p.module in sys.modules}


_warned: set[str] = set()


def _skip(module: str, error: Exception) -> None:
    if module not in _warned:
        _warned.add(module)
        log.warning("pitstop: cannot load pitstop's %s support (%s: %s); pitstop.RNG() "
                    "leaves %s's random state out", module, type(error).__name__, error, module)


# ---------------------------------------------------------------------- Python, numpy
def _mt_to_json(state: dict[str, Any]) -> Any:
    """numpy's bit-generator state with arrays (MT19937's key) as lists of ints."""
    def conv(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return [int(x) for x in v.tolist()]
        if isinstance(v, np.integer):
            return int(v)
        if isinstance(v, np.floating):
            return float(v)
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return conv(state)


def _mt_from_json(state: dict[str, Any]) -> dict[str, Any]:
    inner = state.get("state")
    if isinstance(inner, dict) and isinstance(inner.get("key"), list):
        state = dict(state, state=dict(inner, key=np.asarray(inner["key"], dtype=np.uint32)))
    return state


register_rng_provider("python", random.getstate, random.setstate, module="random")
register_rng_provider("numpy", lambda: _mt_to_json(np.random.get_state(legacy=False)),
                      lambda s: np.random.set_state(_mt_from_json(s)), module="numpy")


class RNG:
    """The global random generators of Python, numpy and every imported framework.

    >>> state = {"model": model, "optimizer": opt, "rng": pitstop.RNG()}

    ``only`` limits it to some providers (``"python"``, ``"numpy"``, ``"torch"``, ...).
    A checkpoint's state for a framework not imported at restore time is skipped with a
    warning: import the framework before ``restore`` to get it back.
    """

    def __init__(self, only: list[str] | tuple[str, ...] | None = None) -> None:
        self.only = tuple(only) if only is not None else None

    def _selected(self) -> dict[str, RNGProvider]:
        active = _active()
        if self.only is None:
            return active
        return {n: p for n, p in active.items() if n in self.only}

    def state_dict(self) -> dict[str, Any]:
        """The current state of every selected generator, as JSON-able values."""
        return {name: p.get_state() for name, p in self._selected().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set every generator the checkpoint holds and this process has."""
        providers = self._selected()
        for name, value in state.items():
            p = providers.get(name)
            if p is None:
                log.warning("pitstop: the checkpoint holds %s's random state but %s is not "
                            "imported here; import it before restore() to restore it", name, name)
                continue
            p.set_state(value)

    def __repr__(self) -> str:
        return f"RNG({', '.join(self._selected())})"


# ---------------------------------------------------------------------- generator objects
class NumpyGeneratorAdapter(Adapter):
    """``np.random.Generator`` / ``BitGenerator``: ``bit_generator.state`` as JSON values."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, (np.random.Generator, np.random.BitGenerator))

    def capture(self, obj: Any) -> Any:
        bg = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
        return _mt_to_json(dict(bg.state))

    def apply(self, obj: Any, tree: Any) -> None:
        bg = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
        bg.state = _mt_from_json(tree)

    def check(self, obj: Any, tree: Any) -> None:
        bg = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
        saved = tree.get("bit_generator") if isinstance(tree, dict) else None
        if not isinstance(saved, str):
            raise IncompatibleTargetError(
                "the checkpoint does not hold a numpy generator's state here (another kind of "
                "generator was saved under this key); restore into the kind that was saved")
        if saved != type(bg).__name__:
            raise IncompatibleTargetError(
                f"the checkpoint holds the state of a {saved} bit generator, the target draws "
                f"from a {type(bg).__name__}; create it as np.random.Generator("
                f"np.random.{saved}()) to resume its stream")


class RandomStateAdapter(Adapter):
    """``np.random.RandomState`` objects (legacy API)."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, np.random.RandomState)

    def capture(self, obj: np.random.RandomState) -> Any:
        return _mt_to_json(obj.get_state(legacy=False))

    def apply(self, obj: np.random.RandomState, tree: Any) -> None:
        obj.set_state(_mt_from_json(tree))

    def check(self, obj: np.random.RandomState, tree: Any) -> None:
        if not isinstance(tree, dict) or tree.get("bit_generator") != "MT19937":
            raise IncompatibleTargetError(
                "the checkpoint does not hold a RandomState's state (an MT19937 state); "
                "restore into the kind of generator that was saved")


class PythonRandomAdapter(Adapter):
    """``random.Random`` instances (the module-level functions are covered by :class:`RNG`)."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, random.Random)

    def capture(self, obj: random.Random) -> Any:
        return obj.getstate()

    def apply(self, obj: random.Random, tree: Any) -> None:
        obj.setstate(tree)

    def check(self, obj: random.Random, tree: Any) -> None:
        if not (isinstance(tree, (tuple, list)) and len(tree) == 3
                and isinstance(tree[1], (tuple, list))):
            raise IncompatibleTargetError(
                "the checkpoint does not hold a random.Random's state; restore into the kind "
                "of generator that was saved")


for _a in (NumpyGeneratorAdapter(), RandomStateAdapter(), PythonRandomAdapter()):
    register_adapter(_a, first=False)

__all__ = ["RNG", "RNGProvider", "register_rng_provider", "LAZY_PROVIDERS"]
