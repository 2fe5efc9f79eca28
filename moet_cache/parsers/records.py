"""Records the parsers produce: a parsed message and the events of a stream.

All records are frozen; `collect()` folds a list of stream events into the
`Message` that `parse()` would return for the same text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call. `arguments` is the JSON object text, as streamed."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """A parsed model output. Empty reasoning or content is None, never ""."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`. `name` is set on the call's first delta only."""

    index: int
    name: str | None
    arguments_delta: str


@dataclass(frozen=True)
class ToolCallAborted:
    """Call `index` was cut off by the end of the output: it is not a call.

    Only ever emitted by `finish()`, for the last call, after its deltas.
    """

    index: int


Event = ReasoningDelta | ContentDelta | ToolCallDelta | ToolCallAborted


def collect(events: Iterable[Event]) -> Message:
    """Fold stream events into a Message (aborted calls are left out)."""
    reasoning: list[str] = []
    content: list[str] = []
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    aborted: set[int] = set()
    for ev in events:
        if isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallDelta):
            if ev.name is not None:
                names[ev.index] = ev.name
            args.setdefault(ev.index, []).append(ev.arguments_delta)
        elif isinstance(ev, ToolCallAborted):
            aborted.add(ev.index)
        else:
            raise ValueError(f"not a parser event: {ev!r}")
    calls = tuple(
        ToolCall(names[i], "".join(args[i]))
        for i in sorted(args)
        if i not in aborted and i in names
    )
    return Message("".join(reasoning) or None, "".join(content) or None, calls)
