"""Restore you can trust: every state shape comes back in place (same containers, same
types), every key a dict can hold round-trips or is refused at save time, a restore refused
for a reason known without the data changes nothing, corruption found mid-stream says what
it overwrote, and adapters restore like their own load_state_dict."""

from __future__ import annotations

import collections
import glob
import logging
import os
import warnings
from typing import Any

import numpy as np
import pytest

import pitstop
from pitstop.core.adapter import register_adapter, unregister_adapter
from pitstop.core.directory.names import step_name
from pitstop.core.tree import ArraySpec


def open_mgr(directory, **kw) -> pitstop.CheckpointManager:
    kw.setdefault("memory_tier", False)
    kw.setdefault("save_on_signals", None)
    return pitstop.CheckpointManager(directory, **kw)


Point = collections.namedtuple("Point", "x y")


# ------------------------------------------------------------------ state shapes
@pytest.mark.parametrize("saved, target", [
    ({"epoch": 3, "lr": 0.1}, {"epoch": 0, "lr": 0.0}),
    ([1, "a", None], [0, "", 5]),
    ({"cfg": {"nested": [1, 2, {"k": "v"}]}}, {"cfg": {}}),
], ids=["flat-dict", "list", "nested"])
def test_a_state_without_arrays_is_restored_in_place(tmp_path, saved, target):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, saved).wait()
        ident = id(target)
        assert mgr.restore(target) == 1
        assert target == saved and id(target) == ident


def test_containers_keep_their_type_and_aliases_stay_the_restored_objects(tmp_path):
    def state(n: int) -> dict:
        return {
            "w": np.full(4, n, np.float32),
            "cfg": Point(n, n + 1),                       # values only: rebuilt, same type
            "mixed": Point(np.full(2, n), n),              # array inside: rebuilt around it
            "od": collections.OrderedDict([("b", n), ("a", [n])]),
            "dd": collections.defaultdict(list, {"k": [n]}),
            "counters": {"seen": n, "hist": [n, n]},
        }
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, state(1)).wait()
        target = state(0)
        counters, hist, od, dd = (target["counters"], target["counters"]["hist"],
                                  target["od"], target["dd"])
        arr = target["mixed"].x
        assert mgr.restore(target) == 1
        assert type(target["cfg"]) is Point and target["cfg"] == Point(1, 2)
        assert type(target["mixed"]) is Point and target["mixed"].x is arr
        assert arr.tolist() == [1, 1] and target["mixed"].y == 1
        assert target["od"] is od and type(od) is collections.OrderedDict
        assert list(od.items()) == [("b", 1), ("a", [1])]
        assert target["dd"] is dd and dd.default_factory is list and dd["k"] == [1]
        assert target["counters"] is counters and counters["hist"] is hist and hist == [1, 1]
        assert counters["seen"] == 1


def test_an_immutable_root_that_would_change_is_refused_before_writing(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, (np.arange(3.0), 5)).wait()
        target = (np.zeros(3), 6)
        with pytest.raises(pitstop.IncompatibleTargetError, match="tuple") as info:
            mgr.restore(target)
        assert "load()" in str(info.value)
        assert target[0].tolist() == [0, 0, 0]
        same = (np.zeros(3), 5)  # nothing to change in place but the array: fine
        assert mgr.restore(same) == 1 and same[0].tolist() == [0, 1, 2]


# ------------------------------------------------------------------ keys
def test_empty_and_root_like_keys_round_trip_without_colliding(tmp_path):
    a, b, c = np.arange(3), np.ones(2), np.full(4, 7.0)
    saved = {"": a, "<root>": b, "e": {"": {"x": c}, "x": np.zeros(1)}, "~2": np.ones(5)}
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, saved).wait()
        loaded = mgr.load()
        for key, want in [("", a), ("<root>", b), ("~2", np.ones(5))]:
            np.testing.assert_array_equal(loaded[key], want)
        np.testing.assert_array_equal(loaded["e"][""]["x"], c)
        np.testing.assert_array_equal(loaded["e"]["x"], np.zeros(1))
        target = {"": np.zeros(3, int), "<root>": np.zeros(2), "~2": np.zeros(5),
                  "e": {"": {"x": np.zeros(4)}, "x": np.ones(1)}}
        assert mgr.restore(target) == 1
        np.testing.assert_array_equal(target[""], a)
        np.testing.assert_array_equal(target["<root>"], b)
        np.testing.assert_array_equal(target["e"][""]["x"], c)
        np.testing.assert_array_equal(target["e"]["x"], np.zeros(1))


