"""CURVE security for tcp channels: key files, a ZAP allow-list, refusals logged once.

Keys are pyzmq's certificate files (``zmq.auth.create_certificates``): ``NAME.key``
holds a public key, ``NAME.key_secret`` the pair. ``evflow keys DIR`` writes them. A
channel is a CURVE server (it binds, and a ZAP handler lets in only clients whose
public key is in its allow-list directory) or a CURVE client (it knows the server's
public key). Channel options (see :mod:`evflow.transport.channel_config`)::

    curve=server,curveSecretKey=keys/server.key_secret,curveAllow=keys
    curve=client,curveSecretKey=keys/client.key_secret,curveServerKey=keys/server.key

A refused peer is logged ONCE per (channel, address, reason) at WARNING with its
address: the ZAP handler names a client whose key is not allowed (address and key);
the socket monitor (``EVENT_HANDSHAKE_FAILED_*``) names a peer that failed the
handshake otherwise (a plaintext client, a client with the wrong server key). Nothing
is a silent time-out. Refusals are counted in :attr:`CurveSecurity.refusals`.

A handshake cut short without a reason (``EVENT_HANDSHAKE_FAILED_NO_DETAIL``: the peer
closed or reset the connection) is ambiguous. A plaintext peer that sees the mechanism
mismatch first and hangs up does it, once (its libzmq does not retry); so does a good
peer that leaves while it connects, e.g. a process ending with its run. The first is a
refusal, the second not: so it is a refusal until the socket's owner says the run is
winding down (:meth:`CurveSecurity.winding_down`), and an INFO line after that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket as pysocket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.z85

from evflow.errors import ConfigurationError
from evflow.transport.security import CurveAllowList, ZapHandler, zap_handler

log = logging.getLogger("evflow.curve")

CURVE_ROLES = ("", "server", "client")
SECRET_SUFFIX = ".key_secret"
PUBLIC_SUFFIX = ".key"


def require_curve() -> None:
    """Refuse CURVE when the linked libzmq was built without it."""
    if not zmq.has("curve"):
        raise ConfigurationError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE security; "
            "install a pyzmq wheel (bundles libzmq with libsodium) or a libzmq with CURVE"
        )


# --- key files -----------------------------------------------------------------------
def create_keys(directory: str | Path, names: list[str]) -> list[tuple[Path, Path]]:
    """Write a key pair per name into ``directory`` (0700; secret files 0600).

    Refuses to overwrite an existing pair. Returns (public, secret) paths.
    """
    require_curve()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise ConfigurationError(f"bad key name {name!r} (letters, digits, '_', '-', '.')")
        existing = directory / f"{name}{SECRET_SUFFIX}"
        if existing.exists():
            raise ConfigurationError(
                f"{existing} exists already; remove it first to make a new pair for {name!r}"
            )
    out = []
    old_umask = os.umask(0o077)  # the secret file never exists with a wider mode
    try:
        for name in names:
            import zmq.auth

            public, secret = zmq.auth.create_certificates(directory, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            out.append((Path(public), Path(secret)))
    finally:
        os.umask(old_umask)
    return out


def check_secret_permissions(path: Path) -> None:
    """A secret key readable or writable by group/others is refused, naming the fix."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigurationError(
            f"secret key file {str(path)!r} is accessible by other users (mode {mode:04o}); "
            f"fix: chmod 600 {path}"
        )


