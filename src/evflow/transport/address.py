"""Parse and validate channel addresses: ``tcp://``, ``ipc://`` and ``inproc://``.

Accepted forms (several endpoints of one channel are separated by ``;``, each may carry
FairMQ's ``@`` = bind or ``>`` = connect prefix that overrides the channel method):

- ``tcp://host:port`` (``host`` may be ``*`` for bind, a name, an IPv4 address or
  ``[v6]``); ``tcp://*:0`` binds to a free port that the OS picks.
- ``ipc://path``: an absolute path is used as is, a relative one is placed in the
  session directory (so that devices of one session find each other); bare ``ipc://``
  binds to a fresh file in the session directory.
- ``inproc://name``; bare ``inproc://`` binds to a fresh name.

Every error names the bad address and the likely fix, e.g.
``invalid channel address 'tcp://*' (missing port?)``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from evflow.errors import ConfigurationError
from evflow.transport.paths import session_dir

#: schemes we accept, with the transport they use
SCHEMES = ("tcp", "ipc", "inproc")
#: longest ipc path the kernel accepts (sun_path is 108 bytes incl. the NUL)
MAX_IPC_PATH = 107

_HOST_RE = re.compile(r"^(\*|[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\])$")


@dataclass(frozen=True)
class Endpoint:
    """One parsed endpoint.

    ``method`` is ``"bind"``, ``"connect"`` or ``""`` (take the channel's method);
    ``auto`` is True for bare ``ipc://`` / ``inproc://`` and tcp port 0 (the real
    endpoint is only known after binding).
    """

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""
    method: str = ""
    auto: bool = False

    @property
    def url(self) -> str:
        """The address as zmq wants it (without the ``@``/``>`` prefix)."""
        if self.scheme == "tcp":
            return f"tcp://{self.host}:{self.port}"
        return f"{self.scheme}://{self.path}"


def _invalid(text: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"invalid channel address {text!r} ({why})")


def parse_endpoint(text: str) -> Endpoint:
    """Parse one endpoint (no ``;``) into an :class:`Endpoint`; raise ConfigurationError."""
    raw = text
    text = text.strip()
    method = ""
    if text[:1] == "@":
        method, text = "bind", text[1:]
    elif text[:1] == ">":
        method, text = "connect", text[1:]
    if "://" not in text:
        raise _invalid(raw, "expected tcp://host:port, ipc://path or inproc://name")
    scheme, rest = text.split("://", 1)
    if scheme not in SCHEMES:
        raise _invalid(raw, f"unknown transport {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if scheme == "tcp":
        if ":" not in rest or rest.endswith("]"):
            raise _invalid(raw, "missing port?")
        host, port_text = rest.rsplit(":", 1)
        if not host:
            raise _invalid(raw, "missing host; use '*' to bind on every interface")
        if not _HOST_RE.match(host):
            raise _invalid(raw, f"bad host {host!r}")
        if port_text in ("*", "0"):
            return Endpoint("tcp", host=host, port=0, method=method, auto=True)
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise _invalid(
                raw, f"port must be 1-65535, '*' or 0 for any free port, got {port_text!r}"
            )
        return Endpoint("tcp", host=host, port=int(port_text), method=method)
    if scheme == "ipc":
        if len(rest.encode()) > MAX_IPC_PATH:
            raise _invalid(raw, f"ipc path longer than {MAX_IPC_PATH} bytes")
        return Endpoint("ipc", path=rest, method=method, auto=not rest)
    return Endpoint("inproc", path=rest, method=method, auto=not rest)


def parse_address(text: str) -> list[Endpoint]:
    """Parse ``text`` with one or more ``;``-separated endpoints."""
    if not text or not text.strip():
        raise _invalid(text, "empty address")
    parts = text.split(";")
    if any(not p.strip() for p in parts):
        raise _invalid(text, "empty endpoint between ';'")
    return [parse_endpoint(p) for p in parts]


def check_endpoint(endpoint: Endpoint, method: str, raw: str = "") -> None:
    """Refuse endpoints that cannot work with ``method`` (``bind`` or ``connect``)."""
    raw = raw or endpoint.url
    if method == "connect":
        if endpoint.auto:
            what = "port 0" if endpoint.scheme == "tcp" else "an empty path"
            raise _invalid(raw, f"cannot connect to {what}; only bind picks one")
        if endpoint.scheme == "tcp" and endpoint.host == "*":
            raise _invalid(raw, "cannot connect to '*'; name the host, e.g. tcp://localhost:PORT")


def resolve_for_socket(endpoint: Endpoint, session: str, name: str) -> tuple[str, Path | None]:
    """Return ``(zmq_url, ipc_file)`` for ``endpoint``.

    Relative and bare ipc paths live in ``session_dir(session)``; ``ipc_file`` is the
    socket file a bind will create (None for tcp/inproc). Bare inproc gets a fresh name.
    """
    if endpoint.scheme == "ipc":
        if endpoint.auto:
            path = session_dir(session) / f"{name}-{uuid.uuid4().hex[:8]}.ipc"
        elif endpoint.path.startswith("/"):
            path = Path(endpoint.path)
        else:
            path = session_dir(session) / endpoint.path
        url = f"ipc://{path}"
        if len(str(path).encode()) > MAX_IPC_PATH:
            raise _invalid(
                url, f"ipc path longer than {MAX_IPC_PATH} bytes; use a shorter session dir"
            )
        return url, path
    if endpoint.scheme == "inproc" and endpoint.auto:
        return f"inproc://{name}-{uuid.uuid4().hex[:8]}", None
    return endpoint.url, None


def connectable(endpoint: str, host: str = "127.0.0.1") -> str:
    """Turn a bound endpoint such as ``tcp://0.0.0.0:4242`` into one a peer can connect to."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard) :]}"
    return endpoint
