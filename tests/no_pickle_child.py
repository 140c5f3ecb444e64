"""The child of tests/test_no_pickle.py: ``python tests/no_pickle_child.py GROUP WORKDIR``.

It imports pitstop and the group's frameworks, writes real checkpoints, then :func:`trap`s
pickle and runs every restore / load / import / CLI read path of the group. Any unpickling
after the trap raises :class:`PickleTrapped` *and* is recorded (so a caller that swallows
the exception is still caught). It prints one JSON line: the paths it ran and the calls it
trapped.
"""

from __future__ import annotations

import _pickle
import contextlib
import copyreg
import io
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pitstop  # noqa: E402
import pitstop.cli  # noqa: E402

warnings.filterwarnings("ignore")
logging.getLogger("pitstop").setLevel(logging.ERROR)

TRAPPED: list[str] = []
RAN: list[str] = []


class PickleTrapped(BaseException):  # noqa: N818 - not an error a caller should handle
    """Raised by every unpickling entry point once the trap is set."""


def _trap(name: str) -> Callable[..., Any]:
    def trapped(*args: Any, **kwargs: Any) -> Any:
        TRAPPED.append(f"{name}: {''.join(traceback.format_stack(limit=6)[:-1])}")
        raise PickleTrapped(f"{name} called after the trap")
    return trapped


#: the unpicklers that may stay: pitstop's restricted ones, bound before the trap
ALLOWED: set[type] = set()


def trap() -> list[str]:
    """Make every way to unpickle raise. Returns what it replaced beyond the pickle modules:
    module attributes that held the real functions (``from pickle import load`` elsewhere)
    and Unpickler subclasses made before the trap (their ``load``)."""
    real = {pickle.load: "pickle.load", pickle.loads: "pickle.loads",
            pickle._load: "pickle._load", pickle._loads: "pickle._loads",
            _pickle.load: "_pickle.load", _pickle.loads: "_pickle.loads",
            pickle.Unpickler: "pickle.Unpickler", pickle._Unpickler: "pickle._Unpickler",
            copyreg._reconstructor: "copyreg._reconstructor"}
    unpicklers = (pickle.Unpickler, pickle._Unpickler)

    class TrappedUnpickler:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _trap("pickle.Unpickler()")()

        def __init_subclass__(cls, **kwargs: Any) -> None:  # subclassed later: still trapped
            super().__init_subclass__(**kwargs)

    replaced = []
    for module in list(sys.modules.values()):
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            try:
                name = real.get(value)
            except TypeError:  # unhashable
                continue
            if name is None:
                continue
            new = TrappedUnpickler if isinstance(value, type) else _trap(name)
            with contextlib.suppress(AttributeError, TypeError):
                setattr(module, attr, new)
                if module.__name__ not in ("pickle", "_pickle", "copyreg"):
                    replaced.append(f"{module.__name__}.{attr}")
    seen: set[type] = set()
    todo = [*unpicklers]
    while todo:  # every Unpickler subclass made so far, but pitstop's restricted ones
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub in seen:
                continue
            seen.add(sub)
            todo.append(sub)
            if sub in ALLOWED:
                continue
            with contextlib.suppress(TypeError):
                sub.load = _trap(f"{sub.__module__}.{sub.__qualname__}.load")
                replaced.append(f"{sub.__module__}.{sub.__qualname__}.load")
    return replaced


def early_bindings() -> Any:
    """A module that bound pickle's functions and subclassed its Unpickler *before* the trap
    (as cloudpickle, rich or torch do): the trap must reach those too."""
    import types

    early = types.ModuleType("pitstop_test_early_pickle")
    early.loads = pickle.loads  # type: ignore[attr-defined]

    class Early(pickle.Unpickler):
        pass

    early.Early = Early  # type: ignore[attr-defined]
    sys.modules[early.__name__] = early
    return early


EARLY = early_bindings()


def check_trap() -> None:
    """The trap holds: plain pickle, the C module, and what was bound before the trap."""
    data = pickle.dumps({"a": 1})
    for name, call in [("early `from pickle import loads`", lambda: EARLY.loads(data)),
                       ("early Unpickler subclass",
                        lambda: EARLY.Early(io.BytesIO(data)).load()),
                       ("pickle.loads", lambda: pickle.loads(data)),
                       ("pickle.load", lambda: pickle.load(io.BytesIO(data))),
                       ("pickle.Unpickler", lambda: pickle.Unpickler(io.BytesIO(data)).load()),
                       ("_pickle.loads", lambda: _pickle.loads(data)),
                       ("pickle._loads", lambda: pickle._loads(data))]:
        try:
            call()
        except PickleTrapped:
            continue
        raise AssertionError(f"{name} was not trapped")
    del TRAPPED[:]


