"""``Device``: one process with FairMQ's state machine, named channels and user hooks.

Subclasses override hooks; the framework owns the wrappers that call them, each inside
try/except so that an exception ends in ERROR (and is logged with its traceback):

=================  =========================================================
state              what runs
=================  =========================================================
COMPLETE_INIT      ``init()``
BINDING            channels with a bind endpoint are opened, then ``bind()``
CONNECTING         the other channels are opened, then ``connect()``
INITIALIZING_TASK  ``init_task()``
RUNNING            ``pre_run()``; ``conditional_run()`` in a loop (at ``rate_hz``
                   when set) or the ``on_data`` handlers; ``post_run()``
RESETTING_TASK     ``reset_task()``
RESETTING_DEVICE   ``reset()``, then every channel is closed (ipc files removed)
=================  =========================================================

The RUNNING loop ends when ``conditional_run`` or a handler returns False, after
``max_iterations`` calls/messages, or on a STOP/shutdown request; the device then
takes STOP itself. Requests from other threads (bus, stdin, signals) only set flags or
queue transitions; all hooks run in the thread that called :meth:`run`.

Incoming messages are decoded with the wire protocol; malformed ones are counted per
channel (``BadMessageCounter``) and dropped, never raised.
"""

from __future__ import annotations

import logging
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import zmq

from evflow.errors import ConfigurationError, IncompleteStreamError, StateTransitionError
from evflow.params import Param, declared_params, resolve_params
from evflow.runtime.device_stats import RateLogger, channel_metrics
from evflow.runtime.framing import outgoing
from evflow.runtime.loops import (
    DRAIN_BATCH,
    POLL_INTERVAL_MS,
    BatchHandler,
    Handler,
    Origin,
    conditional_loop,
    data_loop,
    idle_loop,
)
from evflow.runtime.states import (
    SHUTDOWN_STEP,
    STARTUP_SEQUENCE,
    State,
    StateMachine,
    Transition,
)
from evflow.transport.channel import Channel, ChannelConfig
from evflow.transport.opening import open_channel
from evflow.wire.messages import BadMessageCounter, MsgType

_NOBLOCK = int(zmq.NOBLOCK)

__all__ = ["BIDIRECTIONAL", "DRAIN_BATCH", "POLL_INTERVAL_MS", "Device", "Handler", "Origin"]

log = logging.getLogger("evflow.device")

#: socket types whose peer can answer on the same socket
BIDIRECTIONAL = frozenset({"pair", "dealer", "router", "req", "rep"})


