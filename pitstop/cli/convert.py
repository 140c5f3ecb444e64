"""``pitstop export`` and ``pitstop import``: checkpoints out to, and in from, other formats.

Export writes one pitstop checkpoint as a ``.npz`` (numpy only), ``.safetensors`` or
``torch.save`` file (torch), or a step of an Orbax directory (JAX); import turns a
``torch.save`` file, a DCP directory, a native TensorFlow checkpoint, an Orbax directory,
a ``.safetensors`` or a ``.npz`` file into a committed pitstop checkpoint. Each imports only
the framework its format needs (TensorFlow and torch crash when one process loads both).

The npz layout (``docs/cli.md``): one ``.npy`` member per array, named by its pitstop key
path (components joined by ``/``, a ``/`` inside a component escaped as ``~1``), and one
0-d unicode array ``__pitstop__`` holding JSON: ``{"format": "pitstop-npz",
"format_version": 1, "step", "metrics", "values": {key path: value in the manifest's
encoding}, "dtypes": {key path: ml_dtypes name}, "structure"}``. Arrays of ml_dtypes types
(bfloat16, float8, int4 ...), which ``.npy`` cannot describe, are stored as their bits
(unsigned ints of the same width) and named in ``dtypes``. ``np.load(path,
allow_pickle=False)`` reads every member.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import struct
import sys
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pitstop.core.arguments import MAX_STEP
from pitstop.core.errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError
from pitstop.core.format.dtypes import ML_DTYPES
from pitstop.core.tree import decode_value, encode_value, join, split, unflatten

NPZ_META = "__pitstop__"
NPZ_FORMAT = "pitstop-npz"
EXPORTS = ("npz", "safetensors", "torch", "orbax", "tf")
IMPORTS = ("torch", "dcp", "tf", "orbax", "safetensors", "npz")
_EXT = {"npz": ".npz", "safetensors": ".safetensors", "torch": ".pt", "orbax": "-orbax"}
_ML_BY_DTYPE = {v: k for k, v in ML_DTYPES.items()}
_TORCH_EXTRA = "pip install 'pitstop[torch]'"

EXPORT_EPILOG = """\
formats: npz (numpy only), safetensors and torch (need torch), orbax (needs jax and
orbax-checkpoint: OUT is an Orbax CheckpointManager directory). Writing native
TensorFlow checkpoints is not supported.

example:
  pitstop export runs/exp1 --to safetensors --key model -o model.safetensors
"""

IMPORT_EPILOG = """\
formats (--from; guessed from SRC when not given): torch (a torch.save file), dcp (a
torch.distributed.checkpoint directory), tf (a native TensorFlow checkpoint prefix),
orbax (an Orbax CheckpointManager directory or one checkpoint), safetensors, npz.
A TensorFlow directory (with its "checkpoint" file) imports its newest checkpoint.

example:
  pitstop import model.pt runs/exp1 --step 0