def test_every_key_a_value_dict_can_hold_round_trips(tmp_path):
    values = {"k": {float("nan"): 1, float("inf"): 2, 1.5: 3, (1, "a"): 4, b"raw": 5,
                    None: 6, True: 7, 2: 8, "2": 9, "$dict": 10, "": 11, "a/b~": 12}}
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.zeros(1), **values}).wait()
        got = mgr.load()["k"]
        assert len(got) == len(values["k"])
        assert [k for k in got if isinstance(k, float) and k != k] and got[float("inf")] == 2
        for k in (1.5, (1, "a"), b"raw", None, True, 2, "2", "$dict", "", "a/b~"):
            assert got[k] == values["k"][k], k


def test_numpy_integer_keys_are_saved_as_ints(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        state = {"m": {np.int64(3): np.zeros(2)}, "v": {np.int32(4): "x"}}
        mgr.save(1, state).wait()
        loaded = mgr.load()
        assert list(loaded["m"]) == [3] and type(next(iter(loaded["m"]))) is int
        assert loaded["v"] == {4: "x"} and type(next(iter(loaded["v"]))) is int
        assert mgr.restore(state) == 1


@pytest.mark.parametrize("key", [True, 1.5, (1, 2), None, b"x"])
def test_keys_beside_arrays_that_cannot_have_a_path_are_refused_at_save(tmp_path, key):
    with open_mgr(tmp_path / "ck") as mgr:
        with pytest.raises(pitstop.UnsupportedStateError, match="str or int"):
            mgr.save(1, {"m": {key: np.zeros(2)}})
        assert mgr.all_steps() == []


# ------------------------------------------------------------------ all or nothing
def test_overlapping_numpy_target_is_refused_before_anything_is_written(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"a": np.arange(3.0), "z": np.arange(6.0).reshape(3, 2)}).wait()
        base = np.zeros(2)
        expanded = np.lib.stride_tricks.as_strided(base, (3, 2), (0, 8))  # writable, stride 0
        target = {"a": np.zeros(3), "z": expanded}
        with pytest.raises(pitstop.IncompatibleTargetError, match="share memory") as info:
            mgr.restore(target)
        assert "z" in str(info.value) and "nothing was changed" in str(info.value)
        assert target["a"].tolist() == [0, 0, 0] and base.tolist() == [0, 0]


class Box:
    """A user object with its own adapter (below) that can refuse and replace."""

    def __init__(self, n: int, size: int = 3) -> None:
        self.arrays = {f"a{i}": np.full(size, float(n)) for i in range(n)}
        self.limit = n
        self.applied: list[Any] = []


class BoxAdapter:
    replace_on_mismatch = True

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, Box)

    def capture(self, obj: Box) -> Any:
        return {"arrays": obj.arrays, "limit": obj.limit}

    def check(self, obj: Box, tree: Any) -> None:
        if tree["limit"] > 10:
            raise pitstop.IncompatibleTargetError(f"limit {tree['limit']} is too high for a Box")
        for spec in tree["arrays"].values():
            assert isinstance(spec, ArraySpec)

    def apply(self, obj: Box, tree: Any) -> None:
        obj.applied.append(tree)
        obj.arrays = tree["arrays"]
        obj.limit = tree["limit"]

    def caveats(self, obj: Box) -> list[str]:
        return ["a Box with limit 7 resumes approximately; use limit 6"] if obj.limit == 7 else []


@pytest.fixture
def box_adapter():
    adapter = BoxAdapter()
    register_adapter(adapter)
    yield adapter
    unregister_adapter(adapter)


def test_an_adapter_that_refuses_stops_the_restore_before_any_byte_is_written(
        tmp_path, box_adapter):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.arange(4.0), "box": Box(2)}).wait()
        box = Box(2)
        box.limit = 11
        mgr.save(2, {"w": np.arange(4.0) + 10, "box": box}).wait()
        target = {"w": np.zeros(4), "box": Box(2)}
        with pytest.raises(pitstop.IncompatibleTargetError, match="too high") as info:
            mgr.restore(target, step=2)
        assert "'box' (Box)" in str(info.value) and "nothing was changed" in str(info.value)
        assert info.value.mismatched_keys == ["box"]
        assert target["w"].tolist() == [0, 0, 0, 0] and target["box"].applied == []
        # with strict=False the refusing object is left out, the rest restored
        step = mgr.restore(target, step=2, strict=False)
        assert step.mismatched_keys == ["box"] and target["w"].tolist() == [10, 11, 12, 13]
        assert target["box"].applied == []


