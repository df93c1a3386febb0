"""The cluster key set, and what every pdserve ZeroMQ socket does with it (CurveZMQ): servers admit
only clients that hold the cluster's key pair, and everything between them is encrypted.

One key pair makes a cluster: every member holds its secret (possession is membership). A server
socket takes it as its own and admits a CURVE client only if the client's public key is the
cluster's, a check made by the ZAP handler of the socket's ZeroMQ context (`Gatekeeper`, started
here before any server socket is keyed, and required by ZAP_ENFORCE_DOMAIN: a context without one
refuses every client instead of admitting any). A client takes the same pair and the cluster's
public key as the server's. Denied peers are logged once per address.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import shutil
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.certs import load_certificate
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from pdserve.cluster.codec import MalformedLog

logger = logging.getLogger(__name__)

KEYS_ENV = "PDSERVE_CLUSTER_KEYS"  # the default key directory, over the per-user one
PUBLIC_FILE = "cluster.key"  # pyzmq's certificate format: zmq.auth.load_certificate reads both
SECRET_FILE = "cluster.key_secret"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler
PLAIN_USER = "pdserve"
# Monitor events of a client whose handshake the server refused (other keys, or one side
# insecure): retrying will not help, so they are worth a log line.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


# A server's handshakes that fail before its ZAP handler is asked (a client with other keys, with
# none, or not speaking ZMTP at all): libzmq names no peer for these.
REFUSED_BEFORE_ZAP = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class NoClusterKeys(ValueError):
    """No key set where one was looked for; the message says how to get one."""


def default_key_dir() -> Path:
    """Where `serve` keeps (and creates on first use) its key set, and where nodes and the Python
    client look without --cluster-keys: $PDSERVE_CLUSTER_KEYS, else a per-user directory."""
    if os.environ.get(KEYS_ENV):
        return Path(os.environ[KEYS_ENV]).expanduser()
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "pdserve" / "cluster-keys"


_CERT = """#   pdserve cluster key set: {what}
#   {note}
metadata
curve
    public-key = "{public}"
{secret}"""


@dataclass(frozen=True)
class ClusterKeys:
    public: bytes  # z85, 40 characters
    secret: bytes = field(repr=False)  # never in a log line or a traceback's locals
    directory: Path | None = None

    @classmethod
    def generate(cls) -> ClusterKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @property
    def fingerprint(self) -> str:
        """A short name of the key set for logs (its public key's start)."""
        return self.public[:8].decode()

    def write(self, directory: str | Path) -> ClusterKeys:
        """Into `directory` (made 0700 if missing; it must not hold a key set already): the public
        key in cluster.key, both in cluster.key_secret (0600)."""
        directory = Path(directory).expanduser()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if (directory / SECRET_FILE).exists() or (directory / PUBLIC_FILE).exists():
            raise ValueError(
                f"{directory} already holds a cluster key set; give another directory (keys "
                "are rotated by making a new set, see docs/security.md)"
            )
        public = self.public.decode()
        files = {
            PUBLIC_FILE: (0o644, "public key", "may be shown to anyone", ""),
            SECRET_FILE: (
                0o600,
                "SECRET key",
                "whoever holds this file is a cluster member: keep it mode 0600",
                f'    secret-key = "{self.secret.decode()}"\n',
            ),
        }
        for name, (mode, what, note, secret) in files.items():
            fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "w") as f:
                f.write(_CERT.format(what=what, note=note, public=public, secret=secret))
        return ClusterKeys(self.public, self.secret, directory)

    @classmethod
    def load(cls, directory: str | Path) -> ClusterKeys:
        """The key set in `directory`; refused (ValueError naming the fix) when it is missing,
        readable by group or others, or its two keys do not belong together."""
        directory = Path(directory).expanduser()
        path = directory / SECRET_FILE
        try:
            info = path.stat()
        except FileNotFoundError:
            raise NoClusterKeys(
                f"no cluster keys in {directory} ({SECRET_FILE} is missing): copy the cluster's "
                "key directory there, or give its place with --cluster-keys DIR (`pdserve "
                "keygen DIR` makes a key set)"
            ) from None
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"cluster key file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise ValueError(
                f"cluster key file {path} is readable by others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}): run `chmod 600 {path}`"
            )
        try:
            public, secret = load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cluster key file {path} cannot be read: {exc}") from None
        if secret is None or len(secret) != 40 or len(public) != 40:
            raise ValueError(f"cluster key file {path} holds no CURVE key pair")
        if zmq.curve_public(secret) != public:
            raise ValueError(f"cluster key file {path}: its public key is not its secret key's")
        return cls(public, secret, directory)

    @classmethod
    def load_or_create(cls, directory: str | Path) -> ClusterKeys:
        """The key set in `directory`, made there first if there is none (by `serve`, for its own
        processes). Made beside it and renamed into place, so two processes starting at once
        end up with the same set."""
        directory = Path(directory).expanduser()
        if (directory / SECRET_FILE).exists() or (directory.is_dir() and any(directory.iterdir())):
            return cls.load(directory)
        directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".keys-", dir=directory.parent))
        try:
            cls.generate().write(staging)
            try:
                os.rename(staging, directory)  # replaces an empty directory, never a full one
                logger.info("made a cluster key set in %s", directory)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return cls.load(directory)


