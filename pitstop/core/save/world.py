"""The multi-rank persist: every rank hashes and writes its part of one checkpoint, the
leader checks the whole and commits; three exchanges that every rank makes whatever happens
locally, so no rank waits for one that gave up (see :mod:`pitstop.core.runtime.coordination`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from pitstop.core.errors import CheckpointError, CheckpointWriteError
from pitstop.core.format.schema import SHARD_MARK, ArrayEntry, Manifest, RankView, group_pieces
from pitstop.core.format.validate import parse
from pitstop.core.runtime.coordination import CoordinationError, Coordinator, Holding, plan
from pitstop.core.save.persist import Persist, PersistJob, SaveSkipped, Times
from pitstop.core.save.snapshot import Layout

log = logging.getLogger("pitstop")


class _Round:
    """The exchanges of one multi-rank save, and what a failure on any rank undoes: the
    temporary checkpoint this rank holds (``txn``) and the failure told to the others."""

    def __init__(self, coord: Coordinator, job: PersistJob, path: str) -> None:
        self.coord = coord
        self.job = job
        self.path = path
        self.where = f"saving step {job.step} to {path}"
        self.txn: Any = None
        self.failure: BaseException | None = None

    def error(self) -> str | None:
        """This rank's failure as told to the others (None: none)."""
        return None if self.failure is None else _why(self.failure)

    def abort(self) -> None:
        if self.txn is not None:
            self.txn.abort()

    def exchange(self, doc: dict[str, Any], what: str) -> list[Any]:
        try:
            return self.coord.all_gather_json(doc, what=f"{self.where}: {what}",
                                              channel="persist")
        except BaseException:
            self.abort()
            raise

    def fail_if(self, answers: list[Any], what: str) -> None:
        bad = [(r, a["error"]) for r, a in enumerate(answers) if a.get("error")]
        if not bad:
            return
        self.abort()
        text = "; ".join(f"rank {r}: {e}" for r, e in bad)
        err = CheckpointWriteError(
            f"{self.where} failed {what} ({text}). The step is not committed; committed "
            f"checkpoints are intact.", step=self.job.step, path=self.path)
        raise err from self.failure