def test_replace_on_mismatch_hands_apply_the_checkpoints_subtree(tmp_path, box_adapter):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"box": Box(3)}).wait()
        # same layout: arrays restored in place, apply gets the live objects
        same = Box(3)
        live = same.arrays["a0"]
        live[:] = -1
        assert mgr.restore({"box": same}) == 1
        assert same.arrays["a0"] is live and live.tolist() == [3, 3, 3]
        # another layout (fewer entries, another shape): no error, apply gets fresh arrays
        other = Box(1, size=5)
        assert mgr.restore({"box": other}) == 1
        assert sorted(other.arrays) == ["a0", "a1", "a2"] and other.limit == 3
        assert other.arrays["a2"].tolist() == [3, 3, 3]


def test_caveats_are_warned_once_at_the_first_save_that_shows_them(tmp_path, box_adapter,
                                                                   caplog):
    caplog.set_level(logging.WARNING, logger="pitstop")
    with open_mgr(tmp_path / "ck") as mgr:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mgr.save(1, {"box": Box(2)}).wait()
            assert not [w for w in seen if "Box" in str(w.message)]
            mgr.save(2, {"box": Box(7)}).wait()
            mgr.save(3, {"box": Box(7)}).wait()
        texts = [str(w.message) for w in seen if "limit 7" in str(w.message)]
        assert len(texts) == 1 and "state entry 'box'" in texts[0] and "use limit 6" in texts[0]
        assert sum("limit 7" in r.getMessage() for r in caplog.records) == 1


def _corrupt_array(directory, step: int, key: str) -> None:
    import json
    ck = os.path.join(directory, step_name(step))
    with open(os.path.join(ck, "manifest.json")) as f:
        entry = json.load(f)["arrays"][key]
    with open(os.path.join(ck, entry["file"]), "r+b") as f:
        f.seek(entry["offset"])
        byte = f.read(1)
        f.seek(entry["offset"])
        f.write(bytes([byte[0] ^ 0xFF]))


def _state(n: float) -> dict:
    # one data file, arrays in key order: "a" is written before "m" before "z"
    return {"a": np.full(1000, n), "m": np.full(1000, n), "z": np.full(1000, n)}


def test_corruption_mid_stream_names_what_was_overwritten(tmp_path):
    d = tmp_path / "ck"
    with open_mgr(d, writer_threads=1) as mgr:
        mgr.save(1, _state(1)).wait()
        mgr.save(2, _state(2)).wait()
    _corrupt_array(d, 2, "m")
    with open_mgr(d, writer_threads=1) as mgr:
        target = _state(0)
        with pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.restore(target, step=2)
        err = info.value
        assert err.key == "m" and "a" in err.overwritten and "z" not in err.overwritten
        assert "already overwritten" in str(err)
        # the latest path completes the restore from the previous valid checkpoint
        with pytest.warns(UserWarning, match=step_name(2)):
            assert mgr.restore(target) == 1
        for k in "amz":
            assert (target[k] == 1).all(), k


def test_no_valid_checkpoint_says_the_target_holds_corrupt_bytes(tmp_path):
    d = tmp_path / "ck"
    with open_mgr(d, writer_threads=1) as mgr:
        mgr.save(1, _state(1)).wait()
    _corrupt_array(d, 1, "m")
    with open_mgr(d, writer_threads=1) as mgr:
        target = _state(0)
        with pytest.warns(UserWarning), pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.restore(target)
        assert "already holds bytes of a corrupt checkpoint" in str(info.value)
        assert "a" in info.value.overwritten
    assert glob.glob(str(d / (step_name(1) + ".corrupt-*")))


