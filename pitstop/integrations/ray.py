"""pitstop inside Ray Train: the checkpoint a worker reports to Ray is a pitstop checkpoint.

In the training function of a ``ray.train.torch.TorchTrainer`` (Ray Train V2, the default of
Ray 2.60), every worker makes one :class:`Checkpointing` over its state and calls
``restore()`` once and ``report(metrics, step=...)`` where it would call
``ray.train.report``. A report that saves takes pitstop's snapshot (the training-thread
stall) and hands Ray, in Ray's own asynchronous upload mode, a ``ray.train.Checkpoint``
that *is* the pitstop checkpoint's directory under the run's ``storage_path``
(``<storage_path>/<name>/pitstop/step_NNNNNNNNNN``, local or ``s3://``): Ray registers it
once pitstop committed it, without copying a byte. ``ray.train.get_checkpoint()``,
``CheckpointConfig(num_to_keep=...)`` (Ray deletes the evicted checkpoint directories), the
``Result`` checkpoints and ``resume_from_checkpoint=`` keep their meaning.

``restore()`` reads ``ray.train.get_checkpoint()``; a checkpoint there that is not
pitstop's (a Ray run that ``torch.save``-d its state) is imported once and restored, so such
a run continues under pitstop.

:func:`resumable_loader` turns the ``DataLoader`` that ``ray.train.torch.prepare_data_loader``
returned (a ``DistributedSampler`` over the dataset) into a
:class:`~pitstop.adapters.torch.ResumableLoader` with the same order, whose position is
saved with the state: a resumed worker goes on at the next batch, without re-reading the
ones before it.
"""

from __future__ import annotations

import glob
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import ray.train
import torch
from ray.train import Checkpoint
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from pitstop.adapters.torch import ResumableLoader, ResumableSampler, import_torch_save
from pitstop.core.errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError
from pitstop.core.manager import CheckpointManager

__all__ = ["Checkpointing", "resumable_loader"]

#: the folder of the Ray run (``<storage_path>/<name>``) that holds pitstop's checkpoints
SUBDIR = "pitstop"
#: the names of pitstop's step directories here (pitstop's default, fixed so that the path
#: handed to Ray is known before the commit)
STEP_PREFIX, STEP_DIGITS = "step_", 10
#: pitstop's retention options: Ray's ``CheckpointConfig(num_to_keep=...)`` decides instead
_RETENTION = ("keep_last", "keep_best", "keep_every_steps", "retention")
#: file names a ``torch.save`` checkpoint of a Ray run has (the first match is imported)
TORCH_FILES = ("*.pt", "*.pth", "*.ckpt", "*.bin")


def _in_ray_worker() -> bool:
    try:
        ray.train.get_context()
    except Exception:  # noqa: BLE001 - outside a Ray Train worker Ray raises its own errors
        return False
    return True


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _s3_options(fs: Any) -> dict[str, Any]:
    """s3fs options that reach the store a pyarrow ``S3FileSystem`` was made for (its
    endpoint and keys: pyarrow exposes them only through its pickling arguments)."""
    try:
        args = fs.__reduce__()[1][0]
    except Exception:  # noqa: BLE001 - another pyarrow: fall back to the standard chain
        return {}
    options: dict[str, Any] = {}
    if args.get("endpoint_override"):
        endpoint = args["endpoint_override"]
        if "://" not in endpoint:
            endpoint = f"{args.get('scheme') or 'https'}://{endpoint}"
        options["endpoint_url"] = endpoint
    if args.get("access_key"):
        options["key"], options["secret"] = args["access_key"], args.get("secret_key")
        if args.get("session_token"):
            options["token"] = args["session_token"]
    if args.get("region"):
        options["client_kwargs"] = {"region_name": args["region"]}
    return options


def _url(fs: Any, fs_path: str, what: str) -> tuple[str, dict[str, Any]]:
    """(the URL pitstop opens, its storage options) of ``fs_path`` on Ray's file system."""
    import pyarrow.fs

    if isinstance(fs, pyarrow.fs.LocalFileSystem) or fs is None:
        return fs_path, {}
    if isinstance(fs, pyarrow.fs.S3FileSystem):
        return f"s3://{fs_path}", _s3_options(fs)
    raise InvalidArgumentError(
        f"pitstop.integrations.ray: {what} ({type(fs).__name__}, {fs_path!r}) is neither a "
        "local path nor s3://, whose URL pitstop can tell; pass Checkpointing(state, "
        "directory=<that folder as a URL pitstop opens, e.g. gs://bucket/run/pitstop>)")


