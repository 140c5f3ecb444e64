"""Framework-neutral core: format, storage, snapshot engine, policies, manager."""

from pitstop.core import _moved

_moved.install()