# ------------------------------------------------------------------ messages
def test_mismatch_message_has_a_line_per_kind_and_names_a_subtree_once(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.zeros(3), "old": {"a": np.zeros(1), "b": np.zeros(1)}}).wait()
        target = {"w": np.zeros(4), "new": {"x": np.zeros(1), "y": np.zeros(1),
                                            "z": {"q": np.zeros(1)}}}
        with pytest.raises(pitstop.IncompatibleTargetError) as info:
            mgr.restore(target)
        lines = str(info.value).splitlines()
        assert lines[0].startswith("cannot restore") and lines[-1].startswith("Pass strict")
        missing = next(x for x in lines if "missing in the checkpoint" in x)
        unexpected = next(x for x in lines if "not in the target" in x)
        mismatched = next(x for x in lines if "mismatched" in x)
        assert "'new' (whole subtree, 3 entries)" in missing and "new/x" not in missing
        assert "'old' (whole subtree, 2 entries)" in unexpected
        assert "'w' (checkpoint float64[3], target float64[4])" in mismatched
        assert info.value.missing_keys == ["new/x", "new/y", "new/z/q"]


def test_value_errors_name_the_list_index(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        state = {"w": np.zeros(1), "opt": {"param_groups": [{"lr": 0.1}, {"dtype": object()}]}}
        with pytest.raises(pitstop.UnsupportedStateError, match="'opt/param_groups/1/dtype'"):
            mgr.save(1, state)


def test_an_adapter_capture_error_names_the_state_path(tmp_path):
    class Bad:
        def state_dict(self):
            return {"w": np.zeros(1), "f": print}

        def load_state_dict(self, sd):
            pass

    with open_mgr(tmp_path / "ck") as mgr:
        with pytest.raises(pitstop.UnsupportedStateError, match="'model/f'"):
            mgr.save(1, {"model": Bad()})


# ------------------------------------------------------------------ found by probing (issue 8)
def test_a_target_of_plain_values_is_matched_key_by_key(tmp_path):
    """A state of plain values against a checkpoint that also holds an array: a mismatch
    named, never a target emptied to {}."""
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"epoch": 3, "lr": 0.1, "loss_scale": np.float64(1024.0)}).wait()
        target = {"epoch": 0, "lr": 0.0, "loss_scale": 1.0}
        with pytest.raises(pitstop.IncompatibleTargetError, match="'loss_scale'"):
            mgr.restore(target)
        assert target == {"epoch": 0, "lr": 0.0, "loss_scale": 1.0}
        step = mgr.restore(target, strict=False)
        assert step.mismatched_keys == ["loss_scale"]
        assert target == {"epoch": 3, "lr": 0.1, "loss_scale": 1.0}
        for bad in (None, "abc", [None, 0]):
            with pytest.raises(pitstop.IncompatibleTargetError):
                mgr.restore(bad)


def test_a_value_is_not_silently_replaced_by_a_subtree_with_arrays(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"cfg": {"ema": np.ones(2), "decay": 0.9}}).wait()
        cfg = {"lr": 0.1, "warmup": 100}
        with pytest.raises(pitstop.IncompatibleTargetError, match="'cfg'"):
            mgr.restore({"cfg": cfg})
        assert cfg == {"lr": 0.1, "warmup": 100}
        empty: dict = {}  # an empty container that has filled since is rebuilt (a buffer)
        assert mgr.restore({"cfg": empty}) == 1 and empty["decay"] == 0.9


def test_a_root_key_named_like_the_root_marker_is_an_ordinary_key(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.ones(3)}).wait()
        target = {"w": np.zeros(3), "<root>": 5}
        with pytest.raises(pitstop.IncompatibleTargetError, match="missing.*'<root>'"):
            mgr.restore(target)
        assert target["<root>"] == 5 and target["w"].tolist() == [0, 0, 0]
        mgr.save(2, {"<root>": np.ones(3)}).wait()
        bare = np.zeros(3)
        with pytest.raises(pitstop.IncompatibleTargetError, match="a dict, the target is a leaf"):
            mgr.restore(bare, step=2)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("make", [np.matrix, lambda a: a.view(np.recarray)],
                         ids=["matrix", "recarray"])
def test_ndarray_subclass_targets_restore_and_valid_checkpoints_stay(tmp_path, make):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"m": make(np.arange(4.0).reshape(2, 2))}).wait()
        target = {"m": make(np.zeros((2, 2)))}
        assert mgr.restore(target) == 1
        assert np.asarray(target["m"]).tolist() == [[0, 1], [2, 3]]
        assert mgr.all_steps() == [1] and not glob.glob(str(tmp_path / "ck" / "*.corrupt-*"))


