"""A tcp address beyond loopback needs --wire-keys (shared/wire_keys.check_exposure); one loopback test
(shared/defaults.is_loopback) serves it and the api's warning about a missing API key."""

from __future__ import annotations

import pytest

from ferry.shared.defaults import is_loopback
from ferry.shared.errors import ConfigError
from ferry.shared.wire_keys import check_exposure


@pytest.mark.parametrize(
    "addr",
    [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.2:5555",
        "tcp://localhost:5555",
        "tcp://[::1]:5555",
        "ipc:///tmp/ferry/api.sock",
    ],
)
def test_loopback_and_ipc_need_no_keys(addr):
    check_exposure("--scheduler-addr", addr, None)


@pytest.mark.parametrize(
    "addr", ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5556", "tcp://scheduler:5557", "tcp://[::]:5555"]
)
def test_an_address_beyond_this_host_is_refused_without_keys_and_names_the_flag(addr):
    with pytest.raises(ConfigError, match="--scheduler-addr .* --wire-keys"):
        check_exposure("--scheduler-addr", addr, None)
    check_exposure("--scheduler-addr", addr, object())  # with keys: accepted


def test_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.9.10", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "api", "128.0.0.1"]))


@pytest.mark.parametrize("host", ["127.0.0.1.nip.io", "127.evil.example", "localhost.example", "127.0.0.1:80", "127."])
def test_a_name_that_starts_like_a_loopback_address_is_not_loopback(host):
    assert not is_loopback(host)


def test_a_name_beyond_loopback_is_refused_naming_the_flag_and_why():
    with pytest.raises(ConfigError, match=r"--api-addr tcp://127\.0\.0\.1\.nip\.io:5555 .*is a name.*127\.0\.0\.1"):
        check_exposure("--api-addr", "tcp://127.0.0.1.nip.io:5555", None)
