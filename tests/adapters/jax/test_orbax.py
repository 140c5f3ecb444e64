"""import_orbax / export_orbax against the real orbax-checkpoint package (no mocks): Orbax
writes, pitstop imports, pitstop exports, Orbax restores; every array is compared bit for
bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pitstop
from pitstop.interop.orbax import import_orbax
from pitstop.interop.orbax_export import export_orbax

ocp = pytest.importorskip("orbax.checkpoint")

ROOT = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------- helpers
def bits(a: Any) -> np.ndarray:
    """The bytes of an array, to compare NaN payloads, -0.0 and bfloat16 exactly."""
    return np.frombuffer(np.ascontiguousarray(np.asarray(a)).tobytes(), np.uint8)


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Same structure, same container and scalar types, arrays equal bit for bit."""
    where = path or "<root>"
    if isinstance(want, (np.ndarray, jax.Array)):
        assert isinstance(got, np.ndarray), (where, type(got))
        want = np.asarray(want)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=where)
    elif isinstance(want, dict):
        assert isinstance(got, dict), (where, type(got))
        assert list(got) == list(want) or set(got) == set(want), (where, list(got), list(want))
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}/{i}")
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def load(directory: Path, step: int | None = None) -> tuple[list[int], Any]:
    with pitstop.CheckpointManager(directory, read_only=True, save_on_signals=None) as mgr:
        return mgr.all_steps(), mgr.load(step)


def steps_of(directory: Path) -> list[int]:
    with pitstop.CheckpointManager(directory, read_only=True, save_on_signals=None) as mgr:
        return mgr.all_steps()


def orbax_save(directory: Path, steps: dict[int, Any], **options: Any) -> None:
    """One Orbax CheckpointManager save per step (``args`` or a tree for StandardSave)."""
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False, **options)) as mgr:
        for step, args in steps.items():
            metrics = None
            if isinstance(args, tuple):
                args, metrics = args
            if not isinstance(args, ocp.args.CheckpointArgs):
                args = ocp.args.StandardSave(args)
            assert mgr.save(step, args=args, metrics=metrics)
        mgr.wait_until_finished()


def special_f32() -> np.ndarray:
    """float32 values whose bits a lossy path would change: -0.0, a NaN with a payload, inf,
    the smallest subnormal."""
    a = np.array([0.0, -0.0, np.inf, 1.5, 0.0, 1e-45], np.float32)
    a.view(np.uint32)[4] = 0x7FC0_1234
    return a


def to_host(tree: Any) -> Any:
    """jax.Arrays as numpy arrays; everything else as it is."""
    return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, tree)


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))


