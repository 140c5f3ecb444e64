"""Round trips, bit for bit: every dtype and layout pitstop supports, numpy scalars, nested
containers and JSON values, through ``restore`` (in place, same objects) and ``load``; with
compression and sha256 too. Plus what must be refused (object arrays, sets) and the error API
of a target that does not match (IncompatibleTargetError, strict=False)."""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np
import pytest

import pitstop
from pitstop.core.format.dtypes import ML_DTYPES

CONFIGS = {
    "plain": {},
    "zstd": {"compression": "zstd"},
    "zstd+shuffle": {"compression": "zstd+shuffle"},
    "sha256": {"hash_algorithm": "sha256"},
    "zstd+shuffle+sha256": {"compression": "zstd+shuffle", "hash_algorithm": "sha256"},
}


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(directory, **kw)


# --------------------------------------------------------------------------- content
def random_array(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    """Random content that uses every bit of the dtype (NaN payloads, NaT, padding)."""
    dtype = np.dtype(dtype)
    n = math.prod(shape)
    if dtype == np.bool_:
        return (rng.random(shape) > 0.5)
    if dtype.kind == "U":
        alphabet = list("aZ09 /~é漢🙂\u0000")
        width = dtype.itemsize // 4
        words = ["".join(rng.choice(alphabet, rng.integers(0, width + 1))).rstrip("\u0000")
                 for _ in range(n)]
        return np.array(words, dtype).reshape(shape)
    raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)
    if dtype.names is None:
        return raw.copy()
    # padding between fields is not data (numpy copies field by field): keep it zero
    out = np.zeros(shape, dtype)
    for name in dtype.names:
        out[name] = raw[name]
    return out


def fill(arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Overwrite ``arr`` in place (any layout) with new random content; returns it."""
    arr[...] = random_array(rng, arr.dtype, arr.shape)
    return arr


NUMPY_DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8",
                np.longdouble, "c8", "c16", np.clongdouble, "U7", "S5", "V3",
                "M8[Y]", "M8[D]", "M8[s]", "M8[ms]", "M8[ns]", "m8[h]", "m8[us]", "m8[ps]"]
NESTED = np.dtype([("id", "<i4"),
                   ("pos", [("x", ">f8"), ("y", "<f4"), ("tag", "U3")]),
                   ("m", "<i2", (2, 3)),
                   ("when", "M8[ms]"),
                   ("raw", "S4")])
PADDED = np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"], "offsets": [0, 8],
                   "itemsize": 24})


def make_arrays(seed: int) -> dict[str, np.ndarray]:
    """Every supported dtype and layout; the same layouts (strides, order, byte order) for
    any seed, different content."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for dt in NUMPY_DTYPES:
        out[f"dt/{np.dtype(dt).str}"] = random_array(rng, dt, (3, 5))
    for name, dt in ML_DTYPES.items():
        out[f"ml/{name}"] = random_array(rng, dt, (4, 9))
    out["struct/flat"] = random_array(rng, [("a", "<u2"), ("b", "<f4")], (6,))
    out["struct/nested_subarray"] = random_array(rng, NESTED, (2, 3))
    out["struct/padded"] = random_array(rng, PADDED, (5,))
    out["struct/record"] = random_array(rng, NESTED, (4,)).view(np.recarray)
    for dt in (">i2", ">i8", ">f4", ">f8", ">c16", ">U4", ">M8[us]"):
        out[f"bigendian/{dt}"] = random_array(rng, dt, (3, 4))
    out["bigendian/struct"] = random_array(rng, [("a", ">i4"), ("b", ">f8")], (5,))
    out["shape/0d"] = random_array(rng, "f8", ())
    out["shape/0d_int4"] = random_array(rng, ML_DTYPES.get("int4", "i1"), ())
    out["shape/empty"] = np.zeros((0,), "f4")
    out["shape/empty_2d"] = np.zeros((3, 0, 2), "i8")
    out["shape/empty_str"] = np.zeros((0, 4), "U3")
    out["shape/5d"] = random_array(rng, "i2", (2, 1, 3, 1, 2))
    out["shape/large"] = random_array(rng, "f4", (1 << 19,))  # 2 MiB: own data file region
    base = random_array(rng, "f8", (10, 12))
    out["layout/strided"] = base[::3, 1::4]
    out["layout/negative_stride"] = random_array(rng, "i4", (7, 5))[::-2, ::-1]
    out["layout/transpose"] = random_array(rng, "c8", (4, 6)).T
    out["layout/fortran"] = np.asfortranarray(random_array(rng, "u2", (5, 3, 2)))
    out["layout/bf16_transpose"] = random_array(rng, ml_dtypes.bfloat16, (3, 8)).T
    out["layout/struct_strided"] = random_array(rng, NESTED, (6,))[::2]
    out["layout/bigendian_fortran"] = np.asfortranarray(random_array(rng, ">f4", (4, 3)))
    return out


def make_scalars(seed: int) -> dict[str, np.generic]:
    rng = np.random.default_rng(seed + 1000)
    vals = {
        "f32": np.float32(rng.standard_normal()), "f16": np.float16(rng.standard_normal()),
        "i64": np.int64(rng.integers(-2**62, 2**62)), "u8": np.uint8(rng.integers(0, 255)),
        "bool": np.bool_(seed % 2 == 0), "c128": np.complex128(rng.standard_normal() + 1j),
        "longdouble": np.longdouble(rng.standard_normal()),
        "datetime": np.datetime64(int(rng.integers(0, 2**40)), "ms"),
        "timedelta": np.timedelta64(int(rng.integers(0, 2**40)), "ns"),
        "str": np.str_(f"π/{seed}~"), "bytes": np.bytes_(b"\x01\x02" * (seed + 1)),
        "nan": np.float64(np.nan),
    }
    for name, dt in ML_DTYPES.items():
        vals[f"ml_{name}"] = random_array(rng, dt, ())[()]
    return vals


def make_values(seed: int) -> dict:
    return {
        "epoch": seed, "lr": 0.1 * (seed + 1), "neg_zero": -0.0, "flag": bool(seed % 2),
        "none": None, "big": 2**200 + seed, "neg_big": -(2**70) - seed,
        "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"),
        "bytes": bytes(range(256)) + bytes([seed]),
        "int_keys": {1: "one", 2: [seed, 2], -3: {4: "four"}},
        "mixed_keys": {1: "int", "1": "str", None: "none", False: "bool", 2.5: "float"},
        "tuple": (seed, "x", (2.5, None), [(), ()]),
        "keys": {"a/b": 1, "c~d": 2, "~1": 3, "~0/": 4, "$float": "not a tag", "$d": 5,
                 "ünï/cødé~": seed},
        "empty": {}, "empty_list": [], "empty_tuple": (),
        "text": "line\nbreak \u2028 \ud7ff 🙂 " * 3,
    }


