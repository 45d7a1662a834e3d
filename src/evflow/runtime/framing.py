"""Messages on a channel's framing: evflow's wire protocol, or raw frames (FairMQ).

A ``framing = "raw"`` channel carries each message as its plain ZeroMQ frames, the way
FairMQ's zeromq transport does: no type byte, no header. What arrives is taken as an
EVENTS message with an empty header and the frames as payload; only EVENTS can be sent
(their payload frames). END and ACK have no raw form: a raw stream ends by count
(``--max-iterations`` on the receiver) or by a STOP, as between FairMQ devices.

An evflow-framed channel that receives such frames (a FairMQ peer on a channel without
``framing=raw``) refuses them as bad messages, never as data; the first one is logged
once as a WARNING that names the channel and the fix (:func:`raw_hint`) instead of the
generic bad-message line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from evflow.errors import ProtocolError
from evflow.transport.channel import Channel
from evflow.wire.messages import (
    BadMessageCounter,
    Message,
    MsgType,
    decode_message,
    encode_message,
)

__all__ = ["Decoder", "decoder", "looks_raw", "outgoing", "raw_hint", "raw_message"]

_NO_HEADER: dict[Any, Any] = {}

#: frames in, the message out (None: refused, counted by the channel's BadMessageCounter)
Decoder = Callable[[Sequence[Any]], Message | None]


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


def looks_raw(frames: Sequence[Any]) -> bool:
    """``frames`` cannot be evflow's ``[type byte][header map]...`` the way FairMQ's are:
    a single frame, or a first frame that is not one byte long."""
    return len(frames) == 1 or (len(frames) > 1 and len(frames[0]) != 1)


def raw_hint(ch: Channel) -> str:
    """What to tell the user whose channel ``ch`` receives FairMQ's frames."""
    return (
        "the peer looks like a raw (FairMQ) stream: plain ZeroMQ frames without evflow's "
        f"type byte and header; channel {ch.name!r} needs framing=raw "
        f"(--channel-config name={ch.name},...,framing=raw)"
    )


def decoder(ch: Channel, bad: BadMessageCounter) -> Decoder:
    """The decoder of what arrives on ``ch``: a raw channel's frames are data; on an
    evflow channel a malformed message is counted in ``bad`` and refused (None). The
    first refused message that looks raw (:func:`looks_raw`) is logged once, as a
    WARNING naming the channel and ``framing=raw``; the later ones are only counted."""
    if ch.raw:
        return raw_message
    hinted = False

    def decode(frames: Sequence[Any]) -> Message | None:
        nonlocal hinted
        try:
            return decode_message(frames)
        except ProtocolError as exc:
            kind = getattr(exc, "kind", type(exc).__name__)
            if not looks_raw(frames):
                bad.record(kind, str(exc))
                return None
            if not hinted:
                hinted = True
                bad.logger.warning(
                    "%s: %s; these messages are refused (counted as bad messages, never as data)",
                    bad.where or ch.label,
                    raw_hint(ch),
                )
            bad.record(kind, str(exc), quiet=True)
            return None

    return decode