# ----------------------------------------------------------------------------- import
def test_manager_steps_only_those_orbax_kept(tmp_path: Path) -> None:
    def tree(s: int) -> dict[str, Any]:
        return {"w": np.arange(6, dtype=np.float32).reshape(2, 3) + s, "step": s}

    orbax_save(tmp_path / "latest", {s: tree(s) for s in range(5)}, max_to_keep=2)
    assert import_orbax(tmp_path / "latest", tmp_path / "p1") == [3, 4]
    with pitstop.CheckpointManager(tmp_path / "p1", read_only=True) as mgr:
        assert mgr.all_steps() == [3, 4]
        for s in (3, 4):
            assert_same(mgr.load(s), tree(s))
            assert mgr.metadata(s).metrics == {}

    # kept by metric: Orbax saves the metrics (and pitstop imports them) with a best_fn
    loss = [0.5, 0.1, 0.4, 0.2, 0.3]
    orbax_save(tmp_path / "best", {s: (tree(s), {"loss": loss[s], "tag": "x"})
                                   for s in range(5)},
               max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(tmp_path / "best") as mgr:
        kept = mgr.all_steps()
    assert kept == [1, 3]
    assert import_orbax(tmp_path / "best", tmp_path / "p2") == kept
    with pitstop.CheckpointManager(tmp_path / "p2", read_only=True) as mgr:
        assert mgr.all_steps() == kept
        for s in kept:
            assert_same(mgr.load(s), tree(s))  # the metrics item is not part of the state
            assert mgr.metadata(s).metrics == {"loss": loss[s], "tag": "x"}


def test_dtypes_nesting_and_scalars(tmp_path: Path) -> None:
    bf16 = np.array([1.5, -0.0, np.nan, 3.0e38], ml_dtypes.bfloat16)
    tree = {
        "params": {"dense": {"kernel": jnp.asarray(special_f32()), "bias": jnp.asarray(bf16)},
                   "emb": [np.arange(4, dtype=np.int32) - 2,
                           np.array([0, 2**32 - 1], np.uint32)]},
        "opt": ({"count": jnp.array(3, jnp.int32)}, None),  # a tuple, and an empty node
        "scalars": {"i": 7, "f": 0.25, "b": True, "np_f32": np.float32(2.5),
                    "zero_d": np.array(-1, np.int32)},
        "empty": {},
    }
    orbax_save(tmp_path / "ox", {10: tree})
    assert import_orbax(tmp_path / "ox", tmp_path / "ps") == [10]
    _, got = load(tmp_path / "ps", 10)
    want = {  # what Orbax's metadata gives: tuples as lists, numpy scalars as 0-d arrays
        "params": {"dense": {"kernel": special_f32(), "bias": bf16},
                   "emb": [np.arange(4, dtype=np.int32) - 2,
                           np.array([0, 2**32 - 1], np.uint32)]},
        "opt": [{"count": np.array(3, np.int32)}, None],
        "scalars": {"i": 7, "f": 0.25, "b": True, "np_f32": np.array(2.5, np.float32),
                    "zero_d": np.array(-1, np.int32)},
        "empty": {},
    }
    assert_same(got, want)


def test_composite_items(tmp_path: Path) -> None:
    state = {"w": np.ones((2, 2), np.float32), "n": 3, "pair": (np.zeros(1), np.ones(1))}
    orbax_save(tmp_path / "ox", {4: ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        extra=ocp.args.JsonSave({"epoch": 2, "name": "run-1", "lrs": [0.1, 0.01]}),
        tokens=ocp.args.PyTreeSave({"vocab": "abc", "ids": np.arange(3)}))})
    assert import_orbax(tmp_path / "ox", tmp_path / "all") == [4]
    assert_same(load(tmp_path / "all")[1], {
        "state": dict(state, pair=list(state["pair"])),  # Orbax keeps no tuples
        "extra": {"epoch": 2, "name": "run-1", "lrs": [0.1, 0.01]},
        "tokens": {"vocab": "abc", "ids": np.arange(3)}})
    # items= picks some; one item is imported under its name (only "default" is unwrapped);
    # a target per item gives its structure back
    assert import_orbax(tmp_path / "ox", tmp_path / "one", items=["state"],
                        target={"state": state}) == [4]
    assert_same(load(tmp_path / "one")[1], {"state": state})
    with pytest.raises(pitstop.InvalidArgumentError, match="'nope'.*'extra', 'state', 'tokens'"):
        import_orbax(tmp_path / "ox", tmp_path / "two", target={"nope": state})


def test_target_gives_the_structure_of_a_live_state(tmp_path: Path) -> None:
    """Orbax stores an optax state's namedtuples as dicts and its tuples as lists; with the
    live state as target the import saves what a live pitstop save would, so it restores
    into a Flax TrainState, optimizer state and typed key."""
    optax = pytest.importorskip("optax")
    nn = pytest.importorskip("flax.linen")
    train_state = pytest.importorskip("flax.training.train_state")

    model = nn.Dense(3)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def fresh(seed: int) -> dict[str, Any]:
        params = model.init(jax.random.key(seed), jnp.ones((1, 4)))
        return {"ts": train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx),
                "key": jax.random.key(seed), "epoch": 0}

    saved = fresh(0)
    saved["ts"] = saved["ts"].apply_gradients(
        grads=jax.tree.map(jnp.ones_like, saved["ts"].params))
    saved["epoch"] = 2
    orbax_save(tmp_path / "ox", {1: saved})

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                            if isinstance(a, jax.Array) else a, fresh(1))
    assert import_orbax(tmp_path / "ox", tmp_path / "ps", target=abstract) == [1]
    live = fresh(1)
    with pitstop.CheckpointManager(tmp_path / "ps", read_only=True) as mgr:
        assert mgr.restore(live) == 1
    assert type(live["ts"]) is type(saved["ts"]) and live["epoch"] == 2
    assert jax.random.key_impl(live["key"]) == jax.random.key_impl(saved["key"])

    def host(tree: Any) -> list[np.ndarray]:
        return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(tree)
            if hasattr(x, "dtype")]

    for got, want in zip(host(live), host(saved), strict=True):
        assert_same(got, want)

    bad = dict(abstract, extra=jax.ShapeDtypeStruct((2,), jnp.float32))
    with pytest.raises(pitstop.IncompatibleTargetError, match="not in the checkpoint: 'extra'"):
        import_orbax(tmp_path / "ox", tmp_path / "p2", target=bad)


