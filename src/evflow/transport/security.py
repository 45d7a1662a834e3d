"""Who may connect to a session's sockets: ZAP checks at connection time.

Every process of a parallel run holds the run's secret (:class:`RunAuth`, made by the
parent and handed to each forked role). A socket that binds is a ZeroMQ PLAIN
*server*; a socket that connects presents the secret as a PLAIN *client*, under its
role name as user name. Each process that binds runs one :class:`ZapHandler` (a thread
on ZeroMQ's ZAP endpoint in its context, shared by every server socket there: see
:func:`zap_handler`) which, for every new connection, checks:

- the credentials: PLAIN with the run's secret (compared in constant time) and a user
  name the socket's domain allows (``events``: workers; ``back``: the output; ...);
  or, on a CURVE server socket (tcp across hosts, :mod:`evflow.transport.curve`), a
  client public key on that socket's allow-list (:class:`CurveAllowList`, each key
  accepted under the name of its key file);
- the peer process, for ipc: the kernel's credentials of the unix socket (libzmq puts
  ``uid:gid:pid`` in the ZAP address) must show our user id and, when the policy
  names one, a process whose parent is the run's zygote: a process outside the run
  is refused even if it read the secret.

A refused connection never delivers a message; refusals are counted per reason and
the first of each reason is logged. After the handshake nothing is checked per
message (PLAIN does not encrypt; ipc never leaves the host): the cost is one ZAP
round trip per connection. Messages carry ``User-Id`` (the accepted user name) and
``Peer-Address`` as frame metadata: :func:`peer_pid` reads the sender's pid from it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.utils.z85

from evflow.errors import ConfigurationError

__all__ = [
    "ZAP_ENDPOINT",
    "CurveAllowList",
    "PlainSecret",
    "RunAuth",
    "ZapHandler",
    "ZapRequest",
    "current",
    "install",
    "is_alive",
    "is_sibling",
    "output_only",
    "parent_of",
    "peer_pid",
    "refused_total",
    "workers_only",
    "zap_handler",
]

log = logging.getLogger("evflow.security")

#: where libzmq sends its ZAP requests (RFC 27), one handler per context
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: the refusal kind of a peer process that ended before its connection was checked
ENDED = "ended"
#: the user names a role may connect with
_ROLE_NAME = re.compile(r"^(input|output|worker-\d{1,6}(\.\d{1,6})?)$")


@dataclass(frozen=True, slots=True)
class ZapRequest:
    """One ZAP request: which socket (``domain``), who (``address``), how (``mechanism``)."""

    domain: str
    address: str
    mechanism: str
    credentials: tuple[bytes, ...]

    @property
    def peer(self) -> tuple[int, int, int] | None:
        """``(uid, gid, pid)`` of an ipc peer (SO_PEERCRED, set by the kernel), else None."""
        return _creds_of(self.address)


def _creds_of(address: str) -> tuple[int, int, int] | None:
    parts = address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        return int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None


def peer_pid(frame: Any) -> int | None:
    """The pid of the process that sent ``frame`` (a ``zmq.Frame``) over ipc, or None."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None
    creds = _creds_of(address) if isinstance(address, str) else None
    return creds[2] if creds is not None else None


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid``, None if there is no such process (or unreadable)."""
    fields = _stat(pid) if pid > 0 else None
    try:
        return int(fields[1]) if fields else None
    except (ValueError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie is dead: it only waits to be reaped)."""
    fields = _stat(pid) if pid > 0 else None
    return fields is not None and len(fields) > 0 and fields[0] != b"Z"


def is_sibling(pid: int) -> bool:
    """True if ``pid`` is another child of our parent: in a run, a role forked by the
    same zygote (the input and output check their peers' HELLOs with it)."""
    return pid != os.getpid() and parent_of(pid) == os.getppid()


@dataclass(slots=True)
class PlainSecret:
    """PLAIN with the run's ``secret``; ``users`` per domain (a predicate on the name);
    ``parent_pid``: the peer must be a child of this process (0: not checked)."""

    secret: bytes
    users: dict[str, Callable[[str], bool]] = field(default_factory=dict)
    parent_pid: int = 0

    def check(self, req: ZapRequest) -> tuple[str | None, str]:
        """``(user id, "")`` when accepted, ``(None, reason)`` when refused."""
        if req.mechanism != "PLAIN" or len(req.credentials) != 2:
            return None, f"wrong mechanism: {req.mechanism} (expected PLAIN)"
        raw_user, password = req.credentials
        if not hmac.compare_digest(password, self.secret):
            return None, "wrong secret: PLAIN password"
        user = raw_user.decode("utf-8", "replace")
        allowed = self.users.get(req.domain, _ROLE_NAME.match)
        if not allowed(user):
            return None, f"user not allowed: {user!r} may not connect to {req.domain!r}"
        return user, ""


