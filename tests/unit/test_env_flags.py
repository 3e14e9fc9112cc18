"""FERRY_* variables configure every command (what compose uses); flags win over variables."""

from __future__ import annotations

import pytest

from ferry.services.cli import build_parser
from ferry.shared.env_flags import apply_env_defaults
from ferry.shared.errors import ConfigError


def parse(argv, monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return build_parser(argv[0]).parse_args(argv)


def test_variables_fill_flags_with_their_types(monkeypatch):
    args = parse(
        ["worker"],
        monkeypatch,
        FERRY_MODEL="/models/x",
        FERRY_NUM_PAGES="128",
        FERRY_GPU_MEMORY="2GiB",
        FERRY_HEALTH_PORT="8002",
    )
    assert (args.model, args.num_pages, args.gpu_memory, args.health_port) == ("/models/x", 128, 2 * 2**30, 8002)


def test_flags_win_over_variables(monkeypatch):
    args = parse(["api", "--port", "9000"], monkeypatch, FERRY_MODEL="/m", FERRY_PORT="8001", FERRY_HOST="0.0.0.0")
    assert (args.port, args.host) == (9000, "0.0.0.0")


def test_bad_boolean_variable_names_the_variable(monkeypatch):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    with pytest.raises(ConfigError, match="FERRY_JSON"):
        apply_env_defaults(p, {"FERRY_JSON": "maybe"})
    apply_env_defaults(p, {"FERRY_JSON": "yes"})
    assert p.parse_args([]).json is True


def test_a_required_model_flag_is_still_required_without_its_variable(monkeypatch, capsys):
    monkeypatch.delenv("FERRY_MODEL", raising=False)
    with pytest.raises(SystemExit):
        build_parser("api").parse_args(["api"])
    assert "--model" in capsys.readouterr().err


def test_demo_model_is_served_under_a_readable_name():
    from ferry.services.serve_command import DEMO_MODEL_NAME, served_model_name

    demo = build_parser("serve").parse_args(["serve"])
    assert served_model_name(demo, "/home/u/.cache/ferry/tiny-qwen3-moe") == DEMO_MODEL_NAME
    given = build_parser("serve").parse_args(["serve", "--model", "Qwen/Qwen3-30B-A3B"])
    assert served_model_name(given, "Qwen/Qwen3-30B-A3B") == "Qwen/Qwen3-30B-A3B"
    named = build_parser("serve").parse_args(["serve", "--served-model-name", "q"])
    assert served_model_name(named, "/x") == "q"
