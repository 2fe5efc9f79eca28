"""The public parser: reasoning stage piped into the content/tool stage."""

from __future__ import annotations

from .reasoning import ReasoningStage
from .records import Event, Message, ReasoningDelta, collect
from .tools import ContentStage


class StreamParser:
    """Incremental DeepSeek output parser.

    `thinking`: the prompt ended with `<think>` (output starts inside the
    reasoning). `tools_enabled=False`: tool blocks are still recognised, so
    their markup never shows, but they yield no calls.
    """

    def __init__(self, *, thinking: bool, tools_enabled: bool = True) -> None:
        if not isinstance(thinking, bool) or not isinstance(tools_enabled, bool):
            raise ValueError("thinking and tools_enabled must be bool")
        self._reasoning = ReasoningStage(thinking)
        self._content = ContentStage(tools_enabled)
        self._finished = False

    @property
    def reasoning_ended(self) -> bool:
        """True once the parser knows everything further is not reasoning."""
        return self._reasoning.ended

    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise ValueError("feed() after finish()")
        if not isinstance(delta, str):
            raise ValueError(f"delta must be str, not {type(delta).__name__}")
        reasoning, raw = self._reasoning.feed(delta)
        events: list[Event] = [ReasoningDelta(reasoning)] if reasoning else []
        if raw:
            events += self._content.feed(raw)
        return events

    def finish(self) -> list[Event]:
        """Release whatever was held back; the end of the output."""
        if self._finished:
            raise ValueError("finish() called twice")
        self._finished = True
        reasoning, raw = self._reasoning.finish()
        events: list[Event] = [ReasoningDelta(reasoning)] if reasoning else []
        if raw:
            events += self._content.feed(raw)
        return events + self._content.finish()


def parse(text: str, *, thinking: bool, tools_enabled: bool = True) -> Message:
    """Parse a complete output: the same code path as streaming it in one delta."""
    parser = StreamParser(thinking=thinking, tools_enabled=tools_enabled)
    return collect(parser.feed(text) + parser.finish())
