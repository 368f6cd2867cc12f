"""The contract of a pure core: shared actions, stimulus ids, and the log of recent events.

Every event a core handles gets a *stimulus id*: ``"<kind>-<n>"``, numbered per core. The actions it
returns carry that id (``Send.stimulus``), and the core records the event, its id and what it caused in
an ``EventLog``: a bounded ring of the latest events, cheap enough to keep always on (a tuple each), so
that when a daemon misbehaves its last events can be dumped (``pwmesh debug events``) and replayed in a
test against a fresh core (``EventLog.timed``, ``replay``). A daemon dumps them replayable too
(``GetEvents(raw=True)``: ``record``, then ``recorded`` on the other side; ``pwmesh debug events --raw``).

The actions every core may return: ``Send`` (post a message to a daemon), ``Reply`` (answer the request
being handled) and ``Timer`` (hand the core an event later). A core adds its own where its shell must do
something no message says (the executor's ``Admit``, the resource manager's ``Notify``...).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from pwmesh.errors import PwmeshError
from pwmesh.wire import Message, codec
from pwmesh.wire.messages import RecordedEvent

EVENT_LOG_LENGTH = 2_000  # events kept per core


@dataclasses.dataclass(slots=True)
class Received:
    """Event: ``message`` arrived for the core (the resource manager's and the scheduler's main event; the
    executor and the proxy have their own, with what they need besides)."""

    message: Message


# Not frozen (a frozen dataclass's __init__ costs four times a plain one's; a Send is made per message), and
# not changed once made all the same.
@dataclasses.dataclass(slots=True)
class Send:
    """Post ``message`` to the daemon at address ``to``; ``stimulus``: the event that caused it."""

    to: str
    message: Message
    stimulus: str = ""


@dataclasses.dataclass(slots=True)
class Reply:
    """Answer the request being handled with ``message`` (None: with nothing), or fail it with ``error``."""

    message: Message | None = None
    error: PwmeshError | None = None
    stimulus: str = ""


@dataclasses.dataclass(slots=True)
class Timer:
    """Hand the core ``event`` at ``at`` (the core's clock); ``at`` <= now: once the shell's pending wake-ups
    have run (the same instant, after what is ready now)."""

    at: float
    event: Any
    stimulus: str = ""


def describe(value: Any) -> str:
    """A short line for an event or action: its type and fields, long values cut."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = []
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            text = item.op if isinstance(item, Message) else repr(item)
            if isinstance(item, Message) and dataclasses.is_dataclass(item):  # every Message is (@record)
                inner = [f"{f.name}={getattr(item, f.name)!r}" for f in dataclasses.fields(item)
                         if f.name in ("run_id", "nodes", "executor_seq", "scheduler", "epoch")]
                text = f"{item.op}({', '.join(inner)})"
            fields.append(f"{field.name}={text[:120]}")
        return f"{type(value).__name__}({', '.join(fields)})"
    return repr(value)[:200]


class EventLog:
    """The latest ``length`` events a core handled: (time, stimulus id, event, the actions' summary).

    ``stimulus(kind)`` names the next event; ``record`` keeps it. Events are kept as objects (not
    formatted) so recording costs a tuple; ``lines`` formats them when asked."""

    def __init__(self, length: int = EVENT_LOG_LENGTH) -> None:
        # (time, stimulus id: "<kind>-<n>" or (kind, n), event, actions): a core on a hot path appends itself
        self.entries: collections.deque[tuple[float, str | tuple[str, int], Any, int]] = collections.deque(maxlen=length)
        self._ids = itertools.count(1)

    def stimulus(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}"

    def record(self, now: float, stimulus: str, event: Any, actions: int) -> None:
        """Keep ``event`` (it must hold no large payload: pass a summary line for one that does)."""
        self.entries.append((now, stimulus, event, actions))

    def lines(self, limit: int = 0) -> list[str]:
        """The newest ``limit`` (0: all) entries, oldest first, one line each."""
        entries = list(self.entries)[-limit:] if limit > 0 else list(self.entries)
        return [f"{now:.6f} {stimulus if isinstance(stimulus, str) else '-'.join(map(str, stimulus))} "
                f"{event if isinstance(event, str) else describe(event)} -> {actions} actions"
                for now, stimulus, event, actions in entries]

    def events(self) -> list[Any]:
        """The events kept, oldest first (summary lines for those that carried payloads; an entry that stands
        for several, with an ``expand()``, as those): hand them to a fresh core to replay what this one did."""
        out: list[Any] = []
        for _, _, event, _ in self.entries:
            expand = getattr(event, "expand", None)
            out.extend(expand() if expand is not None else [event])
        return out

    def timed(self) -> list[tuple[float, Any]]:
        """The events kept as (time, event), oldest first, expanded as ``events`` (an entry standing for events
        at several times, with a ``timed()``, gives those): what ``replay`` hands a fresh core."""
        out: list[tuple[float, Any]] = []
        for now, _, event, _ in self.entries:
            timed = getattr(event, "timed", None)
            if timed is not None:
                out.extend(timed())
                continue
            expand = getattr(event, "expand", None)
            out.extend((now, e) for e in (expand() if expand is not None else [event]))
        return out


def record(now: float, event: Any) -> RecordedEvent:
    """``event`` (of ``EventLog.timed``) as it travels (``GetEvents(raw=True)``): a ``Received`` as its
    message's frames, an event with no fields by its class name, anything else as its line only."""
    if isinstance(event, Received):
        return RecordedEvent(time=now, kind="Received",
                             frames=[bytes(f) for f in codec.encode(event.message, msg_id=0)])
    if dataclasses.is_dataclass(event) and not dataclasses.fields(event):
        return RecordedEvent(time=now, kind=type(event).__name__)
    return RecordedEvent(time=now, kind="line", line=event if isinstance(event, str) else describe(event))


def recorded(events: Iterable[RecordedEvent], kinds: Iterable[type]) -> list[tuple[float, Any]]:
    """The (time, event) pairs ``record`` made, for ``replay``: ``kinds`` are the core's own field-less
    events (its ``Tick``); an event that was kept only as a line stays a line (``replay`` refuses it)."""
    by_name = {k.__name__: k for k in kinds}
    out: list[tuple[float, Any]] = []
    for ev in events:
        if ev.kind == "Received":
            out.append((ev.time, Received(codec.decode(ev.frames).message)))
        elif ev.kind in by_name:
            out.append((ev.time, by_name[ev.kind]()))
        else:
            out.append((ev.time, ev.line or ev.kind))
    return out


def replay(handle: Callable[[Any, float], list[Any]], events: Iterable[tuple[float, Any]]) -> list[list[Any]]:
    """Hand ``events`` ((time, event), as ``EventLog.timed`` gives them) to a fresh core's ``handle`` in order;
    returns what each caused. An event logged as a line (it carried a payload too large to keep) cannot be
    replayed: that is refused, not skipped, since what followed it may depend on it."""
    out = []
    for now, event in events:
        if isinstance(event, str):
            raise ValueError(f"cannot replay an event logged as a line: {event[:200]}")
        out.append(handle(event, now))
    return out
