"""The guard BackupAndRestore puts around one ``fit()``: the batch hooks of a resumed epoch
passed over, and a failure anywhere in ``fit()`` committing the backups before it propagates."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import keras

log = logging.getLogger("pitstop")


#: fit()'s calls into its callbacks that a guard wraps (see _FitGuard)
#: (on_train_end too: a callback before this one that raises there ends fit() before this
#: one's on_train_end commits the backups)
_GUARDED_HOOKS = ("on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
                  "on_train_batch_end", "on_test_begin", "on_test_end",
                  "on_test_batch_begin", "on_test_batch_end", "on_train_end")


def _callback_list(cb: Any) -> Any:
    """The ``CallbackList`` through which ``fit()`` calls ``cb`` (found from the hook that
    is running), or None where Keras's internals differ."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList) \
                and any(c is cb for c in getattr(owner, "callbacks", ())):
            return owner
        frame = frame.f_back
    return None


def _ends_the_data(e: BaseException) -> bool:
    """Whether ``e`` is how a train step says its input ran out (``fit()`` catches it and
    goes on with the next epoch), not a failure."""
    return isinstance(e, StopIteration) or type(e).__name__ == "OutOfRangeError"


class _FitGuard:
    """One ``fit()``'s calls into its callbacks, its train step and its validation, wrapped:
    a batch hook that ``hidden(name)`` says is passed over reaches no callback, and an
    exception from any of them calls ``on_failure`` (once) before it propagates, so that
    ``fit()`` never ends with a write of its callbacks in flight. :meth:`remove` puts back
    what it wrapped."""

    def __init__(self, on_failure: Any, hidden: Any) -> None:
        self._on_failure, self._hidden = on_failure, hidden
        self._wrapped: list[tuple[Any, str, bool, Any]] = []
        self._failed = False
        self.hides = False

    def install(self, callbacks: Any, model: Any, owner: Any = None) -> None:
        if callbacks is not None:
            self.hides = True
            for name in _GUARDED_HOOKS:
                self._wrap(callbacks, name, name in ("on_train_batch_begin",
                                                     "on_train_batch_end"))
            # the callbacks after ``owner`` are yet to run their on_train_begin (the list's
            # own call is under way: ours is one of it): a failure there ends fit() too
            later = list(getattr(callbacks, "callbacks", ()))
            at = next((i for i, c in enumerate(later) if c is owner), None)
            for c in later[at + 1:] if at is not None else ():
                self._wrap(c, "on_train_begin", False)
        if getattr(model, "train_function", None) is not None:
            self._wrap(model, "train_function", False)
        self._wrap(model, "evaluate", False)

    def _wrap(self, obj: Any, name: str, hideable: bool) -> None:
        real = getattr(obj, name)
        own = name in vars(obj)

        def call(*args: Any, **kwargs: Any) -> Any:
            if hideable and self._hidden(name):
                return None
            try:
                return real(*args, **kwargs)
            except BaseException as e:
                if not _ends_the_data(e):
                    self.fail()
                raise

        self._wrapped.append((obj, name, own, real))
        setattr(obj, name, call)

    def watch_input(self, it: Any) -> None:
        """Also watch fit()'s reading of its input: on torch the batches are read outside
        the train step (``EpochIterator.__next__``, within its ``catch_stop_iteration()``),
        so an exception of the data pipeline reaches neither a hook nor the train step."""
        if it is None or not callable(getattr(it, "catch_stop_iteration", None)):
            return
        real, guard = it.catch_stop_iteration, self

        class Watched:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._inner = real(*args, **kwargs)

            def __enter__(self) -> Any:
                return self._inner.__enter__()

            def __exit__(self, kind: Any, e: Any, tb: Any) -> Any:
                if e is not None and not _ends_the_data(e):
                    guard.fail()
                return self._inner.__exit__(kind, e, tb)

        self._wrapped.append((it, "catch_stop_iteration", "catch_stop_iteration" in vars(it),
                              real))
        it.catch_stop_iteration = Watched

    def fail(self) -> None:
        if not self._failed:
            self._failed = True
            self._on_failure()

    def remove(self) -> None:
        while self._wrapped:
            obj, name, own, real = self._wrapped.pop()
            if own:
                setattr(obj, name, real)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
