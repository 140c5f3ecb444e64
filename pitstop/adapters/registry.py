"""Moved: the adapter seam is :mod:`pitstop.core.adapter` (register with
``pitstop.adapters.register_adapter``). This name stays for code written against the earlier
docs, with a DeprecationWarning."""

import warnings

from pitstop.core.adapter import (  # noqa: F401
    Adapter,
    StatefulAdapter,
    ambient_coordinator,
    ambient_rank,
    exception_hints,
    frameworks_of,
    has_state_dict_methods,
    register_adapter,
    resolve,
    staging_hooks,
)

warnings.warn("pitstop.adapters.registry moved to pitstop.core.adapter; import register_adapter "
              "from pitstop.adapters", DeprecationWarning, stacklevel=2)
