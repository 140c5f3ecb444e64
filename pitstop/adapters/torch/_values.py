"""Adapters for torch objects whose state is values, not tensors: generators, the resumable
sampler and loader, and the hint that a plain ``DataLoader`` or ``Sampler`` has no state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pitstop.adapters.torch._adapter import _refused
from pitstop.adapters.torch._loader import ResumableLoader
from pitstop.adapters.torch._sampler import ResumableSampler
from pitstop.core.adapter import Adapter
from pitstop.core.errors import IncompatibleTargetError


class GeneratorAdapter(Adapter):
    """A ``torch.Generator`` (CPU or CUDA): its state as a value, set back with set_state."""

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, torch.Generator)

    def capture(self, obj: torch.Generator) -> dict[str, Any]:
        return {"device": str(obj.device), "state": obj.get_state().numpy().tobytes()}

    def check(self, obj: torch.Generator, tree: Any) -> None:
        """A generator state fits only a generator of the same device type (and size)."""
        state = tree.get("state") if isinstance(tree, Mapping) else None
        if not isinstance(state, (bytes, bytearray)):
            if isinstance(tree, Mapping) and "bit_generator" in tree:
                saved = "a numpy generator's state (np.random.Generator or RandomState)"
            elif isinstance(tree, (tuple, list)):
                saved = "a random.Random state"
            else:
                saved = "no torch.Generator state"
            raise IncompatibleTargetError(
                f"the checkpoint holds {saved} here, not a torch.Generator's; restore it "
                "into the kind of generator that saved it")
        saved = torch.device(str(tree.get("device", "cpu"))).type
        if saved != obj.device.type:
            raise IncompatibleTargetError(
                f"the checkpoint holds the state of a {saved} torch.Generator, this one is on "
                f"{obj.device}; build it with torch.Generator(device={saved!r})")
        size = obj.get_state().numel()
        if len(state) != size:
            raise IncompatibleTargetError(
                f"the checkpoint's torch.Generator state has {len(state)} bytes, this "
                f"{obj.device} generator's has {size} (saved by another torch build?); leave "
                "it out of the state to start it from its own seed")

    def apply(self, obj: torch.Generator, tree: dict[str, Any]) -> None:
        self.check(obj, tree)
        try:
            obj.set_state(torch.frombuffer(bytearray(tree["state"]), dtype=torch.uint8))
        except RuntimeError as e:
            raise _refused(obj, e, "Leave it out of the state to start it from its own "
                           "seed.") from e


class SamplerAdapter(Adapter):
    """:class:`ResumableSampler` / :class:`ResumableLoader`: their position, as values.

    A sampler iterated by a plain ``DataLoader`` with worker processes saves a position
    ahead of the loop (the workers prefetch); ``caveats`` says so, naming the fix.
    """

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, (ResumableSampler, ResumableLoader))

    def capture(self, obj: ResumableSampler | ResumableLoader) -> dict[str, Any]:
        return obj.state_dict()

    def check(self, obj: ResumableSampler | ResumableLoader, tree: Any) -> None:
        obj.check_state(tree)

    def apply(self, obj: ResumableSampler | ResumableLoader, tree: Any) -> None:
        obj.load_state_dict(tree)

    def caveats(self, obj: ResumableSampler | ResumableLoader) -> list[str]:
        if isinstance(obj, ResumableLoader):
            return []  # it counts what the loop took: exact with any number of workers
        return obj.caveats()

