"""Object storage behind the :class:`~pitstop.core.storage.base.Storage` interface: ``s3://``
through s3fs/aiobotocore, and any other fsspec URL (``memory://``, ``gs://`` where gcsfs is
installed, ...) through fsspec's generic calls.

Object stores have no rename, so a save is published by an object written last:

1. ``begin(name)`` refuses a step whose ``<name>/manifest.json`` exists (StepExistsError),
   then writes a *save marker* ``.tmp-<name>-<8 hex>`` (pitstop's temporary name, see
   :mod:`pitstop.core.directory.names`) that records the data objects the save may write, before it
   writes any of them.
2. Data objects go straight to ``<name>/data-NNN.bin``: large ones as parallel multipart
   uploads (``part_size`` parts, at most ``max_concurrency`` requests in flight), each
   request under a deadline (``request_timeout``) and retried a bounded number of times
   (``max_attempts``). On S3 every object is *created*, never replaced (``If-None-Match:
   *``), so a second writer can never overwrite a committed checkpoint's bytes.
3. ``commit`` writes ``<name>/manifest.json`` last, create-only: that one PUT is the commit.
   Then the marker is deleted.

A checkpoint is listed only when its manifest exists; an interrupted save leaves a marker,
and ``cleanup_incomplete`` (run by a writer when it opens the directory, and by ``pitstop
gc``, both holding the lock) removes exactly the objects its marker names, aborts their
unfinished multipart uploads, then the marker; it also aborts every other unfinished upload
of a checkpoint object (one a stalled server or a writer that lost its lock started late),
except those of this storage's own open saves. Deletions work the same way: a marker ``.tmp-deleting-<name>-…``
lists the objects, the manifest goes first (the checkpoint is then gone for readers), the
rest after.

The writer lock is a lease object ``.pitstop/lock`` created with ``If-None-Match: *`` and
renewed (``If-Match``) every ``lock_ttl / 4`` seconds; a holder that died on this host
(same boot, pid gone) or that has not renewed it for ``lock_ttl`` seconds (the store's own
clock) is taken over. Before every commit the writer reads the lease back and refuses to
commit when another writer holds it. Where the store ignores conditional writes (checked
when the lock is taken) or fsspec offers none (``gs://`` ...), there is no exclusion between
processes: this is said once, as a warning. ``memory://`` lives in one process, where the
lock is exact.

See docs/storage.md for the options, credentials and what is and is not guaranteed.
"""

from pitstop.core.storage.objectstore.ops import (
           ObjectStoreError,
           ObjectStoreTimeout,
           TransferOptions,
)
from pitstop.core.storage.objectstore.storage import FsspecStorage, Leftover, ObjectListing

__all__ = ["FsspecStorage", "ObjectStoreError", "ObjectStoreTimeout", "ObjectListing",
           "Leftover", "TransferOptions"]
