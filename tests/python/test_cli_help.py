"""Every `resilient` subcommand answers `--help` (exit 0, a usage line), and the top-level
description is a whole sentence."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from resilient.cli import DESCRIPTION, build_parser, main


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*prefix, name))
                out += _commands(sub, (*prefix, name))
    return out


COMMANDS = _commands(build_parser())


def test_top_level_help_is_a_whole_sentence():
    r = subprocess.run([sys.executable, "-m", "resilient", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0
    assert DESCRIPTION.endswith(".") and DESCRIPTION.split()[0] in r.stdout
    assert " ".join(r.stdout.split()).count(" ".join(DESCRIPTION.split())) == 1


def test_every_subcommand_is_listed():
    names = {c[0] for c in COMMANDS}
    assert {"bench", "sim", "chaos", "settings", "ckpt"} <= names
    assert ("bench", "straggler") in COMMANDS
    assert {("ckpt", n) for n in ("ls", "show", "verify", "diff", "export", "import")} <= set(
        COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: resilient " + " ".join(command))