def test_a_masked_array_is_refused_at_save(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        with pytest.raises(pitstop.UnsupportedStateError, match="mask"):
            mgr.save(1, {"x": np.ma.masked_array([1.0, 2.0], mask=[0, 1])})


def test_values_are_recorded_when_save_returns_whatever_their_container(tmp_path):
    import collections as c
    import types
    with open_mgr(tmp_path / "ck") as mgr:
        inner, ud = {"epoch": 1}, c.UserDict({"epoch": 1})
        state = {"w": np.zeros(2), "meta": types.MappingProxyType(inner), "ud": ud}
        gate = __import__("threading").Event()
        mgr.hooks["before_write"] = lambda step: gate.wait(30)
        h = mgr.save(1, state)
        inner["epoch"] = 999
        ud["epoch"] = 999
        gate.set()
        h.wait()
        got = mgr.load(1)
        assert got["meta"] == {"epoch": 1} and got["ud"] == {"epoch": 1}


def test_leaves_sharing_memory_are_refused_unless_tied(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"a": np.ones(3), "b": np.full(3, 2.0)}).wait()
        base = np.zeros(5)
        target = {"a": base[0:3], "b": base[2:5]}
        with pytest.raises(pitstop.IncompatibleTargetError, match="shares memory"):
            mgr.restore(target)
        assert base.tolist() == [0] * 5
        same = np.zeros(3)
        with pytest.raises(pitstop.IncompatibleTargetError, match="different values"):
            mgr.restore({"a": same, "b": same})
        # tied weights: the same array saved under two keys restores into the same array
        tied = np.arange(3.0)
        mgr.save(2, {"a": tied, "b": tied}).wait()
        live = np.zeros(3)
        assert mgr.restore({"a": live, "b": live}, step=2) == 2 and live.tolist() == [0, 1, 2]


def test_enum_keys_beside_arrays_load_and_restore(tmp_path):
    import enum

    class Split(str, enum.Enum):
        TRAIN = "train"

    class Rank(enum.IntEnum):
        TOP = 1

    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"buf": {Split.TRAIN: np.arange(3.0)}, "r": {Rank.TOP: np.ones(2)}}).wait()
        loaded = mgr.load()
        assert loaded["buf"]["train"].tolist() == [0, 1, 2] and loaded["r"][1].tolist() == [1, 1]
        target = {"buf": {Split.TRAIN: np.zeros(3)}, "r": {Rank.TOP: np.zeros(2)}}
        assert mgr.restore(target) == 1
        assert target["buf"][Split.TRAIN].tolist() == [0, 1, 2] and len(target["buf"]) == 1


class Pair(tuple):
    """A tuple subclass whose constructor takes the items as arguments."""

    def __new__(cls, a: Any, b: Any) -> Pair:
        return super().__new__(cls, (a, b))


class Opaque(tuple):
    """A tuple subclass that cannot be rebuilt from its items."""

    def __new__(cls, token: str) -> Opaque:
        if token != "secret":
            raise ValueError("no")
        return super().__new__(cls, (np.zeros(2), 0))


def test_tuple_subclasses_are_rebuilt_as_their_type_or_refused_up_front(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"p": Pair(np.ones(2), 5), "v": Pair(1, 5)}).wait()
        target = {"p": Pair(np.zeros(2), 0), "v": Pair(0, 0)}
        assert mgr.restore(target) == 1
        assert type(target["p"]) is Pair and target["p"][1] == 5
        assert type(target["v"]) is Pair and tuple(target["v"]) == (1, 5)
        mgr.save(2, {"o": (np.ones(2), 7)}).wait()
        target = {"o": Opaque("secret")}
        with pytest.raises(pitstop.IncompatibleTargetError, match="cannot be rebuilt"):
            mgr.restore(target, step=2)
        assert target["o"][0].tolist() == [0, 0]


def test_a_defaultdicts_new_entries_are_made_by_its_factory(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.zeros(1), "counts": {"cats": {"a": 1}}}).wait()
        counts: collections.defaultdict = collections.defaultdict(
            lambda: collections.defaultdict(int))
        assert mgr.restore({"w": np.zeros(1), "counts": counts}) == 1
        counts["cats"]["new"] += 1  # training goes on as before the restart
        assert type(counts["cats"]) is collections.defaultdict and counts["cats"]["a"] == 1


