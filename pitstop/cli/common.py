"""What every ``pitstop`` command shares: errors and exit statuses, text read from a
checkpoint shown safely, opening a directory (local or a URL) and listing it by pitstop's
names (:class:`Listing`), picking and reading the checkpoint asked for, and the argument
parser of every subcommand. The rules themselves are core's (directory names, records,
retention, reading); this module says them on a terminal."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pitstop.core.directory.names import DEFAULT, Naming
from pitstop.core.directory.records import read_record
from pitstop.core.directory.text import printable as _shown
from pitstop.core.errors import CheckpointError, CorruptCheckpointError, EncryptionKeyError
from pitstop.core.format.schema import Manifest
from pitstop.core.restore.read import CheckpointReader
from pitstop.core.storage import FsspecStorage, ObjectStoreError, Storage, is_url
from pitstop.core.storage import local as _local
from pitstop.core.storage.local import MANIFEST, META_DIR, LocalStorage
from pitstop.core.storage.objectstore import Leftover, ObjectListing

OK, CORRUPT, ERROR = 0, 1, 2
#: what pitstop names the temporaries of interrupted writes of .pitstop/ files (a file in
#: .pitstop/); those of interrupted saves and deletions (a directory in DIR) are the naming's
_TMP_META = getattr(_local, "_TMP_META", re.compile(r"^.+\.tmp-[0-9a-f]{8}$"))
#: errors of the environment, not of a checkpoint: it could not be checked, not "corrupt"
_ENVIRONMENT = {errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE, errno.ENOMEM}


class CliError(Exception):
    """A user-facing error: printed as ``pitstop: <message>``, exit status ``code``."""

    def __init__(self, message: str, code: int = ERROR) -> None:
        super().__init__(message)
        self.code = code


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


#: Python advice in core's messages that a command-line user cannot take (the command
#: reads the key from PITSTOP_ENCRYPTION_KEY, which the same messages name)
_PYTHON_ONLY = re.compile(r",? or pass encryption=pitstop\.Encryption\([^)]*\)")


def _one_line(text: object) -> str:
    return _shown(_PYTHON_ONLY.sub("", " ".join(str(text).splitlines())))


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
        return read_record(storage).naming()
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
    from pitstop.core.directory.identity import encrypted_evidence
    record = read_record(storage)
    encrypted = record.encrypted
    if not encrypted:
        try:
            encrypted = encrypted_evidence(storage, naming) is not None
        except OSError:
            encrypted = False
    return {"plaintext_ok": not encrypted, "directory_id": record.directory_id}


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


__all__ = ["OK", "CORRUPT", "ERROR", "CliError", "human_size", "Listing", "ArgumentParser",
           "DEFAULT", "Naming"]
