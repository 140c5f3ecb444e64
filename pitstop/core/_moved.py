"""Module names of the core before its save and restore flow moved into folders: importing
one gives the module at its new home (the same object, so its names and patches are the
new module's), with a DeprecationWarning that names it. For code written against the
earlier layout; pitstop itself imports only the new names."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

#: old dotted name -> new dotted name
MOVED = {f"pitstop.core.{old}": f"pitstop.core.{new}" for old, new in {
    "snapshot": "save.snapshot", "lazy": "save.lazy", "engine": "save.engine",
    "skips": "save.skips", "memtier": "save.memtier", "reader": "restore.read",
    "codecs": "format.codecs", "hashing": "format.hashing", "crypto": "format.crypto",
    "dtypes": "format.dtypes", "catalog": "directory.catalog", "names": "directory.names",
    "recovery": "directory.recovery", "signals": "runtime.signals",
    "lifecycle": "runtime.lifecycle", "coordination": "runtime.coordination",
    "supervised": "runtime.supervised",
}.items()}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Asked last (after the files), so only a name no file has any more is answered."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at its new home is already executed."""


def install() -> None:
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())