@dataclass(slots=True)
class CurveAllowList:
    """CURVE: a client public key (32 bytes, raw) on the allow-list is accepted under
    the user name it maps to (its key file's name). For tcp across hosts."""

    allowed: dict[bytes, str] = field(default_factory=dict)

    def check(self, req: ZapRequest) -> tuple[str | None, str]:
        if req.mechanism != "CURVE" or len(req.credentials) != 1:
            return None, f"wrong mechanism: {req.mechanism} (expected CURVE)"
        user = self.allowed.get(req.credentials[0])
        if user is None:
            key = req.credentials[0]
            z85 = zmq.utils.z85.encode(key).decode() if len(key) == 32 else "none"
            return None, f"unknown key: client key {z85} not in the allow-list"
        return user, ""


#: a refusal on one domain goes to its owner (address, reason) instead of the log
OnRefuse = Callable[[str, str], None]


class ZapHandler:
    """The ZAP handler thread of ``ctx``: accepts what the socket's domain allows.

    A domain added with :meth:`add` (a CURVE server socket) is checked by its own
    policy alone; any other domain by ``policies`` (the run's PLAIN secret), the first
    that accepts. ``parent_pid`` (ipc only): the peer process must be a child of it
    (the run's zygote); our own user id is always required of ipc peers. Start it
    before any server socket binds (libzmq lets every connection in while no handler
    listens). ``refused`` counts refusals per reason; the first of each reason is logged.
    One per context: :func:`zap_handler` shares it; :meth:`close` when the last user
    is done.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        policies: list[Any] | None = None,
        parent_pid: int = 0,
        where: str = "",
    ) -> None:
        self.context = ctx
        self.policies = list(policies or [])
        self.parent_pid = parent_pid
        self.where = where
        self.accepted = 0
        self.refused: dict[str, int] = {}
        self.users = 1
        self._domains: dict[str, tuple[Any, OnRefuse | None]] = {}
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise ConfigurationError(
                f"cannot start the ZAP handler{self._at()}: {exc} (one per zmq context)"
            ) from None
        self._wake_r = ctx.socket(zmq.PAIR)
        self._wake_w = ctx.socket(zmq.PAIR)
        self._wake_r.bind(f"inproc://evflow-zap-stop-{id(self)}")
        self._wake_w.connect(f"inproc://evflow-zap-stop-{id(self)}")
        self._thread = threading.Thread(target=self._serve, name="evflow-zap", daemon=True)
        self._thread.start()
        _handlers.append(self)
        with _lock:
            _by_context[id(ctx)] = self

    def _at(self) -> str:
        return f" of {self.where}" if self.where else ""

    def __repr__(self) -> str:
        return f"<ZapHandler{self._at()} accepted={self.accepted} refused={self.refused}>"

    def add(self, domain: str, policy: Any, on_refuse: OnRefuse | None = None) -> None:
        """Check ``domain`` (one server socket) with ``policy`` alone; refusals there go
        to ``on_refuse(address, reason)`` when given (the socket logs them itself)."""
        self._domains[domain] = (policy, on_refuse)

    def remove(self, domain: str) -> None:
        self._domains.pop(domain, None)

    def close(self) -> None:
        """Leave the handler; the last user stops the thread and closes its sockets
        (before the context terminates)."""
        with _lock:
            self.users -= 1
            if self.users > 0:
                return
            if _by_context.get(id(self.context)) is self:
                del _by_context[id(self.context)]
        if self in _handlers:
            _handlers.remove(self)
        if not self._thread.is_alive():
            return
        with contextlib.suppress(zmq.ZMQError):
            self._wake_w.send(b"")
        self._thread.join(5)
        self._wake_w.close(0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._wake_r in events:
                    return
                frames = self._sock.recv_multipart()
                try:
                    reply = self.handle(frames)
                except Exception as exc:  # a bug here must refuse, never hang a handshake
                    self._refuse(f"handler error: {type(exc).__name__}: {exc}")
                    reply = None
                if reply is not None:
                    self._sock.send_multipart(reply)
        finally:
            self._sock.close(0)
            self._wake_r.close(0)

    def handle(self, frames: list[bytes]) -> list[bytes] | None:
        """The reply to one routed ZAP request (RFC 27); None for non-requests."""
        # [routing id, empty, version, request id, domain, address, identity, mechanism, creds...]
        if len(frames) < 8 or frames[1] != b"" or frames[2] != b"1.0":
            self._refuse("malformed ZAP request: not RFC 27 version 1.0")
            return None
        head = frames[:2]
        request_id = frames[3]
        req = ZapRequest(
            domain=frames[4].decode("utf-8", "replace"),
            address=frames[5].decode("utf-8", "replace"),
            mechanism=frames[7].decode("ascii", "replace"),
            credentials=tuple(frames[8:]),
        )
        user, reason = self.check(req)
        if user is None:
            owner = self._domains.get(req.domain, (None, None))[1]
            if owner is not None:
                owner(req.address, reason.split(": ", 1)[-1])
            else:
                self._refuse(reason, req)
            return [*head, b"1.0", request_id, b"400", reason.encode()[:200], b"", b""]
        self.accepted += 1
        return [*head, b"1.0", request_id, b"200", b"OK", user.encode(), b""]

    def check(self, req: ZapRequest) -> tuple[str | None, str]:
        """``(user id, "")`` or ``(None, reason)`` for one request."""
        peer = req.peer
        if peer is not None:  # ipc: the kernel says who connects
            uid, _, pid = peer
            if uid != os.getuid():
                return None, f"other user: peer process {pid} runs as user {uid}, not {os.getuid()}"
            parent = parent_of(pid) if self.parent_pid else self.parent_pid
            if parent is None:
                # it connected and ended before we looked (a role killed as a run aborts
                # at start-up): refused, counted, and no warning (see _refuse)
                return None, f"{ENDED}: peer process {pid} ended before its check"
            if parent != self.parent_pid:
                return (
                    None,
                    f"not in the run: peer process {pid} is not a child of {self.parent_pid}",
                )
        if req.domain in self._domains:
            return self._domains[req.domain][0].check(req)  # type: ignore[no-any-return]
        reasons = []
        for policy in self.policies:
            user, reason = policy.check(req)
            if user is not None:
                return user, ""
            reasons.append(reason)
        return None, "; ".join(reasons) or "no policy: nothing accepts connections"

    def _refuse(self, reason: str, req: ZapRequest | None = None) -> None:
        kind = reason.split(":", 1)[0]
        n = self.refused.get(kind, 0) + 1
        self.refused[kind] = n
        if n == 1:
            what = f" on {req.domain!r} from {req.address or '?'}" if req is not None else ""
            (log.debug if kind == ENDED else log.warning)(
                "refused a connection%s%s: %s; further ones of this kind are only counted",
                self._at(),
                what,
                reason,
            )


@dataclass(frozen=True, slots=True)
class RunAuth:
    """A run's shared secret and the process its members descend from.

    Picklable: the parent makes one (:meth:`generate`) and hands it to every role it
    forks. ``zygote_pid`` (0: unknown) is the parent of every role process.
    """

    secret: bytes
    zygote_pid: int = 0

    @classmethod
    def generate(cls, zygote_pid: int = 0) -> RunAuth:
        return cls(secrets.token_hex(32).encode(), zygote_pid)

    def __repr__(self) -> str:  # never show the secret in logs or tracebacks
        return f"<RunAuth zygote={self.zygote_pid}>"

    def server(self, sock: zmq.Socket[Any], domain: str) -> None:
        """Make ``sock`` (not bound yet) a PLAIN server checked in ZAP domain ``domain``."""
        sock.plain_server = True
        sock.zap_domain = domain.encode()

    def client(self, sock: zmq.Socket[Any], user: str) -> None:
        """Make ``sock`` (not connected yet) present the secret as ``user``."""
        sock.plain_username = user.encode()
        sock.plain_password = self.secret

    def handler(
        self, ctx: zmq.Context[Any], where: str, users: dict[str, Callable[[str], bool]]
    ) -> ZapHandler:
        """The ZAP handler of ``ctx`` with this run's secret (``users`` per domain)."""
        handler = zap_handler(ctx, where)
        handler.policies.append(PlainSecret(self.secret, users))
        handler.parent_pid = self.zygote_pid
        return handler


