"""One process of a real multi-process JAX job, for tests/adapters/jax/test_multiprocess.py.

    python tests/adapters/jax/mp_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT DIR [JSON_ARGS]

With ``NUM_PROCESSES`` > 1 the process joins the job with ``jax.distributed.initialize`` on
``127.0.0.1:PORT`` (process 0 hosts the coordination service); with 1 it is a plain JAX
process. The parent sets ``XLA_FLAGS`` (host devices per process) and ``JAX_PLATFORMS``.
A scenario is a function below; it returns a JSON-able dict, printed after ``RESULT`` as the
process's last line of stdout. Progress marks (``MARK`` lines) let the parent follow it.
Every process then leaves through ``jax.distributed.shutdown()`` (a barrier: process 0, which
hosts the service, must not go before the others are done) and ``os._exit``, so no exit
handler of JAX or gloo can hang it; a scenario that raised leaves with status 1 after
printing its traceback on stderr.

The state (:func:`make_state`) is a pure function of the step, the process and the
shardings, with a numpy mirror of every value, so any world can check a restore exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).absolute().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULT = "PITSTOP_RESULT "
MARK = "PITSTOP_MARK "
ROWS, COLS = 8, 8


def say(line: str) -> None:
    # one write per line (marks, RESULT lines): print writes the text and its newline apart,
    # and a mark from another thread (a save's hook) then lands between them
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def mark(text: str) -> None:
    say(MARK + text)


# ---------------------------------------------------------------------------- the state
def meshes() -> dict[str, Any]:
    """``flat``: every device of the job on one axis ``x``; ``grid``: processes x local
    devices (``p`` splits across processes, ``l`` within one)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = np.array(jax.devices())  # process-major order
    return {"flat": Mesh(devices, ("x",)),
            "grid": Mesh(devices.reshape(jax.process_count(), -1), ("p", "l"))}


_classes: dict[str, Any] = {}


def train_state_class() -> Any:
    """A Flax struct dataclass (a pytree node) holding params and an Optax state, made once
    (flax is imported only by the processes that need it)."""
    if "TrainState" not in _classes:
        import flax.struct

        @flax.struct.dataclass
        class TrainState:
            step: Any
            params: Any
            opt_state: Any

        _classes["TrainState"] = TrainState
    return _classes["TrainState"]


#: the partition of each global array: as saved, and the other one a restore asks for
LAYOUTS: dict[str, dict[str, tuple[str, tuple[Any, ...]]]] = {
    "saved": {"w": ("flat", ("x",)), "across": ("grid", ("p",)), "within": ("grid", (None, "l")),
              "rep": ("flat", ()), "kernel": ("flat", (None, "x")), "bias": ("flat", ()),
              "gkey": ("flat", ())},
    "other": {"w": ("flat", (None, "x")), "across": ("grid", (None, "l")),
              "within": ("grid", ("p", "l")), "rep": ("grid", ("p",)), "kernel": ("grid", ("l",)),
              "bias": ("grid", (None,)), "gkey": ("grid", ())},
}


