"""BackupAndRestore's ``manager_options`` checked when the callback is built: names and value
types of :class:`pitstop.CheckpointManager`'s arguments, and none the callback sets itself."""

from __future__ import annotations

import collections
import collections.abc
import logging
from typing import Any

log = logging.getLogger("pitstop")


#: options BackupAndRestore sets itself: what to pass instead
_OWN_OPTIONS = {
    "directory": "it is the backup_dir argument",
    "read_only": "backups are written; open the folder with pitstop.CheckpointManager("
                 "backup_dir, read_only=True) to read them",
    "on_busy": "BackupAndRestore saves whenever save_freq asks, as Keras's does (on_busy="
               "'wait'); drop the option",
}


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (plain types, unions, containers'
    outer types; a bool is no int here); an annotation it cannot judge passes."""
    import collections.abc as abc
    import typing

    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    target = origin or hint
    if target is abc.Callable:
        return callable(value)
    if not isinstance(target, type) or getattr(target, "_is_protocol", False):
        return True
    if target in (int, float) and isinstance(value, bool):
        return False
    if target is float:
        return isinstance(value, (int, float))
    return isinstance(value, target)


def _check_manager_options(options: Any, double_checkpoint: bool) -> dict[str, Any]:
    """``manager_options`` checked when the callback is built: known names of
    :class:`pitstop.CheckpointManager`, values of the types it takes, none that the callback
    sets itself. A bad one raises InvalidArgumentError naming it and what to do."""
    import difflib
    import inspect
    import typing

    from pitstop.core.errors import InvalidArgumentError
    from pitstop.core.manager import CheckpointManager

    if options is None:
        return {}
    if not isinstance(options, collections.abc.Mapping):
        raise InvalidArgumentError(
            f"manager_options must be a dict of pitstop.CheckpointManager arguments, e.g. "
            f"{{'memory_tier': False}}; got a {type(options).__name__}")
    params = inspect.signature(CheckpointManager.__init__).parameters
    hints = typing.get_type_hints(CheckpointManager.__init__)
    known = [n for n in params if n not in ("self", "directory")]
    for name, value in options.items():
        if name in _OWN_OPTIONS:
            raise InvalidArgumentError(
                f"manager_options[{name!r}] is set by BackupAndRestore itself: "
                f"{_OWN_OPTIONS[name]}")
        if name not in params:
            near = difflib.get_close_matches(str(name), known, n=1)
            raise InvalidArgumentError(
                f"manager_options[{name!r}]: pitstop.CheckpointManager has no such option"
                + (f" (did you mean {near[0]!r}?)" if near else "")
                + f"; it takes {', '.join(known)}")
        hint = hints.get(name, Any)
        if not _type_ok(value, hint):
            raise InvalidArgumentError(
                f"manager_options[{name!r}] must be {_hint_text(hint)}, got "
                f"{type(value).__name__} {value!r}")
    keep = options.get("keep_last")
    if keep is not None and keep < (2 if double_checkpoint else 1):
        raise InvalidArgumentError(
            f"manager_options['keep_last']={keep!r} would keep fewer backups than "
            f"double_checkpoint={double_checkpoint} needs; pass keep_last >= "
            f"{2 if double_checkpoint else 1} or drop it")
    return dict(options)


def _hint_text(hint: Any) -> str:
    import typing

    args = typing.get_args(hint)
    if args and typing.get_origin(hint) not in (None,) and all(
            isinstance(a, type) or a is type(None) for a in args) \
            and typing.get_origin(hint) is not collections.abc.Iterable:
        return " or ".join("None" if a is type(None) else a.__name__ for a in args)
    return getattr(hint, "__name__", None) or str(hint).replace("collections.abc.", "")