class WorldPersist(Persist):
    """The engine's multi-rank persist (see :class:`pitstop.core.save.engine.Engine`)."""

    forget_step: Callable[[int], None] | None

    def _persist_world(self, job: PersistJob, name: str, coord: Coordinator) -> Manifest:
        """One multi-rank save: the stages of a one-process save (hash, write, publish,
        committed) with an exchange after each, which every rank makes whatever happens
        locally, so no rank waits for one that gave up."""
        buf = job.buffer
        layout = buf.layout if buf is not None else Layout((), (), (), (), (), 0)
        r = _Round(coord, job, self.storage.path_of(name))
        times = Times()
        hashes, finite = self._world_hash(job, name, r)
        times.hashed = time.perf_counter()
        # 1. what each rank holds; everyone plans the same writes from the answers
        answers = self._world_agree(job, layout, hashes, finite, r)
        record, cipher = self._new_cipher(job.step, answers[0]["save_id"], coord.leader)
        if not all(a["finite"] for a in answers):
            r.abort()
            bad = [i for i, a in enumerate(answers) if not a["finite"]]
            raise SaveSkipped(f"an array holds NaN or Inf on rank(s) {bad} (non-finite guard)")
        writes, writer = plan([[Holding(k, n, h) for k, n, h in a["held"]] for a in answers])
        mine = writes[coord.rank]
        assert buf is not None  # a rank without a snapshot said so, and fail_if raised
        # 2. every rank writes its part into the leader's temporary checkpoint
        times.write = time.perf_counter()
        results: list[Any] = []
        try:
            if not coord.leader:
                r.txn = self.storage.join(name, answers[0]["token"])
            groups = [[i for i in g if layout.keys[i] in mine] for g in layout.groups()]
            results = self._write_all(r.txn, buf, groups, hashes, cipher,
                                      prefix=f"r{coord.rank:05d}-")
            self._lazy_check(job)
        except BaseException as e:  # noqa: BLE001
            r.failure = e
        times.written = time.perf_counter()
        files = {f: n for f, n, _e in results if f is not None}
        entries = {k: _entry_json(e) for _f, _n, es in results for k, e in es.items()}
        answers_b = r.exchange({"files": files, "entries": entries, "values": job.values,
                                "structure": job.structure, "shapes": job.global_shapes,
                                "error": r.error()}, "collecting what each rank wrote")
        r.fail_if(answers_b, "while writing")
        # 3. the leader checks the whole, writes the manifest and publishes
        manifest: Manifest | None = None
        removed: list[int] = []
        if coord.leader:
            manifest = self._world_publish(job, name, answers, answers_b, writer, record, r)
            r.txn = None  # committed, or aborted: nothing more to undo
            if r.failure is None and manifest is not None:
                # committed: index and retention now, before the other ranks hear of it, so
                # that every rank's wait() returns to the same directory
                self._committed(job, self.storage.path_of(name), times)
                removed = self._bookkeep(job, manifest, name)
        # (no abort if this exchange fails: the leader may have committed, and a part of
        # an uncommitted save left behind is removed by the next writer's cleanup)
        outcome = coord.all_gather_json({"error": r.error(), "removed": removed},
                                        what=f"{r.where}: publishing the checkpoint",
                                        channel="persist")
        r.fail_if(outcome, "at the commit")  # (another rank aborts its own part there)
        if r.txn is not None:
            r.txn.done()
        if manifest is None:  # a follower: what its bookkeeping needs of the manifest
            manifest = self._manifest(job, job.structure, job.values)
            manifest.world = coord.world_size
        if not coord.leader:
            forget = self.forget_step
            for s in outcome[0].get("removed") or []:
                if forget is not None:
                    forget(int(s))  # deleted by the leader's retention
            self._committed(job, self.storage.path_of(name), times)
        return manifest

    def _world_hash(self, job: PersistJob, name: str, r: _Round) -> tuple[dict[str, str], bool]:
        """This rank's hashes and whether its arrays (and metrics) are finite; the leader
        opens the temporary checkpoint. A failure is kept in ``r``, to be told to all."""
        hook = self.hooks.get("before_persist")
        hashes: dict[str, str] = {}
        finite = True
        try:
            if job.failed is not None:
                raise CheckpointError(f"its snapshot failed: {job.failed}")
            if hook is not None:
                hook(job.step)
            hashes, finite = self._hash_and_seal(job)
            finite = finite and not job.nonfinite_metrics
            if r.coord.leader and finite:
                r.txn = self.storage.begin(name)
        except BaseException as e:  # noqa: BLE001 - told to every rank, raised below
            r.failure = e
        return hashes, finite

    def _world_agree(self, job: PersistJob, layout: Layout, hashes: dict[str, str],
                     finite: bool, r: _Round) -> list[Any]:
        """The first exchange: what each rank holds; the ranks must save the same step, with
        the same key, and none may have failed."""
        held = [[k, n, hashes.get(k, "")] for k, n in zip(layout.keys, layout.nbytes,
                                                             strict=True)]
        enc = self.encryption
        answers = r.exchange({"step": job.step, "finite": finite, "held": held,
                              "token": getattr(r.txn, "token", None),
                              "key_id": None if enc is None else enc.key_id,
                              "save_id": None if enc is None else secrets.token_hex(16),
                              "error": r.error()},
                             "exchanging what each rank holds")
        steps = sorted({a["step"] for a in answers})
        if len(steps) > 1:
            r.abort()
            said = ", ".join(f"rank {i}: {a['step']}" for i, a in enumerate(answers))
            raise CoordinationError(
                f"{r.where}: the ranks saved different steps ({said}); every rank must call "
                "save() / step() with the same step, in the same order")
        r.fail_if(answers, "before writing")
        keys = [a.get("key_id") for a in answers]
        if len(set(keys)) > 1:
            r.abort()
            raise CheckpointWriteError(
                f"{r.where}: the ranks encrypt with different keys (key ids {keys}; None: no "
                "encryption); give every rank the same key (the same environment variable). "
                "The step is not committed", step=job.step, path=r.path)
        return answers

    def _world_publish(self, job: PersistJob, name: str, answers: list[Any],
                       answers_b: list[Any], writer: dict[tuple[str, str], int],
                       record: dict[str, Any] | None, r: _Round) -> Manifest | None:
        """The leader: the whole checked (shards cover their arrays), the manifest written
        and published; a failure aborts and is kept in ``r``, to be told to all."""
        try:
            manifest = self._world_manifest(job, name, answers, answers_b, writer)
            manifest.encryption = record
            data = manifest.to_bytes(self.encryption)
            parse(data, r.where, self.encryption)  # every entry checked before the commit
            self._publish(r.txn, job, data, check_lazy=False)
        except BaseException as e:  # noqa: BLE001
            r.txn.abort()
            r.failure = e
            return None
        return manifest

    def _world_manifest(self, job: PersistJob, name: str, held: list[Any], wrote: list[Any],
                        writer: dict[tuple[str, str], int]) -> Manifest:
        """The manifest of a multi-rank save: rank 0's whole view at the top level, the
        other ranks' differences in ``world``; sharded arrays assembled from every rank."""
        where = self.storage.path_of(name)
        stored: dict[tuple[str, str], ArrayEntry] = {}
        files: dict[str, int] = {}
        for r, doc in enumerate(wrote):
            files.update(doc["files"])
            hash_of = {k: h for k, _n, h in held[r]["held"]}
            for k, e in doc["entries"].items():
                stored[(k, hash_of[k])] = _entry_of(e)
        # every shard of every sharded array, once (the lowest rank's bytes where replicas
        # of one shard differ)
        pieces: dict[str, ArrayEntry] = {}
        diverged: list[str] = []
        for r, doc in enumerate(held):
            for k, _n, h in doc["held"]:
                if SHARD_MARK not in k:
                    continue
                if k in pieces:
                    if pieces[k].hash != stored[(k, h)].hash:
                        diverged.append(f"{k} (rank {r})")
                    continue
                pieces[k] = stored[(k, h)]
        if diverged:
            log.warning("pitstop: %s: replicas of these shards differ between ranks; the "
                        "lowest rank's bytes were saved: %s", where, ", ".join(diverged[:10]))
        sharded = group_pieces(pieces)
        shapes: dict[str, list[int]] = {}
        for r, doc in enumerate(wrote):
            for k, shape in doc["shapes"].items():
                got = sharded.get(k)
                if got is None or got.shape != shape or shapes.setdefault(k, shape) != shape:
                    raise CheckpointError(
                        f"{where}: array {k!r} has global shape {shape} on rank {r}, but the "
                        f"ranks' shards make {got.shape if got else 'nothing'} (a rank's "
                        "shard is missing, or the ranks disagree on the array)")

        def view(r: int) -> dict[str, ArrayEntry]:
            out: dict[str, ArrayEntry] = {}
            for k, _n, h in held[r]["held"]:
                base, mark, _ = k.partition(SHARD_MARK)
                if mark:
                    if base not in out:
                        out[base] = sharded[base]
                else:
                    out[k] = stored[(k, h)]
            for k in wrote[r]["shapes"]:
                out.setdefault(k, sharded[k])  # a sharded array of which it holds no shard
            return out

        top = view(0)
        manifest = self._manifest(job, wrote[0]["structure"], wrote[0]["values"])
        manifest.files = files
        manifest.arrays = top
        manifest.world = len(held)
        for r in range(1, len(held)):
            mine = view(r)
            rv = RankView(
                arrays={k: e for k, e in mine.items() if top.get(k) is not e},
                absent=[k for k in top if k not in mine])
            if wrote[r]["values"] != wrote[0]["values"]:
                rv.values = wrote[r]["values"]
            if wrote[r]["structure"] != wrote[0]["structure"]:
                rv.structure = wrote[r]["structure"]
            manifest.ranks.append(rv)
        return manifest


def _entry_json(e: ArrayEntry) -> dict[str, Any]:
    d = {"dtype": e.dtype, "shape": e.shape, "file": e.file, "offset": e.offset,
         "length": e.length, "hash": e.hash}
    if e.codec != "none":
        d["codec"] = e.codec
    return d


def _entry_of(d: dict[str, Any]) -> ArrayEntry:
    return ArrayEntry(dtype=d["dtype"], shape=list(d["shape"]), file=d["file"],
                      offset=d["offset"], length=d["length"], hash=d["hash"],
                      codec=d.get("codec", "none"))


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"

