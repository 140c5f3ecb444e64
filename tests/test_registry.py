"""The adapter registry: lazy framework adapters, and a clear refusal where none is built."""

import numpy as np
import pytest

import pitstop


def _foreign(module: str) -> object:
    cls = type("Thing", (), {})
    cls.__module__ = module  # looks like an object of that framework to the registry
    return cls()


# (every framework pitstop names has its adapter now: a made-up one stands for a framework
# whose adapter is planned but not built)
@pytest.mark.parametrize("module,root", [("fakefw.core", "fakefw")])
def test_a_framework_without_an_adapter_is_refused_by_name(tmp_path, monkeypatch, module, root):
    from pitstop import adapters as registry

    monkeypatch.setitem(registry.LAZY, root, f"pitstop.adapters.{root}")
    monkeypatch.setitem(registry.INSTALL_HINT, root, root)
    with pitstop.CheckpointManager(tmp_path / "ck", memory_tier=False,
                                   save_on_signals=None) as mgr:
        with pytest.raises(pitstop.UnsupportedStateError, match=f"no {root} adapter yet"):
            mgr.save(1, {"w": np.zeros(3), "x": _foreign(module)})
        # nothing was committed, and the manager still works
        assert mgr.all_steps() == []
        mgr.save(2, {"w": np.ones(3)}).wait()
        assert mgr.all_steps() == [2]


def test_an_object_with_state_dict_needs_no_adapter(tmp_path):
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n, "buf": np.full(4, self.n)}

        def load_state_dict(self, sd: dict) -> None:
            self.n = sd["n"]
            assert sd["buf"].tolist() == [self.n] * 4

    c = Counter()
    c.n = 7
    with pitstop.CheckpointManager(tmp_path / "ck", memory_tier=False,
                                   save_on_signals=None) as mgr:
        mgr.save(1, {"c": c}).wait()
        fresh = Counter()
        assert mgr.restore({"c": fresh}) == 1
    assert fresh.n == 7