def make_state(seed: int) -> dict:
    arrays = make_arrays(seed)
    scalars = make_scalars(seed)
    rng = np.random.default_rng(seed + 7)
    return {
        "arrays": arrays,
        "scalars": scalars,
        "values": make_values(seed),
        "nested": {
            "layers": [{"w": random_array(rng, "f4", (4, 4)), "b": random_array(rng, "f4", (4,)),
                        "meta": {"name": f"layer{i}", "frozen": i == 0}} for i in range(3)],
            "opt": (random_array(rng, "f8", (5,)), {"m": random_array(rng, "f8", (5,))}),
            "mixed": [random_array(rng, "i4", (2,)), seed, "text", None, np.int16(seed)],
            7: random_array(rng, "u1", (3,)),
            "a/b": random_array(rng, "i2", (2,)),
            "a~1b": random_array(rng, "i2", (2,)),
            "~": {"/": random_array(rng, "i2", (2,)), "": random_array(rng, "i2", (1,))},
            "ünï/cødé~key": random_array(rng, "f2", (3,)),
            "const_in_tuple": (random_array(rng, "f4", (2,)), "fixed", np.float32(1.5)),
        },
    }


def blank_like(state):
    """A target with the same structure, dtypes and memory layouts but other content."""
    target = make_state(99)
    # what sits in tuples cannot change in place: those constants must be the same
    target["nested"]["const_in_tuple"] = (target["nested"]["const_in_tuple"][0], "fixed",
                                          np.float32(1.5))
    return target


