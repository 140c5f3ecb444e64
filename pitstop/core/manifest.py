"""Moved: the manifest is :mod:`pitstop.core.format` (``schema``, ``encode``, ``seal``,
``validate``); this name stays for code written against the earlier docs, with a
DeprecationWarning."""

import warnings

from pitstop.core.format.encode import FORMAT, FORMAT_VERSION  # noqa: F401
from pitstop.core.format.schema import SHARD_MARK, ArrayEntry, Manifest, RankView  # noqa: F401
from pitstop.core.format.seal import seal  # noqa: F401
from pitstop.core.format.validate import MAJOR, MIGRATIONS, parse, peek_header  # noqa: F401

warnings.warn("pitstop.core.manifest moved to pitstop.core.format (schema, encode, seal, "
              "validate)", DeprecationWarning, stacklevel=2)
