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
        from torch.utils.data import DataLoader, IterableDataset
        dataset = getattr(obj, "dataset", None)
        stateful = callable(getattr(dataset, "state_dict", None))
        workers = int(getattr(obj, "num_workers", 0) or 0)
        if isinstance(obj, DataLoader) and (not isinstance(dataset, IterableDataset)
                                            or (stateful and workers > 0)):
            raise UnsupportedStateError(
                f"a plain {type(obj).__name__} has no state to save, so a resumed run would "
                "restart the epoch (and with worker processes its workers run ahead of the "
                "loop). Swap it for an equivalent one whose state is the loop's position: "
                "loader = pitstop.adapters.torch.ResumableLoader.from_loader(loader) (same "
                "dataset, sampler, batching and workers), and put that in the state; or "
                "leave the loader out of the state.")
        if isinstance(dataset, IterableDataset):
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
