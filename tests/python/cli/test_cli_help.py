"""Every `resilient` subcommand answers `--help` (exit 0, a usage line), and the top-level
description is a whole sentence."""


from __future__ import annotations

import argparse

import pytest

from resilient.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*prefix, name))
                out += _commands(sub, (*prefix, name))
    return out


COMMANDS = _commands(build_parser())


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


def _leaves(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                has_sub = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
                out += _leaves(sub, (*prefix, name)) if has_sub else [((*prefix, name), sub)]
    return out


def test_every_command_but_the_launcher_has_json():
    """`resilient run` is a launcher (torchrun's arguments, then the script's); every other
    command prints one JSON document with --json."""
    missing = [" ".join(c) for c, p in _leaves(build_parser())
               if c != ("run",) and "--json" not in p._option_string_actions]
    assert missing == []


def test_descriptions_are_not_cut_mid_sentence():
    """A description taken from a docstring is its whole first paragraph (`sim ettr` once
    stopped at the end of the docstring's first line)."""
    cut = [" ".join(c) for c, p in _leaves(build_parser())
           if p.description and not p.description.rstrip().endswith(".")]
    assert cut == []


def test_settings_json(capsys):
    assert main(["settings", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert {"name", "kind", "default", "meaning"} <= set(rows[0])
    assert any(r["name"] == "RESILIENT_POOL_BYTES" for r in rows)
