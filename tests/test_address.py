"""Channel addresses: accepted forms, resolution into the session dir, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from evflow.errors import ConfigurationError
from evflow.transport.address import (
    check_endpoint,
    connectable,
    parse_address,
    parse_endpoint,
    resolve_for_socket,
)


def test_tcp_host_port_is_parsed() -> None:
    ep = parse_endpoint("tcp://localhost:5555")
    assert (ep.scheme, ep.host, ep.port, ep.auto) == ("tcp", "localhost", 5555, False)
    assert ep.url == "tcp://localhost:5555"


@pytest.mark.parametrize("text", ["tcp://*:0", "tcp://*:*", "tcp://127.0.0.1:0"])
def test_tcp_port_zero_or_star_binds_automatically(text: str) -> None:
    ep = parse_endpoint(text)
    assert ep.auto and ep.port == 0


def test_ipv6_host_is_accepted() -> None:
    assert parse_endpoint("tcp://[::1]:7000").host == "[::1]"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tcp://*", "missing port?"),
        ("tcp://localhost", "missing port?"),
        ("tcp://:5555", "missing host"),
        ("tcp://*:99999", "port must be 1-65535"),
        ("tcp://*:abc", "port must be 1-65535"),
        ("tcp://ho st:1", "bad host"),
        ("udp://x:1", "unknown transport 'udp'"),
        ("localhost:5555", "expected tcp://host:port"),
        ("", "empty address"),
        ("tcp://*:1;;tcp://*:2", "empty endpoint"),
        ("ipc://" + "x" * 200, "longer than"),
    ],
)
def test_bad_address_names_the_problem(text: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_address(text)
    assert fragment in str(info.value)
    if text:
        assert repr(text.split(";")[0] if ";;" not in text else text) in str(info.value)


def test_missing_port_message_is_exactly_the_style_guide_one() -> None:
    with pytest.raises(
        ConfigurationError, match=r"^invalid channel address 'tcp://\*' \(missing port\?\)$"
    ):
        parse_address("tcp://*")


def test_several_endpoints_with_method_prefixes() -> None:
    eps = parse_address("@tcp://*:5555;>ipc://x;inproc://y")
    assert [(e.scheme, e.method) for e in eps] == [
        ("tcp", "bind"),
        ("ipc", "connect"),
        ("inproc", ""),
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tcp://*:5555", "cannot connect to '*'"),
        ("tcp://h:0", "cannot connect to port 0"),
        ("ipc://", "cannot connect to an empty path"),
    ],
)
def test_connect_refuses_what_only_bind_can_do(text: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        check_endpoint(parse_endpoint(text), "connect")


def test_bare_ipc_gets_a_fresh_file_in_the_session_dir(_runtime_dir: Path) -> None:
    url1, path1 = resolve_for_socket(parse_endpoint("ipc://"), "s1", "data-0")
    _, path2 = resolve_for_socket(parse_endpoint("ipc://"), "s1", "data-0")
    assert path1 is not None and path2 is not None and path1 != path2
    assert path1.parent == _runtime_dir / "s1" and url1 == f"ipc://{path1}"
    (_runtime_dir / "s1").rmdir()


def test_relative_ipc_lives_in_the_session_dir_absolute_is_kept(_runtime_dir: Path) -> None:
    _, rel = resolve_for_socket(parse_endpoint("ipc://data"), "s2", "x")
    assert rel == _runtime_dir / "s2" / "data"
    _, absolute = resolve_for_socket(parse_endpoint("ipc:///tmp/abc"), "s2", "x")
    assert absolute == Path("/tmp/abc")
    (_runtime_dir / "s2").rmdir()


def test_connectable_replaces_wildcard_host() -> None:
    assert connectable("tcp://0.0.0.0:4242") == "tcp://127.0.0.1:4242"
    assert connectable("tcp://0.0.0.0:4242", "node1") == "tcp://node1:4242"
    assert connectable("ipc:///x") == "ipc:///x"
