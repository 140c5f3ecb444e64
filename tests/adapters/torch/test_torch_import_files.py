"""Probes of the torch import helpers with files an attacker (or a garbling tool) made from
nothing but the globals the restricted unpicklers allow: DCP ``.metadata`` holding only
DCP's own classes, but with absurd contents (a size of 10**15, a shape that is a string, a
``planner_data`` list index of 10**11, a path nested 300000 deep). Each must be a clear
``CheckpointError`` naming the file, never a raw exception or a huge allocation."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

import pitstop  # noqa: E402
from pitstop.adapters.torch.convert import import_dcp, import_torch_save  # noqa: E402


@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory) -> tuple[Path, bytes]:
    src = tmp_path_factory.mktemp("dcp") / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group
        dcp.save({"w": torch.arange(4.0), "n": 3}, checkpoint_id=src)
    return src, (src / ".metadata").read_bytes()


def _edit(md, how: str):
    w = md.state_dict_metadata["w"]
    if how == "huge size":  # 4 PB of float32: torch.empty raised a raw RuntimeError
        md.state_dict_metadata["w"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([10**15]), w.chunks)
    elif how == "beyond any checkpoint":
        md.state_dict_metadata["w"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([2**40, 2**40]),
            [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**40, 2**40]))])
    elif how == "negative size":
        w.size = torch.Size([-4])
    elif how == "shape is a string":
        w.size = "abcd"
    elif how == "no properties":
        w.properties = None
    elif how == "entries are a list":
        md.state_dict_metadata = [1, 2]
    elif how == "planner index 10**11":  # [None] * 10**11: an 800 GB list
        md.planner_data = {"w": ("w", 10**11), "n": ("n",)}
    elif how == "planner index negative":
        md.planner_data = {"w": ("w", -5), "n": ("n",)}
    elif how == "planner path not a path":
        md.planner_data = {"w": 5, "n": ("n",)}
    elif how == "many planner lists":  # each index small, all of them together huge
        md.planner_data = {f"k{i}": (f"k{i}", 2**20) for i in range(64)}
    return md


@pytest.mark.parametrize("how", [
    "huge size", "beyond any checkpoint", "negative size", "shape is a string",
    "no properties", "entries are a list", "planner index 10**11", "planner index negative",
    "planner path not a path", "many planner lists"])
def test_absurd_dcp_metadata_of_allowed_classes_is_a_clear_error(tmp_path, dcp_source, how):
    src, raw = dcp_source
    bad = tmp_path / "dcp"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / ".metadata").write_bytes(pickle.dumps(_edit(pickle.loads(raw), how)))
    with pytest.raises(pitstop.CorruptCheckpointError, match=r"\.metadata|cannot be allocated"):
        import_dcp(bad, tmp_path / "out", 1)
    assert not (tmp_path / "out" / "step_0000000001").exists()


@pytest.mark.parametrize("where", ["planner_data", "entry key"])
def test_a_dcp_metadata_nested_300000_deep_is_a_clear_error(tmp_path, dcp_source, where):
    """Built with raw pickle opcodes (pickling it would overflow the C stack): the checks
    and their messages must not recurse into it."""
    src, raw = dcp_source
    md = pickle.loads(raw)
    if where == "planner_data":
        md.planner_data = {"w": "PLACEHOLDER", "n": ("n",)}
    else:
        md.state_dict_metadata["PLACEHOLDER"] = md.state_dict_metadata["w"]
    data = pickle.dumps(md, protocol=4)
    ph = b"\x8c\x0bPLACEHOLDER\x94"
    assert data.count(ph) == 1
    n = 300_000
    deep = b"]" * n + b"a" * (n - 1)  # EMPTY_LIST n times, APPEND n-1 times
    data = data.replace(ph, (deep if where == "planner_data" else b"(" + deep + b"t") + b"\x94")
    bad = tmp_path / "dcp"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / ".metadata").write_bytes(data)
    with pytest.raises(pitstop.CorruptCheckpointError, match=r"\.metadata"):
        import_dcp(bad, tmp_path / "out", 1)


def test_the_unedited_source_still_imports(tmp_path, dcp_source):
    src, _raw = dcp_source
    assert import_dcp(src, tmp_path / "out", 1) == 1


class _Reduce:
    """Pickles as ``fn(*args)``: only globals weights_only allows, with odd arguments."""

    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize("how", ["OrderedDict(5)", "rebuild with a str offset",
                                 "rebuild past its storage", "rebuild at offset -3"])
def test_allowed_globals_with_odd_arguments_in_a_torch_save_file_are_a_clear_error(
        tmp_path, how):
    """torch.load(weights_only=True) lets these globals through; called with odd arguments
    they raised a raw TypeError out of import_torch_save."""
    import collections

    rebuild = torch._utils._rebuild_tensor_v2
    storage = torch.arange(4.0).untyped_storage()
    obj = {
        "OrderedDict(5)": _Reduce(collections.OrderedDict, (5,)),
        "rebuild with a str offset": {"w": _Reduce(rebuild, (
            storage, "x", (4,), (1,), False, collections.OrderedDict()))},
        "rebuild past its storage": {"w": _Reduce(rebuild, (
            storage, 0, (10**12,), (1,), False, collections.OrderedDict()))},
        "rebuild at offset -3": {"w": _Reduce(rebuild, (
            storage, -3, (4,), (1,), False, collections.OrderedDict()))},
    }[how]
    path = tmp_path / "f.pt"
    torch.save(obj, path)
    with pytest.raises(pitstop.CorruptCheckpointError, match="f.pt: torch.load cannot read"):
        import_torch_save(path, tmp_path / "out", 1)


@pytest.mark.parametrize("how", ["absolute path", "dot-dot path", "/dev/zero", "a FIFO"])
def test_dcp_storage_paths_outside_the_checkpoint_or_not_files_are_refused(
        tmp_path, dcp_source, how):
    """A ``_StorageInfo.relative_path`` is joined to the DCP directory by DCP: an absolute
    path or '..' imported another checkpoint of the importing user's (any file they can
    read) as if it were this one's data; /dev/zero was read for as long as the entry's
    length said (gigabytes); a FIFO would block the import forever."""
    src, raw = dcp_source
    other = tmp_path / "other"  # the victim's own private checkpoint elsewhere
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.full((4,), 666.0), "n": 3}, checkpoint_id=other)
    bad = tmp_path / "dcp"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    md = pickle.loads(raw)
    rel = {"absolute path": str(other / "__0_0.distcp"), "dot-dot path": "../other/__0_0.distcp",
           "/dev/zero": "/dev/zero", "a FIFO": "fifo"}[how]
    if how == "a FIFO":
        os.mkfifo(bad / "fifo")
    for info in md.storage_data.values():
        info.relative_path = rel
        if how == "/dev/zero":
            info.length = 1 << 40
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(pitstop.CorruptCheckpointError, match=r"\.metadata: not DCP metadata"):
        import_dcp(bad, tmp_path / "out", 1)
    assert not (tmp_path / "out" / "step_0000000001").exists()


def test_a_fifo_as_the_dcp_metadata_is_refused_not_hung_on(tmp_path, dcp_source):
    src, _raw = dcp_source
    bad = tmp_path / "dcp"
    bad.mkdir()
    for f in src.iterdir():
        if f.name != ".metadata":
            (bad / f.name).write_bytes(f.read_bytes())
    os.mkfifo(bad / ".metadata")
    with pytest.raises(pitstop.CorruptCheckpointError, match="not a regular file"):
        import_dcp(bad, tmp_path / "out", 1)
