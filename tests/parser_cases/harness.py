"""Shared checks for the parser tests (loaded by path: tests/ is no package)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence

from moet_cache.parsers import (
    ContentDelta,
    Event,
    Message,
    ReasoningDelta,
    StreamParser,
    ToolCallAborted,
    ToolCallDelta,
    collect,
    parse,
)
from moet_cache.parsers.markers import FIXED, TAGGED

BAR = "\uff5c"


def norm(s: str) -> str:
    return s.replace("|", BAR)


# An oracle for "this text holds a complete marker", written independently of
# the scanner: fixed markers as substrings, tags as prefix + space/`>` with a
# later `>` (conservative: it may reject text the scanner would not call a tag).
_TAG_RE = re.compile("(" + "|".join(re.escape(p) for p in TAGGED) + r")(>|\s[^<]*>)", re.DOTALL)


def has_marker(text: str) -> bool:
    n = norm(text)
    return any(m in n for m in FIXED) or _TAG_RE.search(n) is not None


def is_marker_prefix(text: str) -> bool:
    """Could `text` still grow into a marker (what the stream may hold back)?"""
    n = norm(text)
    if not n.startswith("<"):
        return False
    if any(m.startswith(n) and len(n) < len(m) for m in FIXED):
        return True
    return any(p.startswith(n) or (n.startswith(p) and ">" not in n) for p in TAGGED)


def may_hold(rest: str) -> bool:
    """What a stream may still hold back: whitespace, then a possible marker."""
    body = rest.lstrip()
    return body == "" or is_marker_prefix(body)


def run(chunks: Iterable[str], **kw) -> list[Event]:
    parser = StreamParser(**kw)
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def split_at(text: str, cuts: Iterable[int]) -> list[str]:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def check_events(events: Sequence[Event]) -> None:
    """Well-formed stream: no empty deltas, names once and first, calls in order."""
    seen: list[int] = []
    aborted: list[int] = []
    for pos, ev in enumerate(events):
        if isinstance(ev, (ReasoningDelta, ContentDelta)):
            assert ev.text, f"empty delta at {pos}"
        elif isinstance(ev, ToolCallDelta):
            assert not aborted, "tool delta after an abort"
            if not seen or ev.index != seen[-1]:
                assert ev.index == len(seen), f"call {ev.index} out of order {seen}"
                assert ev.name, "a call's first delta must carry its name"
                seen.append(ev.index)
            else:
                assert ev.name is None, "name sent twice"
                assert ev.arguments_delta, "empty arguments delta"
        elif isinstance(ev, ToolCallAborted):
            assert seen and ev.index == seen[-1] and not aborted
            aborted.append(ev.index)
            assert pos == len(events) - 1 or all(
                isinstance(e, (ReasoningDelta, ContentDelta)) for e in events[pos + 1 :]
            )
        else:  # pragma: no cover - a new event type must be added here
            raise AssertionError(f"unknown event {ev!r}")


def check_chunking(text: str, chunks: Sequence[str], expected: Message, **kw) -> None:
    assert "".join(chunks) == text
    events = run(chunks, **kw)
    check_events(events)
    got = collect(events)
    assert got == expected, f"chunks={chunks!r}\n got={got!r}\nwant={expected!r}"


def check_all_chunkings(text: str, **kw) -> Message:
    """parse(text) equals the stream for single characters and every 2-way split."""
    expected = parse(text, **kw)
    check_chunking(text, list(text), expected, **kw)
    for cut in range(1, len(text)):
        check_chunking(text, [text[:cut], text[cut:]], expected, **kw)
    return expected
