"""The ``pitstop`` command: supervise training jobs; look at, check, compare, convert and
tidy checkpoint directories.

    pitstop run [--dir DIR] -- CMD...    run a training command, restart it when it dies
                                         (back-off, crash-loop stop), forward signals

    pitstop ls DIR                       every checkpoint: time, size, metrics, and its status
                                         (what retention keeps and why; incomplete, corrupt,
                                         abandoned, unreadable); the newest marked
    pitstop inspect DIR [--step N]       one checkpoint's manifest: who wrote it (frameworks
                                         and versions), arrays, values, metrics
    pitstop verify DIR [--step N|--all]  read every array and check its hash (a progress bar
                                         on stderr when it is a terminal)
    pitstop gc DIR                       remove leftovers of interrupted saves
    pitstop diff A B                     which arrays and values differ, and by how much
    pitstop export CKPT --to FORMAT      as .npz, .safetensors, a torch.save file or Orbax
    pitstop import SRC DEST              torch.save, DCP, TensorFlow, Orbax, safetensors, npz
    pitstop demo [--framework F]         train, kill -9, restart under `pitstop run`, compare

Every command that reads one checkpoint takes the run directory (its newest, or ``--step N``)
or the checkpoint's own path (``runs/exp1/step_0000000300``).

DIR is a local directory or an object-store URL (``s3://bucket/prefix``, ``memory://...``,
any fsspec URL): credentials and the endpoint come from the standard AWS environment and
files (``AWS_ENDPOINT_URL`` ...), and ``-o KEY=VALUE`` passes storage options (e.g.
``-o endpoint_url=http://127.0.0.1:9000``, ``-o anon=true``); see docs/storage.md.

Every subcommand's ``--help`` ends with an example, and a bad argument is one line
(``pitstop inspect: --step: invalid int value: 'x'; see `pitstop inspect --help```), exit
status 2: subcommands added with ``sub.add_parser`` get both rules from
:class:`ArgumentParser` (the test walks every subparser).

``ls``, ``inspect`` and ``verify`` open the directory read-only (no lock, nothing written),
so they work while a trainer is writing to it. Exit status: 0 fine, 1 a checkpoint failed
verification, 2 anything else that went wrong (bad arguments, no such directory or step,
directory busy or read-only). A failure is one line ``pitstop: ...`` on stderr that names
the path and what to do; the command never prints a traceback.

Names are those of :mod:`pitstop.core.directory.names`, by the naming the directory records in
``.pitstop/directory.json``: a checkpoint is ``step_<10 digits>`` by default (``ckpt-<step>``,
``<step>``, ... where the directory was created with another ``step_prefix`` / ``step_digits``);
one moved aside is ``<name>.corrupt-<time>-<4 hex>`` or ``<name>.abandoned-<time>-<4 hex>``;
anything else (``step_5`` included) is not pitstop's, is listed as such and is never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DirectoryLockedError,
    EncryptionKeyError,
)
from pitstop.core.format.decoding import load_json
from pitstop.core.format.schema import Manifest
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.restore.stream import nbytes_of
from pitstop.core.save import memtier
from pitstop.core.storage import FsspecStorage, ObjectStoreError, Storage, is_url
from pitstop.core.storage import local as _local
from pitstop.core.storage.local import MANIFEST, META_DIR, LocalStorage
from pitstop.core.storage.objectstore import Leftover, ObjectListing

OK, CORRUPT, ERROR = 0, 1, 2
#: the status of a command whose reader closed the pipe (128 + SIGPIPE, as a shell reports it)
BROKEN_PIPE = 141
#: what pitstop names the temporaries of interrupted writes of .pitstop/ files (a file in
#: .pitstop/); those of interrupted saves and deletions (a directory in DIR) are the naming's
_TMP_META = getattr(_local, "_TMP_META", re.compile(r"^.+\.tmp-[0-9a-f]{8}$"))
#: what the memory tier names its files after the directory's prefix: ``-<slot>.buf``, its
#: description ``-<slot>.json``, and ``-<slot>.json.tmp`` while a description is being
#: replaced (memtier.MemoryTier._write_text); nothing else is the tier's
_TIER_FILE = r"-(\d+)\.(buf|json|json\.tmp)"
#: a directory id that can name memory-tier files (pitstop writes uuid4().hex)
_DIRECTORY_ID = re.compile(r"^[0-9A-Za-z_-]{1,128}$")
#: errors of the environment, not of a checkpoint: it could not be checked, not "corrupt"
_ENVIRONMENT = {errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE, errno.ENOMEM}


class CliError(Exception):
    """A user-facing error: printed as ``pitstop: <message>``, exit status ``code``."""

    def __init__(self, message: str, code: int = ERROR) -> None:
        super().__init__(message)
        self.code = code


# ====================================================================== helpers
def human_size(n: float) -> str:
    try:
        n = float(n)
    except OverflowError:
        return f"{n} B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _time(unix: float) -> str:
    if not unix:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))
    except (OverflowError, OSError, ValueError, TypeError):  # NaN, or past year 9999
        return f"? ({unix!r})"


def _metric_text(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float):
            v = f"{v:.6g}"
        parts.append(f"{_shown(k)}={_shown(v)}")
    return " ".join(parts) or "-"


def _short(obj: Any, width: int = 100) -> str:
    try:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = repr(obj)
    text = _shown(text)
    return text if len(text) <= width else text[: width - 3] + "..."


#: Python advice in core's messages that a command-line user cannot take (the command
#: reads the key from PITSTOP_ENCRYPTION_KEY, which the same messages name)
_PYTHON_ONLY = re.compile(r",? or pass encryption=pitstop\.Encryption\([^)]*\)")


def _one_line(text: object) -> str:
    return _shown(_PYTHON_ONLY.sub("", " ".join(str(text).splitlines())))


def _shown(text: object) -> str:
    """Text read from a checkpoint (a key, a file or metric name) as printable text on one
    line: a newline, an escape sequence or a bidi override in it is escaped, so a manifest
    cannot forge output lines ("step 2: ok") or drive the terminal."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace")
                   .decode("ascii") for c in s)


def _why(e: BaseException) -> str:
    """An exception's reason in one line (an OSError's file and strerror)."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    if isinstance(e, CheckpointError):
        return str(e)
    if isinstance(e, RecursionError):
        return "nested too deeply to parse"
    return f"{type(e).__name__}: {e}"


def _open(directory: str, options: list[str] | None = None) -> Storage:
    """The directory's storage, opened without creating or writing anything: a local
    directory, or an object-store URL (``options``: ``KEY=VALUE`` storage options)."""
    if is_url(directory):
        return _open_url(directory, options or [])
    if options:
        raise CliError(f"{directory}: -o/--storage-option is for object-store URLs "
                       "(s3://bucket/prefix ...), not local directories")
    if directory.lower().startswith("file://"):
        directory = directory[len("file://"):]
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        if os.path.isfile(directory + ".index"):  # a tf.train path: <prefix>.index beside
            raise CliError(
                f"{directory}: a tf.train checkpoint ({os.path.basename(directory)}.index and "
                ".data-* files), not a pitstop one; pitstop.adapters.tf restores it as it is, "
                f"`pitstop import {directory} DEST` makes a pitstop checkpoint of it") from None
        link = " (a symbolic link to nothing)" if os.path.islink(directory) else ""
        raise CliError(f"{directory}: no such directory{link}; check the path") from None
    except NotADirectoryError:
        raise CliError(
            f"{directory}: no such directory (a part of the path is a file); check the path"
        ) from None
    except OSError as e:
        raise CliError(
            f"{directory}: cannot access it ({e.strerror}); check the path and your permissions"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "a device, pipe or socket"
        raise CliError(
            f"{directory}: not a directory ({kind}); give the checkpoint "
            "directory, the one that holds .pitstop/ and the step_* checkpoints"
        )
    return LocalStorage(directory, create=False)


def _storage_options(options: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as storage options; a value is read as JSON when it is JSON
    (``true``, ``5``, ``{"region_name": "eu-west-1"}``), else as a string."""
    out: dict[str, Any] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"-o {item!r}: storage options are KEY=VALUE, e.g. "
                           "-o endpoint_url=http://127.0.0.1:9000")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def _open_url(url: str, options: list[str]) -> FsspecStorage:
    """An object-store directory, checked to be reachable (its bucket exists, the
    credentials may list it); nothing is written."""
    try:
        storage = FsspecStorage(url, create=False, **_storage_options(options))
    except CheckpointError as e:
        raise CliError(_one_line(e)) from None
    try:
        storage.check()
    except OSError as e:
        raise CliError(f"{_one_line(_why(e))}; check the URL, the credentials and the "
                       "endpoint (AWS_ENDPOINT_URL, or -o endpoint_url=...)") from None
    return storage