def _run_location() -> tuple[str, Any, dict[str, Any]]:
    """(pitstop directory, Ray's file system, storage options) of this Ray run's checkpoints."""
    storage = ray.train.get_context().get_storage()
    fs, base = storage.storage_filesystem, storage.experiment_fs_path.rstrip("/")
    directory, options = _url(fs, f"{base}/{SUBDIR}", "the run's storage")
    return directory, fs, options


def _check_in_run(directory: str) -> None:
    """Ray registers only checkpoints under the run's folder: refuse another one now,
    rather than at the first report."""
    base = ray.train.get_context().get_storage().experiment_fs_path.rstrip("/")
    if not (_fs_path(directory).rstrip("/") + "/").startswith(base + "/"):
        raise InvalidArgumentError(
            f"pitstop.integrations.ray.Checkpointing: directory {directory} is outside this "
            f"Ray run's folder {base}, and Ray registers only checkpoints inside it; leave "
            "directory out (it is <storage_path>/<name>/pitstop) or pass a folder under it")


def _fs_path(directory: str) -> str:
    """The path Ray's file system names ``directory`` by (a URL without its scheme)."""
    return directory.split("://", 1)[1] if "://" in directory else directory


class Checkpointing:
    """pitstop's checkpoints as the checkpoints of a Ray Train run; one per worker, made
    alike on every worker (they save together: see docs/distributed.md).

    ``directory`` defaults to ``<storage_path>/<run name>/pitstop`` of the running trainer
    (local or ``s3://``); the other keywords go to :class:`pitstop.CheckpointManager`
    (``save_every_steps``, ``save_every_seconds``, ``nonfinite_guard``, ``memory_tier``,
    ...), except retention: Ray's ``CheckpointConfig(num_to_keep=...)`` decides which
    checkpoints stay, and deletes the others.
    """

    def __init__(self, state: Any, directory: Any = None, **manager_options: Any) -> None:
        refused = sorted(k for k in _RETENTION if k in manager_options)
        if refused:
            raise InvalidArgumentError(
                f"pitstop.integrations.ray.Checkpointing: {', '.join(refused)} is Ray's to "
                "decide here: Ray keeps the checkpoints it registered and deletes the others "
                "(RunConfig(checkpoint_config=CheckpointConfig(num_to_keep=N, "
                "checkpoint_score_attribute=...))); leave it out")
        for key in ("step_prefix", "step_digits"):
            if key in manager_options:
                raise InvalidArgumentError(
                    f"pitstop.integrations.ray.Checkpointing: {key} is fixed here (the path "
                    "handed to Ray is named before the commit); leave it out")
        self.state = state
        self._ray = _in_ray_worker()
        self._fs: Any = None
        options = dict(manager_options)
        if directory is None:
            if not self._ray:
                raise InvalidArgumentError(
                    "pitstop.integrations.ray.Checkpointing: not inside a Ray Train worker, "
                    "so there is no run folder to save into; call it in the training function "
                    "of a TorchTrainer, or pass directory=")
            directory, self._fs, s3 = _run_location()
            if s3:
                options["storage_options"] = {**s3, **options.get("storage_options", {})}
        elif self._ray:
            import pyarrow.fs
            if "://" not in str(directory):
                directory = os.path.abspath(directory)  # the worker's cwd is Ray's
            self._fs, _ = pyarrow.fs.FileSystem.from_uri(str(directory))
            _check_in_run(str(directory))
        self.directory = str(directory)
        # the training function runs on a thread of Ray's worker, where Python installs no
        # signal handler: Ray's own preemption path is the one (see docs/ray.md)
        options.setdefault("save_on_signals", None)
        self.manager = CheckpointManager(directory, step_prefix=STEP_PREFIX,
                                         step_digits=STEP_DIGITS, **options)
        self.restored: int | None = None

    # ---------------------------------------------------------------- context manager
    def __enter__(self) -> Checkpointing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the saves in flight to commit and release the manager."""
        self.manager.close()

    # ---------------------------------------------------------------- paths
    def path(self, step: int) -> str:
        """The directory (path or URL) of the checkpoint of ``step``."""
        return f"{self.directory.rstrip('/')}/{STEP_PREFIX}{step:0{STEP_DIGITS}d}"

    def _own_step(self, checkpoint: Checkpoint) -> int | None:
        """The step of ``checkpoint`` when it is one of this directory's, else None."""
        parent, _, name = checkpoint.path.rstrip("/").rpartition("/")
        if parent.rstrip("/") != _fs_path(self.directory).rstrip("/"):
            return None
        rest = name[len(STEP_PREFIX):] if name.startswith(STEP_PREFIX) else ""
        return int(rest) if rest.isdigit() else None

    # ---------------------------------------------------------------- restore
    def restore(self, checkpoint: Checkpoint | None = None, *, torch_step: int | None = None,
                strict: bool = True) -> int | None:
        """Restore the state, in place, from Ray's checkpoint of this run; return its step
        (train on from ``step + 1``), or None on a fresh start.

        ``checkpoint`` defaults to ``ray.train.get_checkpoint()``. A newer step that pitstop
        committed but Ray had not registered yet (the run died in between) is restored
        instead: it is as exact, and less work is lost. A checkpoint that is not pitstop's
        (a ``torch.save`` file of an earlier Ray run, from ``resume_from_checkpoint=``) is
        imported as step ``torch_step`` (default: its ``"step"`` entry) and restored.
        """
        if checkpoint is None and self._ray:
            checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None and self._own_step(checkpoint) is None and \
                self.manager.latest_step() is None:
            restored: int | None = self._migrate(checkpoint, torch_step)
        else:
            got = self.manager.restore(self.state, strict=strict)
            restored = None if got is None else int(got)
            own = None if checkpoint is None else self._own_step(checkpoint)
            if checkpoint is not None and own is not None and \
                    (restored is None or restored < own):
                raise CheckpointNotFoundError(
                    f"pitstop.integrations.ray: Ray's checkpoint {checkpoint.path} (step "
                    f"{own}) is not a valid pitstop checkpoint any more (newest valid one: "
                    f"{restored}); it was deleted or damaged outside Ray. Start the run under a "
                    "new RunConfig(name=...), or pass resume_from_checkpoint= an intact one")
        self.restored = None if restored is None else int(restored)
        return self.restored

    def _migrate(self, checkpoint: Checkpoint, torch_step: int | None) -> int:
        """Restore a foreign checkpoint of Ray's (a ``torch.save`` file): each worker imports
        it into a private temporary directory and restores from there (this run's own
        directory gets its first checkpoint at the next save); return its step."""
        with checkpoint.as_directory() as folder:
            if os.path.exists(os.path.join(folder, "manifest.json")):
                return self._restore_foreign(checkpoint)
            files = sorted(f for p in TORCH_FILES for f in glob.glob(os.path.join(folder, p)))
            if not files:
                raise CheckpointNotFoundError(
                    f"pitstop.integrations.ray: Ray's checkpoint {checkpoint.path} holds "
                    f"neither a pitstop checkpoint nor a torch.save file ({', '.join(TORCH_FILES)}"
                    f"); found {sorted(os.listdir(folder))[:10]}. Restore it yourself, or "
                    "start without it")
            step = torch_step if torch_step is not None else _step_entry(files[0])
            with tempfile.TemporaryDirectory(prefix="pitstop-ray-import-") as tmp:
                imported = os.path.join(tmp, "ckpt")
                import_torch_save(files[0], imported, step=step)
                with CheckpointManager(imported, read_only=True) as mgr:
                    # what the file lacks (the loader's position, RNG streams) starts fresh
                    mgr.restore(self.state, step=step, strict=False)
        return step

    def _restore_foreign(self, checkpoint: Checkpoint) -> int:
        """Restore a pitstop checkpoint of another run (``resume_from_checkpoint=`` an
        earlier run's ``result.checkpoint``) from where it is, read-only; return its step.
        Each worker reads the saving rank 0's view: state that differed between its ranks
        (RNG streams) is rank 0's on every worker, a sampler keeps its own rank."""
        parent, _, name = checkpoint.path.rstrip("/").rpartition("/")
        rest = name[len(STEP_PREFIX):] if name.startswith(STEP_PREFIX) else ""
        if not rest.isdigit():
            raise InvalidArgumentError(
                f"pitstop.integrations.ray: {checkpoint.path} is a pitstop checkpoint whose "
                f"folder is not named {STEP_PREFIX}<step>; pass restore(checkpoint=...) the "
                "checkpoint's own folder, as Ray reported it")
        url, options = _url(checkpoint.filesystem, parent, "the checkpoint's storage")
        with CheckpointManager(url, read_only=True, storage_options=options or None,
                               step_prefix=STEP_PREFIX, step_digits=STEP_DIGITS) as mgr:
            mgr.restore(self.state, step=int(rest))
        return int(rest)

    # ---------------------------------------------------------------- report
    def report(self, metrics: Mapping[str, Any], *, step: int,
               checkpoint: bool | None = None) -> bool:
        """``ray.train.report(metrics)``, with a pitstop checkpoint of ``step`` when one is
        saved: ``checkpoint=None`` lets the manager's policy decide (``save_every_steps``,
        ``save_every_seconds``, the non-finite guard), ``True`` saves now, ``False`` never.
        Call it on every worker alike (Ray's report is a barrier). Returns whether a
        checkpoint was saved; Ray registers it once it is committed (its upload is the wait
        for pitstop's commit, on Ray's upload thread)."""
        numeric = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if checkpoint is False:
            handle = None
        elif checkpoint:
            handle = self.manager.save(step, self.state, numeric)
        else:
            handle = self.manager.step(step, self.state, numeric)
        if handle is not None and handle.done() and not handle.committed:
            handle = None  # skipped at once (the non-finite guard): nothing to register
        if not self._ray:
            if handle is not None:
                handle.wait()
            return handle is not None
        if handle is None:
            ray.train.report(dict(metrics))
            return False
        path = self.path(step)
        ray_ckpt = Checkpoint(path=_fs_path(path), filesystem=self._fs)

        def committed(reported: Checkpoint, _name: str) -> Checkpoint:
            handle.wait()  # a failed save raises: Ray fails the attempt and restarts it
            if not handle.committed:
                raise CheckpointError(f"pitstop: the save of step {step} into {path} was "
                                      f"skipped ({handle.stats.skipped}); nothing to register")
            return reported

        ray.train.report(
            dict(metrics), checkpoint=ray_ckpt, checkpoint_dir_name=path.rsplit("/", 1)[1],
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=False, checkpoint_upload_fn=committed)
        return True


