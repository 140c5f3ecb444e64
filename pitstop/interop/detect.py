"""What format a file or directory to import is in, told from its files alone (no
framework imported): DCP, DeepSpeed, Orbax, native TensorFlow, npz, safetensors, torch.save; and the
pitstop and Keras files that ``pitstop import`` refuses by name."""

from __future__ import annotations

import os
import re
import zipfile


def is_orbax(path: str) -> bool:
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


def is_pitstop(src: str) -> bool:
    """A pitstop run directory (``.pitstop/`` in it) or one of its checkpoints (a
    ``manifest.json`` in it, ``.pitstop/`` beside it)."""
    here = os.path.abspath(src)
    return os.path.isdir(os.path.join(here, ".pitstop")) or (
        os.path.isfile(os.path.join(here, "manifest.json"))
        and os.path.isdir(os.path.join(os.path.dirname(here), ".pitstop")))


def is_keras(src: str) -> bool:
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
        if deepspeed_tag_dir(src) is not None:
            return "deepspeed"
        if is_orbax(src):
            return "orbax"
        return "tf" if tf_latest(src) else None
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


def deepspeed_tag_dir(src: str, tag: str | None = None) -> str | None:
    """The folder of the DeepSpeed checkpoint in ``src`` (what ``engine.save_checkpoint``
    wrote): ``src/tag``, else the folder its ``latest`` file names, else ``src`` itself,
    when it holds ``mp_rank_00_model_states.pt``; None otherwise."""
    if tag is not None:
        d = os.path.join(src, tag)
        return d if os.path.isfile(os.path.join(d, "mp_rank_00_model_states.pt")) else None
    if os.path.isfile(os.path.join(src, "mp_rank_00_model_states.pt")):
        return src
    try:
        with open(os.path.join(src, "latest"), encoding="utf-8") as f:
            named = f.read(4096).strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not named or "/" in named or named in (".", ".."):
        return None
    return deepspeed_tag_dir(src, named)


def tf_latest(directory: str) -> str | None:
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


def tf_prefix(src: str) -> str:
    if os.path.isdir(src):
        return tf_latest(src) or src
    if src.endswith(".index") and os.path.isfile(src):
        return src[: -len(".index")]
    if ".data-" in os.path.basename(src) and os.path.isfile(src):
        return src[: src.rindex(".data-")]
    return src
