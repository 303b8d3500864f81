"""resilient._lazy.lazy_getattr, the one helper behind the packages' lazily imported names:
an exported name imports its module at first use and is kept; an unknown name is an
AttributeError naming the package; every name a package lists lazily resolves."""

from __future__ import annotations

import sys
import types

import pytest

from resilient._lazy import lazy_getattr


def test_a_name_imports_its_module_once_and_is_kept(monkeypatch) -> None:
    pkg = types.ModuleType("fakepkg")
    monkeypatch.setitem(sys.modules, "fakepkg", pkg)
    imported = []
    target = types.ModuleType("fakepkg.impl")
    target.Thing = object()
    monkeypatch.setitem(sys.modules, "fakepkg.impl", target)
    monkeypatch.setattr("importlib.import_module",
                        lambda name: imported.append(name) or sys.modules[name])
    pkg.__getattr__ = lazy_getattr("fakepkg", {"Thing": "fakepkg.impl"})
    assert pkg.Thing is target.Thing and imported == ["fakepkg.impl"]
    assert pkg.Thing is target.Thing and imported == ["fakepkg.impl"]  # kept: no second import
    with pytest.raises(AttributeError, match="module 'fakepkg' has no attribute 'Other'"):
        _ = pkg.Other


@pytest.mark.parametrize("package", ["resilient", "resilient.checkpoint", "resilient.recovery",
                                     "resilient.comm"])
def test_every_lazy_name_of_the_packages_resolves(package: str) -> None:
    import importlib

    module = importlib.import_module(package)
    names = [n for n in getattr(module, "__all__", []) if n not in vars(module)]
    for name in names:
        assert getattr(module, name) is not None, name