def _step_entry(path: str) -> int:
    """The ``"step"`` (else ``"global_step"``) entry of a ``torch.save`` file."""
    try:  # weights_only: torch's restricted unpickler (tensors, plain values; no code runs)
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - reported with what to do
        raise CheckpointError(f"pitstop.integrations.ray: cannot read {path} with "
                              f"torch.load(weights_only=True) ({e})") from e
    for key in ("step", "global_step"):
        value = obj.get(key) if isinstance(obj, Mapping) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                math.isfinite(value):
            return int(value)
    raise InvalidArgumentError(
        f"pitstop.integrations.ray: {path} has no 'step' entry to import it under; pass "
        "restore(torch_step=<the step it was saved at>)")


def resumable_loader(loader: DataLoader, *, seed: int | None = None) -> ResumableLoader:
    """The :class:`~pitstop.adapters.torch.ResumableLoader` equivalent of ``loader`` (a
    ``DataLoader``, or what ``ray.train.torch.prepare_data_loader`` made of one): the same
    dataset, batch size, workers and collate function, the ``DistributedSampler``'s order
    (its shuffle, seed, replicas, rank and ``drop_last``), and a position saved with the
    state. Batches stay on the CPU: move them with ``.to(ray.train.torch.get_device())``."""
    base = getattr(loader, "_dataloader", loader)  # prepare_data_loader's device wrapper
    if not isinstance(base, DataLoader):
        raise InvalidArgumentError(f"resumable_loader takes a torch DataLoader, got "
                                   f"{type(loader).__name__}")
    if isinstance(base.sampler, (DistributedSampler, RandomSampler, SequentialSampler)) \
            and base.batch_size is not None:
        return _from_loader(base, seed)  # a ResumableSampler: the same order, no replay
    try:  # any other sampler or batch_sampler: replayed indices (docs/torch.md)
        return ResumableLoader.from_loader(base, seed=seed)
    except TypeError as e:
        raise InvalidArgumentError(f"resumable_loader: {e}") from e


