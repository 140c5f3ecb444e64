"""Modules the docs named before the restructuring still import, with a DeprecationWarning
that names the new home, and give the same objects: code written against the earlier docs
keeps working."""

from __future__ import annotations

import importlib
import sys

import pytest

from pitstop.core._moved import MOVED as ALIASED

MOVED = {
    "pitstop.adapters.registry": ("pitstop.core.adapter", ["register_adapter", "resolve", "Adapter"]),
    "pitstop.core.manifest": ("pitstop.core.format.validate", ["MIGRATIONS", "parse"]),
}


@pytest.mark.parametrize("old", sorted(ALIASED))
def test_an_old_core_module_name_is_the_module_at_its_new_home(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=ALIASED[old]):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(ALIASED[old])
    sys.modules.pop(old, None)  # the next test's import warns again


def test_the_documented_memory_tier_import_still_works() -> None:
    sys.modules.pop("pitstop.core.memtier", None)
    with pytest.warns(DeprecationWarning):
        from pitstop.core.memtier import default_root
    from pitstop.core.save import memtier
    assert default_root is memtier.default_root


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_still_imports_and_says_where_it_went(old: str) -> None:
    new, names = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.rsplit(".", 1)[0]):
        mod = importlib.import_module(old)
    target = importlib.import_module(new)
    for name in names:
        assert getattr(mod, name) is getattr(target, name)


def test_the_manifest_names_the_distributed_docs_import() -> None:
    sys.modules.pop("pitstop.core.manifest", None)
    with pytest.warns(DeprecationWarning):
        from pitstop.core.manifest import ArrayEntry, Manifest, RankView
    from pitstop.core.format import schema
    assert (ArrayEntry, Manifest, RankView) == (schema.ArrayEntry, schema.Manifest,
                                                schema.RankView)
