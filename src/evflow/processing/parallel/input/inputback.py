"""The input's ``back`` socket: the output's HELLO, CONFIRMs, END and quarantine.

A mixin of ``input._Input`` (the attributes are the input's). Only the run's output
may say HELLO here (a restarted one gets every unconfirmed event again); with
--ordered it first gets ORDER. CONFIRM takes events off the ledger; poisoned events
go to the output raw, to be written quarantined; END goes to the workers when the
ledger is empty, then to the output with the counts. Separate from the workers' side:
the output is the other end of the ledger, with its own restart rules.
"""

from __future__ import annotations

from typing import Any

import zmq

from evflow.errors import ModuleError, PeerLostError
from evflow.processing.chain import ModuleChain
from evflow.processing.parallel.batching import from_u64, pack_batch, u64
from evflow.processing.parallel.input.inputfeed import WorkerSlot
from evflow.processing.parallel.input.ledger import Ledger, LedgerEntry
from evflow.processing.parallel.input.resend import ResendQueue
from evflow.processing.parallel.input.roster import Roster
from evflow.processing.parallel.persist import encode_persistent
from evflow.transport.security import is_alive, is_sibling, peer_pid
from evflow.wire.messages import MsgType, decode_message, encode_message, field_int, refuse


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class BackMixin:
    """The output's side of the input, for ``input._Input``."""

    back: zmq.Socket[Any]
    router: zmq.Socket[Any]
    chain: ModuleChain
    ledger: Ledger
    resend: ResendQueue
    roster: Roster
    workers: dict[bytes, WorkerSlot]
    seq_of: dict[int, int]
    goodbye: list[str]
    ordered: bool
    output_id: bytes | None
    output_pid: int
    unsent_quarantine: list[LedgerEntry]
    end_for_output: list[Any] | None
    last_error: ModuleError | None
    quarantined: int
    max_quarantined: int
    read: int
    dropped: int
    next_seq: int
    start_seq: int
    exhausted: bool
    stopping: bool
    end_sent: bool
    drain_sent: bool
    output_end_sent: bool
    done: bool

    def _on_output(self, frames: list[Any]) -> None:
        ident = frames[0].bytes
        msg = decode_message(frames[1:])
        if msg.type == MsgType.HELLO:
            self._output_hello(ident, frames[0], msg.header)
            return
        if ident != self.output_id:  # only the output the input knows may confirm or end
            raise refuse("unknown-peer", f"{msg.type.name} on the back socket from a stranger")
        if msg.type == MsgType.CONFIRM:
            if len(msg.payload) != 1 or len(msg.payload[0]) % 8:
                raise refuse("bad-confirm", "CONFIRM payload is not one frame of uint64 uids")
            uids = from_u64(msg.payload[0].buffer).tolist()
            self.ledger.confirm(uids)
            if self.ordered:
                pop = self.seq_of.pop
                for uid in uids:
                    pop(uid, None)
        elif msg.type == MsgType.GOODBYE:
            if not self.output_end_sent:
                raise refuse("early-goodbye", "GOODBYE from the output before END was sent")
            self.done = True
        else:
            raise refuse("unexpected", f"{msg.type.name} on the back socket")

    def _output_hello(self, ident: bytes, frame: Any, header: dict[Any, Any]) -> None:
        """An output introduces itself: the first one, or a restarted one (the previous
        output is dead). Anything else saying HELLO here is refused: taken for a new
        output, it would make the input send every unconfirmed event to nowhere."""
        if header.get("role") != "output" or header.get("name") != "output":
            raise refuse("bad-hello", f"HELLO on the back socket from {_short(header)}")
        pid = field_int(header, "pid", 1, 2**31)
        sender = peer_pid(frame)
        if sender is not None and sender != pid:
            raise refuse("bad-hello", f"HELLO of output pid {pid} sent by process {sender}")
        if not is_sibling(pid) or any(s.pid == pid for s in self.workers.values()):
            raise refuse("bad-hello", f"HELLO of output pid {pid}: not the run's output")
        if self.output_id is not None and pid != self.output_pid and is_alive(self.output_pid):
            raise refuse("bad-hello", f"HELLO of output pid {pid}: output {self.output_pid} lives")
        restarted = self.output_id is not None
        self.output_id = ident
        self.output_pid = pid
        self.drain_sent = False  # (a new output must hear it too)
        if self.ordered:  # before anything else: where the output's order goes on
            order = encode_message(MsgType.ORDER, self._order_start())
            self.back.send_multipart([self.output_id, *order])
        if restarted:
            self._output_restarted()
        if self.unsent_quarantine:
            self._send_quarantine(self.unsent_quarantine)
            self.unsent_quarantine = []

    def _output_restarted(self) -> None:
        """A new output (the old one died): whatever it had not confirmed may be lost.

        Every unconfirmed event goes out again (workers may still deliver the first
        copies; the new output drops the uids its reopened files already hold).
        """
        entries = self.ledger.requeue_all("output restarted")
        self.resend.replace(e for e in entries if not e.poisoned)
        self.unsent_quarantine += [e for e in entries if e.poisoned]
        if self.end_for_output is not None:  # it died after END: the new one needs it
            assert self.output_id is not None  # (set by the HELLO that told us)
            self.back.send_multipart([self.output_id, *self.end_for_output])

    def _order_start(self) -> dict[str, Any]:
        """--ordered: the ORDER header for an output that said HELLO.

        ``seq``: the lowest unconfirmed seq (the output confirms in order: everything
        below is written); ``done``: seqs above it confirmed already (only while a
        restarted input catches up, when confirms of re-read events come out of order).
        """
        unconfirmed = set(self.seq_of.values())
        first = min(unconfirmed) if unconfirmed else self.next_seq
        done = [s for s in range(first, self.next_seq) if s not in unconfirmed]
        return {"seq": first, "done": done}

    def _quarantine(self, entries: list[LedgerEntry]) -> None:
        self.quarantined += len(entries)
        if self.quarantined > self.max_quarantined:
            last = self.last_error
            raise PeerLostError(
                f"{self.quarantined} events were quarantined (limit max_quarantined="
                f"{self.max_quarantined}); the run is stopped. Last failure: "
                f"{last if last is not None else entries[-1].reason}"
            )
        if self.output_id is None:  # the output has not said HELLO yet: send it then
            self.unsent_quarantine += entries
            return
        self._send_quarantine(entries)

    def _send_quarantine(self, entries: list[LedgerEntry]) -> None:
        header = {
            "b": -1,
            "a": max(e.attempt for e in entries),
            "u": u64([e.uid for e in entries]),
            "s": u64([self.seq_of.get(e.uid, 0) for e in entries]),
            "k": bytes([1] * len(entries)),
            "w": "input",
            "q": [e.reason for e in entries],
        }
        payload = pack_batch([e.frames for e in entries], header, packed=False)
        message = encode_message(MsgType.EVENTS, header, payload)
        assert self.output_id is not None
        self.back.send_multipart([self.output_id, *message])

    def _end_message(self) -> list[Any]:
        run = self.chain.run
        return encode_message(MsgType.END, {"run": [run.experiment, run.run] if run else None})

    def _maybe_end(self) -> None:
        if not (self.exhausted or self.stopping) or len(self.ledger) or self.resend:
            return
        if not self.end_sent:
            self.end_sent = True
            for ident in self.workers:
                self.router.send_multipart([ident, *self._end_message()])
        if self.workers or self.roster.coming or self.output_end_sent or self.output_id is None:
            return  # (a replacement still on its way gets END at its HELLO, then ends too)
        self.output_end_sent = True
        last = self.chain.run
        self.chain.end_run()
        self.chain.terminate()
        head, frames, skipped = encode_persistent(self.chain.persistent)
        header = {
            "workers": self.goodbye,
            "read": self.read,
            "dropped": self.dropped,
            "sent": self.next_seq - self.start_seq,
            "run": [last.experiment, last.run] if last else None,
            "skipped": skipped,
            "stopped": self.stopping,
        }
        message = encode_message(MsgType.END, header, [head, *frames])
        self.end_for_output = message
        self.back.send_multipart([self.output_id, *message])