class Device:
    """Base class of devices; see the module docstring for hooks and states.

    ``channels`` are configs (several with one name make sub-channels); ``params`` are
    values for the class's declared ``Param`` attributes. ``bus`` is an optional object
    with ``publish_state(device, old, new)`` / ``publish_metrics(device)`` / ``poll(device)``
    called by the device (see :meth:`attach_bus`).
    """

    #: one-line description shown by ``evflow device CLASS --help``
    description: ClassVar[str] = ""
    #: batching of this device's push/pair channels whose config leaves ``batchUs`` at
    #: -1 (microseconds; 0 = off). Safe for a device whose sends happen in its loops'
    #: hooks and handlers (the loops flush before they wait); a device that sends and
    #: then blocks on its own receive must keep 0 or :meth:`flush_channels` first
    default_batch_us: ClassVar[int] = 0

    def __init__(
        self,
        id: str = "",
        channels: Sequence[ChannelConfig] = (),
        *,
        session: str = "default",
        rate_hz: float = 0.0,
        max_iterations: int = 0,
        context: zmq.Context[Any] | None = None,
        **params: Any,
    ) -> None:
        self.id = id or type(self).__name__.lower()
        self.session = session
        self.rate_hz = float(rate_hz)
        self.max_iterations = int(max_iterations)
        if self.rate_hz < 0 or self.max_iterations < 0:
            raise ConfigurationError(
                f"device {self.id!r}: rate and max-iterations must be >= 0, "
                f"got {rate_hz!r} and {max_iterations!r}"
            )
        self._own_context = context is None
        self.context: zmq.Context[Any] = context if context is not None else zmq.Context()
        self.channel_configs = list(channels)
        self.channels: dict[str, list[Channel]] = {}
        self.fsm = StateMachine(self.id)
        self._handlers: dict[str, Handler] = {}
        self._batch_handlers: dict[str, BatchHandler] = {}
        self._views: set[str] = set()  # on_data(views=True)
        self._requests: queue.SimpleQueue[Transition] = queue.SimpleQueue()
        self._loop_stop = False
        self.shutdown_requested = False
        self.iterations = 0
        self.bad_messages: dict[str, BadMessageCounter] = {}
        self._bus: Any = None
        #: endpoint exchange of a topology (``evflow.topology.node``): the channel configs
        #: come from ``channel_configs(device, binding)`` before the bind channels and
        #: again before the connect channels open; ``published(device)`` after binding
        self.exchange: Any = None
        self.error: BaseException | None = None
        #: where stream counts outlive the process (a topology device that its agent may
        #: restart; ``evflow.runtime.devices._streamrecord``); None: in memory only
        self.stream_dir: Any = None
        self._next_tick = 0.0
        self._next_rate_log = 0.0
        self._rates = RateLogger(self.id)
        self._params: dict[str, Any] = {}
        self._set_params(params)

    # --- parameters ----------------------------------------------------------------------
    @classmethod
    def declared_params(cls) -> dict[str, Param[Any]]:
        return declared_params(cls)

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        """Look at a configuration before any process starts; raise an ``EvflowError``
        naming what is wrong (e.g. an input file that does not exist). ``evflow up``
        calls it for a topology that runs on its own host, with every declared
        parameter (defaults filled in). The default finds nothing wrong."""

    @classmethod
    def preflight(cls, params: dict[str, Any]) -> None:
        """Check, before anything of a topology starts, what would make this device fail
        later (a file another process holds); raise ConfigurationError with one line.

        Called by the controller (``evflow up``) in its own process, with the device's
        ``params`` from the topology file, for devices placed on the controller's host.
        It must not change anything: a pre-flight check only looks."""

    def _set_params(self, params: dict[str, Any]) -> None:
        self._params.update(resolve_params(f"device {self.id!r}", self.declared_params(), params))

    # --- hooks (override) ----------------------------------------------------------------
    def init(self) -> None:
        """Read configuration; channels are not open yet."""

    def bind(self) -> None:
        """After the bind channels are open."""

    def connect(self) -> None:
        """After the connect channels are open."""

    def init_task(self) -> None:
        """Prepare the task (register ``on_data`` handlers here or in ``init``)."""

    def pre_run(self) -> None:
        """Just before the RUNNING loop."""

    def conditional_run(self) -> bool:
        """One iteration of the loop; return False to stop. Not called unless overridden."""
        return False

    def post_run(self) -> None:
        """After the RUNNING loop (also after a STOP request or an error in the loop)."""

    def reset_task(self) -> None:
        """Undo ``init_task``."""

    def reset(self) -> None:
        """Undo ``init``; the channels are closed right after this."""

    # --- API for subclasses ------------------------------------------------------------
    def on_data(
        self,
        channel: str,
        handler: Handler,
        *,
        views: bool = False,
        batch: BatchHandler | None = None,
    ) -> None:
        """Call ``handler(message, origin)`` for each message on every sub-channel of
        ``channel``; a handler returning False stops the RUNNING loop.

        ``views``: on a ``transport=shm`` channel, payload frames that came through
        shared memory are read in place (``InMessage``, see ``shm_channel``); the
        region's chunk goes back when the message is released or dropped.

        ``batch``: ``batch(messages, origin)`` takes the decoded messages of one batch
        at once (those a sender packed together, one or more) instead of ``handler``
        one by one: a loop per batch, not per message. It is used on pull, pair and sub
        channels with evflow framing of a device without ``max_iterations`` (which
        counts exactly, message by message); elsewhere ``handler`` is.
        """
        self._handlers[channel] = handler
        if batch is not None:
            self._batch_handlers[channel] = batch
        else:
            self._batch_handlers.pop(channel, None)
        if views:
            self._views.add(channel)
        else:
            self._views.discard(channel)

    def channel(self, name: str, index: int = 0) -> Channel:
        try:
            return self.channels[name][index]
        except (KeyError, IndexError):
            have = ", ".join(f"{n}[{len(c)}]" for n, c in self.channels.items()) or "none"
            raise ConfigurationError(
                f"device {self.id!r}: no channel {name!r} index {index} (open: {have}); "
                f"give it with --channel-config name={name},..."
            ) from None

    def has_channel(self, name: str) -> bool:
        return bool(self.channels.get(name)) or any(c.name == name for c in self.channel_configs)

    def send(
        self,
        name: str,
        type: MsgType,
        header: dict[str, Any] | None = None,
        payload: Sequence[Any] = (),
        index: int = 0,
    ) -> None:
        """Encode and send one message on ``name[index]`` in the channel's framing (a
        raw channel sends only EVENTS, as their payload frames; others are dropped)."""
        ch = self.channel(name, index)
        frames = outgoing(ch, type, header, payload)
        if frames is not None:
            ch.send(frames)

    @property
    def state(self) -> State:
        return self.fsm.state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id!r} state={self.fsm.state}>"

    # --- requests (thread-safe) --------------------------------------------------------
    def request(self, transition: Transition) -> None:
        """Queue ``transition`` for the driving thread; STOP/END while RUNNING end the loop.

        END from any state other than IDLE asks for the orderly shutdown sequence.
        """
        if transition is Transition.AUTO:
            raise StateTransitionError(f"{self.id}: AUTO is internal and cannot be requested")
        if transition is Transition.END and self.fsm.state is not State.IDLE:
            self.request_shutdown()
            return
        if transition is Transition.STOP and self.fsm.state is State.RUNNING:
            self._loop_stop = True
            return
        self._requests.put(transition)

    def request_shutdown(self) -> None:
        """Orderly way out from any state (safe to call from a signal handler)."""
        self.shutdown_requested = True
        self._loop_stop = True

    # --- driving the machine -----------------------------------------------------------
    def run(self, control: str = "static") -> int:
        """Drive the machine until EXITING or ERROR; return 0 or 1 (error).

        ``static``: INIT_DEVICE ... RUN, then after the loop RESET_TASK, RESET_DEVICE, END.
        ``interactive``: wait for :meth:`request` (stdin, bus); shutdown requests win.
        """
        if control not in ("static", "interactive"):
            raise ConfigurationError(f"unknown control {control!r}; expected static or interactive")
        pending = list(STARTUP_SEQUENCE) if control == "static" else []
        try:
            while self.fsm.state not in (State.EXITING, State.ERROR):
                self._tick()
                if self.shutdown_requested or (control == "static" and not pending):
                    step = SHUTDOWN_STEP[self.fsm.state]
                    if step is None:  # cannot happen: -ING states are left inside step()
                        break
                    self.step(step)
                elif pending:
                    self.step(pending.pop(0))
                else:
                    transition = self._next_request()
                    if transition is not None:
                        self.step(transition)
        except BaseException:  # a second signal: leave fast, but still clean up
            self.close_channels(linger_ms=0)
            raise
        finally:
            self.close_channels(linger_ms=0 if self.fsm.state is State.ERROR else None)
            if self._own_context:
                self.context.term()
        return 1 if self.fsm.state is State.ERROR else 0

    def _next_request(self) -> Transition | None:
        """Wait up to POLL_INTERVAL_MS for a requested transition. With a bus, wake on
        its socket: a command is handled at once, not at the next 100 ms tick."""
        try:
            return self._requests.get_nowait()
        except queue.Empty:
            pass
        sock = getattr(self._bus, "socket", None)
        if sock is None:
            try:
                return self._requests.get(timeout=POLL_INTERVAL_MS / 1000)
            except queue.Empty:
                return None
        wait = getattr(self._bus, "wait_command", None)
        if wait(POLL_INTERVAL_MS) if wait is not None else sock.poll(POLL_INTERVAL_MS):
            try:
                self._bus.poll(self)
            except Exception:
                log.exception("device %s: bus client failed", self.id)
        try:
            return self._requests.get_nowait()
        except queue.Empty:
            return None

    def step(self, transition: Transition) -> bool:
        """Take ``transition`` now (driving thread only), run the hooks of the state it
        leads to and the AUTO moves after it. False (logged) if not allowed."""
        state = self.fsm.state
        completing = transition is Transition.COMPLETE_INIT
        if completing and state is State.INITIALIZING_DEVICE and not self._call(self.init, "init"):
            return True
        if not self.fsm.change_state(transition):
            return False
        work = _WORK.get(self.fsm.state)
        if work is not None and work(self):
            self.fsm.change_state(
                Transition.AUTO if self.fsm.state is not State.RUNNING else Transition.STOP
            )
        return True

    def _call(self, hook: Callable[[], Any], name: str) -> bool:
        """Run a hook; on an exception log it with its traceback, go to ERROR, return False."""
        try:
            hook()
            return True
        except IncompleteStreamError as exc:  # a count, not a bug: its one line is enough
            log.error("device %s: %s", self.id, exc)
            self.error = exc
            self.fsm.change_state(Transition.ERROR_FOUND)
            return False
        except Exception as exc:
            log.error(
                "device %s: %s() raised %s: %s\n%s",
                self.id,
                name,
                type(exc).__name__,
                exc,
                traceback.format_exc(),
            )
            self.error = exc
            self.fsm.change_state(Transition.ERROR_FOUND)
            return False

    def _open(self, binding: bool) -> None:
        if self.exchange is not None:
            self.channel_configs = list(self.exchange.channel_configs(self, binding))
        counts: dict[str, int] = {}
        for cfg in self.channel_configs:
            index = counts.get(cfg.name, 0)
            counts[cfg.name] = index + 1
            is_bind = any((ep.method or cfg.method) == "bind" for ep in cfg.endpoints)
            if is_bind != binding:
                continue
            ch = open_channel(self.context, cfg, self.session, index)
            if cfg.batchUs < 0 and self.default_batch_us > 0:
                ch.set_batching(self.default_batch_us)
            subs = self.channels.setdefault(cfg.name, [])
            subs.append(ch)
            subs.sort(key=lambda c: c.index)
            self.bad_messages[ch.label] = BadMessageCounter(f"{self.id}/{ch.label}", log)
        if binding and self.exchange is not None:
            self.exchange.published(self)

    def _do_binding(self) -> bool:
        self.channels = {}
        self._rates.reset()
        return self._call(lambda: self._open(binding=True), "bind channels") and self._call(
            self.bind, "bind"
        )

    def _do_connecting(self) -> bool:
        return self._call(lambda: self._open(binding=False), "connect channels") and self._call(
            self.connect, "connect"
        )

    def _do_init_task(self) -> bool:
        return self._call(self.init_task, "init_task")

    def _do_reset_task(self) -> bool:
        return self._call(self.reset_task, "reset_task")

    def _do_reset_device(self) -> bool:
        ok = self._call(self.reset, "reset")
        self.close_channels()
        return ok

    def _do_running(self) -> bool:
        self._loop_stop = self.shutdown_requested
        self.iterations = 0
        if not self._call(self.pre_run, "pre_run"):
            return False
        if type(self).conditional_run is not Device.conditional_run:
            loop, name = conditional_loop, "conditional_run"
        elif self._handlers:
            loop, name = data_loop, "on_data handler"
        else:
            loop, name = idle_loop, "run"
        ok = self._call(lambda: loop(self), name)
        if self.fsm.state is State.ERROR:
            self._call(self.post_run, "post_run")
            return False
        return self._call(self.post_run, "post_run") and ok

    def channel_list(self, name: str) -> list[Channel]:
        if name not in self.channels:
            self.channel(name)  # raises the clear error
        return self.channels[name]

    # --- timers: rate logging and the bus ------------------------------------------------
    def _tick(self, now_s: float | None = None) -> None:
        """Timers, at most every 100 ms: bus commands (and its 1 s metrics), rate logs."""
        now_s = time.monotonic() if now_s is None else now_s
        if now_s < self._next_tick:
            return
        self._next_tick = now_s + POLL_INTERVAL_MS / 1000
        if now_s >= self._next_rate_log:
            self._next_rate_log = now_s + 1.0
            self._rates.log(self.all_channels(), now_s)
        if self._bus is not None:
            try:
                self._bus.tick(self, now_s)
            except Exception:
                log.exception("device %s: bus client failed", self.id)

    def attach_bus(self, bus: Any) -> None:
        """Plug in a control-bus client (``evflow.runtime.busclient.BusClient``).

        It hears every state change (``bus.publish_state(device, old, new)``) and, every
        100 ms from the device's loops, ``bus.tick(device, now_s)`` publishes metrics
        (once a second, :meth:`metrics` included) and answers commands; a ``transition``
        command calls :meth:`request`.
        """
        self._bus = bus
        self.fsm.subscribe(lambda old, new, tr: bus.publish_state(self, old, new))

    # --- introspection -------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """A JSON-able snapshot: state, pid, iterations, per-channel counters, bad messages."""
        return {
            "node_id": self.id,
            "node_state": str(self.fsm.state),
            "pid": os.getpid(),
            "iterations": self.iterations,
            **channel_metrics(self.all_channels(), self.bad_messages),
        }

    def flush_channels(self) -> bool:
        """Send every batch still held (without blocking); False if a peer could not
        take one yet (it stays held and goes at the next flush)."""
        done = True
        for subs in self.channels.values():
            for ch in subs:
                if ch.held and not ch.closed:
                    try:
                        ch.flush(_NOBLOCK)
                    except zmq.Again:
                        done = False
                    except zmq.ZMQError as exc:  # (the END count check reports the loss)
                        log.warning("%s: held messages on %s not sent: %s", self.id, ch.label, exc)
        return done

    def all_channels(self) -> list[Channel]:
        """Every channel and sub-channel (closed ones too, for their counters)."""
        return [ch for subs in self.channels.values() for ch in subs]

    def summary(self) -> dict[str, Any]:
        """What ``--stats-file`` gets at exit: :meth:`metrics` (subclasses add results)."""
        return self.metrics()

    def close_channels(self, linger_ms: int | None = None) -> None:
        """Close every open channel (idempotent); removes the ipc files we bound.

        Closed channels stay in ``channels`` so their counters remain readable; the next
        BINDING starts afresh.
        """
        for subs in self.channels.values():
            for ch in subs:
                ch.close(linger_ms)


_WORK: dict[State, Callable[[Device], bool]] = {
    State.BINDING: Device._do_binding,
    State.CONNECTING: Device._do_connecting,
    State.INITIALIZING_TASK: Device._do_init_task,
    State.RUNNING: Device._do_running,
    State.RESETTING_TASK: Device._do_reset_task,
    State.RESETTING_DEVICE: Device._do_reset_device,
}