# --- the ZAP handler of a context ---------------------------------------------------------------


class Gatekeeper(ThreadAuthenticator):
    """The ZAP handler of one ZeroMQ context: admits a CURVE client of a keyed server socket only
    if its public key is that socket's cluster's, and a PLAIN client only with that socket's
    password (compared in constant time). Each denied address is logged once per socket kind."""

    def __init__(self, context: zmq.Context) -> None:
        super().__init__(context, log=logging.getLogger("pdserve.zap"))
        self.curve: dict[str, bytes] = {}  # ZAP domain -> the cluster's z85 public key
        self.plain: dict[str, bytes] = {}  # ZAP domain -> its PLAIN password
        self.labels: dict[str, str] = {}  # ZAP domain -> what the socket is, for the log
        self.users: dict[str, int] = {}  # ZAP domain -> server sockets using it
        self.denied: dict[str, MalformedLog] = {}
        self._address = ""

    def use(self, domain: str, label: str, *, curve: bytes = b"", plain: bytes = b"") -> None:
        if curve:
            self.curve[domain] = curve
        if plain:
            self.plain[domain] = plain
        self.labels[domain] = label
        self.users[domain] = self.users.get(domain, 0) + 1
        self.denied.setdefault(domain, MalformedLog(logger, label, what="a connection"))

    def release(self, domain: str) -> bool:
        """One socket of `domain` is closed; True when the handler serves no socket any more."""
        self.users[domain] = self.users.get(domain, 1) - 1
        if self.users[domain] <= 0:
            for table in (self.curve, self.plain, self.labels, self.users, self.denied):
                table.pop(domain, None)
        return not self.users

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        try:
            await super().handle_zap_message(msg)
        except Exception:  # a reply must go out, and the handler must live on: deny
            logger.exception("ZAP request from %s failed; denied", self._address)
            if len(msg) > 1:
                self._send_zap_reply(msg[1], b"500", b"internal error")

    def _deny(self, domain: str, why: str) -> tuple[bool, bytes]:
        log = self.denied.get(domain)
        if log is not None:
            log(self._address, why)
        else:
            logger.warning(
                "refused a connection from %s to an unknown ZAP domain %r", self._address, domain
            )
        return False, why.encode()

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        expected = self.curve.get(domain)
        if expected is not None and hmac.compare_digest(z85.encode(client_key), expected):
            return True, b"OK"
        return self._deny(domain, "its CURVE key is not this cluster's: it lacks the cluster keys")

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        expected = self.plain.get(domain)
        if expected is not None and hmac.compare_digest(password.encode(), expected):
            return True, b"OK"
        return self._deny(domain, "wrong password for this KV receiver")


_gates: dict[int, Gatekeeper] = {}  # by the libzmq context's address
_gates_lock = threading.Lock()


def _gatekeeper(ctx: zmq.Context) -> Gatekeeper:
    with _gates_lock:
        gate = _gates.get(ctx.underlying)
        if gate is None or not gate.is_alive():
            if gate is not None:  # its thread died: unbind its socket before a new one binds
                gate.stop()
            gate = Gatekeeper(ctx)
            gate.start()
            _gates[ctx.underlying] = gate
        _check_handler(ctx)
        return gate


