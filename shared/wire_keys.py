"""ZeroMQ CURVE for the tcp layout: `ferry keys DIR` writes one key pair per role, and `--wire-keys DIR`
(FERRY_WIRE_KEYS; compose mounts the files as secrets under /run/secrets) makes every socket
encrypted and authenticated (docs/ARCHITECTURE.md §1, "Trust").

The scheduler is the CURVE server of all three of its sockets and runs pyzmq's ZAP authenticator:
its api port (ZAP domain "api") admits only the api key, its steps and results ports (domain
"worker") only the worker key. A peer without the right secret key cannot complete the handshake,
so it can neither submit requests, nor take steps, nor pose as a worker. The ipc layout (`ferry
serve`) needs none of this: its sockets live in a 0700 directory only the user reaches.

Each process needs only its own secret and the scheduler's public key; the scheduler needs the api's
and the worker's public keys. Nothing secret goes on a command line: the flag names a directory.

tcp without keys is refused, loopback included: any local process (any user's) reaches a loopback port,
and could submit requests past the api's key or pose as the worker. `--insecure-wire`
(FERRY_INSECURE_WIRE) accepts that on loopback, and only there.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ferry.shared.defaults import is_loopback
from ferry.shared.errors import ConfigError

ROLES = ("scheduler", "api", "worker")
CLIENT_ROLES = ("api", "worker")  # ZAP domain of each scheduler socket: the role allowed on it
INSECURE_ENV = "FERRY_INSECURE_WIRE"
_TRUE = {"1", "true", "yes", "on"}
_insecure_flag = False  # --insecure-wire was on this process's command line (_InsecureWireFlag)


def add_wire_keys_flag(group) -> None:
    group.add_argument(
        "--wire-keys",
        default=None,
        metavar="DIR",
        help="directory of the CURVE keys `ferry keys DIR` wrote (compose: the secrets' directory, "
        "/run/secrets): authenticates and encrypts the ZeroMQ wire; required for tcp addresses "
        "(loopback too, unless --insecure-wire)",
    )
    group.add_argument(
        "--insecure-wire",
        action=_InsecureWireFlag,
        help="accept tcp addresses on loopback without --wire-keys: any local process can then submit "
        "requests past the api's key and pose as the worker (ferry serve needs neither: it uses "
        "private ipc sockets)",
    )


class _InsecureWireFlag(argparse._StoreTrueAction):  # argparse has no public base for a store_true flag
    """Also remembered for the whole process: the api and the worker check their wire where they set it
    up (require_keys_for_tcp), and their configs do not carry this flag there."""

    def __call__(self, parser, namespace, values, option_string=None):
        global _insecure_flag
        _insecure_flag = True
        super().__call__(parser, namespace, values, option_string)


def insecure_wire_allowed(environ=os.environ) -> bool:
    """--insecure-wire on this process's command line, or FERRY_INSECURE_WIRE set true."""
    return _insecure_flag or environ.get(INSECURE_ENV, "").strip().lower() in _TRUE


def generate(directory: Path) -> list[Path]:
    """One key pair per role in `directory` (created 0700): ROLE.key (public) and ROLE.key_secret (0600)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    written = []
    for role in ROLES:
        for suffix in (".key", ".key_secret"):
            if (directory / f"{role}{suffix}").exists():
                raise ConfigError(
                    f"{directory / (role + suffix)} exists: keys are never overwritten; use a new directory"
                )
    for role in ROLES:
        public, secret = zmq.auth.create_certificates(str(directory), role)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        written += [Path(public), Path(secret)]
    return written


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--wire-keys: cannot read {path.name} in the key directory ({exc}); write the keys with `ferry keys DIR`"
        ) from exc
    if secret and secret_key is None:
        raise ConfigError(f"--wire-keys: {path.name} holds no secret key")
    return public, secret_key


class WireKeys:
    """One process's CURVE keys: its own pair, the scheduler's public key and, for the scheduler, the
    public keys it admits per ZAP domain."""

    def __init__(self, directory: str | Path, role: str):
        d = Path(directory)
        if not d.is_dir():
            raise ConfigError(f"--wire-keys: {directory} is not a directory; write the keys with `ferry keys DIR`")
        self.role = role
        self.public, self.secret = _load(d / f"{role}.key_secret", secret=True)
        self.server_public = self.public if role == "scheduler" else _load(d / "scheduler.key", secret=False)[0]
        self.admitted = {r: _load(d / f"{r}.key", secret=False)[0] for r in CLIENT_ROLES} if role == "scheduler" else {}
        self._auth: ThreadAuthenticator | None = None

    def server(self, domain: str):
        """Socket setup for one of the scheduler's bound sockets, admitting the `domain` role's key only."""

        def secure(sock: zmq.Socket) -> None:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = self.secret, self.public, True
            sock.zap_domain = domain.encode()

        return secure

    def client(self):
        def secure(sock: zmq.Socket) -> None:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = (
                self.secret,
                self.public,
                self.server_public,
            )

        return secure

    def start_authenticator(self, ctx: zmq.Context) -> None:
        """The scheduler's ZAP handler (a thread of pyzmq's): each domain admits its role's key only."""
        auth = ThreadAuthenticator(ctx)
        auth.start()
        for domain, key in self.admitted.items():
            auth.configure_curve_callback(domain, _Admit(key))
        self._auth = auth

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class _Admit:
    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key == self.key


def check_exposure(flag: str, addr: str, keys: object | None) -> None:
    """A tcp address beyond loopback needs --wire-keys: anyone who reaches such a port could otherwise
    submit requests past the api's checks, take steps or pose as the worker."""
    if keys is not None or not addr.startswith("tcp://"):
        return
    host = addr[len("tcp://") :].rsplit(":", 1)[0]
    if is_loopback(host):
        return
    named = ""
    if host != "*" and not _is_ip(host.strip("[]")):
        named = (
            f" ({host!r} is a name, which may resolve to any address: only a literal loopback address such "
            "as 127.0.0.1 or [::1], or localhost, counts as this host)"
        )
    raise ConfigError(
        f"{flag} {addr} may be reachable beyond this host{named} but the wire is not authenticated: "
        "write keys with `ferry keys DIR` and pass --wire-keys DIR (FERRY_WIRE_KEYS) to the api, the "
        "scheduler and the worker, or use a loopback address"
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def require_keys_for_tcp(flag: str, addr: str, keys: object | None, insecure: bool | None = None) -> None:
    """A tcp address, loopback included, needs keys unless `insecure` (default: insecure_wire_allowed()).
    check_exposure refuses tcp beyond loopback without keys whatever this says."""
    if keys is not None or not addr.startswith("tcp://"):
        return
    if insecure_wire_allowed() if insecure is None else insecure:
        return
    raise ConfigError(
        f"{flag} {addr} is a tcp address but the wire is not authenticated: any local process could "
        "submit requests past the api's key or pose as the worker. Write keys with `ferry keys DIR` and "
        "pass --wire-keys DIR (FERRY_WIRE_KEYS) to the api, the scheduler and the worker; or run "
        "`ferry serve`, whose private ipc sockets need no keys; or pass --insecure-wire "
        "(FERRY_INSECURE_WIRE=1) to accept that risk on loopback"
    )