def test_composite_item_pitstop_cannot_import_is_named(tmp_path: Path) -> None:
    orbax_save(tmp_path / "ox", {1: ocp.args.Composite(
        state=ocp.args.StandardSave({"w": np.zeros(2)}),
        arr=ocp.args.ArraySave(np.arange(3)))})
    with pytest.raises(pitstop.UnsupportedStateError, match=r"'arr'.*items=\[\.\.\.\].*'state'"):
        import_orbax(tmp_path / "ox", tmp_path / "ps")
    assert not (tmp_path / "ps").exists() or steps_of(tmp_path / "ps") == []
    assert import_orbax(tmp_path / "ox", tmp_path / "ps", items=["state"]) == [1]
    with pytest.raises(pitstop.CheckpointNotFoundError, match="'nope'.*'arr', 'state'"):
        import_orbax(tmp_path / "ox", tmp_path / "other", items=["nope"])


def test_standard_checkpointer_single_directory(tmp_path: Path) -> None:
    tree = {"a": np.arange(3, dtype=np.int32), "b": {"c": 1.5}}
    ckptr = ocp.StandardCheckpointer()
    for name in ("12", "final"):
        ckptr.save(tmp_path / "ox" / name, tree)
    ckptr.wait_until_finished()
    ckptr.close()
    assert import_orbax(tmp_path / "ox" / "12", tmp_path / "p1") == [12]  # the name's step
    assert_same(load(tmp_path / "p1", 12)[1], tree)
    assert import_orbax(tmp_path / "ox" / "final", tmp_path / "p2") == [0]
    assert import_orbax(tmp_path / "ox" / "final", tmp_path / "p2", step=5) == [5]
    assert load(tmp_path / "p2")[0] == [0, 5]
    assert_same(load(tmp_path / "p2", 5)[1], tree)


def test_one_step_directory_of_a_manager(tmp_path: Path) -> None:
    orbax_save(tmp_path / "ox", {3: {"x": np.ones(2)}, 4: {"x": np.zeros(2)}})
    assert import_orbax(tmp_path / "ox" / "3", tmp_path / "ps") == [3]
    assert import_orbax(tmp_path / "ox", tmp_path / "ps", step=4) == [4]
    assert_same(load(tmp_path / "ps", 3)[1], {"x": np.ones(2)})
    assert_same(load(tmp_path / "ps", 4)[1], {"x": np.zeros(2)})


def test_sharded_array_comes_back_global(tmp_path: Path) -> None:
    host = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) * np.float32(0.5)
    x = jax.device_put(host, NamedSharding(mesh(), P("x", "y")))
    assert len(x.sharding.device_set) == 8
    ids = jax.device_put(np.arange(16, dtype=np.uint32) * 3, NamedSharding(mesh(), P("x")))
    orbax_save(tmp_path / "ox", {2: {"x": x, "ids": ids}})
    assert import_orbax(tmp_path / "ox", tmp_path / "ps") == [2]
    _, got = load(tmp_path / "ps", 2)
    assert_same(got, {"x": host, "ids": np.arange(16, dtype=np.uint32) * 3})


