"""Every ``RESILIENT_*`` setting in one place: typed, parsed the way the C++ core parses it.

The table lives in ``settings.toml`` next to this module (name, kind, default, meaning, grouped by
component); docs/SETTINGS.md is generated from it (``resilient settings``), and a test
checks that the two agree and that every variable the code reads is listed.

    from resilient import settings
    settings.get("io_uring")                  # "auto": RESILIENT_IO_URING, or its default
    with settings.set(io_uring="off", ckpt_timeout_s=30):
        ...                                   # restored on exit
    settings.set(log_level="info")            # without `with`: stays set
    print(settings.describe())                # the whole table, as markdown

Values are parsed by the native helpers (``_C.parse_int`` and friends), so Python and C++ accept
and reject the same spellings: ``on/off, 1/0, true/false, yes/no`` for booleans, ``auto/on/off``
for features, binary suffixes for sizes. A malformed value is a ValueError naming the variable;
reading an unknown name is a KeyError. Settings are read from the environment when a component
is created (a Checkpointer, a FailureDetector...), so ``set`` affects objects made afterwards.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from resilient import _C

PREFIX = "RESILIENT_"
_TABLE = Path(__file__).with_name("settings.toml")


@dataclass(frozen=True)
class Setting:
    name: str  # the environment variable, RESILIENT_...
    kind: str
    meaning: str
    section: str
    default: str | None = None  # parsed like a value when the variable is unset
    shown: str | None = None  # how the docs show the default, where it is computed
    choices: tuple[str, ...] = ()

    def parse(self, text: str) -> Any:
        """The typed value of `text`; ValueError naming the variable when malformed."""
        try:
            return _parse(self.kind, text, self.choices)
        except ValueError as e:
            raise ValueError(f"{self.name}={text!r}: {_reason(e)}") from None


def _reason(e: ValueError) -> str:
    text = str(e)
    return text.split(": ", 1)[1] if text.startswith("InvalidArgument: ") else text


def _parse(kind: str, text: str, choices: tuple[str, ...]) -> Any:
    if kind == "int":
        return _C.parse_int(text)
    if kind == "float":
        return _C.parse_float(text)
    if kind == "bool":
        return _C.parse_bool(text)
    if kind == "bytes":
        return _C.parse_bytes(text)
    if kind == "feature":
        return _C.parse_feature(text)
    if kind == "choice":
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value
    return text  # string, path, cpus, ipv4, list, errno: the component checks them


def _load() -> tuple[str, list[dict[str, Any]], dict[str, Setting]]:
    with open(_TABLE, "rb") as f:
        doc = tomllib.load(f)
    table: dict[str, Setting] = {}
    for section in doc["section"]:
        for row in section.get("setting", []):
            s = Setting(row["name"], row["kind"], row["meaning"], section["key"],
                        row.get("default"), row.get("shown"), tuple(row.get("choices", ())))
            if s.name in table:
                raise ValueError(f"settings.toml lists {s.name} twice")
            table[s.name] = s
    return doc["preface"], doc["section"], table


_PREFACE, _SECTIONS, SETTINGS = _load()


def lookup(name: str) -> Setting:
    """The Setting for "io_uring", "IO_URING" or "RESILIENT_IO_URING"; KeyError if unknown."""
    full = name.upper()
    if not full.startswith(PREFIX):
        full = PREFIX + full
    try:
        return SETTINGS[full]
    except KeyError:
        raise KeyError(f"unknown setting {name!r} (resilient.settings.describe() lists them)") \
            from None


def get(name: str) -> Any:
    """The typed value of a setting: the environment's, else the default (None when the
    setting has no fixed default and is unset). ValueError for a malformed value."""
    s = lookup(name)
    raw = os.environ.get(s.name, "")
    if raw.strip():
        return s.parse(raw)
    return None if s.default is None else s.parse(s.default)


def get_or(name: str, fallback: Any) -> Any:
    """`get(name)`, or `fallback` when the setting is unset (for computed defaults)."""
    value = get(name)
    return fallback if value is None else value


class set:  # noqa: A001 - the module's verb: settings.set(...)
    """Sets settings in this process's environment (checked first: nothing changes if one is
    unknown or malformed). Used in ``with``, restores the previous values on exit. None unsets."""

    def __init__(self, values: dict[str, Any] | None = None, **kwargs: Any):
        changes = {**(values or {}), **kwargs}
        resolved = {}
        for key, value in changes.items():
            s = lookup(key)
            if value is not None:
                text = _format(value)
                s.parse(text)
                resolved[s.name] = text
            else:
                resolved[s.name] = None
        self._previous = {name: os.environ.get(name) for name in resolved}
        for name, text in resolved.items():
            _put(name, text)

    def __enter__(self) -> set:
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, text in self._previous.items():
            _put(name, text)


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _put(name: str, text: str | None) -> None:
    if text is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = text


def describe() -> str:
    """docs/SETTINGS.md: every setting, grouped by component, as markdown."""
    out = ["# Settings", "", "<!-- Generated from python/resilient/settings.toml by "
           "`resilient settings`; edit the table, not this file. -->", "",
           _PREFACE.strip()]
    for section in _SECTIONS:
        out += ["", f"## {section['title']}", ""]
        if section.get("intro"):
            out += [section["intro"].strip(), ""]
        out += ["| variable | type | default | meaning |",
                "|----------|------|---------|---------|"]
        for row in section.get("setting", []):
            s = SETTINGS[row["name"]]
            kind = "/".join(s.choices) if s.kind == "choice" else s.kind
            shown = s.shown or (f"`{s.default}`" if s.default is not None else "unset")
            out.append(f"| `{s.name}` | {kind} | {shown} | {s.meaning} |")
        if section.get("after"):
            out += ["", section["after"].strip()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(describe())
