"""Every port flag of every command refuses a number outside 1..65535 at parse time, naming the flag
(`ferry serve --port 99999` listened on a random port)."""

from __future__ import annotations

import contextlib
import io

import pytest

from ferry.services.cli import COMMANDS, build_parser, main


def _flags(command: str) -> list[str]:
    sub = build_parser(command)._subparsers._group_actions[0].choices[command]  # argparse has no public accessor
    return [flag for action in sub._actions for flag in action.option_strings]


PORT_FLAGS = [(command, flag) for command in COMMANDS for flag in _flags(command) if flag.endswith("-port")]


def argv(command: str, flag: str, value: str) -> list[str]:
    return [command, flag, value, *(["--model", "m"] if "--model" in _flags(command) else [])]


def test_the_port_flags_are_found():
    assert {
        ("serve", "--port"),
        ("serve", "--scheduler-health-port"),
        ("serve", "--worker-health-port"),
        ("api", "--port"),
        ("scheduler", "--health-port"),
        ("worker", "--health-port"),
    } <= set(PORT_FLAGS)


@pytest.mark.parametrize(("command", "flag"), PORT_FLAGS)
@pytest.mark.parametrize("value", ["99999", "65536", "0", "-1", "http"])
def test_a_port_outside_1_to_65535_is_refused_naming_the_flag(command, flag, value):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main(argv(command, flag, value))
    assert exc.value.code == 2
    assert f"argument {flag}: expected" in err.getvalue() and "1..65535" in err.getvalue(), err.getvalue()


@pytest.mark.parametrize(("command", "flag"), PORT_FLAGS)
def test_a_port_in_range_is_taken(command, flag):
    args = build_parser(command).parse_args(argv(command, flag, "65535"))
    assert 65535 in vars(args).values()


def test_a_port_from_the_environment_is_checked_too(monkeypatch):
    monkeypatch.setenv("FERRY_PORT", "99999")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        main(["api", "--model", "m"])
    assert "argument --port" in err.getvalue() and "1..65535" in err.getvalue(), err.getvalue()