def _naming(storage: Storage) -> Naming:
    """How the directory names its checkpoints (``.pitstop/directory.json``): the default
    where none is recorded, or where that file is unreadable (gc then says so)."""
    try:
        raw = storage.read_meta("directory.json")
        doc = load_json(raw) if raw is not None else None
    except (OSError, ValueError, RecursionError):
        return DEFAULT
    if not isinstance(doc, dict) or "naming" not in doc:
        return DEFAULT  # none yet, or written before namings were recorded
    try:
        return Naming.from_json(doc["naming"])
    except CheckpointError as e:
        raise CliError(
            f"{os.path.join(storage.location, META_DIR, 'directory.json')}: records no valid "
            f"checkpoint naming ({_one_line(e)}); pitstop cannot tell which entries are its "
            'checkpoints: write back the naming they have, e.g. "naming": {"step_prefix": '
            '"step_", "step_digits": 10} for step_0000000042'
        ) from None


def _looks_like(naming: Naming, entry: str) -> bool:
    """A foreign entry spelled almost like one of the naming's checkpoints (``step_5``)."""
    rest = entry[len(naming.prefix):] if entry.startswith(naming.prefix) else None
    return rest is not None and (bool(naming.prefix) or rest[:1].isdigit())


@dataclass
class Listing:
    """What a checkpoint directory holds, by pitstop's names (:mod:`pitstop.core.directory.names`)."""

    location: str
    #: how the directory names its checkpoints (``step_<10 digits>`` by default)
    naming: Naming = DEFAULT
    #: committed checkpoints: directories named by ``naming`` with a manifest.json
    steps: list[int] = field(default_factory=list)
    #: (name, step, reason) of checkpoints moved aside: reason "corrupt" or "abandoned"
    aside: list[tuple[str, int, str]] = field(default_factory=list)
    #: (name, what is wrong) of entries named like checkpoints that are no checkpoint
    odd: list[tuple[str, str]] = field(default_factory=list)
    #: names pitstop did not make (``step_5`` included): listed, never touched
    foreign: list[str] = field(default_factory=list)
    #: hidden pitstop run directories inside this one (``.pitstop-best-``: the
    #: checkpoints of a second tf.train checkpoint name)
    nested: list[str] = field(default_factory=list)
    #: leftovers of interrupted saves: ``.tmp-<name>-<8 hex>`` directories and
    #: ``.pitstop/<file>.tmp-<8 hex>`` files (what gc removes)
    tmp: list[str] = field(default_factory=list)
    has_meta: bool = False
    #: an object-store directory: its objects, and its interrupted operations (what gc
    #: removes; ``tmp`` names their markers)
    objects: ObjectListing | None = None
    leftovers: list[Leftover] = field(default_factory=list)
    #: the object-store directory listed (to look at the directory above it)
    storage: FsspecStorage | None = None


def _kind(path: str) -> int:
    try:
        return stat.S_IFMT(os.lstat(path).st_mode)
    except OSError:
        return 0


def _scan_url(storage: FsspecStorage) -> Listing:
    """:func:`_scan` of an object-store directory: the same classes of entries, read from
    one listing of its objects (a checkpoint is a prefix holding manifest.json)."""
    loc = storage.location
    try:
        objects = storage.scan()
        naming = _naming(storage)
        leftovers = storage.leftovers(naming, objects)
    except OSError as e:
        raise CliError(f"{loc}: cannot list it ({_one_line(_why(e))})") from None
    out = Listing(loc, naming, objects=objects, leftovers=leftovers, storage=storage)
    marked = {item.entry for item in leftovers}
    saving = {item.name for item in leftovers if item.op in ("save", "delete")}
    for entry in sorted(set(objects.dirs) | set(objects.files)):
        if entry == META_DIR:
            continue
        if naming.parse_tmp(entry) is not None:
            if entry not in marked and entry + "/" not in marked:
                out.foreign.append(entry)  # named like pitstop's, but no marker it wrote
            continue
        if entry.startswith("."):
            continue
        step = naming.parse(entry)
        if step is not None:
            files = objects.dirs.get(entry)
            if files is not None and MANIFEST in files:
                out.steps.append(step)
            elif entry in saving:
                continue  # the objects of an interrupted save: listed with its marker
            elif files is None:
                out.odd.append((entry, "an object, not a checkpoint directory"))
            else:
                out.odd.append((entry, "no manifest.json: not a committed checkpoint"))
            continue
        _aside_or_foreign(out, naming, entry)
    out.steps.sort()
    out.tmp = [item.entry for item in leftovers]
    out.has_meta = bool(objects.meta)
    return out


def _aside_or_foreign(out: Listing, naming: Naming, entry: str) -> None:
    """An entry that is no checkpoint: one moved aside by pitstop, or someone else's."""
    aside = naming.parse_aside(entry)
    if aside is not None:
        out.aside.append((entry, aside[0], aside[1]))
    else:
        out.foreign.append(entry)


def _scan(storage: Storage) -> Listing:
    if isinstance(storage, FsspecStorage):
        return _scan_url(storage)
    loc = storage.location
    try:
        entries = sorted(os.listdir(loc))
    except OSError as err:
        raise CliError(f"{loc}: cannot list it ({err.strerror}); check your permissions") from None
    naming = _naming(storage)
    out = Listing(loc, naming)
    for entry in entries:
        path = os.path.join(loc, entry)
        if entry == META_DIR:
            continue
        if naming.parse_tmp(entry) is not None:
            # pitstop's temporaries are directories; a file or link of that name is not one
            # (a symlinked step that retention was deleting leaves its link: the link alone
            # is pitstop's, removed without following it)
            ours = _kind(path) == stat.S_IFDIR or (
                entry.startswith(".tmp-deleting-") and _kind(path) == stat.S_IFLNK)
            (out.tmp if ours else out.foreign).append(entry)
            continue
        if entry.startswith("."):
            if os.path.isdir(os.path.join(path, META_DIR)) and not os.path.islink(path):
                out.nested.append(entry)  # a run directory of its own: ls points to it
            continue  # other hidden files: none of pitstop's business
        step = naming.parse(entry)
        if step is not None:
            manifest = os.path.join(path, MANIFEST)
            if os.path.isfile(manifest):  # what storage.list_checkpoints() counts
                out.steps.append(step)
            elif not os.path.isdir(path):
                out.odd.append((entry, "a file, not a checkpoint directory"))
            elif os.path.lexists(manifest):
                out.odd.append(
                    (
                        entry,
                        "manifest.json is not a regular file (a directory, or "
                        "a link to nothing): not a committed checkpoint",
                    )
                )
            else:
                out.odd.append((entry, "no manifest.json: not a committed checkpoint"))
            continue
        _aside_or_foreign(out, naming, entry)
    out.steps.sort()
    meta = os.path.join(loc, META_DIR)
    out.has_meta = os.path.isdir(meta)
    if out.has_meta:
        try:
            meta_entries = sorted(os.listdir(meta))
        except OSError as err:
            raise CliError(
                f"{meta}: cannot list it ({err.strerror}); check your permissions"
            ) from None
        for entry in meta_entries:
            if _TMP_META.match(entry):
                is_file = _kind(os.path.join(meta, entry)) == stat.S_IFREG
                (out.tmp if is_file else out.foreign).append(f"{META_DIR}/{entry}")
    return out


def _no_meta(listing: Listing) -> str:
    if listing.objects is not None:
        if META_DIR in listing.objects.files:
            return f"{META_DIR} is an object, not a directory"
        return f"no {META_DIR}/ inside"
    meta = os.path.join(listing.location, META_DIR)
    if os.path.lexists(meta):
        return f"{META_DIR} is not a directory"
    return f"no {META_DIR}/ inside"


def _as_checkpoint(listing: Listing) -> tuple[Storage, int] | None:
    """When the listed directory is itself one committed checkpoint (``.../step_0000000003``):
    the storage of the run directory that holds it, and its step; else None."""
    loc = listing.location
    above: Storage | None
    if listing.objects is not None:
        above = listing.storage.parent() if listing.storage is not None else None
        if MANIFEST not in listing.objects.files or above is None:
            return None
        base = loc.rstrip("/").rpartition("/")[2]
    else:
        # the real path: a symlink to a checkpoint (``latest -> run/step_0000000003``) names
        # the checkpoint by its target's name and run directory, not the link's
        real = os.path.realpath(loc)
        parent = os.path.dirname(real)
        if not os.path.isfile(os.path.join(loc, MANIFEST)) or parent == real:
            return None
        above, base = LocalStorage(parent, create=False), os.path.basename(real)
    try:  # the naming of the directory that holds it
        naming = _naming(above)
    except CliError:
        naming = DEFAULT
    step = naming.parse(base)
    return None if step is None or above is None else (above, step)


