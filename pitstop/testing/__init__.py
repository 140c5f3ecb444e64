"""Conformance suites shipped with pitstop, as zarr ships ``zarr.testing.store.StoreTests``.

A face of pitstop (numpy, torch, TensorFlow, Keras, JAX) or a third-party adapter proves it
keeps pitstop's contract by subclassing :class:`AdapterSuite` in a pytest module and filling
in a few hooks (see docs/architecture.md, "Testing an adapter: the conformance suite")::

    from pitstop.testing import AdapterSuite

    class TestMyFaceConformance(AdapterSuite):
        def make_state(self): ...
        def train_step(self, state, step): ...
        def leaf_examples(self, seed): ...
        def wrong_shape_target(self): ...

It needs pytest (its tests take pytest's ``tmp_path`` and ``caplog`` fixtures).
"""

from pitstop.testing._bits import Bits
from pitstop.testing.adapter import SEED_VARIABLE, AdapterSuite

__all__ = ["AdapterSuite", "Bits", "SEED_VARIABLE"]
