"""The torch adapter for a plain ``DataLoader`` or ``Sampler``: it captures nothing and says
what to put in the state instead (a resumed run would otherwise restart the epoch)."""

from __future__ import annotations

from typing import Any

from pitstop.core.adapter import Adapter
from pitstop.core.errors import UnsupportedStateError


class DataLoaderHint(Adapter):
    """A plain ``DataLoader`` or ``Sampler`` has no state to save: say what to use instead."""

    def can_handle(self, obj: Any) -> bool:
        from torch.utils.data import DataLoader, Sampler
        return isinstance(obj, (DataLoader, Sampler)) and not callable(
            getattr(obj, "state_dict", None))

    def capture(self, obj: Any) -> Any:
        from torch.utils.data import IterableDataset
        if isinstance(getattr(obj, "dataset", None), IterableDataset):
            # ResumableLoader needs a map-style dataset: it would refuse this one
            raise UnsupportedStateError(
                f"a {type(obj).__name__} over an IterableDataset "
                f"({type(obj.dataset).__name__}) has no state to save, so a resumed run "
                "would restart the stream. Save the dataset's own position instead: give it "
                "state_dict()/load_state_dict() and put the dataset in the state, or use "
                "torchdata's StatefulDataLoader (pip install torchdata; its state_dict() "
                "is saved); or leave the loader out of the state.")
        raise UnsupportedStateError(
            f"a {type(obj).__name__} has no state to save, so a resumed run would restart the "
            "epoch. Use pitstop.adapters.torch.ResumableLoader (DataLoader's arguments plus "
            "seed) or ResumableSampler, or leave it out of the state.")

    def apply(self, obj: Any, tree: Any) -> None:  # pragma: no cover - capture raises
        raise AssertionError("unreachable")