def _single_checkpoint_hint(listing: Listing, command: str) -> str:
    """When DIR is itself one checkpoint (a common slip), how to name it instead."""
    one = _as_checkpoint(listing)
    if one is None:
        return ""
    above, step = one
    which = f" --step {step}" if command in ("inspect", "verify") else ""
    return (f"; {listing.location} is one checkpoint, give the directory that holds it: "
            f"pitstop {command} {above.location}{which}")


def _locate(path: str, step: int | None, options: list[str] | None, command: str
            ) -> tuple[Storage, int | None]:
    """The run directory's storage and the step a command that reads one checkpoint asks
    for: ``path`` is a run directory (``step``: the one given with --step, None for the
    newest) or a checkpoint's own directory (``.../step_0000000003``: that step)."""
    storage = _open(path, options)
    listing = _scan(storage)
    if listing.steps or listing.has_meta:
        return storage, step
    one = _as_checkpoint(listing)
    if one is None:
        return storage, step  # the command's own message says what is missing here
    above, own = one
    if step is not None and step != own:
        raise CliError(
            f"{listing.location} is the checkpoint of step {own}, and --step {step} asks for "
            f"another: give the run directory instead (pitstop {command} {above.location} "
            f"--step {step}), or drop --step")
    return above, own


def _no_checkpoint(listing: Listing, command: str) -> str:
    loc = listing.location
    hint = _single_checkpoint_hint(listing, command)
    if hint:
        return f"{loc}: no committed checkpoint inside{hint}"
    look_alike = [f for f in listing.foreign if _looks_like(listing.naming, f)]
    if look_alike:
        return (
            f"{loc}: no committed checkpoint ({', '.join(look_alike[:5])} are not "
            f"pitstop's: this directory names a checkpoint {listing.naming.describe()})"
        )
    if not listing.has_meta:
        return (
            f"{loc}: no committed checkpoint, and {_no_meta(listing)}: not a pitstop "
            "checkpoint directory; check the path"
        )
    if listing.odd:
        return (
            f"{loc}: no committed checkpoint ({', '.join(n for n, _ in listing.odd[:5])} "
            f"are not committed checkpoints; `pitstop ls {loc}` says why)"
        )
    return f"{loc}: no committed checkpoint (nothing was saved here yet)"


def _pick(listing: Listing, step: int | None, command: str) -> int:
    steps = listing.steps
    if not steps:
        raise CliError(_no_checkpoint(listing, command))
    if step is None:
        return steps[-1]
    if step not in steps:
        msg = (
            f"{listing.location}: no checkpoint of step {step} "
            f"(have: {', '.join(map(str, steps[-10:]))})"
        )
        naming = listing.naming
        for f in listing.foreign:
            m = re.fullmatch(re.escape(naming.prefix) + "([0-9]{1,255})", f)
            if m and int(m.group(1)) == step:
                msg += f"; {f} is not pitstop's (pitstop names step {step} {naming.name(step)})"
        raise CliError(msg)
    return step


@contextlib.contextmanager
def _lease(storage: Storage, name: str) -> Iterator[None]:
    """Hold the checkpoint's read lease, so a live trainer's retention skips it meanwhile.

    A manifest the lease cannot open (a link loop, say) is the reader's to report."""
    lease = getattr(storage, "read_lease", None)
    with contextlib.ExitStack() as stack:
        if lease is not None:
            with contextlib.suppress(OSError):
                stack.enter_context(lease(name))
        yield


def _failure(e: BaseException, where: str) -> tuple[int, str]:
    """(exit status, reason) of a checkpoint that could not be read or verified."""
    if isinstance(e, EncryptionKeyError):
        return ERROR, str(e)  # no key or another key: not the checkpoint's fault
    if isinstance(e, CheckpointError):  # corrupt, or written by a newer pitstop
        if not isinstance(e, CorruptCheckpointError) and isinstance(
                e.__cause__ or e.__context__, ObjectStoreError):
            return ERROR, str(e)  # the network or the credentials, not the checkpoint
        return CORRUPT, str(e)
    if isinstance(e, ObjectStoreError):
        return ERROR, f"{where}: {_why(e)}"
    if isinstance(e, OSError):
        code = ERROR if e.errno in _ENVIRONMENT else CORRUPT
        what = os.path.basename(e.filename) if isinstance(e.filename, str) else "its files"
        return code, f"{where}: cannot read {what} ({e.strerror or e})"
    if isinstance(e, RecursionError):
        return CORRUPT, f"{where}: manifest is nested too deeply to be a pitstop manifest"
    # core let a raw error out of a malformed checkpoint (it should say CorruptCheckpointError)
    return CORRUPT, f"{where}: malformed checkpoint ({type(e).__name__}: {e})"


_KEY: list[Any] = []


def _encryption() -> Any:
    """The key of encrypted checkpoints, from PITSTOP_ENCRYPTION_KEY (None when unset; read
    once). Plaintext checkpoints are read as well: the CLI inspects both kinds."""
    from pitstop.core.format.crypto import ENV, Encryption
    if not _KEY:
        try:
            _KEY.append(Encryption() if os.environ.get(ENV) else None)
        except CheckpointError as e:
            raise CliError(str(e), ERROR) from None
    return _KEY[0]


def _bound(storage: Storage, naming: Naming, key: Any) -> dict[str, Any]:
    """How a checkpoint of this directory is read with ``key`` (None: no key): plaintext
    ones too, except in an encrypted directory (its identity records encryption, or any of
    its checkpoints is encrypted: a plaintext one there is not authenticated, so verify
    reports it); an encrypted one only when its sealed manifest names the directory's id
    (as the identity records it)."""
    if key is None:
        return {"plaintext_ok": True}
    from pitstop.core.directory.catalog import encrypted_evidence
    try:
        raw = storage.read_meta("directory.json")
        doc = load_json(raw) if raw is not None else None
    except (OSError, ValueError, RecursionError, UnicodeDecodeError):
        doc = None
    ident = doc.get("directory_id") if isinstance(doc, dict) else None
    encrypted = isinstance(doc, dict) and bool(doc.get("encryption"))
    if not encrypted:
        try:
            encrypted = encrypted_evidence(storage, naming) is not None
        except OSError:
            encrypted = False
    return {"plaintext_ok": not encrypted,
            "directory_id": ident if isinstance(ident, str) else None}


def _reader(storage: Storage, name: str, naming: Naming) -> CheckpointReader:
    """The checkpoint's reader (manifest parsed and validated); any failure is a CliError
    with the right exit status: 1 when the checkpoint is at fault, 2 when it is not."""
    key = _encryption()
    try:
        return CheckpointReader(storage, name, naming=naming, encryption=key,
                                **_bound(storage, naming, key))
    except Exception as e:  # noqa: BLE001 - every way a manifest can be broken
        code, why = _failure(e, storage.path_of(name))
        raise CliError(why, code) from None


def _checked(reader: CheckpointReader, where: str) -> Manifest:
    """The reader's manifest, once its data files are there with the recorded sizes, as
    regular files inside the checkpoint, and its compressed arrays' frames decode to the
    sizes it declares (``check_files``, ``check_frames``: no array is read)."""
    try:
        reader.check_files()
        reader.check_frames()
    except Exception as e:  # noqa: BLE001 - every way a file can be wrong
        code, why = _failure(e, where)
        raise CliError(why, code) from None
    return reader.manifest