# --------------------------------------------------------------------------- comparison
def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_value(got, want, path="") -> None:
    """Equal, type for type, NaN for NaN (JSON values and numpy scalars)."""
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), path
        for k in want:
            assert_same_value(got[k], want[k], f"{path}/{k!r}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_value(g, w, f"{path}/{i}")
    elif isinstance(want, np.ndarray):
        assert same_bits(got, want), path
    elif isinstance(want, np.generic):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), f"{path}: {got!r} {want!r}"
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path
    elif isinstance(want, float):
        assert math.copysign(1, got) == math.copysign(1, want) and got == want, path
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def walk_arrays(tree, path=""):
    if isinstance(tree, np.ndarray):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from walk_arrays(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from walk_arrays(v, f"{path}/{i}")


def snapshot_bytes(state) -> dict[str, tuple[np.dtype, tuple, bytes]]:
    return {p: (a.dtype, a.shape, a.tobytes()) for p, a in walk_arrays(state)}


# --------------------------------------------------------------------------- tests
def test_cases_cover_every_ml_dtype_pitstop_knows():
    arrays = make_arrays(0)
    assert {k.removeprefix("ml/") for k in arrays if k.startswith("ml/")} == set(ML_DTYPES)
    assert len(ML_DTYPES) >= 10  # bfloat16, the float8 family, int4, ...
    assert arrays["layout/strided"].flags.c_contiguous is False
    assert arrays["layout/fortran"].flags.f_contiguous and not arrays["layout/fortran"].flags.c_contiguous
    assert arrays["bigendian/>f8"].dtype.byteorder == ">"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_restore_in_place_and_load_are_bit_exact(tmp_path, config):
    kw = CONFIGS[config]
    state = make_state(1)
    expected = snapshot_bytes(state)
    with open_mgr(tmp_path / "ck", **kw) as mgr:
        mgr.save(5, state).result(timeout=60)
        # the save is a snapshot: mutating the state afterwards must not change it
        for _, a in walk_arrays(state):
            if a.size:
                fill(a, np.random.default_rng(3))
    state = None

    with open_mgr(tmp_path / "ck", **kw) as mgr:
        target = blank_like(None)
        ids = {p: id(a) for p, a in walk_arrays(target)}
        containers = [target["arrays"], target["nested"], target["nested"]["layers"],
                      target["nested"]["layers"][1], target["nested"]["opt"],
                      target["nested"]["mixed"], target["scalars"]]
        container_ids = [id(c) for c in containers]
        # make sure the target really differs before the restore
        assert snapshot_bytes(target)["/arrays/shape/large"] != expected["/arrays/shape/large"]

        step = mgr.restore(target)

        assert step == 5 and isinstance(step, int)
        assert step.missing_keys == [] and step.unexpected_keys == [] and step.mismatched_keys == []
        # same objects, new bits
        assert {p: id(a) for p, a in walk_arrays(target)} == ids
        assert [id(c) for c in [target["arrays"], target["nested"], target["nested"]["layers"],
                                target["nested"]["layers"][1], target["nested"]["opt"],
                                target["nested"]["mixed"], target["scalars"]]] == container_ids
        got = snapshot_bytes(target)
        assert got.keys() == expected.keys()
        for p in expected:
            assert got[p] == expected[p], f"{config}: {p} differs after restore"
        # layouts of the live arrays are untouched (still strided / Fortran / big-endian)
        assert target["arrays"]["layout/fortran"].flags.f_contiguous
        assert target["arrays"]["layout/strided"].base is not None
        assert target["arrays"]["bigendian/>f8"].dtype.byteorder == ">"
        assert isinstance(target["arrays"]["struct/record"], np.recarray)
        # numpy scalars (immutable) are replaced in their container, type for type
        assert_same_value(target["scalars"], make_scalars(1), "scalars")
        assert_same_value(target["nested"]["mixed"][4], np.int16(1))
        # JSON values come back equal, type for type
        assert_same_value(target["values"], make_values(1), "values")
        assert_same_value(target["nested"]["layers"][2]["meta"], {"name": "layer2", "frozen": False})

        loaded = mgr.load()
    want = make_state(1)
    # load(): a fresh tree of the same shape; big-endian arrays come back little-endian
    for p, a in walk_arrays(want):
        g = dict(walk_arrays(loaded))[p]
        if a.dtype.byteorder == ">":
            assert g.dtype == a.dtype.newbyteorder("<") and g.tobytes() == a.astype(g.dtype).tobytes(), p
        else:
            assert g.dtype == a.dtype and g.shape == a.shape and g.tobytes() == a.tobytes(), p
        assert g.flags.c_contiguous and g.flags.writeable
    assert type(loaded["nested"]["opt"]) is tuple and type(loaded["nested"]["mixed"]) is list
    assert 7 in loaded["nested"] and "7" not in loaded["nested"]
    assert_same_value(loaded["scalars"], want["scalars"], "scalars")
    assert_same_value(loaded["values"], want["values"], "values")
    assert_same_value(loaded["nested"]["mixed"][1:], want["nested"]["mixed"][1:], "mixed")
    assert_same_value(loaded["nested"]["const_in_tuple"][1:], ("fixed", np.float32(1.5)))


def test_a_single_array_or_a_flat_list_as_the_whole_state(tmp_path):
    arr = random_array(np.random.default_rng(0), "f8", (3, 3))
    with open_mgr(tmp_path / "a") as mgr:
        mgr.save(0, {"only": arr}).result(timeout=30)
        mgr.save(1, [arr, 3, "x"]).result(timeout=30)
        t = {"only": np.zeros((3, 3))}
        assert mgr.restore(t, step=0) == 0 and same_bits(t["only"], arr)
        lst = [np.zeros((3, 3)), 0, ""]
        assert mgr.restore(lst, step=1) == 1 and same_bits(lst[0], arr) and lst[1:] == [3, "x"]
        assert mgr.load(1)[1:] == [3, "x"]


def test_restore_into_a_readonly_or_mismatched_layout_is_refused_cleanly(tmp_path):
    with open_mgr(tmp_path / "a") as mgr:
        mgr.save(0, {"w": np.arange(4.0).reshape(2, 2)}).result(timeout=30)
        ro = np.zeros((2, 2)).T  # non-contiguous, so restore must assign() into it
        ro.flags.writeable = False
        other = np.zeros(3)
        with pytest.raises(pitstop.IncompatibleTargetError, match="read-only") as info:
            mgr.restore({"w": ro})
        assert "w" in str(info.value) and "nothing was changed" in str(info.value)
        assert other.tolist() == [0, 0, 0]


@pytest.mark.parametrize("bad, where", [
    ({"w": np.array([1, "a", None], dtype=object)}, "object"),
    ({"model": {"w": np.zeros(2), "o": np.empty((2, 2), dtype=object)}}, "object"),
    ({"w": np.zeros(2, dtype=[("a", "f4"), ("b", "O")])}, "object"),
    ({"w": np.zeros(2), "seen": {1, 2, 3}}, "set"),
    ({"w": np.zeros(2), "cfg": {"nested": {"tags": frozenset({"a"})}}}, "set"),
    ({"w": np.zeros(2), "cfg": [1, {2, 3}]}, "set"),
    ({"w": np.zeros(2), "obj": object()}, "pickle"),
    ({"w": np.zeros(2), "cfg": {"fn": print}}, "pickle"),
    ({1: np.zeros(2), "1": np.ones(2)}, "same key path"),
])
def test_unsavable_state_raises_on_the_callers_thread(tmp_path, bad, where):
    with open_mgr(tmp_path / "a") as mgr:
        with pytest.raises(pitstop.UnsupportedStateError, match=where) as info:
            mgr.save(0, bad)
        assert "cannot" in str(info.value) or "not savable" in str(info.value) \
            or "rename" in str(info.value)
        # nothing was written, and the manager is not poisoned: the next save works
        mgr.wait()
        assert mgr.all_steps() == []
        assert not [e for e in os.listdir(tmp_path / "a") if e.startswith(".tmp-")]
        mgr.save(0, {"w": np.ones(2)}).result(timeout=30)
        assert mgr.all_steps() == [0]


def test_nan_metrics_and_metadata_do_not_break_a_save(tmp_path):
    with open_mgr(tmp_path / "a", keep_best=1, best_metric="loss") as mgr:
        mgr.save(0, {"w": np.zeros(2)}, metrics={"loss": 1.0}).result(timeout=30)
        mgr.save(1, {"w": np.ones(2)}, metrics={"loss": float("nan"), "acc": np.float32(0.5)},
                 user_metadata={"note": float("inf"), "t": (1, 2)}).result(timeout=30)
        m = mgr.metadata(1)
        assert math.isnan(m.metrics["loss"]) and m.metrics["acc"] == 0.5
        assert m.user_metadata == {"note": float("inf"), "t": (1, 2)}
        # a NaN loss is never "best", but the newest checkpoint is kept
        assert mgr.all_steps() == [0, 1]


# --------------------------------------------------------------------------- error API
def small_state(seed=0):
    return {"model": {"w": np.full((3, 4), seed, "f4"), "b": np.full(4, seed, "f8")},
            "opt": {"m": np.full(4, seed, "f8")}, "epoch": seed, "tags": ["a", seed]}


def test_incompatible_target_lists_missing_unexpected_and_mismatched_keys(tmp_path):
    with open_mgr(tmp_path / "a") as mgr:
        mgr.save(3, small_state(3)).result(timeout=30)
        target = small_state(0)
        del target["opt"]                              # unexpected in the checkpoint
        target["model"]["extra"] = np.zeros(2)         # missing in the checkpoint
        target["model"]["w"] = np.zeros((4, 3), "f4")  # shape mismatch
        target["model"]["b"] = np.zeros(4, "f4")       # dtype mismatch
        target["epoch"] = np.int64(0)                  # value in checkpoint, array in target
        target["new_value"] = 1                        # missing
        before = snapshot_bytes(target)
        with pytest.raises(pitstop.IncompatibleTargetError) as info:
            mgr.restore(target)
        e = info.value
        assert sorted(e.missing_keys) == ["model/extra", "new_value"]
        assert e.unexpected_keys == ["opt/m"]
        assert sorted(e.mismatched_keys) == ["epoch", "model/b", "model/w"]
        msg = str(e)
        for k in ["model/extra", "new_value", "opt/m", "model/w", "model/b", "strict=False"]:
            assert k in msg
        assert "[3, 4]" in msg and "[4, 3]" in msg  # says what differs
        # strict: nothing was touched
        assert snapshot_bytes(target) == before and target["tags"] == ["a", 0]

        # strict=False restores what matches and reports the rest on the returned step
        step = mgr.restore(target, strict=False)
        assert step == 3
        assert sorted(step.missing_keys) == ["model/extra", "new_value"]
        assert step.unexpected_keys == ["opt/m"]
        assert sorted(step.mismatched_keys) == ["epoch", "model/b", "model/w"]
        assert target["tags"] == ["a", 3]                    # matched value restored
        assert not target["model"]["w"].any() and not target["model"]["b"].any()  # skipped
        assert not target["model"]["extra"].any() and target["new_value"] == 1
        assert target["epoch"] == np.int64(0)


def test_mismatched_key_containing_a_colon_is_skipped_not_half_read(tmp_path):
    with open_mgr(tmp_path / "a") as mgr:
        mgr.save(0, {"layer:0": np.arange(8, dtype="f4"), "ok": np.ones(2)}).result(timeout=30)
        t = {"layer:0": np.zeros(4, "f4"), "ok": np.zeros(2)}
        step = mgr.restore(t, strict=False)
        assert step.mismatched_keys == ["layer:0"]
        assert not t["layer:0"].any() and t["ok"].tolist() == [1, 1]


def test_value_in_target_array_in_checkpoint_is_not_silently_skipped(tmp_path):
    with open_mgr(tmp_path / "a") as mgr:
        mgr.save(0, {"w": np.ones(3), "b": np.ones(1)}).result(timeout=30)
        with pytest.raises(pitstop.IncompatibleTargetError) as info:
            mgr.restore({"w": None, "b": np.zeros(1)})
        assert info.value.mismatched_keys == ["w"]
        assert info.value.missing_keys == [] and info.value.unexpected_keys == []


def test_values_in_tuples_are_restored_by_rebuilding_the_tuple(tmp_path):
    """A tuple cannot change in place: restore builds a new one of the same type (a
    namedtuple too) and puts it back into the parent; arrays inside stay the same objects."""
    with open_mgr(tmp_path / "a") as mgr:
        mgr.save(0, {"t": (np.arange(3.0), 5, np.float32(2.5))}).result(timeout=30)
        for changed in [(np.zeros(3), 6, np.float32(2.5)), (np.zeros(3), 5, np.float32(9))]:
            target = {"t": changed}
            arr = changed[0]
            assert mgr.restore(target) == 0
            assert type(target["t"]) is tuple and target["t"][0] is arr
            assert arr.tolist() == [0, 1, 2] and target["t"][1] == 5
            assert_same_value(target["t"][2], np.float32(2.5))


def test_restore_with_nothing_saved_returns_none_and_unknown_step_raises(tmp_path):
    with open_mgr(tmp_path / "a") as mgr:
        t = small_state(1)
        assert mgr.restore(t) is None
        assert t["epoch"] == 1
        with pytest.raises(pitstop.CheckpointNotFoundError):
            mgr.restore(t, step=4)
        with pytest.raises(pitstop.CheckpointNotFoundError):
            mgr.load()
