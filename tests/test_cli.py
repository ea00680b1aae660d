"""`python -m zerolab`: every listed command exists and describes itself (in-process, fast tier)."""
import importlib

import pytest

from zerolab.__main__ import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, about) in COMMANDS.items():
        assert f"  {name}" in out and about in out


def test_unknown_command_exits_2_with_the_list(capsys):
    assert main(["sweep"]) == 2  # once listed, never implemented
    err = capsys.readouterr().err
    assert "unknown command 'sweep'" in err and "compare" in err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_resolves_and_has_help(name, capsys):
    module, func = COMMANDS[name][0].split(":")
    assert callable(getattr(importlib.import_module(module), func))  # a listed command that does not exist fails here
    with pytest.raises(SystemExit) as stop:
        main([name, "--help"])
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out
