"""Storage backends behind one short interface (see :class:`Storage`)."""

import os

from .base import Storage, Transaction, Writer
from .local import LocalStorage

__all__ = ["Storage", "Transaction", "Writer", "LocalStorage", "open_storage"]


def open_storage(location: "str | os.PathLike[str] | Storage", **kwargs: object) -> Storage:
    """A Storage for a path (local) or an existing Storage object."""
    if isinstance(location, Storage):
        return location
    text = str(location)
    if "://" in text and not text.startswith("file://"):
        raise NotImplementedError(
            f"{text}: object storage (s3://, gs://) is not available yet in this pitstop; "
            "use a local or network-mounted directory")
    return LocalStorage(text.removeprefix("file://"), **kwargs)  # type: ignore[arg-type]
