"""Run the dashboard: uvicorn in a thread of the process that owns the bus.

:func:`start_dashboard` is what ``evflow run --dashboard``, ``evflow dashboard`` and a
topology controller (``evflow up``) call: it starts a collector on the given buses and
the web server, and returns a :class:`Dashboard` handle (``.url``, ``.store``,
``.stop()``). The port is bound here, before uvicorn starts, so that a port in use is
one clear :class:`~evflow.errors.ConfigurationError` (``port="auto"`` takes the next
free one from 8050 instead). Bound to 127.0.0.1 by default; bound anywhere else, a
random token is required in the URL.
"""

from __future__ import annotations

import errno
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from evflow.errors import ConfigurationError
from evflow.monitor.collector import BusCollector, MetricsStore
from evflow.monitor.web.app import build_app
from evflow.runtime.busclient import BusEndpoints

log = logging.getLogger("evflow.monitor.web")

AUTO_FIRST_PORT = 8050
AUTO_TRIES = 100
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind_socket(host: str, port: int | str, option: str = "--dashboard") -> socket.socket:
    """A listening TCP socket on ``host:port``; ``"auto"``: the first free from 8050.

    ``option``: the command-line option that gave the port (named in the error)."""
    if port != "auto" and (type(port) is not int or not 0 <= port <= 65535):
        raise ConfigurationError(f"dashboard: port {port!r}: expected 1-65535 or 'auto'")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = range(AUTO_FIRST_PORT, AUTO_FIRST_PORT + AUTO_TRIES) if port == "auto" else [port]
    last: OSError | None = None
    for p in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(p)))
            sock.listen(256)
        except OSError as exc:
            sock.close()
            last = exc
            if exc.errno == errno.EADDRINUSE:
                continue
            raise ConfigurationError(f"dashboard: cannot listen on {host}:{p}: {exc}") from None
        sock.set_inheritable(False)
        return sock
    if port == "auto":
        raise ConfigurationError(
            f"dashboard: no free port on {host} in {AUTO_FIRST_PORT}-"
            f"{AUTO_FIRST_PORT + AUTO_TRIES - 1}: {last}"
        )
    raise ConfigurationError(
        f"dashboard: port {port} on {host} is in use by another program; "
        f"choose another with {option} PORT, or {option} auto for the next free one"
    )


@dataclass
class Dashboard:
    """A running dashboard: ``url`` (with the token, if any), ``store``, ``stop()``."""

    url: str
    host: str
    port: int
    store: MetricsStore
    token: str | None
    _server: uvicorn.Server
    _thread: threading.Thread
    _collector: BusCollector | None
    _sock: socket.socket
    _stopped: bool = field(default=False)

    @property
    def app(self) -> Any:
        """The starlette app (``app.state.topics``: the SSE streams and their clients)."""
        return self._server.config.app

    @property
    def metrics_url(self) -> str:
        base = f"http://{_urlhost(reachable_host(self.host))}:{self.port}/metrics"
        return base + (f"?token={self.token}" if self.token else "")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server and the collector (idempotent); open streams are ended."""
        if self._stopped:
            return
        self._stopped = True
        for topic in self.app.state.topics.values():
            topic.closing = True
        self._server.should_exit = True
        deadline = time.monotonic() + timeout_s
        self._thread.join(max(0.0, min(1.5, deadline - time.monotonic())))
        if self._thread.is_alive():  # streams still open: do not wait for them
            self._server.force_exit = True
            self._thread.join(max(0.1, deadline - time.monotonic()))
        self._sock.close()
        if self._collector is not None:
            self._collector.stop()

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_dashboard(
    bus_endpoints: Iterable[BusEndpoints | str] = (),
    port: int | str = "auto",
    *,
    host: str = "127.0.0.1",
    repo: str | Path | None = None,
    prometheus_url: str | None = None,
    store: MetricsStore | None = None,
    run_info: Callable[[], dict[str, Any]] | None = None,
    token: str | None = None,
    interval_s: float = 0.5,
    sock: socket.socket | None = None,
    port_option: str = "--dashboard",
) -> Dashboard:
    """Collector on ``bus_endpoints`` + web server on ``host:port`` (see the module doc).

    ``sock``: a socket already bound with :func:`bind_socket` (then ``port`` is ignored),
    so that a caller can fail on a busy port before it starts anything else.
    ``port_option``: the command-line option that gave the port (named in errors).
    """
    if repo is not None and not Path(repo).exists():
        raise ConfigurationError(
            f"dashboard: no QC repository at {repo} (the file does not exist; "
            "give the path of a repository that a run wrote with its QC writer)"
        )
    if token is None and host not in LOOPBACK:
        token = secrets.token_urlsafe(16)
    store = store if store is not None else MetricsStore()
    if run_info is not None:
        store.run_info = run_info
    if sock is None:
        sock = bind_socket(host, port, port_option)
    real_port = sock.getsockname()[1]
    collector = None
    try:
        endpoints = list(bus_endpoints)
        if endpoints:
            collector = BusCollector(store, endpoints).start()
        app = build_app(
            store, repo=repo, prometheus_url=prometheus_url, token=token, interval_s=interval_s
        )
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
            access_log=False,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="evflow-dashboard", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + 10.0
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            raise ConfigurationError(
                f"dashboard: the web server on {host}:{real_port} did not start"
            )
    except BaseException:
        sock.close()
        if collector is not None:
            collector.stop()
        raise
    shown = reachable_host(host)
    url = f"http://{_urlhost(shown)}:{real_port}/" + (f"?token={token}" if token else "")
    return Dashboard(url, host, real_port, store, token, server, thread, collector, sock)


def _urlhost(host: str) -> str:
    return f"[{host}]" if ":" in host else host


#: bind addresses that mean "every interface": no browser can open them
WILDCARDS = ("0.0.0.0", "::", "")


def reachable_host(host: str) -> str:
    """The host to print in a URL for a server bound to ``host``: for a wildcard
    bind, this machine's fully qualified name when it resolves to one of its own
    non-loopback addresses, else the first such address (loopback as a last resort)."""
    if host not in WILDCARDS:
        return host
    family = socket.AF_INET6 if host == "::" else socket.AF_INET
    fqdn = socket.getfqdn()
    if fqdn and "." in fqdn and not _loopback(_resolve(fqdn, family)):
        return fqdn
    for address in _own_addresses(family):
        if not _loopback([address]):
            return address
    return "::1" if family == socket.AF_INET6 else "127.0.0.1"


def _resolve(name: str, family: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, family, socket.SOCK_STREAM)
    except OSError:
        return []
    return [str(info[4][0]) for info in infos]


def _loopback(addresses: list[str]) -> bool:
    """True when there is no address, or any is loopback (127.x, ::1)."""
    import ipaddress

    try:
        return not addresses or any(ipaddress.ip_address(a).is_loopback for a in addresses)
    except ValueError:
        return True


def _own_addresses(family: int) -> list[str]:
    """This machine's addresses of ``family``, by interface (psutil), then by name."""
    try:
        import psutil  # type: ignore[import-untyped]

        found = [
            a.address.split("%")[0]
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == family
        ]
    except Exception:  # no psutil view of the interfaces: the host name's addresses
        found = []
    return found or _resolve(socket.gethostname(), family)