"""


def add_parsers(sub: Any) -> None:
    """Register ``pitstop export`` and ``pitstop import`` on ``build_parser``'s subcommands."""
    s = sub.add_parser(
        "export", help="write one checkpoint as a .npz, .safetensors, torch.save file or "
        "an Orbax checkpoint",
        description="Write one checkpoint (the newest, or --step) to another format. CKPT is "
        "a run directory or a checkpoint's own path.",
        epilog=EXPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("ckpt", metavar="CKPT")
    s.add_argument("--to", required=True, metavar="FORMAT",
                   help="npz, safetensors, torch or orbax")
    s.add_argument("-o", "--output", metavar="OUT",
                   help="the file to write (default: <run>-step<N>.<ext> here)")
    s.add_argument("--key", metavar="KEY", help="export one entry only, e.g. model")
    s.add_argument("--step", type=int, metavar="N", help="the step (default: the newest)")
    s.add_argument("--force", action="store_true", help="replace an existing OUT file")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser(
        "import", help="turn a torch.save file, DCP, TensorFlow, Orbax, safetensors or npz "
        "checkpoint into a pitstop checkpoint",
        description="Import SRC as a committed checkpoint of the run directory DEST "
        "(created if needed); an existing step of DEST is never overwritten.",
        epilog=IMPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("src", metavar="SRC")
    s.add_argument("dest", metavar="DEST")
    s.add_argument("--from", dest="fmt", metavar="FORMAT",
                   help="torch, dcp, tf, orbax, safetensors or npz (default: guessed)")
    s.add_argument("--step", type=int, metavar="N",
                   help="the step to write (default: the step SRC records, TensorFlow's "
                   "save counter, Orbax's own steps; else 0)")
    s.add_argument("--key", metavar="KEY", help="import one entry of SRC only")
    s.add_argument("--keep-prefixes", action="store_true",
                   help="torch, dcp: keep a 'module.' prefix every key of a module state "
                   "dict has (by default dropped, as DDP / DataParallel adds it)")
    s.set_defaults(func=cmd_import)


# ====================================================================== small helpers
def _cli() -> Any:
    """The ``pitstop.cli`` package (its helpers), imported when first needed."""
    from pitstop.cli import common as cli
    return cli


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Write through a temporary file beside ``path``, fsync it, rename it into place."""
    from pitstop.adapters._convert import atomic_write
    try:
        atomic_write(path, write)
    except CheckpointWriteError as e:
        raise _cli().CliError(str(e)) from None


#: the adapters' advice names their Python keywords: the command's options instead
_CLI_WORDS = (("(step=...)", "(--step N)"), ("step=...", "--step N"),
              ("strip_prefixes=()", "--keep-prefixes"),
              ("with export_torch_save", "with --to torch"),
              ("use export_torch_save", "use --to torch"),
              ("(key=...)", "(--key KEY)"), ("with key=", "with --key"),
              ("as key=, or key=None for everything", "as --key, or leave --key out for "
               "everything"),
              ("Use one CheckpointManager per directory, or open it with read_only=True to "
               "only restore.", "Import into another directory, or once that job has "
               "stopped."),
              (" and pass encryption=pitstop.Encryption()", ""))


def _cli_words(text: str) -> str:
    """``text`` (an adapter's error or warning) with its advice in the command's terms."""
    for api, option in _CLI_WORDS:
        text = text.replace(api, option)
    return text


class _CliWordsFilter(logging.Filter):
    """Rewrites the adapters' warnings (a stripped ``module.`` prefix) in the command's
    terms while an import runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = _cli_words(record.getMessage()), None
        return True


def _sub_structure(structure: Any, comps: list[str]) -> Any:
    """The part of a manifest's ``structure`` at key path components ``comps`` (None when
    it cannot be found)."""
    node = structure
    for c in comps:
        while isinstance(node, dict) and "$o" in node:
            node = node["$o"]
        if not isinstance(node, dict):
            return None
        if "$d" in node:
            found = [sub for k, sub in node["$d"] if str(k) == c]
            if not found:
                return None
            node = found[0]
        elif "$t" in node or "$l" in node:
            items: list[Any] = node.get("$t", node.get("$l")) or []
            if not c.isdigit() or int(c) >= len(items):
                return None
            node = items[int(c)]
        else:
            return None
    return node


def _relative(kp: str, key: str | None) -> str | None:
    """``kp`` relative to the entry ``key`` (None: outside it)."""
    if key is None:
        return kp
    if kp == key:
        return split(kp)[-1] if split(kp) else kp
    if kp.startswith(key + "/"):
        return kp[len(key) + 1:]
    return None


def _nested(leaves: dict[str, Any], where: str) -> dict[str, Any]:
    """Nested dicts from ``{key path: leaf}``."""
    root: dict[str, Any] = {}
    for kp, leaf in leaves.items():
        comps = split(kp) or [kp]
        node = root
        for c in comps[:-1]:
            nxt = node.setdefault(c, {})
            if not isinstance(nxt, dict):
                raise CorruptCheckpointError(f"{where}: {kp!r} is inside another entry "
                                             f"({c!r}), so no tree holds both",
                                             checkpoint=where, key=kp)
            node = nxt
        if comps[-1] in node:
            raise CorruptCheckpointError(f"{where}: entry {kp!r} is there twice (or also "
                                         "holds other entries)", checkpoint=where, key=kp)
        node[comps[-1]] = leaf
    return root


# ====================================================================== npz
def write_npz(reader: Any, path: str, key: str | None) -> tuple[int, int]:
    """Write the checkpoint ``reader`` reads (or its entry ``key``) as an npz file at
    ``path``, one array at a time; returns (arrays, bytes)."""
    cli = _cli()
    m = reader.manifest
    arrays = {r: (kp, e) for kp, e in m.arrays.items()
              if (r := _relative(kp, key)) is not None}
    values = {r: v for kp, v in m.values.items() if (r := _relative(kp, key)) is not None}
    if key is not None and not arrays and not values:
        raise cli.CliError(f"{reader.where} has no entry {key!r}; `pitstop inspect` lists "
                           "its keys")
    if NPZ_META in arrays:
        raise cli.CliError(f"{reader.where}: an array is named {NPZ_META!r}, the name of "
                           "the npz file's own metadata; export the other entries with --key")
    structure = m.structure if key is None else _sub_structure(m.structure, split(key))
    dtypes: dict[str, str] = {}
    total = 0

    def write(tmp: str) -> None:
        nonlocal total
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, (kp, entry) in arrays.items():
                try:
                    a = reader.read_array(kp, entry)
                except Exception as e:  # noqa: BLE001 - corrupt bytes, a vanished file
                    code, why = cli._failure(e, reader.where)
                    raise cli.CliError(why, code) from None
                ml = _ML_BY_DTYPE.get(a.dtype)
                if ml is not None:
                    dtypes[name] = ml
                    a = a.view(f"u{a.dtype.itemsize}")
                total += a.nbytes
                with zf.open(name + ".npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, a, allow_pickle=False)
                del a
            meta = {"format": NPZ_FORMAT, "format_version": 1, "step": m.step,
                    "metrics": encode_value(m.metrics), "values": values, "dtypes": dtypes,
                    "structure": structure}
            with zf.open(NPZ_META + ".npy", "w") as f:
                np.lib.format.write_array(f, np.array(json.dumps(meta, allow_nan=False)),
                                          allow_pickle=False)

    _atomic_write(path, write)
    return len(arrays), total


def read_npz(path: str, key: str | None) -> tuple[Any, int | None, dict[str, Any]]:
    """``(tree, step or None, metrics)`` of an npz file (pitstop's, or any ``np.savez`` one:
    its member names read as key paths)."""
    if not zipfile.is_zipfile(path):
        raise CorruptCheckpointError(f"{path}: not an .npz file (not a zip archive)",
                                     checkpoint=path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CorruptCheckpointError(f"{path}: not a readable .npz file ({e})",
                                     checkpoint=path) from None
    if not hasattr(npz, "files"):
        raise CorruptCheckpointError(f"{path}: a .npy file, not an .npz archive",
                                     checkpoint=path)
    with npz:
        meta: dict[str, Any] = {}
        try:
            if NPZ_META in npz.files:
                meta = json.loads(str(npz[NPZ_META][()]))
                if not isinstance(meta, dict) or meta.get("format") != NPZ_FORMAT:
                    raise ValueError("its __pitstop__ member is not pitstop's metadata")
            leaves: dict[str, Any] = {}
            dtypes = meta.get("dtypes") or {}
            for name in npz.files:
                if name == NPZ_META:
                    continue
                a = npz[name]
                if name in dtypes:
                    a = a.view(ML_DTYPES[dtypes[name]])
                leaves[name] = a
            for kp, v in (meta.get("values") or {}).items():
                leaves[kp] = decode_value(v)
            metrics = decode_value(meta.get("metrics") or {})
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError) as e:
            raise CorruptCheckpointError(f"{path}: cannot read this .npz file ({e})",
                                         checkpoint=path) from None
    structure = meta.get("structure")
    tree: Any
    if structure is not None:
        try:
            tree = unflatten(structure, leaves)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CorruptCheckpointError(f"{path}: its __pitstop__ structure does not match "
                                         f"its arrays ({type(e).__name__}: {e})",
                                         checkpoint=path) from None
    else:
        tree = _nested(leaves, path)
    step = meta.get("step")
    return _select(tree, key, path), step if type(step) is int else None, \
        metrics if isinstance(metrics, dict) else {}


def _select(tree: Any, key: str | None, where: str) -> Any:
    from pitstop.core.tree import select
    return select(tree, key, where)


# ====================================================================== safetensors (numpy)
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
              "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1",
              "BOOL": "?", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "C64": "<c8", "F8_E4M3FNUZ": "float8_e4m3fnuz",
              "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu"}


def read_safetensors(path: str, key: str | None) -> tuple[Any, int | None, dict[str, Any]]:
    """``(tree, step or None, metrics)`` of a .safetensors file, read with numpy alone:
    tensor names split at ``/`` into nested dicts; the values and step that
    ``pitstop export --to safetensors`` put in its ``pitstop`` metadata come back."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 << 20):
                raise ValueError("its header length is past the end of the file")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
            base = 8 + n
            leaves: dict[str, Any] = {}
            meta = header.pop("__metadata__", None) or {}
            for name, info in header.items():
                descr = _ST_DTYPES.get(info.get("dtype"))
                if descr is None:
                    raise ValueError(f"tensor {name!r} has dtype {info.get('dtype')!r}, "
                                     "which numpy cannot hold")
                dt = ML_DTYPES[descr] if descr in ML_DTYPES else np.dtype(descr)
                shape = [int(d) for d in info["shape"]]
                start, stop = (int(x) for x in info["data_offsets"])
                count = int(np.prod(shape, dtype=np.int64))
                if not 0 <= start <= stop <= size - base or stop - start != count * dt.itemsize:
                    raise ValueError(f"tensor {name!r} lies outside the file")
                f.seek(base + start)
                a = np.fromfile(f, dtype=dt, count=count) if count else np.empty(0, dt)
                if a.size != count:
                    raise ValueError(f"tensor {name!r} is cut short")
                comps = name.split("/")
                leaves["/".join(join("", c) for c in comps)] = a.reshape(shape)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise CorruptCheckpointError(f"{path}: not a readable .safetensors file ({e})",
                                     checkpoint=path) from None
    step = None
    metrics: dict[str, Any] = {}
    if isinstance(meta, dict) and isinstance(meta.get("pitstop"), str):
        try:
            doc = json.loads(meta["pitstop"])
            for name, kp in (doc.get("keys") or {}).items():
                plain = "/".join(join("", c) for c in name.split("/"))
                if plain in leaves and isinstance(kp, str):
                    leaves[kp] = leaves.pop(plain)
            for kp, v in (doc.get("values") or {}).items():
                leaves[kp] = decode_value(v)
            step = doc.get("step") if type(doc.get("step")) is int else None
        except (ValueError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{path}: its pitstop metadata is malformed ({e})",
                                         checkpoint=path) from None
    return _select(_nested(leaves, path), key, path), step, metrics


# ====================================================================== format detection
def _is_orbax(path: str) -> bool:
    """A directory Orbax wrote: its marker files in it, or in a step directory of it."""
    markers = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "manifest.ocdbt",
               "commit_success.txt")

    def marked(d: str, depth: int) -> bool:
        try:
            names = os.listdir(d)
        except OSError:
            return False
        if any(n in markers for n in names):
            return True
        return depth > 0 and any(
            marked(os.path.join(d, n), depth - 1) for n in names
            if not n.startswith(".") and os.path.isdir(os.path.join(d, n)))

    return marked(path, 2)


def _is_pitstop(src: str) -> bool:
    """A pitstop run directory (``.pitstop/`` in it) or one of its checkpoints (a
    ``manifest.json`` in it, ``.pitstop/`` beside it)."""
    here = os.path.abspath(src)
    return os.path.isdir(os.path.join(here, ".pitstop")) or (
        os.path.isfile(os.path.join(here, "manifest.json"))
        and os.path.isdir(os.path.join(os.path.dirname(here), ".pitstop")))


def _is_keras(src: str) -> bool:
    """An HDF5 file (Keras's ``.weights.h5`` and legacy ``.h5``) or a ``.keras`` zip."""
    try:
        with open(src, "rb") as f:
            head = f.read(8)
        if head == b"\x89HDF\r\n\x1a\n":
            return True
        if head[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(src) as zf:
                names = set(zf.namelist())
            return "config.json" in names and "model.weights.h5" in names
    except (OSError, zipfile.BadZipFile):
        pass
    return False


def detect(src: str) -> str | None:
    """The format of ``src`` by its files (no framework imported), or None."""
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, ".metadata")):
            return "dcp"
        if _is_orbax(src):
            return "orbax"
        return "tf" if _tf_latest(src) else None
    if os.path.exists(src + ".index"):
        return "tf"
    if not os.path.isfile(src):
        return None
    try:
        with open(src, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(src) as zf:
                names = zf.namelist()
        except (zipfile.BadZipFile, OSError):
            return None
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        if any(n.endswith("data.pkl") for n in names):
            return "torch"
        return None
    if len(head) >= 10 and head[8:10] in (b'{"', b"{ ", b"{}"):
        return "safetensors"
    if head[:1] == b"\x80" and src.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"  # a legacy (pre-zip) torch.save file
    return None


def _tf_latest(directory: str) -> str | None:
    """The newest checkpoint prefix a TensorFlow ``checkpoint`` state file in ``directory``
    names (what ``tf.train.latest_checkpoint`` gives), when its ``.index`` is there."""
    try:
        with open(os.path.join(directory, "checkpoint"), encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, UnicodeDecodeError):
        return None
    m = re.search(r'^model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', text, re.M)
    if m is None:
        return None
    prefix = os.path.join(directory, re.sub(r"\\(.)", r"\1", m.group(1)))
    return prefix if os.path.isfile(prefix + ".index") else None


def _tf_prefix(src: str) -> str:
    if os.path.isdir(src):
        return _tf_latest(src) or src
    if src.endswith(".index") and os.path.isfile(src):
        return src[: -len(".index")]
    if ".data-" in os.path.basename(src) and os.path.isfile(src):
        return src[: src.rindex(".data-")]
    return src


# ====================================================================== export
def cmd_export(args: argparse.Namespace) -> int:
    """``pitstop export``."""
    cli = _cli()
    fmt = args.to.lower()
    if fmt not in EXPORTS:
        raise cli.CliError(f"--to {args.to}: unknown format; give one of npz, safetensors, "
                           "torch, orbax")
    if fmt == "tf":
        raise cli.CliError("--to tf: pitstop cannot write native TensorFlow checkpoints; "
                           "restore the checkpoint into your model with "
                           "pitstop.adapters.tf.Checkpoint and save it with tf.train.Checkpoint")
    cli._encryption()
    storage, want = cli._locate(args.ckpt, args.step, None, "export")
    step, naming = cli._pick_live(storage, want, "export")
    name = naming.name(step)
    where = storage.path_of(name)
    run = os.path.basename(storage.location.rstrip("/")) or "checkpoint"
    out = args.output or f"{run}-step{step}{_EXT[fmt]}"
    _outside_run(out, storage.location)
    if fmt != "orbax":
        if os.path.isdir(out):
            raise cli.CliError(f"{out}: a directory; give the file to write with -o")
        if os.path.lexists(out) and not args.force:
            raise cli.CliError(f"{out}: already exists; pass --force to replace it, or -o "
                               "another file")
    with cli._lease(storage, name):
        reader = cli._reader(storage, name, naming)
        m = cli._checked(reader, where)
        if fmt == "npz":
            count, nbytes = write_npz(reader, out, args.key)
        else:
            count, nbytes = _export_framework(fmt, storage.location, step, out, args.key, m)
    print(f"exported {count} arrays ({cli.human_size(nbytes)}) of step {step} of "
          f"{storage.location} to {out} ({fmt})")
    _say_not_kept(fmt, step, m.metrics)
    left = [k for k in m.rank_specific() if _relative(k, args.key) is not None
            or (args.key is not None and args.key.startswith(k + "/"))]
    if left:
        more = f" and {len(left) - 10} more" if len(left) > 10 else ""
        print(f"note: written by {m.world} ranks: exported rank 0's view; {len(left)} key(s) "
              f"hold other values on other ranks, not exported: "
              f"{', '.join(cli._shown(k) for k in left[:10])}{more}")
    return 0


#: what each format's file cannot hold of a checkpoint (npz keeps everything)
_KEEPS_NO_STEP = {"torch": "a torch.save file"}
_KEEPS_NO_METRICS = {"torch": "a torch.save file", "safetensors": "a .safetensors file",
                     "orbax": "an Orbax checkpoint written by export"}


def _say_not_kept(fmt: str, step: int, metrics: dict[str, Any]) -> None:
    """A note line naming what the exported file lacks (the step, the metrics), so that a
    later ``pitstop import`` of it is not a surprise."""
    cli = _cli()
    lost = []
    if fmt in _KEEPS_NO_STEP:
        lost.append(f"the step ({step}: pitstop import it with --step {step})")
    if metrics and fmt in _KEEPS_NO_METRICS:
        names = ", ".join(cli._shown(k) for k in list(metrics)[:10])
        lost.append(f"the metrics ({names}{' ...' if len(metrics) > 10 else ''})")
    if lost:
        what = _KEEPS_NO_STEP.get(fmt) or _KEEPS_NO_METRICS[fmt]
        print(f"note: {what} does not keep {' or '.join(lost)}")


def _outside_run(out: str, run: str) -> None:
    """Refuse an OUT that is the run directory or inside one of its checkpoints (or its
    ``.pitstop`` folder): written there, the export would replace the files of the very
    checkpoint it reads, or leave a foreign file inside a committed checkpoint."""
    if "://" in run:
        return
    cli = _cli()
    root = os.path.realpath(run)
    # the folder resolved, the name not: a link named OUT is replaced, never its target
    where = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(out))),
                         os.path.basename(os.path.abspath(out)))
    try:
        rel = os.path.relpath(where, root)
    except ValueError:  # another drive
        return
    parts = rel.split(os.sep)
    if rel == "." or (parts[0] != ".." and len(parts) > 1):
        raise cli.CliError(f"{out}: the run directory {run} or inside its checkpoints; "
                           "give -o a path outside it (inside the run directory, only "
                           "beside its checkpoints)")


def _export_framework(fmt: str, directory: str, step: int, out: str, key: str | None,
                      m: Any) -> tuple[int, int]:
    cli = _cli()
    from pitstop.core.restore.stream import nbytes_of
    picked = {kp: e for kp, e in m.arrays.items() if _relative(kp, key) is not None}
    if key is not None and not picked and not any(
            _relative(kp, key) is not None for kp in m.values):
        raise cli.CliError(f"{directory}: step {step} has no entry {key!r}; `pitstop inspect` "
                           "lists its keys")
    try:
        if fmt == "orbax":
            try:
                from pitstop.adapters.jax.orbax import export_orbax
            except ImportError as e:
                raise cli.CliError(f"--to orbax needs jax and orbax-checkpoint ({e}); "
                                   "pip install 'pitstop[jax]'") from None
            _quiet_absl()
            export_orbax(directory, step, out, key=key)
        else:
            try:
                from pitstop.adapters.torch.convert import export_safetensors, export_torch_save
                if fmt == "safetensors":
                    import safetensors.torch  # noqa: F401
            except ImportError as e:
                raise cli.CliError(f"--to {fmt} needs torch and safetensors ({e}); "
                                   f"{_TORCH_EXTRA}") from None
            if fmt == "torch":
                export_torch_save(directory, out, step=step, key=key)
            else:
                export_safetensors(directory, out, step=step, key=key)
    except CorruptCheckpointError:
        raise
    except CheckpointError as e:
        raise cli.CliError(_cli_words(cli._one_line(e))) from None
    return len(picked), sum(nbytes_of(e) for e in picked.values())


# ====================================================================== import
def _framework_missing(fmt: str, e: ImportError) -> Any:
    cli = _cli()
    extra = {"torch": _TORCH_EXTRA, "dcp": _TORCH_EXTRA, "tf": "pip install 'pitstop[tf]'",
             "orbax": "pip install 'pitstop[jax]'"}[fmt]
    return cli.CliError(f"importing a {fmt} checkpoint needs its framework ({e}); {extra}")


def _save_tree(tree: Any, dest: str, step: int, metrics: dict[str, Any] | None,
               naming: dict[str, Any] | None = None) -> int:
    """Save a tree of numpy arrays and values as committed step ``step`` of ``dest``."""
    from pitstop.core.manager import CheckpointManager
    key = _refuse_existing(dest, step)
    opts: dict[str, Any] = dict(async_save=False, save_on_signals=None, memory_tier=False,
                                encryption=key)
    if naming and not os.path.isdir(os.path.join(dest, ".pitstop")):
        opts.update(naming)
    mgr = CheckpointManager(dest, **opts)
    try:
        mgr.save(step, tree, metrics).wait()
    finally:
        mgr.close()
    return step


def _refuse_existing(dest: str, step: int | None) -> Any:
    """Raise StepExistsError when ``dest`` has ``step``; returns the key of an encrypted
    ``dest`` (from PITSTOP_ENCRYPTION_KEY), so the import is encrypted as its checkpoints."""
    from pitstop.core.errors import StepExistsError
    from pitstop.core.manager import DirectoryReader
    if "://" not in dest and not os.path.isdir(dest):
        return None  # (a URL's directory is looked up in its store)
    mgr = DirectoryReader(dest)
    try:
        exists = step in mgr.all_steps()
        key = mgr.encryption
    finally:
        mgr.close()
    if exists:
        raise StepExistsError(f"{dest} already has a checkpoint of step {step}; pitstop never "
                              "overwrites one: import with another --step, into another "
                              "directory, or delete that checkpoint first")
    return key


def _check_dest(dest: str) -> None:
    """DEST can be a pitstop run directory: a directory or nothing yet, in a writable place."""
    cli = _cli()
    if dest.startswith("memory://"):
        raise cli.CliError(f"{dest}: the memory:// file system lives inside one process, so "
                           "the import would vanish when this command exits; give a "
                           "directory or an object store URL")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise cli.CliError(f"{dest}: exists and is not a directory; give the run directory "
                           "to import into")
    above = os.path.abspath(dest)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise cli.CliError(f"{dest}: cannot be made ({above} is a file); give a directory")
    if not os.access(above, os.W_OK):
        raise cli.CliError(f"{dest}: cannot write there ({above} is not writable)")


def cmd_import(args: argparse.Namespace) -> int:
    """``pitstop import``."""
    cli = _cli()
    src, dest = args.src, args.dest
    fmt = args.fmt.lower() if args.fmt else None
    if fmt in ("keras", "h5", "hdf5") or (fmt is None and _is_keras(src)):
        raise cli.CliError(
            f"{src}: Keras files (.keras, .weights.h5, .h5) are not supported by pitstop "
            "import; load them into your model (keras.models.load_model or "
            "model.load_weights) and save it with a pitstop CheckpointManager (docs/keras.md)")
    if fmt is not None and fmt not in IMPORTS:
        raise cli.CliError(f"--from {args.fmt}: unknown format; give one of "
                           f"{', '.join(IMPORTS)}")
    if fmt == "tf" or (fmt is None and (src.endswith(".index") or ".data-" in
                                        os.path.basename(src) or _tf_latest(src))):
        src = _tf_prefix(src)
    if not os.path.exists(src) and not os.path.exists(src + ".index"):
        raise cli.CliError(f"{src}: no such file or directory; check the path")
    if fmt is None:
        fmt = detect(src)
        if fmt is None and _is_pitstop(src):
            raise cli.CliError(
                f"{src}: already a pitstop checkpoint directory, nothing to import; every "
                "command reads it as it is (pitstop export writes it to another format)")
        if fmt is None:
            raise cli.CliError(f"cannot tell the format of {src}; give --from (one of "
                               f"{', '.join(IMPORTS)})")
    if args.step is not None and not 0 <= args.step <= MAX_STEP:
        raise cli.CliError(f"--step {args.step}: steps are integers from 0 to {MAX_STEP}")
    if args.key is not None and fmt == "orbax":
        raise cli.CliError("--key is not supported for Orbax imports; import the whole "
                           "checkpoint (pitstop export --key can pick an entry later)")
    _check_dest(dest)
    cli._encryption()
    if args.keep_prefixes and fmt not in ("torch", "dcp"):
        raise cli.CliError(f"--keep-prefixes is for torch and dcp imports, not {fmt}")
    words = _CliWordsFilter()
    logging.getLogger("pitstop").addFilter(words)
    try:
        steps = _import(fmt, src, dest, args.step, args.key,
                        strip=() if args.keep_prefixes else ("module.",))
    except CheckpointError as e:
        text = _cli_words(cli._one_line(e))
        if fmt == "orbax" and "orbax_options=" in text:
            text = text.replace("pass its options as orbax_options=", _orbax_steps_hint(src, dest))
        raise cli.CliError(text) from None
    finally:
        logging.getLogger("pitstop").removeFilter(words)
    for step in steps:
        storage, _ = cli._locate(dest, step, None, "import")
        picked, naming = cli._pick_live(storage, step, "import")
        m = cli._reader(storage, naming.name(picked), naming).manifest
        print(f"imported {len(m.arrays)} arrays ({cli.human_size(m.nbytes)}) from {src} "
              f"as step {step} of {storage.location}")
    return 0


def _orbax_steps_hint(src: str, dest: str) -> str:
    """What a command-line user does with an Orbax manager directory whose steps are named
    otherwise than by plain numbers (its ``step_prefix``): import each step's directory."""
    try:
        names = sorted(n for n in os.listdir(src) if not n.startswith(".")
                       and "tmp" not in n and os.path.isdir(os.path.join(src, n)))
    except OSError:
        names = []
    one = os.path.join(src, names[0]) if names else os.path.join(src, "STEP_DIR")
    return (f"import each step's own directory, with its step (pitstop import {one} {dest} "
            "--step N)")


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null meanwhile: the log lines TensorFlow's native
    code prints as it loads (an ImportError is still raised, and reported after)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _import(fmt: str, src: str, dest: str, step: int | None, key: str | None,
            strip: tuple[str, ...] = ("module.",)) -> list[int]:
    """Import ``src`` of format ``fmt``; returns the steps written."""
    if fmt in ("npz", "safetensors"):
        if not os.path.isfile(src):
            cli = _cli()
            raise cli.CliError(f"{src}: not a file; a {fmt} checkpoint is one file")
        read = read_npz if fmt == "npz" else read_safetensors
        tree, own, metrics = read(src, key)
        return [_save_tree(tree, dest, step if step is not None else own or 0, metrics)]
    if fmt in ("torch", "dcp"):
        try:
            from pitstop.adapters.torch.convert import import_dcp, import_torch_save
        except ImportError as e:
            raise _framework_missing(fmt, e) from None
        s = 0 if step is None else step
        with warnings.catch_warnings():
            # torch's notes as it rebuilds tensors ("ComplexHalf support is experimental"):
            # about torch, not the file; the command's answer stays one line
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\.|$)")
            if fmt == "torch":
                if not os.path.isfile(src):
                    raise _cli().CliError(f"{src}: not a file; a torch.save checkpoint is "
                                          "one file")
                return [import_torch_save(src, dest, s, key=key, strip_prefixes=strip)]
            if not os.path.isdir(src):
                raise _cli().CliError(f"{src}: not a directory; a DCP checkpoint is a "
                                      "directory holding .metadata")
            return [import_dcp(src, dest, s, key=key, strip_prefixes=strip)]
    if fmt == "tf":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        try:
            with _native_stderr_muted():  # TensorFlow's start-up chatter (oneDNN, absl)
                from pitstop.adapters.tf.convert import import_native
        except ImportError as e:
            raise _framework_missing(fmt, e) from None
        return [import_native(src, dest, step, key=key)]
    try:
        from pitstop.adapters.jax.orbax import import_orbax
    except ImportError as e:
        raise _framework_missing(fmt, e) from None
    _quiet_absl()
    key = _refuse_existing(dest, None)  # an encrypted DEST's key (its steps: import_orbax's)
    return import_orbax(src, dest, step=step, **({"encryption": key} if key else {}))


def _quiet_absl() -> None:
    """Orbax logs routine notes as warnings ("Given directory is read only"): the command
    shows only errors of it."""
    import logging
    logging.getLogger("absl").setLevel(logging.ERROR)


__all__ = ["add_parsers", "cmd_export", "cmd_import", "detect", "read_npz",
           "read_safetensors", "write_npz"]
