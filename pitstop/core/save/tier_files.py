"""A run directory's memory-tier files as ``pitstop gc`` sees them: which are the tier's
(regular files named ``<prefix>-<slot>.buf|.json[.tmp]``, owned by this user), and which
of them gc removes, keeping a snapshot the next manager on the directory recovers."""

from __future__ import annotations

import os
import stat

from pitstop.core.save.memtier import FILE_NAME, MemoryTier, owner_name


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def stale_files(tier: MemoryTier, newest: int | None, drop_recoverable: bool
                ) -> tuple[list[str], list[str]]:
    """(the paths of the tier's files gc removes, a line for each it leaves and why):
    only regular files under the tier's own prefix (not those of a path the directory was
    moved from), only this user's; a snapshot of a step newer than ``newest`` (the newest
    committed step) stays unless ``drop_recoverable``. Raises OSError when the tier's root
    cannot be listed."""
    root = tier.root
    stem = os.path.basename(tier.prefix)
    names = os.listdir(root)
    kept: list[str] = []
    ours = sorted(
        n for n in names if n.startswith(stem) and FILE_NAME.match(n[len(stem):])
        and _is_regular(os.path.join(root, n))
    )
    for n in list(ours):  # the tier trusts, and gc removes, only this user's own files
        try:
            owner = os.lstat(os.path.join(root, n)).st_uid
        except OSError:
            owner = os.geteuid()
        if owner != os.geteuid():
            ours.remove(n)
            kept.append(f"{os.path.join(root, n)}: owned by {owner_name(owner)}, not "
                        "by this user; left alone (the memory tier never trusts it)")
    keep: set[str] = set()
    if not drop_recoverable:
        for n in ours:
            m = FILE_NAME.match(n[len(stem):])
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
    return [os.path.join(root, n) for n in ours if n not in keep], kept


__all__ = ["stale_files"]
