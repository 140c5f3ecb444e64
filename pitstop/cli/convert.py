"""``pitstop export`` and ``pitstop import``: checkpoints out to, and in from, other formats.

Export writes one pitstop checkpoint as a ``.npz`` (numpy only), ``.safetensors`` or
``torch.save`` file (torch), or a step of an Orbax directory (JAX); import turns a
``torch.save`` file, a DCP directory, a native TensorFlow checkpoint, an Orbax directory,
a ``.safetensors`` or a ``.npz`` file into a committed pitstop checkpoint. Each imports only
the framework its format needs (TensorFlow and torch crash when one process loads both).

This module is the command: its arguments, its checks and its messages. The converters
live in :mod:`pitstop.interop` (the npz layout: :mod:`pitstop.interop.npz`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from pitstop.core.arguments import MAX_STEP
from pitstop.core.errors import CheckpointError, CorruptCheckpointError
from pitstop.interop import npz
from pitstop.interop.detect import detect, is_keras, is_pitstop, tf_latest, tf_prefix
from pitstop.interop.npz import read_npz, relative
from pitstop.interop.safetensors import read_safetensors

EXPORTS = ("npz", "safetensors", "torch", "orbax", "tf")
IMPORTS = ("torch", "dcp", "deepspeed", "tf", "orbax", "safetensors", "npz")
_EXT = {"npz": ".npz", "safetensors": ".safetensors", "torch": ".pt", "orbax": "-orbax"}
_TORCH_EXTRA = "pip install 'pitstop[torch]'"
_NAMES = {"orbax": "Orbax", "deepspeed": "DeepSpeed"}

EXPORT_EPILOG = """\
formats: npz (numpy only), safetensors and torch (need torch), orbax (needs jax and
orbax-checkpoint: OUT is an Orbax CheckpointManager directory). Writing native
TensorFlow checkpoints is not supported.

example:
  pitstop export runs/exp1 --to safetensors --key model -o model.safetensors
"""

IMPORT_EPILOG = """\
formats (--from; guessed from SRC when not given): torch (a torch.save file), dcp (a
torch.distributed.checkpoint directory), deepspeed (the save_dir of a DeepSpeed
engine.save_checkpoint: its "latest" checkpoint), tf (a native TensorFlow checkpoint prefix),
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
        "import", help="turn a torch.save file, DCP, DeepSpeed, TensorFlow, Orbax, safetensors or npz "
        "checkpoint into a pitstop checkpoint",
        description="Import SRC as a committed checkpoint of the run directory DEST "
        "(created if needed); an existing step of DEST is never overwritten.",
        epilog=IMPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("src", metavar="SRC")
    s.add_argument("dest", metavar="DEST")
    s.add_argument("--from", dest="fmt", metavar="FORMAT",
                   help="torch, dcp, deepspeed, tf, orbax, safetensors or npz (default: guessed)")
    s.add_argument("--step", type=int, metavar="N",
                   help="the step to write (default: the step SRC records, TensorFlow's "
                   "save counter, Orbax's own steps, DeepSpeed's global_steps - 1; else 0)")
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


def write_npz(reader: Any, path: str, key: str | None) -> tuple[int, int]:
    """:func:`pitstop.interop.npz.write_npz`, its errors as the command reports them."""
    cli = _cli()
    try:
        return npz.write_npz(reader, path, key)
    except npz.ArrayUnreadable as e:
        code, why = cli._failure(e.__cause__ or e, reader.where)
        raise cli.CliError(why, code) from None
    except CheckpointError as e:  # no such entry, a clashing name, the write failed
        raise cli.CliError(str(e)) from None


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
    left = [k for k in m.rank_specific() if relative(k, args.key) is not None
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
    from pitstop.core.restore.read import nbytes_of
    picked = {kp: e for kp, e in m.arrays.items() if relative(kp, key) is not None}
    if key is not None and not picked and not any(
            relative(kp, key) is not None for kp in m.values):
        raise cli.CliError(f"{directory}: step {step} has no entry {key!r}; `pitstop inspect` "
                           "lists its keys")
    try:
        if fmt == "orbax":
            try:
                from pitstop.interop.orbax_export import export_orbax
            except ImportError as e:
                raise cli.CliError(f"--to orbax needs jax and orbax-checkpoint ({e}); "
                                   "pip install 'pitstop[jax]'") from None
            _quiet_absl()
            export_orbax(directory, step, out, key=key)
        else:
            try:
                from pitstop.interop.torch_save import export_safetensors, export_torch_save
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
    extra = {"torch": _TORCH_EXTRA, "dcp": _TORCH_EXTRA, "deepspeed": _TORCH_EXTRA, "tf": "pip install 'pitstop[tf]'",
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
    if fmt in ("keras", "h5", "hdf5") or (fmt is None and is_keras(src)):
        raise cli.CliError(
            f"{src}: Keras files (.keras, .weights.h5, .h5) are not supported by pitstop "
            "import; load them into your model (keras.models.load_model or "
            "model.load_weights) and save it with a pitstop CheckpointManager (docs/keras.md)")
    if fmt is not None and fmt not in IMPORTS:
        raise cli.CliError(f"--from {args.fmt}: unknown format; give one of "
                           f"{', '.join(IMPORTS)}")
    if fmt == "tf" or (fmt is None and (src.endswith(".index") or ".data-" in
                                        os.path.basename(src) or tf_latest(src))):
        src = tf_prefix(src)
    if not os.path.exists(src) and not os.path.exists(src + ".index"):
        raise cli.CliError(f"{src}: no such file or directory; check the path")
    if fmt is None:
        fmt = detect(src)
        if fmt is None and is_pitstop(src):
            raise cli.CliError(
                f"{src}: already a pitstop checkpoint directory, nothing to import; every "
                "command reads it as it is (pitstop export writes it to another format)")
        if fmt is None:
            raise cli.CliError(f"cannot tell the format of {src}; give --from (one of "
                               f"{', '.join(IMPORTS)})")
    if args.step is not None and not 0 <= args.step <= MAX_STEP:
        raise cli.CliError(f"--step {args.step}: steps are integers from 0 to {MAX_STEP}")
    if args.key is not None and fmt in ("orbax", "deepspeed"):
        raise cli.CliError(f"--key is not supported for {_NAMES[fmt]} imports; import the "
                           "whole checkpoint (pitstop export --key can pick an entry later)")
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
            from pitstop.interop.dcp import import_dcp
            from pitstop.interop.torch_save import import_torch_save
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
    if fmt == "deepspeed":
        try:
            from pitstop.interop.deepspeed import import_deepspeed
        except ImportError as e:
            raise _framework_missing(fmt, e) from None
        if not os.path.isdir(src):
            raise _cli().CliError(f"{src}: not a directory; a DeepSpeed checkpoint is the "
                                  "save_dir of engine.save_checkpoint")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\.|$)")
            return [import_deepspeed(src, dest, step)]
    if fmt == "tf":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        try:
            with _native_stderr_muted():  # TensorFlow's start-up chatter (oneDNN, absl)
                from pitstop.interop.tf_native import import_native
        except ImportError as e:
            raise _framework_missing(fmt, e) from None
        return [import_native(src, dest, step, key=key)]
    try:
        from pitstop.interop.orbax import import_orbax
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


__all__ = ["add_parsers", "cmd_export", "cmd_import"]