def test_a_read_only_mapping_that_must_change_is_refused_before_writing(tmp_path):
    import types
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.ones(3), "cfg": {"n": 1, "a": np.ones(1)}}).wait()
        w = np.zeros(3)
        cfg = types.MappingProxyType({"n": 0, "a": np.zeros(1)})
        with pytest.raises(pitstop.IncompatibleTargetError, match="mappingproxy"):
            mgr.restore({"w": w, "cfg": cfg})
        assert w.tolist() == [0, 0, 0] and cfg["a"].tolist() == [0]


def test_a_generator_of_another_kind_is_refused_before_writing(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.ones(3), "rng": np.random.default_rng(0)}).wait()
        target = {"w": np.zeros(3), "rng": np.random.Generator(np.random.MT19937(0))}
        with pytest.raises(pitstop.IncompatibleTargetError, match="PCG64"):
            mgr.restore(target)
        assert target["w"].tolist() == [0, 0, 0]


def _reseal(directory, step: int, edit) -> None:
    import json

    from pitstop.core.format.seal import _HASH_KEY, seal
    path = os.path.join(directory, step_name(step), "manifest.json")
    data = open(path, "rb").read()
    doc = json.loads(data)
    algorithm = doc.pop("manifest_hash") and doc["hash_algorithm"]
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(seal(body, algorithm))
    assert _HASH_KEY in open(path, "rb").read()


@pytest.mark.parametrize("edit", [
    lambda doc: doc["values"].__setitem__("lr", {"$bytes": "!!!*"}),
    lambda doc: doc["values"].__setitem__("lr", {"$float": "fast"}),
    lambda doc: doc["values"].__setitem__("w", 5),
    lambda doc: doc["arrays"]["w"].__setitem__("shape", [4.7]),
], ids=["bad-bytes", "bad-float", "array-and-value", "float-shape"])
def test_a_sealed_but_malformed_manifest_is_corrupt_and_never_half_applied(tmp_path, edit):
    d = tmp_path / "ck"
    with open_mgr(d) as mgr:
        mgr.save(1, {"w": np.ones(4), "lr": 0.1}).wait()
        mgr.save(2, {"w": np.full(4, 2.0), "lr": 0.2}).wait()
    _reseal(d, 2, edit)
    with open_mgr(d) as mgr:
        target = {"w": np.zeros(4), "lr": 0.0}
        with pytest.raises(pitstop.CorruptCheckpointError):
            mgr.restore(target, step=2)
        assert target == {"w": target["w"], "lr": 0.0} and target["w"].tolist() == [0] * 4
        with pytest.warns(UserWarning, match=step_name(2)):
            assert mgr.restore(target) == 1
        assert target["lr"] == 0.1 and target["w"].tolist() == [1] * 4


def test_a_renamed_checkpoint_is_never_restored_as_another_step(tmp_path):
    d = tmp_path / "ck"
    with open_mgr(d) as mgr:
        mgr.save(1, {"w": np.ones(2)}).wait()
        mgr.save(2, {"w": np.full(2, 2.0)}).wait()
    os.rename(d / step_name(2), d / "tmp")
    os.rename(d / step_name(1), d / step_name(2))
    os.rename(d / "tmp", d / step_name(1))
    with open_mgr(d) as mgr:
        target = {"w": np.zeros(2)}
        with pytest.warns(UserWarning), pytest.raises(pitstop.CorruptCheckpointError,
                                                       match="manifest is of step"):
            mgr.restore(target)
        assert target["w"].tolist() == [0, 0]


def test_a_fallback_that_cannot_cover_what_the_corrupt_step_overwrote_says_so(tmp_path):
    d = tmp_path / "ck"
    with open_mgr(d, writer_threads=1) as mgr:
        mgr.save(1, {"a": np.ones(100)}).wait()
        mgr.save(2, {"a": np.full(100, 2.0), "b": np.full(100, 2.0),
                     "c": np.full(100, 2.0)}).wait()
    _corrupt_array(d, 2, "c")
    with open_mgr(d, writer_threads=1) as mgr:
        target = {"a": np.zeros(100), "b": np.zeros(100), "c": np.zeros(100)}
        with pytest.warns(UserWarning), pytest.raises(pitstop.CorruptCheckpointError,
                                                       match="still hold bytes") as info:
            mgr.restore(target, strict=False)
        assert set(info.value.overwritten) == {"b", "c"}
        assert (target["a"] == 1).all()  # what step 1 holds was restored


