"""Messages on a channel's framing: evflow's wire protocol, or raw frames (FairMQ).

A ``framing = "raw"`` channel carries each message as its plain ZeroMQ frames, the way
FairMQ's zeromq transport does: no type byte, no header. What arrives is taken as an
EVENTS message with an empty header and the frames as payload; only EVENTS can be sent
(their payload frames). END and ACK have no raw form: a raw stream ends by count
(``--max-iterations`` on the receiver) or by a STOP, as between FairMQ devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from evflow.transport.channel import Channel
from evflow.wire.messages import BadMessageCounter, Message, MsgType, encode_message

_NO_HEADER: dict[Any, Any] = {}


def outgoing(
    ch: Channel, type: MsgType, header: dict[str, Any] | None = None, payload: Sequence[Any] = ()
) -> list[Any] | None:
    """The frames of one message for ``ch``; None if the message has no raw form."""
    if not ch.raw:
        return encode_message(type, header, payload)
    if type is MsgType.EVENTS and payload:
        return list(payload)
    return None


def raw_message(frames: Sequence[Any]) -> Message:
    """What arrives on a raw channel: data, the frames as they are."""
    return Message(MsgType.EVENTS, _NO_HEADER, frames)


def incoming(ch: Channel, frames: list[Any], bad: BadMessageCounter) -> Message | None:
    """The message in ``frames`` received on ``ch`` (None: malformed, already counted)."""
    if ch.raw:
        return raw_message(frames)
    return bad.decode(frames)
