"""Channel configs (FairMQ keys, CLI/JSON/TOML forms, clear errors) and open_channel."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from evflow.errors import ConfigurationError
from evflow.transport.channel import (
    ChannelConfig,
    channel_configs_from_args,
    load_channel_configs,
    parse_channel_config,
)
from evflow.transport.opening import open_channel


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_cli_form_with_fairmq_defaults() -> None:
    (cfg,) = parse_channel_config("name=data,type=push,method=bind,address=tcp://*:5555")
    assert (cfg.name, cfg.type, cfg.method, cfg.address) == ("data", "push", "bind", "tcp://*:5555")
    assert (cfg.sndBufSize, cfg.rcvBufSize, cfg.linger, cfg.transport) == (1000, 1000, 500, "zmq")
    assert cfg.rateLogging == 1 and cfg.autoBind is False


def test_cli_form_converts_numbers_and_bools() -> None:
    (cfg,) = parse_channel_config(
        "name=d,type=pull,method=connect,address=tcp://h:1,rcvBufSize=10,linger=0,"
        "rateLogging=0,autoBind=true"
    )
    assert (cfg.rcvBufSize, cfg.linger, cfg.rateLogging, cfg.autoBind) == (10, 0, 0, True)


def test_json_dict_list_and_toml_file(tmp_path: Path) -> None:
    one = {"name": "a", "type": "pub", "method": "bind", "address": "ipc://a"}
    two = {"name": "b", "type": "sub", "method": "connect", "address": "ipc://a"}
    assert [c.name for c in parse_channel_config(json.dumps(one))] == ["a"]
    assert [c.name for c in parse_channel_config(json.dumps([one, two]))] == ["a", "b"]
    toml = tmp_path / "ch.toml"
    toml.write_text(
        '[[channels]]\nname = "a"\ntype = "push"\nmethod = "bind"\naddress = "ipc://x"\n'
        "sndBufSize = 5\n"
        '[[channels]]\nname = "b"\ntype = "pull"\nmethod = "connect"\naddress = "ipc://x"\n'
    )
    cfgs = load_channel_configs(toml)
    assert [(c.name, c.sndBufSize) for c in cfgs] == [("a", 5), ("b", 1000)]
    js = tmp_path / "ch.json"
    js.write_text(json.dumps({"channels": [one]}))
    assert [
        c.name
        for c in channel_configs_from_args(
            [str(js), "name=z,type=pair,method=bind,address=inproc://"]
        )
    ] == ["a", "z"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("name=data,type=push,method=bind", "missing key 'address'"),
        ("name=data,type=push,method=bind,address=tcp://*:1,color=red", "unknown key 'color'"),
        (
            "name=data,type=shove,method=bind,address=tcp://*:1",
            "bad type 'shove'; expected push | pull",
        ),
        (
            "name=data,type=push,method=attach,address=tcp://*:1",
            "bad method 'attach'; expected bind or connect",
        ),
        ("name=data,type=push,address=tcp://*:1", "missing key 'method'"),
        ("name=data,method=bind,address=tcp://*:1", "missing key 'type'"),
        ("type=push,method=bind,address=tcp://*:1", "missing key 'name'"),
        (
            "name=data,type=push,method=bind,address=tcp://*",
            "invalid channel address 'tcp://*' (missing port?)",
        ),
        ("name=data,type=push,method=connect,address=tcp://*:0", "cannot connect"),
        (
            "name=data,type=push,method=bind,address=tcp://*:1,sndBufSize=lots",
            "bad sndBufSize 'lots'; expected an integer",
        ),
        ("name=data,type=push,method=bind,address=tcp://*:1,linger=-5", "bad linger -5"),
        (
            "name=data,type=push,method=bind,address=tcp://*:1,autoBind=maybe",
            "bad autoBind 'maybe'",
        ),
        ("name=data,type=push,method=bind,address=tcp://*:1,transport=ofi", "bad transport 'ofi'"),
        ("name=data;type=push", "bad name 'data;type=push'"),
        ("name=data,,type=push", "is not key=value"),
        ("[{bad json", "not valid JSON"),
        ('{"channels": 5}', "must be a dict or a list"),
        ("name=da ta,type=push,method=bind,address=tcp://*:1", "bad name 'da ta'"),
    ],
)
def test_bad_config_gets_one_clear_error(text: str, fragment: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_channel_config(text)
    assert fragment in str(info.value)


def test_unreadable_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read channel config file"):
        load_channel_configs(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[channels]\n")
    with pytest.raises(ConfigurationError, match=r"bad\.toml"):
        load_channel_configs(bad)


def test_tcp_port_zero_reports_the_real_port(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    (cfg,) = parse_channel_config("name=d,type=pull,method=bind,address=tcp://127.0.0.1:0")
    ch = open_channel(ctx, cfg, "s")
    try:
        (endpoint,) = ch.endpoints
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        (ccfg,) = parse_channel_config(f"name=d,type=push,method=connect,address={endpoint}")
        out = open_channel(ctx, ccfg, "s")
        out.send([b"\x03", b"\x80", b"x" * 100_000])
        assert ch.poll(5000)
        frames = ch.recv()
        assert [len(f) for f in frames] == [1, 1, 100_000]
        assert (out.messages_out, out.bytes_out, ch.messages_in, ch.bytes_in) == (
            1,
            100_002,
            1,
            100_002,
        )
        out.close(0)
    finally:
        ch.close(0)


def test_bare_ipc_binds_in_the_session_dir_and_close_removes_it(
    ctx: zmq.Context[zmq.Socket[bytes]], _runtime_dir: Path
) -> None:
    (cfg,) = parse_channel_config("name=d,type=pull,method=bind,address=ipc://")
    ch = open_channel(ctx, cfg, "sess")
    (endpoint,) = ch.endpoints
    path = Path(endpoint[len("ipc://") :])
    assert path.parent == _runtime_dir / "sess" and path.exists()
    ch.close()
    assert not path.exists() and not (_runtime_dir / "sess").exists()
    ch.close()  # idempotent


def test_several_endpoints_bind_and_connect(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    (cfg,) = parse_channel_config(
        "name=d,type=pull,method=bind,address=ipc://a;ipc://b;tcp://127.0.0.1:0"
    )
    ch = open_channel(ctx, cfg, "multi")
    assert len(ch.endpoints) == 3
    pushers = []
    for ep in ch.endpoints:
        (pc,) = parse_channel_config(f"name=o,type=push,method=connect,address={ep}")
        pushers.append(open_channel(ctx, pc, "multi"))
        pushers[-1].send([b"hi"])
    got = 0
    while got < 3 and ch.poll(5000):
        ch.recv()
        got += 1
    assert got == 3
    for p in pushers:
        p.close(0)
    ch.close(0)


def test_tcp_address_in_use_names_the_address(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    (cfg,) = parse_channel_config("name=d,type=pull,method=bind,address=tcp://127.0.0.1:0")
    first = open_channel(ctx, cfg, "s")
    try:
        port = first.endpoints[0].rsplit(":", 1)[1]
        (again,) = parse_channel_config(
            f"name=e,type=pull,method=bind,address=tcp://127.0.0.1:{port}"
        )
        with pytest.raises(
            ConfigurationError, match=f"address 'tcp://127.0.0.1:{port}' already in use"
        ):
            open_channel(ctx, again, "s")
        moved = open_channel(ctx, ChannelConfig(**{**again.__dict__, "autoBind": True}), "s")
        assert moved.endpoints[0] != first.endpoints[0]
        moved.close(0)
    finally:
        first.close(0)


def test_ipc_address_in_use_is_refused_but_a_stale_file_is_reused(
    ctx: zmq.Context[zmq.Socket[bytes]], _runtime_dir: Path
) -> None:
    (cfg,) = parse_channel_config("name=d,type=pull,method=bind,address=ipc://busy")
    first = open_channel(ctx, cfg, "s")
    with pytest.raises(ConfigurationError, match=r"ipc://.*busy' already in use"):
        open_channel(ctx, cfg, "s")
    assert (_runtime_dir / "s" / "busy").exists()  # the failed bind did not steal it
    first.close(0)
    (_runtime_dir / "s").mkdir(exist_ok=True)
    (_runtime_dir / "s" / "busy").write_text("stale")
    second = open_channel(ctx, cfg, "s")
    second.close(0)
    assert not (_runtime_dir / "s").exists()


def test_every_socket_type_opens(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    for kind in (
        "push",
        "pull",
        "pub",
        "sub",
        "xpub",
        "xsub",
        "router",
        "dealer",
        "pair",
        "req",
        "rep",
    ):
        (cfg,) = parse_channel_config(f"name={kind},type={kind},method=bind,address=inproc://")
        ch = open_channel(ctx, cfg, "s")
        assert ch.socket.type == zmq.__dict__[kind.upper()]
        assert kind in repr(ch)
        ch.close(0)
        assert "closed" in repr(ch)