def test_a_fallback_that_does_not_match_is_a_corrupt_error_not_an_unchanged_one(tmp_path):
    d = tmp_path / "ck"
    with open_mgr(d, writer_threads=1) as mgr:
        mgr.save(1, {"a": np.ones(4), "b": np.ones(3)}).wait()
        mgr.save(2, {"a": np.full(4, 2.0), "b": np.full(4, 2.0)}).wait()
    _corrupt_array(d, 2, "b")
    with open_mgr(d, writer_threads=1) as mgr:
        target = {"a": np.zeros(4), "b": np.zeros(4)}
        with pytest.warns(UserWarning), pytest.raises(pitstop.CorruptCheckpointError) as info:
            mgr.restore(target)
        text = str(info.value)
        assert "cannot complete the restore" in text and "'b'" in text
        assert "nothing was changed" not in text and "a" in info.value.overwritten


def test_keys_in_messages_are_quoted(tmp_path):
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"model": {"a\nunexpected: fake": np.ones(1)}}).wait()
        with pytest.raises(pitstop.IncompatibleTargetError) as info:
            mgr.restore({"model": {"b": np.ones(1)}})
        lines = str(info.value).splitlines()
        assert len([x for x in lines if "unexpected" in x]) == 1
        assert "'model/a\\nunexpected: fake'" in str(info.value)


class Resizable:
    """An object whose own load_state_dict takes a buffer of any length (as a quantization
    observer or a module's extra state does)."""

    def __init__(self, n: int) -> None:
        self.buf = np.zeros(n)
        self.scale = np.ones(2)

    def state_dict(self) -> dict:
        return {"buf": self.buf, "scale": self.scale}

    def load_state_dict(self, sd: dict) -> None:
        self.buf = np.array(sd["buf"])
        self.scale[:] = sd["scale"]


class ResizableAdapter:
    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, Resizable)

    def capture(self, obj: Resizable) -> Any:
        return obj.state_dict()

    def apply(self, obj: Resizable, tree: Any) -> None:
        obj.load_state_dict(tree)

    def replaceable(self, obj: Resizable) -> list[str]:
        return ["buf"]


def test_replaceable_entries_are_handed_to_apply_fresh_instead_of_refused(tmp_path):
    adapter = ResizableAdapter()
    register_adapter(adapter)
    try:
        with open_mgr(tmp_path / "ck") as mgr:
            saved = Resizable(4)
            saved.buf[:] = [1, 2, 3, 4]
            saved.scale[:] = 5
            mgr.save(1, {"obs": saved}).wait()
            target = Resizable(0)  # an observer before its first forward pass
            scale = target.scale
            assert mgr.restore({"obs": target}) == 1
            assert target.buf.tolist() == [1, 2, 3, 4]
            assert target.scale is scale and scale.tolist() == [5, 5]  # in place, as usual
            other = {"obs": Resizable(0)}
            other["obs"].scale = np.ones(3)  # not replaceable: still refused up front
            with pytest.raises(pitstop.IncompatibleTargetError, match="'obs/scale'"):
                mgr.restore(other)
    finally:
        unregister_adapter(adapter)


def test_string_digit_keys_go_back_under_the_int_keys_the_live_dict_has(tmp_path):
    """A checkpoint imported from DCP keeps only string keys: a MultiStepLR's milestones
    {3: 1} must come back under 3, not "3"."""
    with open_mgr(tmp_path / "ck") as mgr:
        mgr.save(1, {"w": np.zeros(1), "sched": {"milestones": {"3": 1, "6": 1}}}).wait()
        milestones = collections.Counter({3: 1, 6: 1})
        target = {"w": np.zeros(1), "sched": {"milestones": milestones}}
        assert mgr.restore(target) == 1
        assert dict(milestones) == {3: 1, 6: 1} and target["sched"]["milestones"] is milestones


