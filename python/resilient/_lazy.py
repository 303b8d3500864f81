"""Names a package exports without importing their modules until first used (PEP 562), so that
``import resilient`` and the CLI's inspection commands do not import torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for `package`: ``names`` maps an exported name to the
    module that defines it; the module is imported at the first access and the value kept in
    the package's namespace (later accesses do not come here)."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