def test_typed_prng_keys(tmp_path: Path) -> None:
    """Typed keys come in as the JAX adapter saves them, and restore into a live typed key;
    a raw uint32 PRNGKey stays an array. Exported back, Orbax restores typed keys."""
    key = jax.random.key(42)
    rbg = jax.random.split(jax.random.key(7, impl="rbg"), 3)
    raw = jax.random.PRNGKey(5)
    orbax_save(tmp_path / "ox", {1: {"key": key, "rbg": rbg, "raw": raw}})
    assert import_orbax(tmp_path / "ox", tmp_path / "ps") == [1]
    _, got = load(tmp_path / "ps", 1)
    assert_same(got, {
        "key": {"key_data": np.asarray(jax.random.key_data(key)), "impl": "threefry2x32"},
        "rbg": {"key_data": np.asarray(jax.random.key_data(rbg)), "impl": "rbg"},
        "raw": np.asarray(raw)})

    live = {"key": jax.random.key(0), "rbg": jax.random.split(jax.random.key(0, impl="rbg"), 3),
            "raw": jax.random.PRNGKey(0)}
    with pitstop.CheckpointManager(tmp_path / "ps", read_only=True) as mgr:
        assert mgr.restore(live) == 1
    assert jax.random.key_impl(live["rbg"]) == jax.random.key_impl(rbg)
    for name in ("key", "rbg"):
        assert_same(np.asarray(jax.random.key_data(live[name])),
                    np.asarray(jax.random.key_data({"key": key, "rbg": rbg}[name])))

    path = export_orbax(tmp_path / "ps", 1, tmp_path / "back")
    back = ocp.StandardCheckpointer().restore(path)
    for name, want in (("key", key), ("rbg", rbg)):
        assert jax.dtypes.issubdtype(back[name].dtype, jax.dtypes.prng_key), name
        assert jax.random.key_impl(back[name]) == jax.random.key_impl(want)
        assert_same(np.asarray(jax.random.key_data(back[name])),
                    np.asarray(jax.random.key_data(want)))
    assert_same(to_host(back["raw"]), np.asarray(raw))