@pytest.mark.parametrize("tier", [False, True])
def test_restore_right_after_a_save_reads_the_staging_buffer(tmp_path, monkeypatch, caplog,
                                                              tier):
    """A restore of the step just committed reads its data from the staging buffer it was
    written from (no disk read), verified against the committed manifest; damage there means
    a read from disk, never a wrong restore; once a save took the buffer, disk again."""
    from pitstop.core.storage.local import LocalStorage
    opened: list[tuple[str, str]] = []
    original = LocalStorage.open_reader

    def spy(self, name, relpath):
        opened.append((name, relpath))
        return original(self, name, relpath)

    monkeypatch.setattr(LocalStorage, "open_reader", spy)

    def state(v):
        return {"w": np.full(70_000, v, np.float32), "b": np.arange(10, dtype=np.int64) * int(v)}

    with pitstop.CheckpointManager(tmp_path / "c", memory_tier=tier) as mgr:
        mgr.save(1, state(1.0)).wait()
        target = state(0.0)
        assert mgr.restore(target) == 1
        np.testing.assert_array_equal(target["w"], 1.0)
        assert opened == []  # nothing read from disk
        # the buffer no longer holds what the manifest vouches for: disk, loudly
        buf = mgr._engine.staged[1]
        buf.buf[100] ^= 0xFF
        caplog.set_level(logging.WARNING, logger="pitstop")
        target = state(0.0)
        assert mgr.restore(target) == 1
        np.testing.assert_array_equal(target["w"], 1.0)
        assert opened and "staging buffer" in caplog.text
        assert mgr.all_steps() == [1]  # the checkpoint itself is fine: not moved aside
        buf.buf[100] ^= 0xFF
        # a newer save took the buffer: step 1 comes from disk, step 2 from the buffer
        mgr.save(2, state(2.0)).wait()
        opened.clear()
        target = state(0.0)
        assert mgr.restore(target) == 2
        np.testing.assert_array_equal(target["w"], 2.0)
        assert opened == []
        assert mgr.restore(target, step=1) == 1
        np.testing.assert_array_equal(target["b"], np.arange(10))
        assert opened


def test_a_periodic_save_waits_for_a_restore_reading_the_staging_buffer(tmp_path, monkeypatch):
    """A restore reading the step just committed from its staging buffer holds that buffer
    for the read only: a periodic ``step()`` save on another thread meanwhile waits for the
    read (short) and saves, never skipped as "previous save still persisting"."""
    import threading

    def state(v):
        return {"w": np.full(50_000, v, np.float32)}

    with pitstop.CheckpointManager(tmp_path / "c", memory_tier=False, save_on_signals=None,
                                   save_every_steps=1, max_in_flight=1) as mgr:
        mgr.save(1, state(1.0)).wait()
        # what a restore of step 1 holds while it reads the buffer
        staged = mgr._engine.hold_staged(step_name(1))
        assert staged is not None
        waiting = threading.Event()
        original = mgr.pool.cond.wait

        def spy(timeout=None):
            waiting.set()
            return original(timeout)

        monkeypatch.setattr(mgr.pool.cond, "wait", spy)
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(mgr.step(2, state(2.0))))
        t.start()
        while t.is_alive() and not waiting.is_set():
            waiting.wait(0.01)
        mgr.pool.release(staged[0])  # the read is done
        t.join(60)
        assert out and out[0] is not None, "the periodic save was skipped"
        assert not out[0].result().skipped
        assert mgr.all_steps() == [1, 2]


def test_a_data_file_changed_on_disk_after_the_save_is_read_from_disk(tmp_path, caplog):
    """The staging buffer stands for the checkpoint's files only while they are as written:
    a file damaged (or replaced) after the save is read from disk, so the restore finds the
    damage and falls back, as it would in a new process."""
    def state(v):
        return {"w": np.full(5000, v, np.float32)}

    with pitstop.CheckpointManager(tmp_path / "c", memory_tier=False) as mgr:
        mgr.save(1, state(1.0)).wait()
        mgr.save(2, state(2.0)).wait()
        data = next((tmp_path / "c" / step_name(2)).glob("data-*.bin"))
        raw = bytearray(data.read_bytes())
        raw[10] ^= 0xFF
        data.write_bytes(bytes(raw))
        target = state(0.0)
        with pytest.warns(UserWarning, match="corrupt"):
            assert mgr.restore(target) == 1
        np.testing.assert_array_equal(target["w"], 1.0)
