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
for features, binary suffixes for sizes. A number is checked against its setting's ``range``
(``[1, 256]``, ``(0, inf)``; sizes may also need to be a ``multiple`` of a size), a list
(comma-separated) item by item. A malformed or out-of-range value is a ValueError naming the
variable; reading an unknown name is a KeyError. Settings are read from the environment when a
component is created (a Checkpointer, a FailureDetector...), so ``set`` affects objects made
afterwards.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from resilient import _C

PREFIX = "RESILIENT_"
_TABLE = Path(__file__).with_name("settings.toml")


@dataclass(frozen=True)
class Range:
    """The values a number may take: ``[1, 256]``, ``(0, inf)`` (a bracket includes its
    bound, a parenthesis excludes it; ``inf`` is no bound). Sizes may be written with suffixes
    (``[4KiB, 1GiB]``)."""

    text: str
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str, kind: str) -> Range:
        t = text.strip()
        if len(t) < 5 or t[0] not in "[(" or t[-1] not in "])" or t.count(",") != 1:
            raise ValueError(f"range {text!r} is not like [1, 256] or (0, inf)")
        low, high = (part.strip() for part in t[1:-1].split(","))
        return cls(t, _bound(low, kind), _bound(high, kind), t[0] == "[", t[-1] == "]")

    def __contains__(self, value: float) -> bool:
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def describe(self) -> str:
        """"in [1, 256]", "> 0", ">= 4KiB"."""
        if self.high == math.inf:
            low = self.text[1:].split(",")[0].strip()
            return f"{'>=' if self.low_closed else '>'} {low}"
        return f"in {self.text}"


def _bound(text: str, kind: str) -> float:
    if text in ("inf", "-inf"):
        return float(text)
    return float(_C.parse_bytes(text) if kind == "bytes" else _C.parse_float(text))


@dataclass(frozen=True)
class Setting:
    name: str  # the environment variable, RESILIENT_...
    kind: str
    meaning: str
    section: str
    default: str | None = None  # parsed like a value when the variable is unset
    shown: str | None = None  # how the docs show the default, where it is computed
    choices: tuple[str, ...] = ()  # a choice's values; a list's or an errno's allowed items
    range: Range | None = None  # numbers (int, float, bytes)
    multiple: int | None = None  # bytes: a multiple of this many

    def parse(self, text: str) -> Any:
        """The typed value of `text`; ValueError naming the variable when it is malformed or
        outside the setting's range."""
        try:
            value = _parse(self.kind, text, self.choices)
            self._check(value)
            return value
        except ValueError as e:
            raise ValueError(f"{self.name}={text!r}: {_reason(e)}") from None

    def _check(self, value: Any) -> None:
        if self.range is not None and value not in self.range:
            raise ValueError(f"must be {self.range.describe()}")
        if self.multiple and value % self.multiple:
            raise ValueError(f"must be a multiple of {_size(self.multiple)}, not {value}")

    def type_text(self) -> str:
        """The type as the docs show it: "int in [1, 256]", "bytes >= 4KiB, a multiple of
        4KiB", "list of write/fsync/...", "debug/info/warn/error"."""
        if self.kind == "choice":
            return "/".join(self.choices)
        text = self.kind
        if self.kind in ("list", "errno") and self.choices:
            text += " of " + "/".join(self.choices)
        if self.kind == "errno":
            text += " or a number >= 0"
        if self.range is not None:
            text += " " + self.range.describe()
        if self.multiple:
            text += f", a multiple of {_size(self.multiple)}"
        return text


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


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
    if kind == "list":
        return _list(text, choices)
    if kind == "errno":
        return _errno(text, choices)
    if kind == "cpus":
        _cpus(text)
        return text
    if kind == "ipv4":
        try:
            return str(ipaddress.IPv4Address(text.strip()))
        except ipaddress.AddressValueError:
            raise ValueError("expected an IPv4 address such as 10.0.0.5") from None
    return text  # string, path: the component checks them


def _list(text: str, choices: tuple[str, ...]) -> list[str]:
    """Comma-separated items, each stripped; an empty item (``a,,b``, ``a,``) is an error, so
    a typo never becomes an extra item."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError("an empty item in the comma-separated list")
    for item in items:
        if choices and item not in choices:
            raise ValueError(f"unknown item {item!r} (expected {', '.join(choices)})")
    return items


def _errno(text: str, names: tuple[str, ...]) -> int:
    """An errno name the native fault hook knows, or a number >= 0 (0: delay only)."""
    t = text.strip()
    if t in names:
        return getattr(errno, t)
    if t.isdigit():
        return int(t)
    raise ValueError(f"unknown errno (expected one of {', '.join(names)}, or a number >= 0)")


def _cpus(text: str) -> list[int]:
    """A CPU list exactly as the native parse_cpu_list reads it: ``8-15``, ``0,2,4-7``."""
    cpus: list[int] = []
    for part in text.split(","):
        m = _CPU_PART.match(part)
        low = int(m.group(1)) if m else 0
        high = int(m.group(2) or low) if m else -1
        if not low <= high < _CPU_SETSIZE:
            raise ValueError(f"bad part {part!r} of the CPU list (expected e.g. 8-15 or 0,2,4-7)")
        cpus += range(low, high + 1)
    return cpus


_CPU_PART = re.compile(r"^([0-9]{1,5})(?:-([0-9]{1,5}))?$")
_CPU_SETSIZE = 1024  # glibc's CPU_SETSIZE


def _load() -> tuple[str, list[dict[str, Any]], dict[str, Setting]]:
    with open(_TABLE, "rb") as f:
        doc = tomllib.load(f)
    table: dict[str, Setting] = {}
    for section in doc["section"]:
        for row in section.get("setting", []):
            bounds = row.get("range")
            s = Setting(row["name"], row["kind"], row["meaning"], section["key"],
                        row.get("default"), row.get("shown"), tuple(row.get("choices", ())),
                        None if bounds is None else Range.parse(bounds, row["kind"]),
                        row.get("multiple"))
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
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
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
            kind = s.type_text()
            shown = s.shown or (f"`{s.default}`" if s.default is not None else "unset")
            out.append(f"| `{s.name}` | {kind} | {shown} | {s.meaning} |")
        if section.get("after"):
            out += ["", section["after"].strip()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(describe())