def load_secret_key(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file, after the permission check."""
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(f"secret key file {str(path)!r} does not exist (evflow keys DIR)")
    check_secret_permissions(path)
    public, secret = _load(path)
    if not secret:
        raise ConfigurationError(
            f"{str(path)!r} holds no secret key (use the .key_secret file, not the .key)"
        )
    return public, secret


def load_public_key(path: str | Path) -> bytes:
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(f"public key file {str(path)!r} does not exist (evflow keys DIR)")
    return _load(path)[0]


#: key files read by this process, by (path, mtime, size): a device opens two or three
#: CURVE sockets, and inherits what its agent read before the zygote forked
_loaded: dict[tuple[str, int, int], tuple[bytes, bytes]] = {}


def _load(path: Path) -> tuple[bytes, bytes]:
    try:
        import zmq.auth

        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key in _loaded:
            return _loaded[key]
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ConfigurationError(f"{str(path)!r} is not a CURVE key file: {exc}") from None
    _loaded[key] = (public, secret or b"")
    return _loaded[key]


def allowed_keys(directory: str | Path) -> dict[bytes, str]:
    """The public keys (``*.key``) in an allow-list directory, each to its file's name
    (a peer's user id); refuses an empty directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigurationError(f"CURVE allow-list {str(directory)!r} is not a directory")
    keys = {  # raw 32-byte keys, as a ZAP request carries them (the files hold Z85)
        zmq.utils.z85.decode(load_public_key(p)): p.name[: -len(PUBLIC_SUFFIX)]
        for p in sorted(directory.glob(f"*{PUBLIC_SUFFIX}"))
    }
    if not keys:
        raise ConfigurationError(f"CURVE allow-list {str(directory)!r} holds no *.key file")
    return keys


# --- per socket ----------------------------------------------------------------------
@dataclass(frozen=True)
class CurveOptions:
    """A channel's CURVE settings (file paths as given in the channel config)."""

    role: str
    secret_key: str
    server_key: str = ""
    allow: str = ""


#: the socket events that tell whether a peer is connected (and why it is not)
CONNECTION_EVENTS = (
    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
    | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_ACCEPTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)  # fmt: skip

_FAILED_EVENTS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol: plaintext peer or "
    "wrong server key?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused by ZAP",
}


class CurveSecurity:
    """CURVE on one socket: keys, ZAP domain (server) and the refusal monitor."""

    def __init__(self, label: str, options: CurveOptions) -> None:
        require_curve()
        self.label = label
        self.options = options
        self.refusals = 0
        #: the first refusals (peer, reason), for a controller that asks the bus proxy
        self.refused_peers: list[tuple[str, str]] = []
        self._logged: set[tuple[str, str]] = set()
        self._zap: ZapHandler | None = None
        self._domain = ""
        self._monitor: threading.Thread | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._peers: dict[int, str] = {}
        #: the run is ending: a handshake cut short is a peer leaving, not a refusal
        self._winding_down = False
        #: callbacks given every monitor event (kind, value, endpoint), from the watcher
        #: thread: libzmq keeps one monitor per socket, and a second one started on it
        #: closes this one under the watcher's feet (abort in signaler.cpp)
        self._listeners: list[Callable[[int, int, str], None]] = []
        self._public, self._secret = load_secret_key(options.secret_key)
        if options.role == "client":
            self._server_key = load_public_key(options.server_key)
        else:
            self._allowed = allowed_keys(options.allow or Path(options.secret_key).parent)

    def apply(self, sock: zmq.Socket[Any], context: zmq.Context[Any]) -> None:
        """Set the socket's CURVE options (before bind/connect) and start the monitor."""
        sock.curve_publickey = self._public
        sock.curve_secretkey = self._secret
        if self.options.role == "server":
            sock.curve_server = True
            # the context's one ZAP handler (transport/security.py) checks this domain
            # against the allow-list; it hands refusals back to refused()
            self._domain = f"evflow/{self.label}/{id(self)}"
            sock.zap_domain = self._domain.encode()
            self._zap = zap_handler(context, self.label)
            self._zap.add(self._domain, CurveAllowList(self._allowed), self.refused)
        else:
            sock.curve_serverkey = self._server_key
        self._socket = sock
        # the events of the refusal log and those a listener follows a peer by
        monitor = sock.get_monitor_socket(CONNECTION_EVENTS | zmq.EVENT_MONITOR_STOPPED)
        self._monitor = threading.Thread(
            target=self._watch, args=(monitor,), daemon=True, name=f"curve-{self.label}"
        )
        self._monitor.start()

    def listen(self, callback: Callable[[int, int, str], None]) -> None:
        """Give ``callback`` every later monitor event of the socket (in the watcher
        thread): the one way to follow a CURVE socket's connections."""
        self._listeners.append(callback)

    def unlisten(self, callback: Callable[[int, int, str], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    def refused(self, peer: str, reason: str) -> None:
        """Count a refusal; log it the first time this peer fails for this reason."""
        self.refusals += 1
        if (peer, reason) in self._logged:
            return
        self._logged.add((peer, reason))
        if len(self.refused_peers) < 50:
            self.refused_peers.append((peer, reason))
        log.warning("channel %s: CURVE refused peer %s: %s", self.label, peer, reason)

    def _watch(self, monitor: zmq.Socket[Any]) -> None:
        failed: int | None = None
        try:
            from zmq.utils.monitor import recv_monitor_message  # asyncio: only with CURVE

            while True:
                event = recv_monitor_message(monitor)
                kind, value, endpoint = event["event"], event["value"], event["endpoint"]
                if kind == zmq.EVENT_MONITOR_STOPPED:
                    return
                if kind == zmq.EVENT_ACCEPTED:  # first: libzmq may close the fd soon
                    self._peers[value] = _peer_of(value)
                for listener in list(self._listeners):
                    listener(kind, value, endpoint.decode(errors="replace"))
                if kind in _FAILED_EVENTS:
                    if self.options.role == "client":
                        self._failed(endpoint.decode(errors="replace"), kind)
                    elif kind != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # the ZAP logged it
                        failed = kind
                elif kind == zmq.EVENT_DISCONNECTED:
                    peer = self._peers.pop(value, "(address unknown)")
                    if failed is not None:
                        self._failed(peer, failed)
                        failed = None
        except zmq.ZMQError:
            return
        finally:
            monitor.close(linger=0)

    def winding_down(self) -> None:
        """The run is ending: peers that leave mid-handshake from now on are processes
        ending with it (an INFO line), not refusals (see the module docstring)."""
        self._winding_down = True

    def _failed(self, peer: str, kind: int) -> None:
        """A failed handshake: a refusal, unless the run is winding down and the peer
        only cut the handshake short."""
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self._winding_down:
            log.info("channel %s: peer %s left during the CURVE handshake", self.label, peer)
            return
        self.refused(peer, _FAILED_EVENTS[kind])

    def close(self) -> None:
        """Stop the monitor and leave the ZAP handler (call before closing the socket)."""
        if self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._socket = None
        if self._monitor is not None:
            self._monitor.join(2.0)
            self._monitor = None
        if self._zap is not None:
            self._zap.remove(self._domain)
            self._zap.close()
            self._zap = None


def _peer_of(fd: int) -> str:
    """``ip:port`` of the peer on an accepted socket's fd (read at once, before it closes)."""
    try:
        with pysocket.socket(fileno=os.dup(fd)) as s:
            peer = s.getpeername()
    except OSError:
        # libzmq closed it before this thread got to it (a handshake that failed at once)
        return "(address unknown: the connection closed before it was read)"
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) or "(local socket)"  # an ipc peer has no address


# --- one key pair per host: channel options for a topology ----------------------------
class KeyRing:
    """The per-host keys of ``evflow keys DIR --names h1 h2 ...`` as channel options.

    A host's binding channels are CURVE servers with its own secret key and every
    public key in DIR as allow-list; a connecting channel is a client with its host's
    secret key and the binding host's public key.
    """

    def __init__(self, directory: str | Path) -> None:
        require_curve()
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConfigurationError(
                f"key directory {str(self.directory)!r} does not exist "
                f"(make it with: evflow keys {self.directory} --names HOST...)"
            )

    def _secret(self, host: str) -> str:
        path = self.directory / f"{host}{SECRET_SUFFIX}"
        if not path.is_file():
            raise ConfigurationError(
                f"no CURVE key for host {host!r} in {str(self.directory)!r} "
                f"(make it with: evflow keys {self.directory} --names {host})"
            )
        check_secret_permissions(path)
        return str(path)

    def server_options(self, host: str) -> dict[str, str]:
        """Channel keys for a channel that ``host`` binds."""
        return {"curve": "server", "curveSecretKey": self._secret(host),
                "curveAllow": str(self.directory)}  # fmt: skip

    def client_options(self, host: str, server_host: str) -> dict[str, str]:
        """Channel keys for a channel on ``host`` that connects to ``server_host``."""
        public = self.directory / f"{server_host}{PUBLIC_SUFFIX}"
        if not public.is_file():
            raise ConfigurationError(
                f"no public CURVE key for host {server_host!r} in {str(self.directory)!r}"
            )
        return {"curve": "client", "curveSecretKey": self._secret(host),
                "curveServerKey": str(public)}  # fmt: skip