def _from_loader(base: DataLoader, seed: int | None) -> ResumableLoader:
    sampler = base.sampler
    if isinstance(sampler, DistributedSampler):
        sampler_seed = sampler.seed if seed is None else seed
        resumable = ResumableSampler(base.dataset,  # type: ignore[arg-type]
                                     shuffle=sampler.shuffle, seed=sampler_seed,
                                     num_replicas=sampler.num_replicas, rank=sampler.rank,
                                     drop_last=sampler.drop_last)
    elif isinstance(sampler, (RandomSampler, SequentialSampler)):
        sampler_seed = 0 if seed is None else seed
        rank, world = _world()
        resumable = ResumableSampler(base.dataset,  # type: ignore[arg-type]
                                     shuffle=isinstance(sampler, RandomSampler),
                                     seed=sampler_seed, num_replicas=world, rank=rank)
    else:
        raise AssertionError(type(sampler))  # resumable_loader sends other kinds elsewhere
    extra = {"multiprocessing_context": base.multiprocessing_context} \
        if base.multiprocessing_context is not None else {}
    if base.num_workers > 0:
        extra.update(prefetch_factor=base.prefetch_factor,
                     persistent_workers=base.persistent_workers)
    return ResumableLoader(base.dataset, batch_size=base.batch_size, sampler=resumable,
                           seed=sampler_seed, num_workers=base.num_workers,
                           collate_fn=base.collate_fn, pin_memory=base.pin_memory,
                           drop_last=base.drop_last, timeout=base.timeout,
                           worker_init_fn=base.worker_init_fn, **extra)