def _check_handler(ctx: zmq.Context) -> None:
    """A ZAP handler is bound in ctx (libzmq admits any CURVE client where none is)."""
    probe = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
    try:
        probe.bind(ZAP_ENDPOINT)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            return
        raise
    finally:
        probe.close(0)
    raise RuntimeError("no ZAP handler runs in this ZeroMQ context; keyed sockets refuse all")


_keyed: weakref.WeakKeyDictionary[zmq.Socket, str] = weakref.WeakKeyDictionary()  # -> domain


# --- sockets ------------------------------------------------------------------------------------


def curve_server(sock: zmq.Socket, keys: ClusterKeys, label: str) -> None:
    """Make sock (before it binds) a CURVE server admitting only holders of `keys`; label names it
    in the log of denied peers. Undo with `close_server`."""
    domain = f"pdserve-curve:{keys.public.decode()}:{label}"
    _gatekeeper(sock.context).use(domain, label, curve=keys.public)
    _server(sock, domain)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def plain_server(sock: zmq.Socket, password: bytes, label: str) -> None:
    """Make sock (before it binds) a PLAIN server admitting only clients with `password`: the
    connection is authenticated, its traffic neither encrypted nor integrity-checked (for KV
    pages on a trusted network; see docs/security.md)."""
    domain = f"pdserve-plain:{id(sock)}:{label}"
    _gatekeeper(sock.context).use(domain, label, plain=password)
    _server(sock, domain)
    sock.plain_server = True


def _server(sock: zmq.Socket, domain: str) -> None:
    _keyed[sock] = domain
    sock.zap_domain = domain.encode()
    # A context whose handler is gone refuses every client rather than admitting any.
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def curve_client(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Make sock (before it connects) a CURVE client of a server keyed with `keys`."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


def plain_client(sock: zmq.Socket, password: bytes) -> None:
    sock.plain_username = PLAIN_USER.encode()
    sock.plain_password = password


def close_server(sock: zmq.Socket) -> None:
    """Close a server socket made by curve_server or plain_server (any other just closes), then
    stop its context's ZAP handler if no keyed socket needs it any more."""
    ctx, domain = sock.context, _keyed.pop(sock, None)
    sock.close(0)  # first: no client may connect between the handler's end and the close
    if domain is None:
        return
    with _gates_lock:
        gate = _gates.get(ctx.underlying)
        if gate is not None and gate.release(domain):
            del _gates[ctx.underlying]
            gate.stop()


def node_keys(cluster_keys: str | None, insecure: bool) -> ClusterKeys | None:
    """The key set a node's sockets use (NodeOptions.cluster_keys, else the default directory),
    or None when it runs insecure. A node never makes one: it must hold its cluster's."""
    if insecure:
        if cluster_keys:
            raise ValueError("--insecure and --cluster-keys contradict each other: give one")
        return None
    return ClusterKeys.load(cluster_keys or default_key_dir())


async def log_refused_handshakes(sock: zmq.asyncio.Socket, label: str) -> None:
    """Until cancelled, watch a keyed server socket: the first handshake it refuses before its ZAP
    handler (which logs the peers it refuses by address) is logged, the others are counted."""
    await watch_server_socket(sock, label, keyed=True)


async def watch_server_socket(
    sock: zmq.asyncio.Socket,
    label: str,
    keyed: bool,
    on_disconnect: Callable[[int], None] | None = None,
) -> None:
    """Until cancelled, watch a server socket: with `keyed`, log refused handshakes as
    `log_refused_handshakes` does; with `on_disconnect`, call it with a connection's file
    descriptor whenever a peer's connection closes (libzmq says which connection, not whose;
    the messages that came over it carry the same descriptor, their ZMQ_SRCFD)."""
    refused = MalformedLog(logger, label, what="a connection")
    events = (REFUSED_BEFORE_ZAP if keyed else 0) | (
        zmq.EVENT_DISCONNECTED if on_disconnect is not None else 0
    )
    monitor = sock.get_monitor_socket(events)
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                on_disconnect(event["value"])
                continue
            refused(
                "a peer without the cluster keys",
                "its CurveZMQ handshake failed: it holds "
                "another key set or none; libzmq names no address for these",
            )
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)