def _tolerant_streams() -> None:
    """Print names that are not valid text (a non-UTF-8 file name) escaped, never crash."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]


# ====================================================================== ls
#: what each kind of row in ``pitstop ls`` is, said once under the table when one shows
_LS_NOTES = {
    "incomplete": "incomplete: left by an interrupted save or deletion (a writer may still "
    "be using it); `pitstop gc {loc}` removes it when none is",
    "corrupt": "corrupt: moved aside after failing verification; pitstop never restores or "
    "deletes it: delete it by hand when done",
    "abandoned": "abandoned: a newer checkpoint of a run that was rolled back to an older "
    "step, moved aside at its first new save; pitstop never restores or deletes it: delete "
    "it by hand when no longer needed",
    "unreadable": "unreadable: its manifest cannot be read, so it is never restored; "
    "`pitstop verify {loc} --step N` says why",
    "not a checkpoint": "not a checkpoint: named like one, but no committed manifest; left "
    "alone",
}


@dataclass
class _Retention:
    """The retention the directory's writer recorded (``directory.json``, "retention"):
    its policies that ls can evaluate, with their labels, and the names of those it cannot
    (a user's own policy objects); ``policies`` None: nothing recorded."""

    policies: list[tuple[Any, str]] | None
    custom: list[str]
    summary: str


def _retention(storage: Storage) -> _Retention:
    from pitstop.core.errors import InvalidArgumentError
    from pitstop.core.policy import KeepAll, KeepBest, KeepEverySteps, KeepLast
    try:
        raw = storage.read_meta("directory.json")
        doc = load_json(raw) if raw is not None else None
    except (OSError, ValueError, RecursionError):
        doc = None
    record = doc.get("retention") if isinstance(doc, dict) else None
    if record is not None and not isinstance(record, list):
        return _Retention(None, [], f"retention: not understood ({_short(record, 40)}: written "
                          "by a newer pitstop, or edited by hand); its writer records its own "
                          "when it opens the directory")
    if not isinstance(record, list):
        return _Retention(None, [], "retention: policy unknown (the directory records none: "
                          "written by an older pitstop, or not opened by a writer since)")
    policies: list[tuple[Any, str]] = []
    custom: list[str] = []
    said: list[str] = []
    for item in record:
        try:
            if not isinstance(item, dict):
                raise TypeError
            if "keep_last" in item:
                n = item["keep_last"]
                policies.append((KeepLast(n), f"newest {n}"))
                said.append(f"keep_last={n}")
            elif "keep_every_steps" in item:
                k = item["keep_every_steps"]
                policies.append((KeepEverySteps(k), f"every {k}"))
                said.append(f"keep_every_steps={k}")
            elif "keep_best" in item:
                n, metric, mode = item["keep_best"], item["best_metric"], item["best_mode"]
                if not isinstance(metric, str):
                    raise TypeError
                label = f"best {_shown(metric)}" if n == 1 else f"{n} best {_shown(metric)}"
                policies.append((KeepBest(n, metric, mode), label))
                said.append(f"keep_best={n} by {_shown(metric)} ({_shown(mode)})")
            elif item.get("keep_all") is True:
                policies.append((KeepAll(), "keep all"))
                said.append("keep all")
            elif isinstance(item.get("custom"), str):
                custom.append(_shown(item["custom"]))
                said.append(custom[-1])
            else:
                raise TypeError
        except (InvalidArgumentError, TypeError, KeyError, ValueError):
            custom.append(_short(item, 40))
            said.append(f"{custom[-1]} (not understood)")
    summary = ", ".join(said) if said else "none (keeps every checkpoint)"
    return _Retention(policies, custom, f"retention: {summary}")


def _skipped_line(storage: Storage) -> str | None:
    """The periodic saves the writer skipped as busy (``directory.json``, "skipped")."""
    from pitstop.core.save.skips import ls_line
    try:
        raw = storage.read_meta("directory.json")
        return ls_line(json.loads(raw)) if raw is not None else None
    except (OSError, ValueError, RecursionError):
        return None


def _retention_status(ret: _Retention, infos: dict[int, Any], aside_refs: dict[str, Any],
                      naming: Naming) -> dict[int, str]:
    """For each committed step, whether the next retention pass keeps it and why. That pass
    runs after the next save commits, so it is evaluated on these checkpoints plus a newer
    one (no metrics: it outranks no kept best), as the writer's retention decides
    (:func:`pitstop.core.policy.to_delete`, then what incremental checkpoints reference):
    one the ``keep_last`` window keeps now but not then is "kept until the next save";
    {} when the policy is unknown."""
    from pitstop.core.policy import CheckpointInfo
    if ret.policies is None or not infos:
        return {}
    if not ret.policies and not ret.custom:
        return {s: "kept: no retention" for s in infos}
    now = _retention_pass(ret, infos, aside_refs, naming)
    mine = [c for c in infos.values() if c.ours]
    newest = max(infos)
    finite = None if not mine else max(mine, key=lambda c: c.step).all_finite
    nxt = dict(infos)
    # (the next save: ours, and finite when the run checks it; what it will reference is
    # not known, so a checkpoint only it would keep is said deleted, never the reverse)
    nxt[newest + 1] = CheckpointInfo(newest + 1, {}, ours=True,
                                     all_finite=None if finite is None else True)
    then = _retention_pass(ret, nxt, aside_refs, naming)
    out: dict[int, str] = {}
    for s in infos:
        if then[s] is None:
            out[s] = "deleted at the next save" if now[s] is None else \
                f"kept until the next save ({now[s]})"
        elif ret.custom and then[s] == "":
            out[s] = f"kept unless {ret.custom[0]} deletes it"
        else:
            out[s] = f"kept: {then[s]}"
    return out


def _retention_pass(ret: _Retention, infos: dict[int, Any], aside_refs: dict[str, Any],
                    naming: Naming) -> dict[int, str | None]:
    """One retention pass over ``infos``: step -> why it is kept, "" when only a policy ls
    cannot evaluate may delete it, None when it is deleted."""
    mine = [c for c in infos.values() if c.ours]
    why: dict[int, list[str]] = {s: [] for s in infos}
    for policy, label in ret.policies or ():
        for s in policy.keep(mine):
            why[s].append(label)
    newest = max(infos)
    newest_mine = max((c.step for c in mine), default=None)
    finite = [s for s, c in infos.items() if c.all_finite]
    for s, c in infos.items():
        if not why[s] and s in (newest, newest_mine):
            why[s].append("newest")
        if not why[s] and finite and s == max(finite):
            why[s].append("newest all-finite")
        if c.protected:
            why[s].append("protected")
        if not why[s] and not c.ours:
            why[s].append("not written by this directory's runs")
    out: dict[int, str | None] = {s: ", ".join(r) for s, r in why.items() if r}
    remaining = set(infos)
    for s in sorted((s for s in infos if not why[s]), reverse=True):
        if ret.custom:
            out[s] = ""
            continue
        users = sorted(t for t in remaining if t != s and s in (infos[t].refs or ()))
        if users:
            out[s] = f"referenced by step {', '.join(map(str, users))}"
            continue
        name = naming.name(s)
        held = sorted(a for a, refs in aside_refs.items() if name in refs)
        if held:
            out[s] = f"referenced by {', '.join(held)}"
            continue
        remaining.discard(s)
        out[s] = None
    return out


def _protected(storage: Storage, ident: str | None) -> set[int]:
    """The steps the directory's index marks protected (not merely held by a reference)."""
    from pitstop.core.directory.catalog import parse_index
    if not ident:
        return set()
    try:
        raw = storage.read_meta("index.json")
        known = parse_index(raw, ident) if raw is not None else {}
    except Exception:  # noqa: BLE001 - a cache: a doubtful one protects nothing
        return set()
    return {s for s, info in known.items() if info.protected}


def _aside_refs(storage: Storage, listing: Listing) -> dict[str, tuple[str, ...]]:
    """The abandoned checkpoints and what their manifests reference (retention keeps
    those): see :meth:`pitstop.core.directory.catalog.Catalog.held_aside`."""
    out: dict[str, tuple[str, ...]] = {}
    for name, _step, why in listing.aside:
        if why != "abandoned":
            continue
        try:
            doc = load_json(storage.read_bytes(name, MANIFEST))
            out[name] = tuple(str(r) for r in doc.get("refs") or ())
        except Exception:  # noqa: BLE001 - unreadable: references nothing we can tell
            out[name] = ()
    return out


def _leftover_rows(listing: Listing) -> list[tuple[int | None, str]]:
    """(step or None, status) of each leftover of an interrupted operation."""
    naming = listing.naming
    rows: list[tuple[int | None, str]] = []
    if listing.objects is not None:
        for item in listing.leftovers:
            what = {"save": "interrupted save", "delete": "interrupted deletion",
                    "upload": "unfinished upload"}.get(
                item.op, "interrupted write")
            rows.append((naming.parse(item.name), f"incomplete: {what} ({_shown(item.entry)})"))
        return rows
    for entry in listing.tmp:
        if entry.startswith(META_DIR + "/"):
            rows.append((None, f"incomplete: interrupted write ({_shown(entry)})"))
            continue
        what = "interrupted deletion" if entry.startswith(".tmp-deleting-") else \
            "interrupted save"
        rows.append((naming.parse_tmp(entry), f"incomplete: {what} ({_shown(entry)})"))
    return rows


_TF_FILE = re.compile(r"^(.+)(\.index|\.data-\d{5}-of-\d{5})$")


def _tf_native(entries: list[str]) -> tuple[list[str], list[str]]:
    """(the tf.train checkpoints among ``entries``: the prefixes with a ``.index``, the
    other entries): their files, and tf.train's ``checkpoint`` state file beside them, are
    not listed as someone else's, since pitstop's TensorFlow manager sweeps them."""
    prefixes = {m.group(1) for e in entries if (m := _TF_FILE.match(e)) and
                m.group(2) == ".index"}
    if not prefixes:
        return [], entries
    rest = [e for e in entries if e != "checkpoint" and not (
        (m := _TF_FILE.match(e)) and m.group(1) in prefixes)]
    return sorted(prefixes, key=_natural), rest


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def cmd_ls(args: argparse.Namespace) -> int:
    from pitstop.core.policy import CheckpointInfo
    _encryption()  # a malformed key is said once, not on every row as "unreadable"
    storage = _open(args.dir, args.storage_option)
    listing = _scan(storage)
    only: int | None = None
    if not listing.steps and not listing.has_meta:
        one = _as_checkpoint(listing)
        if one is not None:  # a checkpoint's own path: its row, in its run directory
            storage, only = one
            listing = _scan(storage)
    steps = listing.steps
    naming = listing.naming
    loc = storage.location
    out = sys.stdout
    if only is None:
        print(f"{loc}: {len(steps)} checkpoint{'s' * (len(steps) != 1)}", file=out)
    else:
        print(f"{storage.path_of(naming.name(only))}: the checkpoint of step {only} "
              f"(`pitstop ls {loc}` lists all {len(steps)})", file=out)
    ret = _retention(storage) if listing.has_meta else None
    if ret is not None and (steps or ret.policies is not None):
        print(ret.summary, file=out)
    ident, _ = _directory_id(storage)
    protected = _protected(storage, ident)
    #: (step or None, order, mark, saved, size, arrays, status, metrics, kind)
    rows: list[tuple[int | None, int, str, str, str, str, str, str, str]] = []
    infos: dict[int, Any] = {}
    committed: dict[int, tuple[str, str, str, str]] = {}
    unreadable: dict[int, str] = {}
    for s in steps:
        try:
            m = _reader(storage, naming.name(s), naming).manifest
        except CliError as e:
            if _gone(storage, naming.name(s)):
                continue  # deleted by a live trainer's retention while listing
            unreadable[s] = _one_line(e)
            infos[s] = CheckpointInfo(s, {}, ours=False)
            continue
        refs = tuple(sorted(r for r in (naming.parse(h) for h in m.refs) if r is not None))
        infos[s] = CheckpointInfo(s, m.metrics, ours=bool(ident) and m.directory_id == ident,
                                  all_finite=m.all_finite, protected=s in protected, refs=refs)
        committed[s] = (_time(m.created_unix), human_size(sum(m.files.values())),
                        str(len(m.arrays)), _metric_text(m.metrics))
    decided = _retention_status(ret, infos, _aside_refs(storage, listing), naming) \
        if ret is not None else {}
    newest = max(infos) if infos else None
    for s in infos:
        mark = "*" if s == newest else ""
        if s in unreadable:
            rows.append((s, 0, mark, "-", "-", "-", f"unreadable: {unreadable[s]}", "",
                         "unreadable"))
            continue
        saved, size, arrays, metrics = committed[s]
        rows.append((s, 0, mark, saved, size, arrays, decided.get(s, "committed"), metrics,
                     ""))
    if only is None:
        for step, status in _leftover_rows(listing):
            rows.append((step, 1, "", "-", "-", "-", status, "", "incomplete"))
        for name, step, why in listing.aside:
            rows.append((step, 2, "", "-", "-", "-", f"{why}: moved aside ({_shown(name)})", "",
                         why))
        for name, what in listing.odd:
            rows.append((naming.parse(name), 3, "", "-", "-", "-",
                         f"not a checkpoint: {_shown(name)}: {what}", "", "not a checkpoint"))
    else:
        rows = [r for r in rows if r[0] == only]
    rows.sort(key=lambda r: (r[0] is None, r[0] or 0, r[1]))
    if rows:
        table = [("", "STEP", "SAVED", "SIZE", "ARRAYS", "STATUS", "METRICS")] + [
            (r[2], "-" if r[0] is None else str(r[0]), *r[3:8]) for r in rows]
        widths = [max(len(r[i]) for r in table) for i in range(6)]
        for r in table:
            cells = [r[0].ljust(1)] + [
                r[i].rjust(widths[i]) if i in (1, 3, 4) else r[i].ljust(widths[i])
                for i in range(1, 6)] + [r[6]]
            print("  ".join(cells).rstrip(), file=out)
        if newest is not None and any(r[2] for r in rows):
            print("(* newest)", file=out)
    for kind in dict.fromkeys(r[8] for r in rows if r[8]):
        print(_LS_NOTES[kind].format(loc=loc), file=out)
    skipped = _skipped_line(storage) if listing.has_meta and only is None else None
    if skipped is not None:
        print(skipped, file=out)
    #: incremental checkpoints: holder step -> the steps that reference its data
    users: dict[int, list[int]] = {}
    for s, info in sorted(infos.items()):
        for held in info.refs or ():
            users.setdefault(held, []).append(s)
    for held, by in sorted(users.items()):
        if only in (None, held):
            print(f"step {held} holds data referenced by step {', '.join(map(str, by))} "
                  "(incremental: arrays unchanged since it are stored there once; kept while "
                  "a kept checkpoint references it)", file=out)
    if only is not None:
        return OK
    for entry in listing.nested:
        print(f"run directory {entry}/ inside it: `pitstop ls {storage.path_of(entry)}` "
              "lists its checkpoints", file=out)
    native, foreign = _tf_native(listing.foreign)
    if native:
        print(f"tf.train checkpoints: {', '.join(native)} (their .index and .data-* files"
              f"{', and its checkpoint state file' if 'checkpoint' in listing.foreign else ''}"
              "): pitstop's commands leave them alone; a pitstop.adapters.tf.CheckpointManager "
              "of their name restores from them and deletes old ones as tf.train's "
              "max_to_keep does", file=out)
    if foreign:
        hint = (
            f"; this directory names a checkpoint {naming.describe()}"
            if any(_looks_like(naming, f) for f in foreign)
            else ""
        )
        print(f"not pitstop's: {', '.join(foreign)} (left alone{hint})", file=out)
    if not listing.has_meta:
        print(
            f"{_no_meta(listing)}: not a pitstop checkpoint directory (or its {META_DIR}/ "
            "was removed)",
            file=out,
        )
    return OK


# ====================================================================== inspect
def _gone(storage: Storage, name: str) -> bool:
    """True when a listed checkpoint no longer exists (a live trainer's retention deleted
    it, or moved it aside, between listing and reading)."""
    if isinstance(storage, FsspecStorage):
        try:
            storage.size(name, MANIFEST)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # cannot tell: reading it reports what is wrong
        return False
    return not os.path.lexists(os.path.join(storage.location, name, MANIFEST))


def _pick_live(storage: Storage, step: int | None, command: str) -> tuple[int, Naming]:
    """The checkpoint to read: the newest one (again, if it vanishes while a trainer
    writes), or ``step``; and the directory's naming."""
    for attempt in range(10):
        try:
            listing = _scan(storage)
            picked = _pick(listing, step, command)
        except CliError:
            # a live trainer's retention may have deleted the newest one between listing
            # and looking at it, and committed the next a moment later: look again
            if step is not None or attempt == 9:
                raise
            time.sleep(0.01)
            continue
        if step is not None or not _gone(storage, listing.naming.name(picked)):
            return picked, listing.naming
    return picked, listing.naming


def cmd_inspect(args: argparse.Namespace) -> int:
    storage, want = _locate(args.dir, args.step, args.storage_option, "inspect")
    for attempt in range(10):
        step, naming = _pick_live(storage, want, "inspect")
        name = naming.name(step)
        where = storage.path_of(name)
        retry = want is None and attempt < 9
        with _lease(storage, name):
            if retry and _gone(storage, name):
                continue  # deleted by a live trainer's retention before the lease: look again
            try:
                # the manifest validated and its files checked (a stat each) before any
                # print: inspect never describes a checkpoint that cannot be read
                m = _checked(_reader(storage, name, naming), where)
            except CliError as err:
                if retry and _gone(storage, name):
                    continue
                if err.code != CORRUPT:
                    raise
                raise CliError(
                    f"{err}; `pitstop verify {storage.location} --all` checks the "
                    "others, and a restore moves a corrupt checkpoint aside and falls "
                    "back to the previous valid one",
                    CORRUPT,
                ) from None
            if args.json:
                try:
                    text = storage.read_bytes(name, MANIFEST).decode("utf-8")
                except UnicodeDecodeError as err:
                    raise CliError(
                        f"{where}: manifest.json is not UTF-8 text (byte {err.start}); "
                        "pitstop writes UTF-8 only, so it was changed after the commit",
                        CORRUPT,
                    ) from None
                except Exception as err:  # noqa: BLE001 - replaced since it was validated
                    code, why = _failure(err, where)
                    raise CliError(why, code) from None
                print(text.rstrip("\n"))
                return OK
        break
    rank = args.rank
    if rank is not None and not 0 <= rank < m.world:
        raise CliError(f"{where}: --rank {rank}: the checkpoint was saved by "
                       f"{m.world} rank{'s' * (m.world != 1)} (0 to {m.world - 1})")
    out = sys.stdout
    w = m.writer
    print(f"step {m.step}: {where}", file=out)
    if m.world > 1:
        mine = m.rank_specific()
        shown = ", ".join(_shown(k) for k in mine[:12]) + (" ..." if len(mine) > 12 else "")
        print(f"  saved by {m.world} ranks; below: rank {rank or 0}'s view"
              + ("" if rank else " (--rank N for another's)")
              + (f"; each rank saved its own {shown}" if mine else
                 "; every rank saved the same entries"), file=out)
        m = m.view(rank or 0)
    print(f"  format {m.format_version}, saved {_time(m.created_unix)}", file=out)
    print(f"  written by: {_written_by(w)}", file=out)
    print(
        f"  {len(m.arrays)} arrays, {human_size(m.nbytes)} in {len(m.files)} file(s) of "
        f"{human_size(sum(m.files.values()))}, hash {m.hash_algorithm}, "
        f"all finite: {'unchecked' if m.all_finite is None else m.all_finite}",
        file=out,
    )
    if m.refs:
        print(f"  incremental: unchanged arrays are read from "
              f"{', '.join(_shown(h) for h in m.refs)} (referenced, not written again)",
              file=out)
    if m.encryption is not None:
        print(f"  encrypted: {m.encryption.get('algorithm')}, key id "
              f"{m.encryption.get('key_id')}", file=out)
    print(f"  metrics: {_metric_text(m.metrics)}", file=out)
    if m.user_metadata:
        print(f"  user_metadata: {_short(m.user_metadata)}", file=out)
    if m.arrays:
        print("arrays:", file=out)
        rows = [("KEY", "DTYPE", "SHAPE", "BYTES", "WHERE")]
        for key, e in m.arrays.items():
            dtype = e.dtype if isinstance(e.dtype, str) else _short(e.dtype, 40)
            if e.shards is not None:
                at = f"{len(e.shards)} shards, " + ", ".join(
                    sorted({p.file if p.ref is None else f"{p.ref}/{p.file}" for p in e.shards}))
            else:
                at = ("" if e.ref is None else f"{_shown(e.ref)}/") + f"{e.file}@{e.offset}" + (
                    "" if e.codec == "none" else f" ({e.codec}, {human_size(e.length)})"
                )
            rows.append(
                (
                    _shown(key),
                    _shown(dtype),
                    "[" + ", ".join(map(str, e.shape)) + "]",
                    human_size(nbytes_of(e)),
                    at,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            print(
                "  "
                + "  ".join(
                    [
                        r[0].ljust(widths[0]),
                        r[1].ljust(widths[1]),
                        r[2].ljust(widths[2]),
                        r[3].rjust(widths[3]),
                        r[4],
                    ]
                ),
                file=out,
            )
    if m.values:
        print("values:", file=out)
        width = max(len(k) for k in m.values)
        for key, v in m.values.items():
            print(f"  {key.ljust(width)}  {_short(v)}", file=out)
    return OK


def _written_by(writer: dict[str, Any]) -> str:
    """``torch 2.13.0, numpy 2.1.0 (pitstop 0.1.0 on node7, pid 23471)``: the frameworks
    whose adapters captured the state, then pitstop, the host and the pid."""
    who = (f"pitstop {_shown(writer.get('pitstop', '?'))} on "
           f"{_shown(writer.get('host', '?'))}, pid {_shown(writer.get('pid', '?'))}")
    fw = writer.get("frameworks")
    if not isinstance(fw, dict) or not fw:
        return f"{who} (frameworks not recorded: an older pitstop)"
    backend = fw.get("keras.backend")
    parts = []
    for name, version in fw.items():
        if name == "keras.backend":
            continue
        text = f"{_shown(name)} {_shown(version)}"
        if name == "keras" and backend is not None:
            text += f" ({_shown(backend)} backend)"
        parts.append(text)
    if not parts:  # (a backend alone names no framework)
        return f"{who} (frameworks not recorded)"
    return f"{', '.join(parts)} ({who})"


# ====================================================================== verify
def _wants_progress(asked: bool | None) -> bool:
    """--progress / --no-progress, else whether stderr is a terminal (never a pipe or a
    CI log)."""
    if asked is not None:
        return asked
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):
        return False


@contextlib.contextmanager
def _progress_bar(show: bool, label: str) -> Iterator[Any]:
    """A progress bar of bytes read on stderr (rich), cleared when done; yields the
    ``progress(done, total)`` callback, or None without a bar (not asked, or no rich)."""
    if not show:
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
    except ImportError:  # (the `cli` extra not installed): no bar, the check runs all the same
        yield None
        return
    console = Console(file=sys.stderr, force_terminal=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                   DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=console, transient=True)
    task = bar.add_task(label, total=None)

    def progress(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar:
        yield progress


def cmd_verify(args: argparse.Namespace) -> int:
    _encryption()  # a malformed key is said once, before any checkpoint is read
    storage, want = _locate(args.dir, args.step, args.storage_option, "verify")
    if args.all and want is not None:
        raise CliError(f"{args.dir} is one checkpoint (step {want}); --all verifies every "
                       f"checkpoint of a run directory: pitstop verify {storage.location} --all")
    listing = _scan(storage)
    naming = listing.naming
    if args.all:
        for _ in range(10):
            if listing.steps or not (listing.odd or listing.tmp):
                break
            # only entries caught mid-change (a live trainer's retention deleting the newest
            # one while committing the next): look again
            time.sleep(0.01)
            listing = _scan(storage)
        steps = listing.steps
        if not steps:
            raise CliError(_no_checkpoint(listing, "verify"))
    else:
        picked, naming = _pick_live(storage, want, "verify")
        steps = [picked]
    failed: list[int] = []
    unchecked: list[str] = []
    repicks = 0
    show = _wants_progress(args.progress)
    if show:  # imported before any checkpoint's time is taken
        with contextlib.suppress(ImportError):
            import rich.progress  # noqa: F401
    total = len(steps)
    while steps:
        s = steps.pop(0)
        name = naming.name(s)
        where = storage.path_of(name)
        t0 = time.perf_counter()
        with _lease(storage, name):
            if _gone(storage, name):
                # deleted by a live trainer's retention between listing and reading
                if not args.all and want is None and repicks < 9:
                    repicks += 1  # the newest one was asked for: the next newest it is
                    picked, naming = _pick_live(storage, None, "verify")
                    steps = [picked]
                    continue
                print(f"step {s}: gone (deleted while listing), skipped")
                continue
            try:
                key = _encryption()
                reader = CheckpointReader(storage, name, naming=naming, encryption=key,
                                          **_bound(storage, naming, key))
                with _progress_bar(show, f"step {s}") as bar:
                    reader.verify(progress=bar)
            except CorruptCheckpointError as e:
                if isinstance(storage, FsspecStorage) and _gone(storage, name):
                    # object stores have no read leases: a live trainer's retention may
                    # delete a checkpoint while it is read
                    print(f"step {s}: gone (deleted while verifying), skipped")
                    continue
                failed.append(s)
                at = ", ".join(
                    f"{label} {_shown(value)}"
                    for label, value in (("file", e.file), ("tensor", e.key))
                    if value
                )
                print(f"step {s}: CORRUPT{' (' + at + ')' if at else ''}: {_one_line(e)}")
                continue
            except Exception as e:  # noqa: BLE001 - one broken checkpoint never stops the rest
                code, why = _failure(e, where)
                if code == CORRUPT:  # e.g. written by a newer pitstop, or a link loop
                    failed.append(s)
                else:  # e.g. permission denied: not the checkpoint's fault
                    unchecked.append(f"step {s}: {why}")
                print(f"step {s}: UNREADABLE: {_one_line(why)}")
                continue
        m = reader.manifest
        dt = time.perf_counter() - t0
        print(
            f"step {s}: ok ({len(m.arrays)} arrays, {human_size(m.nbytes)}, "
            f"{m.hash_algorithm} verified in {dt:.2f} s)"
        )
    if failed:
        print(f"{len(failed)} of {total} checkpoint(s) failed verification")
        sys.stdout.flush()
        print(
            f"pitstop: {storage.location}: {len(failed)} of {total} checkpoint(s) failed "
            f"verification (step {', '.join(map(str, failed))}; see above); a restore moves "
            "a corrupt checkpoint aside and falls back to the previous valid one",
            file=sys.stderr,
        )
    if unchecked:
        sys.stdout.flush()
        print(
            f"pitstop: {storage.location}: could not check {len(unchecked)} checkpoint(s) "
            f"({_one_line('; '.join(unchecked))}); fix the access and run verify again",
            file=sys.stderr,
        )
    return CORRUPT if failed else ERROR if unchecked else OK


# ====================================================================== gc
GC_DESCRIPTION = """\
Remove what pitstop itself left behind, and nothing else:

  * leftovers of interrupted saves and deletions in DIR: directories named
    .tmp-<name>-<8 hex>, and files named .pitstop/<file>.tmp-<8 hex>;
  * this directory's memory-tier files in /dev/shm (or --memory-tier ROOT):
    pitstop-<directory id>-<8 hex>-<slot>.buf, .json and .json.tmp - except a
    snapshot of a step newer than the newest committed step, which the next
    CheckpointManager on DIR recovers; --drop-recoverable removes that one too.

Only <name>s of the directory's naming count (.pitstop/directory.json; by default
step_<10 digits>, or e.g. ckpt-<step> for step_prefix="ckpt-", step_digits=0).
gc never deletes a committed checkpoint (<name>), a quarantined one
(<name>.corrupt-<time>-<4 hex>: it failed verification), an abandoned one
(<name>.abandoned-<time>-<4 hex>: newer steps of a run that was rolled back
to an older step), nor anything whose name pitstop did not make (step_5, your own
files): delete those by hand. It runs only while no writer holds DIR.
"""


def _write_error(loc: str, e: OSError) -> str:
    if e.errno == errno.EROFS:
        return (
            f"{loc}: on a read-only file system, so gc can remove nothing there; remount "
            "it read-write (or run gc where it is mounted writable); "
            f"`pitstop gc --dry-run {loc}` lists what gc would remove"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return (
            f"{loc}: permission denied ({e.filename}); run gc as the user that owns the "
            f"checkpoints; `pitstop gc --dry-run {loc}` lists what gc would remove"
        )
    return (
        f"{e.filename or loc}: cannot take the directory's writer lock ({e.strerror}); "
        f"{META_DIR}/lock must be a regular file: move whatever is there away and run "
        "gc again"
    )


def cmd_gc(args: argparse.Namespace) -> int:
    storage = _open(args.dir, args.storage_option)
    loc = storage.location
    listing = _scan(storage)
    if not listing.has_meta:
        raise CliError(
            f"{loc}: not a pitstop checkpoint directory ({_no_meta(listing)}); gc only tidies "
            "a directory a CheckpointManager wrote" + _single_checkpoint_hint(listing, "gc")
        )
    root = _tier_root(args)
    notes: list[str] = []
    lock = None
    try:
        lock = storage.lock()  # no writer may be mid-save while we delete its temporaries
    except DirectoryLockedError as e:
        raise CliError(
            f"{_one_line(e)} gc only runs while no writer holds the directory."
        ) from None
    except OSError as e:
        if isinstance(storage, FsspecStorage):
            raise CliError(f"{loc}: cannot take the directory's writer lock "
                           f"({_one_line(_why(e))}); gc only runs while it holds it") from None
        if not (args.dry_run and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)):
            raise CliError(_write_error(loc, e)) from None
        # a dry run removes nothing; where no writer can write, none can be mid-save either
        notes.append(
            f"note: {loc} is not writable ({e.strerror}): a real gc could remove "
            "nothing there (read-only file system, or no permission)"
        )
    removed: list[str] = []
    kept: list[str] = []
    failures: list[str] = []
    problems: list[str] = []
    try:
        listing = _scan(storage)  # again, now that no writer can be mid-save
        if isinstance(storage, FsspecStorage):
            removed += _gc_objects(storage, listing, args.dry_run, failures)
        for rel in listing.tmp if not isinstance(storage, FsspecStorage) else []:
            if args.dry_run:
                removed.append(rel)
                continue
            path = os.path.join(loc, rel)
            try:
                if rel.startswith(META_DIR + "/") or _kind(path) == stat.S_IFLNK:
                    os.unlink(path)  # (a link: never followed)
                else:
                    shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                failures.append(f"{path} ({e.strerror})")
                continue
            removed.append(rel)
        if root is not None:
            removed += _gc_memory_tier(storage, root, listing, args, kept, failures, problems)
    finally:
        if lock is not None:
            lock.release()
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    for line in kept:
        print(f"kept {line}")
    print(
        f"{verb} {len(removed)} leftover(s); committed checkpoints untouched "
        f"({len(listing.steps)} in {loc})"
    )
    for note in notes:
        print(note)
    sys.stdout.flush()
    if failures:
        print(
            f"pitstop: could not remove {len(failures)} of pitstop's leftovers: "
            f"{_one_line(', '.join(failures))}; make them writable (or the file system "
            "read-write) and run gc again",
            file=sys.stderr,
        )
    for problem in problems:
        print(f"pitstop: {_one_line(problem)}", file=sys.stderr)
    return ERROR if failures or problems else OK


def _gc_objects(storage: FsspecStorage, listing: Listing, dry_run: bool,
                failures: list[str]) -> list[str]:
    """Remove an object-store directory's leftovers (markers and the objects they name)."""
    removed: list[str] = []
    for item in listing.leftovers:
        if dry_run:
            removed += item.describe()
            continue
        try:
            removed += storage.remove_leftover(item)
        except OSError as e:
            failures.append(f"{storage.location}/{item.entry} ({_one_line(_why(e))})")
    return removed


def _tier_root(args: argparse.Namespace) -> str | None:
    if args.memory_tier is None:
        return memtier.default_root()
    root = args.memory_tier
    if not os.path.isdir(root):
        what = "not a directory" if os.path.exists(root) else "no such directory"
        raise CliError(
            f"{root}: {what} (--memory-tier); give the directory the memory tier "
            "lives in (default /dev/shm)"
        )
    return root


def _directory_id(storage: Storage) -> tuple[str | None, str | None]:
    """(the directory's id, None), (None, what is wrong with directory.json), or (None, None)
    where there is none (nothing was ever written here, so no memory tier either)."""
    try:
        raw = storage.read_meta("directory.json")
    except OSError as e:
        return None, f"cannot read it ({e.strerror})"
    if raw is None:
        return None, None
    try:
        doc = load_json(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None, "not valid JSON (or a key twice)"
    if not isinstance(doc, dict):
        return None, f"not a JSON object (found {_short(doc, 40)})"
    ident = doc.get("directory_id")
    if not isinstance(ident, str) or not _DIRECTORY_ID.fullmatch(ident):
        return None, f"no valid directory_id in it (found {_short(ident, 40)})"
    return ident, None


def _gc_memory_tier(
    storage: Storage,
    root: str,
    listing: Listing,
    args: argparse.Namespace,
    kept: list[str],
    failures: list[str],
    problems: list[str],
) -> list[str]:
    """Remove this directory's memory-tier files, except a snapshot a restart would recover.

    Only regular files named exactly ``<prefix>-<slot>.buf|.json[.tmp]`` are the tier's."""
    ident, problem = _directory_id(storage)
    if ident is None:
        if problem is not None:
            where = hashlib.sha1(os.path.realpath(storage.location).encode()).hexdigest()[:8]
            problems.append(
                f"{os.path.join(storage.location, META_DIR, 'directory.json')}: {problem}; "
                f"memory-tier files in {root} left alone, as gc cannot tell which are this "
                f"directory's: delete {os.path.join(root, f'pitstop-*-{where}-*')} by hand "
                "once no job uses this directory"
            )
        return []
    tier = memtier.MemoryTier(root, storage.location, ident)
    stem = os.path.basename(tier.prefix)
    pattern = re.compile("^" + re.escape(stem) + _TIER_FILE + "$")
    try:
        names = os.listdir(root)
    except OSError as e:
        failures.append(f"{root} (cannot list it: {e.strerror})")
        return []
    ours = sorted(
        n for n in names if pattern.match(n) and _kind(os.path.join(root, n)) == stat.S_IFREG
    )
    for n in list(ours):  # the tier trusts, and gc removes, only this user's own files
        try:
            owner = os.lstat(os.path.join(root, n)).st_uid
        except OSError:
            owner = os.geteuid()
        if owner != os.geteuid():
            ours.remove(n)
            kept.append(f"{os.path.join(root, n)}: owned by {memtier.owner_name(owner)}, not "
                        "by this user; left alone (the memory tier never trusts it)")
    newest = listing.steps[-1] if listing.steps else None
    keep: set[str] = set()
    if not args.drop_recoverable:
        for n in ours:
            m = pattern.match(n)
            assert m is not None
            if m.group(2) != "json":
                continue
            buf = f"{stem}-{m.group(1)}.buf"
            meta = tier.read_description(os.path.join(root, n), quiet=True)
            if not isinstance(meta, dict) or buf not in ours:
                continue
            step = meta.get("step")
            if type(step) is not int:  # noqa: E721 - True is no step
                continue  # a description that says no step describes no snapshot
            try:
                why = tier.trusted(meta, newest)
            except (KeyError, TypeError, ValueError):
                continue
            if why is None:
                keep |= {n, buf}
                kept.append(
                    f"{os.path.join(root, buf)}: snapshot of step {step}, newer than the "
                    "newest committed step; the next CheckpointManager on this directory "
                    "recovers it (--drop-recoverable removes it)"
                )
    doomed = [os.path.join(root, n) for n in ours if n not in keep]
    if args.dry_run:
        return doomed
    removed = []
    for path in doomed:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            failures.append(f"{path} ({e.strerror})")
            continue
        removed.append(path)
    return removed


# ====================================================================== main
class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``pitstop inspect: --step: invalid int value: 'x';
    see `pitstop inspect --help``` on stderr, exit status 2 (argparse prints the usage and
    the error on two lines or more). Subcommands get it too (``parser_class``)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        text = _one_line(message)
        if text.startswith("argument "):
            text = text[len("argument "):]
        self.exit(ERROR, f"{self.prog}: {text}; see `{self.prog} --help`\n")


def _example(*lines: str) -> dict[str, Any]:
    """The epilog every ``--help`` ends with: ``example:`` and the command lines."""
    return {"epilog": "example:\n" + "".join(f"  {ln}\n" for ln in lines),
            "formatter_class": argparse.RawDescriptionHelpFormatter}


def _url_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="a storage option of an object-store DIR (s3://...), e.g. "
        "endpoint_url=http://127.0.0.1:9000 or anon=true; repeat for more")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="pitstop",
        description="Supervise training jobs; look at, check, compare, convert and tidy pitstop\n"
        "checkpoint directories.",
        epilog="Exit status: 0 fine, 1 a checkpoint failed verification (diff: the checkpoints\n"
        "differ), 2 other errors; `pitstop run` exits with its job's status.\n\n"
        "example:\n  pitstop ls runs/exp1\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from pitstop._version import __version__

    p.add_argument("--version", action="version", version=f"pitstop {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True,
                           parser_class=ArgumentParser)

    s = sub.add_parser(
        "ls",
        help="list checkpoints: committed ones (step, time, size, metrics, whether "
        "retention keeps them), incomplete, corrupt and abandoned ones",
        description="List a checkpoint directory: every committed checkpoint with its "
        "time, size and metrics, and whether the next retention pass keeps it (and why); "
        "incomplete saves, checkpoints moved aside (corrupt, abandoned) and unreadable "
        "ones; entries that are not pitstop's. Given a checkpoint's own path, its row only.",
        **_example("pitstop ls runs/exp1", "pitstop ls runs/exp1/step_0000000300"),
    )
    s.add_argument("dir", metavar="DIR")
    _url_options(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser(
        "inspect", help="show one checkpoint's manifest (newest by default)",
        description="Show one checkpoint: who wrote it (pitstop, frameworks and their "
        "versions, host, pid), its arrays, values and metrics.",
        **_example("pitstop inspect runs/exp1 --step 300"))
    s.add_argument("dir", metavar="DIR")
    _url_options(s)
    s.add_argument("--step", type=int, help="the step to show (default: the newest)")
    s.add_argument("--rank", type=int, metavar="N",
                   help="of a checkpoint several ranks saved: show rank N's view (default 0)")
    s.add_argument(
        "--json",
        action="store_true",
        help="print the raw manifest.json (after validating it; a corrupt one "
        "prints nothing and exits 1)",
    )
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser(
        "verify", help="read every array and check its hash (newest by default)",
        description="Read every array of a checkpoint and check its hash; a progress bar "
        "on stderr when it is a terminal.",
        **_example("pitstop verify runs/exp1 --all"))
    s.add_argument("dir", metavar="DIR")
    _url_options(s)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="verify this step")
    g.add_argument("--all", action="store_true", help="verify every committed checkpoint")
    s.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="show a progress bar on stderr (default: only when stderr is a terminal)")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser(
        "gc",
        help="remove leftovers of interrupted saves and stale memory-tier "
        "files (never a checkpoint, nor anything pitstop did not name)",
        description=GC_DESCRIPTION,
        **_example("pitstop gc --dry-run runs/exp1", "pitstop gc runs/exp1"),
    )
    s.add_argument("dir", metavar="DIR")
    _url_options(s)
    s.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    s.add_argument(
        "--memory-tier", metavar="ROOT", help="where the memory tier lives (default: /dev/shm)"
    )
    s.add_argument(
        "--drop-recoverable",
        action="store_true",
        help="also remove a memory-tier snapshot newer than the newest committed step",
    )
    s.set_defaults(func=cmd_gc)

    from pitstop.cli import demo

    demo.add_parser(sub)
    _ensure_example(sub.choices["demo"], "pitstop demo")
    from pitstop.cli import convert, diff  # pitstop diff, export, import
    from pitstop.cli import run as _run

    _run.add_parser(sub)
    diff.add_parser(sub)
    convert.add_parsers(sub)
    return p


def _ensure_example(parser: argparse.ArgumentParser, line: str) -> None:
    """Give a subcommand that its module left without one the closing example."""
    if "example:" not in (parser.epilog or ""):
        parser.epilog = ((parser.epilog or "").rstrip("\n") + "\n\n" if parser.epilog
                         else "") + f"example:\n  {line}\n"
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


def parser_of(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the subcommand ``argv`` names (its first word that is one), else
    ``parser``: found from the words, as a subcommand may reuse the dest ``command``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word in argv:
                if not word.startswith("-"):
                    return action.choices.get(word, parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pitstop`` console script; returns the exit status."""
    _tolerant_streams()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser: `pitstop ls: unrecognized arguments: b`
        parser_of(parser, sys.argv[1:] if argv is None else argv).error(
            f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except CliError as e:
        print(f"pitstop: {_one_line(e)}", file=sys.stderr)
        return e.code
    except CorruptCheckpointError as e:
        print(f"pitstop: {_one_line(e)}", file=sys.stderr)
        return CORRUPT
    except CheckpointError as e:
        print(f"pitstop: {_one_line(e)}", file=sys.stderr)
        return ERROR
    except BrokenPipeError:  # `pitstop verify DIR | head -1`: the reader went away
        # the output, and with it the verdict, was cut short: not 0 (a failed verification
        # would read as success), but what a shell reports for a command SIGPIPE killed;
        # stdout goes to /dev/null so that the exit's flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE
    except KeyboardInterrupt:
        return 130
    except OSError as e:  # a path the commands above did not expect to fail
        print(f"pitstop: {_one_line(_why(e))}", file=sys.stderr)
        return ERROR
    except Exception as e:  # noqa: BLE001 - the last resort: never a traceback
        if os.environ.get("PITSTOP_DEBUG"):
            raise
        print(
            f"pitstop: internal error ({_one_line(_why(e))}); this is a bug in pitstop: "
            "please report it with the output of the same command run with PITSTOP_DEBUG=1",
            file=sys.stderr,
        )
        return ERROR


__all__ = ["main", "build_parser", "human_size"]