def make_state(step: int, process: int, layout: str = "saved") -> tuple[dict[str, Any], Any]:
    """The training state at ``step`` on ``process``, and its numpy mirror (global values).

    Global arrays (``jax.make_array_from_callback`` over every device of the job): ``w``
    sharded on all devices, ``across`` sharded across processes and replicated within one,
    ``within`` replicated across processes and sharded within one, ``rep`` whole everywhere;
    a Flax struct ``train`` with Optax Adam state over global params; per-process state: a
    numpy array and a value that differ by process; typed and raw PRNG keys of one process,
    and a typed key on every device of the job (``gkey``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    TrainState = train_state_class()
    m = meshes()
    shardings = {k: NamedSharding(m[mesh], P(*spec)) for k, (mesh, spec) in LAYOUTS[layout].items()}

    def source(salt: int, dtype: Any = np.float32, shape: tuple[int, ...] = (ROWS, COLS)
               ) -> np.ndarray:
        n = int(np.prod(shape))
        return (np.arange(n).reshape(shape) * (salt + 1) + step * 1000).astype(dtype)

    def glob(name: str, value: np.ndarray) -> Any:
        return jax.make_array_from_callback(value.shape, shardings[name], lambda i: value[i])

    host = {"w": source(0), "across": source(1, np.int32), "within": source(2, np.float16),
            "rep": source(3, np.int64 if jax.config.read("jax_enable_x64") else np.int32,
                          (ROWS,)),
            "kernel": source(4), "bias": source(5, shape=(COLS,))}
    params_h = {"dense": {"kernel": host["kernel"], "bias": host["bias"]}}
    params = {"dense": {"kernel": glob("kernel", host["kernel"]),
                        "bias": glob("bias", host["bias"])}}
    adam = optax.adam(1e-3).init(params)
    mu_h = jax.tree.map(lambda p: p * np.float32(0.5), params_h)
    nu_h = jax.tree.map(lambda p: p * p, params_h)
    adam = (adam[0]._replace(count=jnp.asarray(step, jnp.int32),
                             mu=jax.tree.map(lambda p: p * np.float32(0.5), params),
                             nu=jax.tree.map(lambda p: p * p, params)), *adam[1:])
    adam_h = (adam[0]._replace(count=np.asarray(step, np.int32), mu=mu_h, nu=nu_h), *adam[1:])
    key = jax.random.fold_in(jax.random.key(7), step)
    gkey_h = np.asarray(jax.random.key_data(jax.random.key(step + 100)))
    state = {
        "w": glob("w", host["w"]), "across": glob("across", host["across"]),
        "within": glob("within", host["within"]), "rep": glob("rep", host["rep"]),
        "train": TrainState(step=jnp.asarray(step), params=params, opt_state=adam),
        "key": key, "raw_key": jax.random.PRNGKey(step),
        "gkey": jax.random.wrap_key_data(glob("gkey", gkey_h)),  # on every device: P()
        "local": np.full(3, process * 100 + step, np.int64), "seen": process * 10 + step,
    }
    mirror = {
        **{k: host[k] for k in ("w", "across", "within", "rep")},
        "train": TrainState(step=np.asarray(step, np.int32), params=params_h, opt_state=adam_h),
        "key": ("key", np.asarray(jax.random.key_data(key))),
        "raw_key": np.asarray(jax.random.PRNGKey(step)), "gkey": ("key", gkey_h),
        "local": np.full(3, process * 100 + step, np.int64), "seen": process * 10 + step,
    }
    return state, mirror


def compare(got: Any, want: Any, target: Any) -> list[str]:
    """Every difference between a restored state and the mirror of the expected one: values
    (each addressable shard of a global array against its region), dtypes, shapes, and each
    array's sharding against the target's. Empty when they are the same."""
    import jax
    import numpy as np

    problems: list[str] = []

    def check(path: Any, g: Any, w: Any, t: Any) -> None:
        where = jax.tree_util.keystr(path)
        if isinstance(w, tuple) and len(w) == 2 and w[0] == "key":
            if not jax.numpy.issubdtype(g.dtype, jax.dtypes.prng_key):
                problems.append(f"{where}: not a typed key ({g!r})")
                return
            g, w = jax.random.key_data(g), w[1]
        if isinstance(w, np.ndarray):
            if not isinstance(g, jax.Array | np.ndarray):
                problems.append(f"{where}: {type(g).__name__}, not an array")
                return
            if tuple(g.shape) != w.shape or np.dtype(g.dtype) != w.dtype:
                problems.append(f"{where}: {g.dtype}{list(g.shape)}, want {w.dtype}{list(w.shape)}")
                return
            if isinstance(g, np.ndarray):
                if not np.array_equal(g, w):
                    problems.append(f"{where}: {g.tolist()} != {w.tolist()}")
                return
            if isinstance(t, jax.Array) and not g.sharding.is_equivalent_to(t.sharding, g.ndim):
                problems.append(f"{where}: sharding {g.sharding}, want the target's {t.sharding}")
            for shard in g.addressable_shards:
                if not np.array_equal(np.asarray(shard.data), w[shard.index]):
                    problems.append(f"{where}: shard {shard.index} differs")
            return
        if g != w:
            problems.append(f"{where}: {g!r} != {w!r}")

    keys = lambda x: isinstance(x, tuple) and len(x) == 2 and x[0] == "key"  # noqa: E731
    got_l = jax.tree_util.tree_flatten_with_path(got)[0]
    want_l = jax.tree_util.tree_leaves(want, is_leaf=keys)
    target_l = jax.tree_util.tree_leaves(target)
    if len(got_l) != len(want_l) or len(got_l) != len(target_l):
        return [f"{len(got_l)} leaves restored, want {len(want_l)} (target {len(target_l)})"]
    for (path, g), w, t in zip(got_l, want_l, target_l, strict=True):
        check(path, g, w, t)
    return problems


# ---------------------------------------------------------------------------- scenarios
class Ctx:
    def __init__(self, process: int, processes: int, directory: Path, args: dict[str, Any]
                 ) -> None:
        self.process, self.processes, self.dir, self.args = process, processes, directory, args


def probe_coordinator(ctx: Ctx) -> dict[str, Any]:
    """The coordinator on its own: both channels at once from two threads, payloads of every
    size, the keys it leaves in the store, a named instance on one process timing out, and a
    closed one refusing."""
    from jax._src import distributed

    from pitstop.adapters.jax import JaxCoordinator
    from pitstop.core.runtime.coordination import CoordinationError

    client: Any = distributed.global_state.client
    out: dict[str, Any] = {}
    c = JaxCoordinator(name="probe", timeout_s=60)
    c.rounds_per_batch = 8  # (64 by default) so that a few batches of keys come and go
    out["instance"] = c.instance
    rounds = 25
    seen: dict[str, list[list[bytes]]] = {"control": [], "persist": []}

    def run(channel: str) -> None:
        for i in range(rounds):
            data = f"{channel}:{i}:{ctx.process}".encode() * (1 + i % 3)
            seen[channel].append(c.all_gather(data, what=f"round {i}", channel=channel))

    t = threading.Thread(target=run, args=("persist",))
    t.start()
    run("control")
    t.join(60)
    out["channels_in_order"] = all(
        seen[ch][i] == [f"{ch}:{i}:{r}".encode() * (1 + i % 3) for r in range(ctx.processes)]
        for ch in seen for i in range(rounds))
    big = bytes(range(256)) * 4096 * (ctx.process + 1)  # 1 MiB, 2 MiB, ...
    got = c.all_gather(big, what="big")
    out["big_ok"] = [len(g) for g in got] == [2**20 * (r + 1) for r in range(ctx.processes)] \
        and got[ctx.process] == big
    out["empty"] = c.all_gather(b"", what="empty") == [b""] * ctx.processes
    out["ints"] = c.all_gather_ints([ctx.process, 7], what="ints")
    # another instance's exchange: every process is past its last round of ``c``; only the
    # newest batch of rounds of each channel is left (the leader deleted each older batch
    # once the next batch's first round showed that everyone had read it)
    sync = JaxCoordinator(name="sync", timeout_s=60)
    sync.all_gather(b"", what="sync")
    out["keys_before_close"] = sorted(
        k.split("/", 2)[2] for k, _v in client.key_value_dir_get_bytes(f"pitstop/{c.instance}"))
    sync.all_gather(b"", what="sync")  # every process listed them before any closes
    c.close()
    try:
        c.all_gather(b"x", what="after close")
        out["closed_error"] = None
    except CoordinationError as e:
        out["closed_error"] = str(e)
    # a named instance made on process 0 alone: nobody answers, the wait ends in time
    if ctx.process == 0:
        alone = JaxCoordinator(name="alone", timeout_s=1)
        try:
            alone.all_gather(b"hello", what="asking nobody")
            out["timeout_error"] = None
        except CoordinationError as e:
            out["timeout_error"] = str(e)
        alone.close()
    # every process closed ``c``: the last one removed its keys
    sync.all_gather(b"", what="sync")
    out["keys_after_close"] = [k for k, _v in client.key_value_dir_get_bytes(
        f"pitstop/{c.instance}")]
    sync.close()
    return out


def save(ctx: Ctx) -> dict[str, Any]:
    """Save steps 1 (``save``), 2 and 4 (``step`` with a policy) through a manager that finds
    the job by itself; then restore into the other layout on the same processes."""
    import pitstop

    out: dict[str, Any] = {}
    if ctx.args.get("probe"):
        out["probe"] = probe_coordinator(ctx)
    # on_busy="wait": step 4 waits for step 2's persist instead of skipping the save
    with pitstop.CheckpointManager(ctx.dir, save_every_steps=2, on_busy="wait") as mgr:
        coord = mgr._coord
        out["coordinator"] = [type(coord).__name__, getattr(coord, "instance", None),
                              coord.rank if coord else None, coord.world_size if coord else None]
        t0 = time.perf_counter()
        state, _ = make_state(1, ctx.process)
        mgr.save(1, state).wait()
        for step in range(2, 5):
            state, _ = make_state(step, ctx.process)
            mgr.step(step, state)
        mgr.wait()
        out["save_s"] = time.perf_counter() - t0
        out["steps"] = mgr.all_steps()
        out["stats"] = [[s.step, s.bytes, s.stall_s, s.persist_s] for s in mgr.stats]
        mark("saved")
        if ctx.args.get("restore_here"):
            out["restore"] = _restore(mgr, ctx, saved_world=ctx.processes)
    if ctx.args.get("skip"):
        out["skip"] = _skip_together(ctx)
    if ctx.args.get("retention"):
        out["retention"] = _retention_and_preemption(ctx)
    if ctx.processes > 1:
        from jax._src import distributed

        client: Any = distributed.global_state.client
        client.wait_at_barrier("pitstop-test-closed", 60_000)
        out["keys_left"] = [k for k, _v in client.key_value_dir_get_bytes("pitstop/auto.0")]
    return out


def _retention_and_preemption(ctx: Ctx) -> dict[str, Any]:
    """``keep_last=2`` over saves of steps 0, 2 and 4 (the leader's retention deletes step 0):
    what each process's ``all_steps()`` says once ``wait()`` returned. Process 0 holds its
    deletion back until process 1 has listed, or for 0.5 s: a process that lists before the
    deletion is seen doing so. Then a SIGTERM to process 1 alone: ``reached_preemption(5)``
    on both, and ``step(5)`` saving on both before they leave as the signal asks (here: a
    handler of the program's that only notes it)."""
    import pitstop

    directory = ctx.dir.parent / f"{ctx.dir.name}-kept"
    listed = ctx.dir.parent / f"{ctx.dir.name}-listed"
    noted: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: noted.append(signum))
    out: dict[str, Any] = {}
    mgr = pitstop.CheckpointManager(directory, keep_last=2, save_every_steps=2, on_busy="wait")

    def hold_back(step: int) -> None:
        deadline = time.monotonic() + 0.5
        while not listed.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    if ctx.process == 0:
        mgr.hooks["before_delete"] = hold_back
    for step in range(5):
        state, _ = make_state(step, ctx.process)
        mgr.step(step, state)
    mgr.wait()
    out["all_steps"] = mgr.all_steps()
    if ctx.process == 1:
        listed.touch()
    out["before_signal"] = mgr.reached_preemption(5)
    if ctx.process == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # noted by pitstop's handler
    out["reached"] = mgr.reached_preemption(5)
    state, _ = make_state(5, ctx.process)
    mgr.step(5, state)  # saves step 5, closes, then calls the program's handler
    out["noted"] = len(noted)
    out["closed"] = mgr.closed
    with pitstop.CheckpointManager(directory, read_only=True) as reader:
        out["after"] = reader.all_steps()
    return out


def _skip_together(ctx: Ctx) -> dict[str, Any]:
    """The default on_busy="skip" with process 0 free and process 1 busy: process 0 has two
    staging buffers, process 1 one, whose persist of step 2 is held until step 4's step()
    returned. Every process must skip step 4 (none may save it alone), and count it."""
    import pitstop

    release = threading.Event()

    def hold(step: int) -> None:
        if step == 2 and ctx.process == 1:
            assert release.wait(60)

    with pitstop.CheckpointManager(ctx.dir.parent / "skip", save_every_steps=2,
                                   max_in_flight=2 if ctx.process == 0 else 1) as mgr:
        mgr.hooks["before_write"] = hold
        saved = []
        for step in range(2, 7):
            state, _ = make_state(step, ctx.process)
            if mgr.step(step, state) is not None:
                saved.append(step)
            if step == 4:
                free = mgr.pool.can_acquire()
                release.set()
                mgr.wait()
        mgr.wait()
        return {"saved": saved, "steps": mgr.all_steps(), "free_at_4": free,
                "skipped": [mgr.skipped_saves, mgr.skipped_steps],
                "before": [[s.step, s.skipped_before] for s in mgr.stats]}


def _restore(mgr: Any, ctx: Ctx, saved_world: int) -> dict[str, Any]:
    """Restore the newest step into zeros of the other layout (and load() it into abstract
    arrays of that layout); compare with the state saved by process
    ``process % saved_world``."""
    import jax

    src = ctx.process % saved_world
    target, _ = make_state(0, ctx.process, "other")
    _state, want = make_state(4, src, "other")
    keep = dict(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = mgr.restore(target)
    def abstract(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    # load(target=...) into ShapeDtypeStructs of the other layout; the typed key that spans
    # processes as its live array (see abstract_key_load)
    loaded = mgr.load(target={**jax.tree.map(abstract, keep), "gkey": keep["gkey"]})
    try:
        full = mgr.load(target=jax.tree.map(abstract, keep))
        abstract_key_load = compare(full["gkey"], want["gkey"], keep["gkey"])
    except Exception as e:  # noqa: BLE001 - reported to the test, which knows the cause
        abstract_key_load = [f"{type(e).__name__}: {e}"]
    # ShapeDtypeStructs without a sharding (jax.eval_shape's): placed as the save recorded
    bare = {k: jax.ShapeDtypeStruct(keep[k].shape, keep[k].dtype)
            for k in ("w", "across", "within")}
    try:
        got = mgr.load(target={**jax.tree.map(abstract, keep), "gkey": keep["gkey"], **bare})
        as_saved: Any = {
            k: [str(tuple(got[k].sharding.spec)), dict(got[k].sharding.mesh.shape),
                compare(got[k], want[k], got[k])] for k in bare}
    except Exception as e:  # noqa: BLE001 - reported to the test
        as_saved = f"{type(e).__name__}: {e}"
    return {"step": None if restored is None else int(restored),
            "as_saved": as_saved,
            "problems": compare(target, want, keep),
            "load_problems": compare(loaded, want, keep),
            "abstract_key_load": abstract_key_load,
            "warnings": [str(w.message) for w in caught]}


def restore(ctx: Ctx) -> dict[str, Any]:
    """Restore what ``save`` wrote (by ``saved_world`` processes) on this world."""
    import pitstop

    with pitstop.CheckpointManager(ctx.dir) as mgr:
        coord = mgr._coord
        out: dict[str, Any] = {"coordinator": None if coord is None else type(coord).__name__}
        t0 = time.perf_counter()
        out.update(_restore(mgr, ctx, saved_world=ctx.args["saved_world"]))
        out["restore_s"] = time.perf_counter() - t0
    return out


def die(ctx: Ctx) -> dict[str, Any]:
    """Step 1 committed; then the process ``victim`` SIGKILLs itself in the middle of step 2
    (after its snapshot, before it writes). What the others see is what the test checks."""
    import pitstop
    from pitstop.adapters.jax import JaxCoordinator

    victim = ctx.args["victim"]
    timeout = ctx.args.get("timeout_s")
    dist: Any = JaxCoordinator(timeout_s=timeout) if timeout else "auto"
    state, _ = make_state(1, ctx.process)
    if timeout:  # every process here first: a short timeout is for the death, not start-up
        JaxCoordinator(name="sync", timeout_s=60).all_gather(b"", what="sync")
    mgr = pitstop.CheckpointManager(ctx.dir, distributed=dist)
    mgr.save(1, state).wait()
    mark("saved 1")

    def kill(step: int) -> None:
        if step == 2 and ctx.process == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    mgr.hooks["before_write"] = kill
    state, _ = make_state(2, ctx.process)
    mark("saving 2")
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        mgr.save(2, state).wait()
        out["error"] = None
    except pitstop.CheckpointError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["waited_s"] = time.monotonic() - t0
    # a job that lost a process cannot shut down together: leave at once (the manager's
    # close would wait for nothing; JAX's exit handlers would wait for the dead peer)
    say(RESULT + json.dumps(out))
    os._exit(0)


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "save": save, "restore": restore, "die": die, "probe": probe_coordinator}


def main() -> None:
    scenario, process, processes, port, directory = sys.argv[1:6]
    args = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    ctx = Ctx(int(process), int(processes), Path(directory), args)
    try:
        import jax

        if ctx.processes > 1:
            if args.get("recoverable"):
                jax.config.update("jax_enable_recoverability", True)
            jax.distributed.initialize(
                coordinator_address=f"127.0.0.1:{port}", num_processes=ctx.processes,
                process_id=ctx.process, initialization_timeout=60,
                heartbeat_timeout_seconds=int(args.get("heartbeat_s", 10)),
                shutdown_timeout_seconds=30)
        result = SCENARIOS[scenario](ctx)
        say(RESULT + json.dumps(result))
        if ctx.processes > 1:
            jax.distributed.shutdown()  # together: the service's host leaves last
    except BaseException:  # noqa: BLE001 - reported on stderr, the status says it failed
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
