"""Incremental checkpoints: arrays whose bytes are unchanged since the engine's last commit
are referenced from the checkpoint that holds them instead of written again.
"""

from __future__ import annotations

from dataclasses import dataclass

from pitstop.core.format.dtypes import encode_dtype
from pitstop.core.format.schema import ArrayEntry, Manifest
from pitstop.core.save.handles import SaveStats
from pitstop.core.save.snapshot import Layout


@dataclass
class Previous:
    """What an engine's last commit holds (incremental saves): per key, its raw bytes'
    hash and an entry referencing the checkpoint that holds them; each data file's length."""

    step: int
    compression: str | None
    arrays: dict[str, tuple[str, ArrayEntry]]
    files: dict[tuple[str, str], int]



class Incremental:
    """What the engine remembers of its last commit, and the comparison against it."""

    compression: str | None
    #: what the last commit holds, for incremental saves (None: nothing known yet)
    _previous: Previous | None

    def _unchanged(self, step: int, layout: Layout, hashes: dict[str, str]
                   ) -> dict[str, tuple[ArrayEntry, int]]:
        """The arrays whose raw bytes, dtype, shape and codec setting equal those of the same
        key in this engine's last commit, each with an entry referencing the checkpoint that
        holds its bytes (never a chain: a referenced entry's own holder) and the length of
        the holder's file."""
        prev = self._previous
        if prev is None or step <= prev.step or prev.compression != self.compression:
            return {}
        out: dict[str, tuple[ArrayEntry, int]] = {}
        for i, k in enumerate(layout.keys):
            held = prev.arrays.get(k)
            if held is None or not layout.nbytes[i] or hashes.get(k) != held[0]:
                continue
            entry = held[1]
            if entry.shape == list(layout.shapes[i]) and \
                    entry.dtype == encode_dtype(layout.dtypes[i]):
                out[k] = entry, prev.files[(entry.ref or "", entry.file)]
        return out

    @staticmethod
    def _reference(manifest: Manifest, same: dict[str, tuple[ArrayEntry, int]],
                   stats: SaveStats) -> None:
        """Put the referencing entries ``same`` into ``manifest``, with the files they read
        (each with its length)."""
        for k, (e, length) in same.items():
            assert e.ref is not None
            manifest.arrays[k] = e
            manifest.refs.setdefault(e.ref, {})[e.file] = length
            stats.reused_bytes += e.length

    def _remember(self, name: str, step: int, layout: Layout, hashes: dict[str, str],
                  entries: dict[str, ArrayEntry], manifest: Manifest) -> None:
        """After a commit: what it holds, for the next save to compare against."""
        files = {(name, f): n for f, n in manifest.files.items()}
        for holder, held in manifest.refs.items():
            files.update({(holder, f): n for f, n in held.items()})
        arrays: dict[str, tuple[str, ArrayEntry]] = {}
        for k in layout.keys:
            e = entries[k]
            if e.ref is None:
                e = ArrayEntry(dtype=e.dtype, shape=e.shape, file=e.file, offset=e.offset,
                               length=e.length, hash=e.hash, codec=e.codec, ref=name)
            arrays[k] = (hashes[k], e)
        self._previous = Previous(step, self.compression, arrays, files)

    def forget_previous(self, name: str | None = None) -> None:
        """The last commit (or any checkpoint it references: ``name``) left the directory
        (deleted, moved aside): the next save writes every array again."""
        prev = self._previous
        if prev is not None and (name is None or any(h == name for h, _f in prev.files)):
            self._previous = None