def test_sharded_checkpoint_imports_on_one_device(tmp_path: Path) -> None:
    """A run on 8 devices, migrated on a machine with one: no device mesh is needed."""
    host = np.arange(64, dtype=np.int32).reshape(8, 8)
    x = jax.device_put(host, NamedSharding(mesh(), P("x", "y")))
    orbax_save(tmp_path / "ox", {1: {"x": x}})
    script = textwrap.dedent(f"""
        import jax
        from pitstop.interop.orbax import import_orbax
        assert jax.device_count() == 1, jax.devices()
        print(import_orbax({str(tmp_path / "ox")!r}, {str(tmp_path / "ps")!r}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[1]"
    assert_same(load(tmp_path / "ps", 1)[1], {"x": host})


def test_uncommitted_orbax_step_is_skipped(tmp_path: Path) -> None:
    orbax_save(tmp_path / "ox", {1: {"v": np.ones(1)}, 2: {"v": np.ones(1) * 2},
                                 3: {"v": np.ones(1) * 3}})
    # A crash before Orbax's final rename leaves the step under its temporary name: make
    # one from a complete step, the name taken from Orbax's own atomic-rename path.
    final = ocp.path.step.find_step_path(tmp_path / "ox", ocp.path.step.standard_name_format(),
                                         step=3)
    tmp = ocp.path.atomicity.AtomicRenameTemporaryPath.from_final(final).get()
    assert tmp.name.startswith("3.orbax-checkpoint-tmp")
    os.rename(final, tmp)
    with ocp.CheckpointManager(tmp_path / "ox") as mgr:
        assert mgr.all_steps() == [1, 2]  # what Orbax itself counts as committed
    assert import_orbax(tmp_path / "ox", tmp_path / "ps") == [1, 2]
    assert load(tmp_path / "ps")[0] == [1, 2]

    only_tmp = tmp_path / "only"
    only_tmp.mkdir()
    os.rename(tmp, only_tmp / tmp.name)
    with pytest.raises(pitstop.CheckpointNotFoundError,
                       match=r"no committed Orbax checkpoint.*3\.orbax-checkpoint-tmp"):
        import_orbax(only_tmp, tmp_path / "p2")
    with pytest.raises(pitstop.CheckpointNotFoundError, match="never finalized"):
        import_orbax(only_tmp / tmp.name, tmp_path / "p2")  # the tmp directory itself


def test_import_leaves_the_orbax_directory_as_it_was(tmp_path: Path) -> None:
    def listing(root: Path) -> dict[str, tuple[int, int]]:
        return {os.fspath(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
                for p in sorted(root.rglob("*"))}

    orbax_save(tmp_path / "ox", {1: {"v": np.ones(3)}, 2: {"v": np.zeros(3)}})
    (tmp_path / "ox" / "3.orbax-checkpoint-tmp").mkdir()  # Orbax would clean it up if asked
    before = listing(tmp_path / "ox")
    assert import_orbax(tmp_path / "ox", tmp_path / "ps") == [1, 2]
    assert listing(tmp_path / "ox") == before


def test_orbax_step_naming_options(tmp_path: Path) -> None:
    options = dict(step_prefix="ckpt", step_format_fixed_length=6)
    orbax_save(tmp_path / "ox", {5: {"v": np.arange(2)}, 120: {"v": np.arange(3)}}, **options)
    assert sorted(p.name for p in (tmp_path / "ox").iterdir()) == ["ckpt_000005", "ckpt_000120"]
    with pytest.raises(pitstop.CheckpointNotFoundError, match="orbax_options="):
        import_orbax(tmp_path / "ox", tmp_path / "ps")
    assert import_orbax(tmp_path / "ox", tmp_path / "ps",
                        orbax_options=ocp.CheckpointManagerOptions(**options)) == [5, 120]
    assert_same(load(tmp_path / "ps", 120)[1], {"v": np.arange(3)})


def test_import_refusals(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(pitstop.CheckpointNotFoundError, match="no committed Orbax checkpoint"):
        import_orbax(tmp_path / "empty", tmp_path / "ps")
    with pytest.raises(pitstop.CheckpointNotFoundError, match="not a directory"):
        import_orbax(tmp_path / "missing", tmp_path / "ps")
    assert not (tmp_path / "missing").exists()

    orbax_save(tmp_path / "ox", {1: {"v": np.ones(2)}, 2: {"v": np.zeros(2)}})
    with pitstop.CheckpointManager(tmp_path / "ps", async_save=False, save_on_signals=None,
                                   memory_tier=False) as mgr:
        mgr.save(2, {"mine": np.arange(3)}).wait()
    with pytest.raises(pitstop.StepExistsError, match=r"already has a checkpoint of step 2\b"):
        import_orbax(tmp_path / "ox", tmp_path / "ps")
    steps, mine = load(tmp_path / "ps")
    assert steps == [2]  # checked before anything was written
    assert_same(mine, {"mine": np.arange(3)})
    assert import_orbax(tmp_path / "ox", tmp_path / "ps", step=1) == [1]
    with pytest.raises(pitstop.CheckpointNotFoundError, match=r"step 7 \(have: \[1, 2\]\)"):
        import_orbax(tmp_path / "ox", tmp_path / "ps", step=7)
    with pytest.raises(pitstop.InvalidArgumentError, match="keep_last"):
        import_orbax(tmp_path / "ox", tmp_path / "p3", keep_last=1)


def test_unreadable_orbax_step_is_a_checkpoint_error(tmp_path: Path) -> None:
    orbax_save(tmp_path / "ox", {5: {"v": np.arange(1000, dtype=np.float32)}})
    for f in (tmp_path / "ox" / "5" / "default").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data Orbax (tensorstore) wrote
            f.write_bytes(b"")
    with pytest.raises(pitstop.CheckpointError, match=r"ox/5.*step 5.*Orbax raised") as info:
        import_orbax(tmp_path / "ox", tmp_path / "ps")
    assert type(info.value) is pitstop.CheckpointError
    assert info.value.__cause__ is not None


# ----------------------------------------------------------------------------- export
def pitstop_state() -> dict[str, Any]:
    return {
        "params": {"w": special_f32().reshape(2, 3),
                   "b": np.array([1.5, -0.0, np.nan], ml_dtypes.bfloat16),
                   "emb": [np.arange(4, dtype=np.int32), np.array([7, 2**32 - 1], np.uint32)]},
        "opt": ({"count": np.array(3, np.int32)}, None),
        "layers": {0: np.ones(2, np.float16)},
        "step": 7, "lr": 0.5, "flag": True, "scale": np.float32(2.5), "empty": {},
    }


#: what Orbax gives back without a target: tuples as lists, int keys as strings, numpy
#: scalars as 0-d arrays
RESTORED = {
    "params": {"w": special_f32().reshape(2, 3),
               "b": np.array([1.5, -0.0, np.nan], ml_dtypes.bfloat16),
               "emb": [np.arange(4, dtype=np.int32), np.array([7, 2**32 - 1], np.uint32)]},
    "opt": [{"count": np.array(3, np.int32)}, None],
    "layers": {"0": np.ones(2, np.float16)},
    "step": 7, "lr": 0.5, "flag": True, "scale": np.array(2.5, np.float32), "empty": {},
}


def save_pitstop(directory: Path, steps: dict[int, Any]) -> None:
    with pitstop.CheckpointManager(directory, async_save=False, save_on_signals=None,
                                   memory_tier=False) as mgr:
        for step, state in steps.items():
            mgr.save(step, state).wait()


def test_export_restores_with_both_orbax_apis(tmp_path: Path) -> None:
    save_pitstop(tmp_path / "ps", {3: {"old": np.zeros(1)}, 9: pitstop_state()})
    path = export_orbax(tmp_path / "ps", None, tmp_path / "ox")  # None: the newest step
    assert Path(path) == tmp_path / "ox" / "9" / "default"

    ckptr = ocp.StandardCheckpointer()
    assert_same(ckptr.restore(path), RESTORED)
    ckptr.close()

    with ocp.CheckpointManager(tmp_path / "ox") as mgr:
        assert mgr.all_steps() == [9]
        assert_same(mgr.restore(9, args=ocp.args.StandardRestore()), RESTORED)
        # into device arrays with a target: a sharded one too
        sharding = NamedSharding(mesh(), P("x"))
        target = dict(RESTORED, params=dict(
            RESTORED["params"],
            w=jax.ShapeDtypeStruct((2, 3), np.float32,
                                   sharding=NamedSharding(mesh(), P(None, None))),
            emb=[jax.ShapeDtypeStruct((4,), np.int32, sharding=sharding),
                 RESTORED["params"]["emb"][1]]))
        restored = mgr.restore(9, args=ocp.args.StandardRestore(target))
    assert isinstance(restored["params"]["emb"][0], jax.Array)
    assert restored["params"]["emb"][0].sharding == sharding
    assert_same(to_host(restored), RESTORED)

    # an older step into the same directory (Orbax's save policy would skip it)
    assert export_orbax(tmp_path / "ps", 3, tmp_path / "ox") == os.fspath(
        tmp_path / "ox" / "3" / "default")
    with ocp.CheckpointManager(tmp_path / "ox") as mgr:
        assert mgr.all_steps() == [3, 9]


def test_round_trip_orbax_pitstop_orbax(tmp_path: Path) -> None:
    sharding = NamedSharding(mesh(), P("x", "y"))
    original = {
        "params": {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) / 3,
                                       sharding),
                   "b": jnp.asarray(np.array([1, -0.0, np.inf, np.nan], ml_dtypes.bfloat16))},
        "opt_state": [{"count": jnp.array(5, jnp.int32),
                       "mu": {"w": jnp.full((8, 8), -1.25, jnp.float32)}}, None],
        "step": 41,
    }
    orbax_save(tmp_path / "ox1", {41: original})
    assert import_orbax(tmp_path / "ox1", tmp_path / "ps") == [41]
    path = export_orbax(tmp_path / "ps", 41, tmp_path / "ox2")

    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        if isinstance(a, jax.Array) else a, original)
    with ocp.CheckpointManager(tmp_path / "ox2") as mgr:
        back = mgr.restore(41, args=ocp.args.StandardRestore(abstract))
    assert back["params"]["w"].sharding == sharding
    assert_same(to_host(back), to_host(original))
    assert_same(ocp.StandardCheckpointer().restore(path)["step"], 41)


def test_export_refusals_name_the_key(tmp_path: Path) -> None:
    save_pitstop(tmp_path / "ps", {1: {"params": {"w": np.ones(2)}, "meta": {"name": "run"}},
                                   2: {"big": 2**70},
                                   3: {"w": np.ones(2)},
                                   4: {"u4": np.arange(3).astype(ml_dtypes.uint4)}})
    with pytest.raises(pitstop.UnsupportedStateError, match=r"'meta/name'.*str.*key="):
        export_orbax(tmp_path / "ps", 1, tmp_path / "ox")
    assert not (tmp_path / "ox").exists()
    path = export_orbax(tmp_path / "ps", 1, tmp_path / "ox", key="params")
    assert_same(ocp.StandardCheckpointer().restore(path), {"w": np.ones(2)})
    with pytest.raises(pitstop.CheckpointNotFoundError, match=r"'nope'.*'meta', 'params'"):
        export_orbax(tmp_path / "ps", 1, tmp_path / "ox", key="nope")
    with pytest.raises(pitstop.UnsupportedStateError, match=r"'big'.*64 bits"):
        export_orbax(tmp_path / "ps", 2, tmp_path / "ox")
    with pytest.raises(pitstop.UnsupportedStateError, match=r"'u4'.*dtype uint4"):
        export_orbax(tmp_path / "ps", 4, tmp_path / "ox")
    assert sorted(p.name for p in (tmp_path / "ox").iterdir() if p.name[0].isdigit()) == ["1"]
    with pytest.raises(pitstop.StepExistsError, match="already has an Orbax checkpoint of step 1"):
        export_orbax(tmp_path / "ps", 1, tmp_path / "ox", key="params")
    with pytest.raises(pitstop.InvalidArgumentError, match="is itself an Orbax checkpoint"):
        export_orbax(tmp_path / "ps", 3, path)
    with pytest.raises(pitstop.CheckpointNotFoundError, match="step 8"):
        export_orbax(tmp_path / "ps", 8, tmp_path / "ox")
    (tmp_path / "none").mkdir()
    with pytest.raises(pitstop.CheckpointNotFoundError, match="no checkpoint"):
        export_orbax(tmp_path / "none", None, tmp_path / "ox")
    assert json.loads((Path(path).parent / "_CHECKPOINT_METADATA").read_text())["item_handlers"]


# ------------------------------------------------------ a save while the previous persists
class _Held:
    """Holds each persist (Orbax's finalize, pitstop's write) until the loop has entered its
    next save step; ``None`` releases all from then on."""

    def __init__(self) -> None:
        import threading
        self.cond = threading.Condition()
        self.released: set[int] = set()
        self.all = False

    def wait(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.all or n in self.released, 60), n

    def release(self, n: int | None) -> None:
        with self.cond:
            if n is None:
                self.all = True
            else:
                self.released.add(n)
            self.cond.notify_all()


def test_a_save_due_while_the_previous_persists_keeps_orbax_steps(tmp_path: Path) -> None:
    """The issue's loop: 25 steps, a save every 5, max_to_keep=2, every persist slower than
    a save interval (held until the loop enters the next save step). Orbax's save() waits
    for the one in flight and keeps [15, 20]; pitstop with on_busy="wait" (the migration
    guide's row) keeps the same, with nothing skipped."""
    tree = lambda s: {"w": np.full(4, s, np.float32)}  # noqa: E731
    held_o = _Held()
    finalized: list[int] = []

    def finalize() -> None:  # Orbax's background thread, before the step is committed
        n = len(finalized)
        finalized.append(n)
        held_o.wait(n)

    with ocp.CheckpointManager(tmp_path / "ox", options=ocp.CheckpointManagerOptions(
            max_to_keep=2, save_interval_steps=5, async_options=ocp.AsyncOptions(
                post_finalization_callback=finalize))) as omgr:
        for s in range(25):
            if s % 5 == 0 and s:
                held_o.release(s // 5 - 1)  # entering the next save: the previous may end
            omgr.save(s, args=ocp.args.StandardSave(tree(s)))
        held_o.release(None)
        omgr.wait_until_finished()
        orbax_kept = omgr.all_steps()

    held_p = _Held()
    with pitstop.CheckpointManager(tmp_path / "ps", keep_last=2, save_every_steps=5,
                                   on_busy="wait", save_on_signals=None,
                                   memory_tier=False) as mgr:
        mgr.hooks["before_write"] = lambda step: held_p.wait(step)
        for s in range(25):
            if s % 5 == 0 and s:
                held_p.release(s - 5)
            mgr.step(s, tree(s))
        held_p.release(None)
        mgr.wait()
        pitstop_kept = mgr.all_steps()
        assert mgr.skipped_saves == 0
    assert finalized == [0, 1, 2, 3, 4]  # each of Orbax's five saves was held
    assert list(orbax_kept) == [15, 20]
    assert pitstop_kept == list(orbax_kept)