def run(name: str, fn: Callable[[], Any]) -> None:
    fn()
    RAN.append(name)


def cli(*argv: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = pitstop.cli.main(list(argv))
    assert rc == 0, (argv, rc)


def core_paths(work: str, state_after: Callable[[], dict[str, Any]]) -> None:
    """A manager's restore, load, read-only load and the CLI on ``work/run``."""
    run_dir = os.path.join(work, "run")

    def restore() -> None:
        with pitstop.CheckpointManager(run_dir, save_on_signals=None) as mgr:
            assert mgr.restore(state_after()) == 2

    run("restore", restore)

    def load() -> None:
        with pitstop.CheckpointManager(run_dir, read_only=True, save_on_signals=None) as mgr:
            got = mgr.load(1)
            assert mgr.all_steps() == [1, 2] and got is not None

    run("read_only load", load)
    for argv in (["ls", run_dir], ["inspect", run_dir], ["verify", run_dir, "--all"],
                 ["gc", run_dir, "--dry-run"]):
        run(f"cli {argv[0]}", lambda argv=argv: cli(*argv))


_CRASH = """
import sys, time, numpy as np, pitstop
mgr = pitstop.CheckpointManager(sys.argv[1], save_on_signals=None)
mgr.hooks["before_write"] = lambda step: (print("HOLD", flush=True), time.sleep(600))
mgr.save(3, {"w": np.arange(10.0) * 3})
time.sleep(600)
"""


def crashed_tier_run(work: str) -> str:
    """A directory whose step 3 is only in the memory tier (the saver was SIGKILLed)."""
    d = os.path.join(work, "crashed")
    with pitstop.CheckpointManager(d, save_on_signals=None) as mgr:
        mgr.save(1, {"w": np.arange(10.0)}).wait()
    p = subprocess.Popen([sys.executable, "-c", _CRASH, d], stdout=subprocess.PIPE,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert p.stdout is not None and p.stdout.readline().startswith(b"HOLD")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    return d


def recover_from_tier(d: str) -> None:
    state = {"w": np.zeros(10)}
    with pitstop.CheckpointManager(d, save_on_signals=None) as mgr:
        assert mgr.restore(state) == 3
    assert (state["w"] == np.arange(10.0) * 3).all()


# ============================================================================ groups
def group_torch(work: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from pitstop.interop import dcp as dcp_import
    from pitstop.interop import torch_save

    ALLOWED.add(dcp_import._DCPMetadataUnpickler)
    torch.manual_seed(0)

    def make() -> tuple[Any, Any]:
        model = torch.nn.Linear(3, 2)
        return model, torch.optim.Adam(model.parameters())

    model, opt = make()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "epoch": 1, "np": np.arange(4)}
    with pitstop.CheckpointManager(os.path.join(work, "run"), save_on_signals=None) as mgr:
        mgr.save(1, state).wait()
        mgr.save(2, state).wait()
    torch.save({"model": model.state_dict(), "epoch": 3}, os.path.join(work, "ckpt.pt"))
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "tag": "x"},
             checkpoint_id=os.path.join(work, "dcp"), no_dist=True)
    crashed = crashed_tier_run(work)

    replaced = trap()
    check_trap()
    # the plain ways torch and DCP unpickle are caught (the trap reaches library code)
    for name, call in [
        ("torch.load(weights_only=False)",
         lambda: torch.load(os.path.join(work, "ckpt.pt"), weights_only=False)),
        ("DCP FileSystemReader.read_metadata",
         lambda: dcp.FileSystemReader(os.path.join(work, "dcp")).read_metadata())]:
        try:
            call()
        except PickleTrapped:
            RAN.append(f"trapped {name}")
        else:
            raise AssertionError(f"{name} ran past the trap")
    del TRAPPED[:]

    def fresh() -> dict[str, Any]:
        m, o = make()
        return {"model": m, "optimizer": o, "epoch": 0, "np": np.zeros(4, np.int64)}

    core_paths(work, fresh)
    run("memory-tier recovery", lambda: recover_from_tier(crashed))
    run("import_torch_save", lambda: torch_save.import_torch_save(
        os.path.join(work, "ckpt.pt"), os.path.join(work, "imported"), 1))
    run("import_dcp", lambda: dcp_import.import_dcp(
        os.path.join(work, "dcp"), os.path.join(work, "imported"), 2))
    run("export_torch_save", lambda: torch_save.export_torch_save(
        os.path.join(work, "imported"), os.path.join(work, "out.pt"), step=2))
    run("export_safetensors", lambda: torch_save.export_safetensors(
        os.path.join(work, "imported"), os.path.join(work, "out.safetensors"), step=1))
    run("torch.load(weights_only=True) of an export", lambda: torch.load(
        os.path.join(work, "out.pt"), weights_only=True))
    print(json.dumps({"ran": RAN, "trapped": TRAPPED, "replaced": replaced}))