_current: RunAuth | None = None
_handlers: list[ZapHandler] = []  # this process's handlers (their refusals are reported)
_by_context: dict[int, ZapHandler] = {}  # id(context) -> its handler
_lock = threading.RLock()


def zap_handler(ctx: zmq.Context[Any], where: str = "") -> ZapHandler:
    """The ZAP handler of ``ctx``, started on first use and shared by every server
    socket there (libzmq has one ZAP endpoint per context); each caller closes it."""
    with _lock:
        handler = _by_context.get(id(ctx))
        if handler is not None and handler.context is ctx and handler.users > 0:
            handler.users += 1
            if where and not handler.where:
                handler.where = where
            return handler
        return ZapHandler(ctx, where=where)


def install(auth: RunAuth | None) -> None:
    """Make ``auth`` this process's credentials (a role calls it once, after the fork)."""
    global _current
    _current = auth


def current() -> RunAuth | None:
    """This process's run credentials (None outside a run, or with ``ipc_auth`` off)."""
    return _current


def refused_total() -> int:
    """Connections the ZAP handlers of this process refused so far (all reasons)."""
    return sum(sum(h.refused.values()) for h in _handlers)


def workers_only(user: str) -> bool:
    return user.startswith("worker-") and _ROLE_NAME.match(user) is not None


def output_only(user: str) -> bool:
    return user == "output"