def group_tf(work: str) -> None:
    import tensorflow as tf

    from pitstop.adapters.tf import Checkpoint, CheckpointManager

    v = tf.Variable(tf.range(4.0))
    gen = tf.random.Generator.from_seed(1)
    state = {"v": v, "gen": gen, "np": np.arange(3)}
    with pitstop.CheckpointManager(os.path.join(work, "run"), save_on_signals=None) as mgr:
        mgr.save(1, state).wait()
        mgr.save(2, state).wait()
    native = tf.train.Checkpoint(v=v).write(os.path.join(work, "native", "ckpt"))
    ckpt = Checkpoint(v=v, gen=gen)
    drop_in = CheckpointManager(ckpt, os.path.join(work, "dropin"), max_to_keep=2)
    drop_in.save()
    drop_in.close()

    replaced = trap()
    check_trap()

    def fresh() -> dict[str, Any]:
        return {"v": tf.Variable(tf.zeros(4)), "gen": tf.random.Generator.from_seed(9),
                "np": np.zeros(3, np.int64)}

    core_paths(work, fresh)

    def native_restore() -> None:
        w = tf.Variable(tf.zeros(4))
        Checkpoint(v=w).restore(native).expect_partial()  # (no save_counter in it)
        assert (w.numpy() == np.arange(4.0)).all()

    run("tf native checkpoint restore", native_restore)

    def drop_in_restore() -> None:
        w = tf.Variable(tf.zeros(4))
        m = CheckpointManager(Checkpoint(v=w, gen=tf.random.Generator.from_seed(2)),
                              os.path.join(work, "dropin"), max_to_keep=2)
        assert m.restore_or_initialize() is not None
        m.close()
        assert (w.numpy() == np.arange(4.0)).all()

    run("tf CheckpointManager restore_or_initialize", drop_in_restore)
    print(json.dumps({"ran": RAN, "trapped": TRAPPED, "replaced": replaced}))


def group_jax(work: str) -> None:
    import jax
    import jax.numpy as jnp
    import keras
    import orbax.checkpoint as ocp

    from pitstop.adapters.jax import export_orbax, import_orbax
    from pitstop.adapters.keras import BackupAndRestore, ModelCheckpoint, verify_file

    key = jax.random.key(0)
    state = {"params": {"w": jnp.arange(4.0)}, "key": key, "np": np.arange(3)}
    with pitstop.CheckpointManager(os.path.join(work, "run"), save_on_signals=None) as mgr:
        mgr.save(1, state).wait()
        mgr.save(2, state).wait()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(work, "orbax", "5"), {"w": jnp.ones(3), "b": jnp.zeros(2)})

    x, y = np.random.default_rng(0).normal(size=(16, 3)), np.zeros((16, 1))

    def model() -> Any:
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        m.compile("adam", "mse")
        return m

    keras_file = os.path.join(work, "k", "m.weights.h5")
    model().fit(x, y, epochs=1, verbose=0, batch_size=8, callbacks=[
        ModelCheckpoint(keras_file, save_weights_only=True),
        BackupAndRestore(os.path.join(work, "backup"), delete_checkpoint=False)])

    replaced = trap()
    check_trap()

    def fresh() -> dict[str, Any]:
        return {"params": {"w": jnp.zeros(4)}, "key": jax.random.key(5),
                "np": np.zeros(3, np.int64)}

    core_paths(work, fresh)
    run("import_orbax", lambda: import_orbax(os.path.join(work, "orbax", "5"),
                                             os.path.join(work, "from-orbax")))
    run("export_orbax", lambda: export_orbax(os.path.join(work, "from-orbax"), None,
                                             os.path.join(work, "to-orbax")))
    run("keras verify_file", lambda: verify_file(keras_file))
    run("keras BackupAndRestore resume", lambda: model().fit(
        x, y, epochs=2, verbose=0, batch_size=8,
        callbacks=[BackupAndRestore(os.path.join(work, "backup"))]))
    print(json.dumps({"ran": RAN, "trapped": TRAPPED, "replaced": replaced}))


if __name__ == "__main__":
    group, workdir = sys.argv[1], sys.argv[2]
    {"torch": group_torch, "tf": group_tf, "jax": group_jax}[group](workdir)
