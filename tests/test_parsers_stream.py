"""Streaming details: hold-back and release, prompt argument streaming,
event shapes, API misuse, and the marker table itself."""

from __future__ import annotations

import json

import pytest

from moet_cache.parsers import (
    ContentDelta,
    Message,
    ReasoningDelta,
    StreamParser,
    ToolCall,
    ToolCallAborted,
    ToolCallDelta,
    collect,
    parse,
)
from moet_cache.parsers.markers import FIXED, MAX_TAG_ATTRS, TAGGED, Kind, Scanner, scan
from moet_cache.parsers.tools import literal_json


def feed_all(parser: StreamParser, chunks: list[str]) -> list[list]:
    return [parser.feed(c) for c in chunks]


def texts(events: list, kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def test_fixed_markers_are_not_prefixes_of_each_other() -> None:
    markers = list(FIXED) + list(TAGGED)
    for a in markers:
        for b in markers:
            if a != b:
                assert not b.startswith(a), (a, b)


@pytest.mark.parametrize("marker", list(FIXED))
def test_every_marker_is_recognised_with_either_bar(marker: str) -> None:
    for spelling in (marker, marker.replace("｜", "|")):
        tokens, held = scan("x" + spelling + "y", final=False)
        assert held == ""
        assert tokens[0] == "x" and tokens[2] == "y"
        assert tokens[1].kind is FIXED[marker] and tokens[1].raw == spelling


def test_partial_marker_is_held_then_released_as_soon_as_it_cannot_be_one() -> None:
    p = StreamParser(thinking=False)
    assert texts(p.feed("see <｜tool▁ca"), ContentDelta) == "see"
    assert texts(p.feed("ll"), ContentDelta) == ""  # "<｜tool▁call" still a prefix
    assert texts(p.feed("!"), ContentDelta) == " <｜tool▁call!"
    assert collect(p.finish()) == Message(None, None)


def test_held_prefix_is_released_at_finish() -> None:
    p = StreamParser(thinking=True)
    assert texts(p.feed("thought </thi"), ReasoningDelta) == "thought"
    assert texts(p.finish(), ReasoningDelta) == " </thi"


def test_unclosed_tag_is_released_after_the_attribute_limit() -> None:
    p = StreamParser(thinking=False)
    head = '<｜DSML｜invoke name="'
    assert p.feed(head) == []
    out = p.feed("x" * MAX_TAG_ATTRS)  # no `>` within the limit: not a tag
    assert texts(out, ContentDelta) == head + "x" * MAX_TAG_ATTRS


def test_plain_text_streams_without_delay() -> None:
    p = StreamParser(thinking=False)
    text = "Hello, world: 1+1=2 and a|b but no markup."
    sent = ""
    for i, ch in enumerate(text, 1):
        sent += texts(p.feed(ch), ContentDelta)
        assert sent == text[:i].rstrip()


def test_v31_arguments_stream_as_they_arrive() -> None:
    args = '{"a": {"b": [1, 2.5, "x<y"]}, "n": 42}'
    p = StreamParser(thinking=False)
    events = p.feed("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>fn<｜tool▁sep｜>")
    assert events == [ToolCallDelta(0, "fn", "")]
    sent = ""
    for i, ch in enumerate(args, 1):
        for ev in p.feed(ch):
            assert isinstance(ev, ToolCallDelta) and ev.name is None and ev.index == 0
            sent += ev.arguments_delta
        # only a `<` that may begin `<｜tool▁call▁end｜>` and whitespace can wait
        assert args[:i].rstrip().startswith(sent) and args[:i].rstrip()[len(sent) :] in ("", "<")
    assert sent == args  # complete before the end marker arrives
    tail = p.feed("<｜tool▁call▁end｜><｜tool▁calls▁end｜>") + p.finish()
    assert [e for e in tail if isinstance(e, ToolCallDelta)] == []


def test_dsml_arguments_stream_key_by_key_and_chunk_by_chunk() -> None:
    p = StreamParser(thinking=False)
    out = p.feed('<｜DSML｜function_calls>\n<｜DSML｜invoke name="w">\n')
    assert out == [ToolCallDelta(0, "w", "")]
    out = p.feed('<｜DSML｜parameter name="city" string="true">Hang')
    assert [e.arguments_delta for e in out] == ['{"city": "', "Hang"]
    out = p.feed('zhou "X"')
    assert [e.arguments_delta for e in out] == ['zhou \\"X\\"']
    out = p.feed('</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">1')
    assert [e.arguments_delta for e in out] == ['"', ', "days": ']  # a literal waits for its end
    out = p.feed("0</｜DSML｜parameter>\n")
    assert [e.arguments_delta for e in out] == ["10"]
    out = p.feed("</｜DSML｜invoke>\n</｜DSML｜function_calls>")
    assert [e.arguments_delta for e in out] == ["}"]
    assert p.finish() == []


def test_whole_call_in_one_delta_is_not_dropped() -> None:
    text = 'Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"x": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    p = StreamParser(thinking=False)
    events = p.feed(text)
    assert events == [
        ContentDelta("Hi"),
        ToolCallDelta(0, "f", ""),
        ToolCallDelta(0, None, '{"x": 1}'),
    ]
    assert p.finish() == []


def test_truncated_call_is_streamed_then_aborted() -> None:
    p = StreamParser(thinking=False)
    events = p.feed('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"x": 1')
    assert events == [ToolCallDelta(0, "f", ""), ToolCallDelta(0, None, '{"x": 1')]
    assert p.finish() == [ToolCallAborted(0)]
    assert collect(events + [ToolCallAborted(0)]) == Message(None, None, ())


def test_tools_disabled_emits_no_call_events() -> None:
    text = 'a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"x": 1'
    p = StreamParser(thinking=False, tools_enabled=False)
    events = p.feed(text) + p.finish()
    assert events == [ContentDelta("a")]


@pytest.mark.parametrize(
    "raw,want",
    [
        ("3", "3"),
        (" -0.5e2 ", "-0.5e2"),
        ('{"a": [true, null]}', '{"a": [true, null]}'),
        ("abc", '"abc"'),
        ("NaN", '"NaN"'),
        ("Infinity", '"Infinity"'),
        ("", '""'),
        ("[1,", '"[1,"'),
        ('"s"', '"s"'),
        ("[" * 100000, json.dumps("[" * 100000)),
    ],
)
def test_literal_values(raw: str, want: str) -> None:
    assert literal_json(raw) == want
    json.loads(literal_json(raw))


def test_api_misuse_raises_value_error() -> None:
    p = StreamParser(thinking=True)
    with pytest.raises(ValueError):
        p.feed(b"bytes")  # type: ignore[arg-type]
    p.finish()
    with pytest.raises(ValueError):
        p.feed("x")
    with pytest.raises(ValueError):
        p.finish()
    with pytest.raises(ValueError):
        StreamParser(thinking="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        collect(["not an event"])  # type: ignore[list-item]


def test_malformed_output_never_raises() -> None:
    junk = (
        "".join(FIXED)
        + '<｜DSML｜parameter name="x" string="false">{{{'
        + "".join(reversed(list(FIXED)))
    )
    for thinking in (True, False):
        msg = parse(junk, thinking=thinking)
        for call in msg.tool_calls:
            json.loads(call.arguments)


def test_records_are_frozen() -> None:
    msg = parse("a", thinking=False)
    with pytest.raises(AttributeError):
        msg.content = "b"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        ToolCall("f", "{}").name = "g"  # type: ignore[misc]


def test_reasoning_ended_flag() -> None:
    p = StreamParser(thinking=True)
    p.feed("abc")
    assert not p.reasoning_ended
    p.feed("</think>x")
    assert p.reasoning_ended


def test_scanner_is_incremental() -> None:
    s = Scanner()
    assert s.feed("a<｜DSML") == ["a"]
    tokens = s.feed('｜invoke name="f">b')
    assert tokens[0].kind is Kind.DSML_INVOKE_OPEN and tokens[0].attr("name") == "f"
    assert tokens[1] == "b"
    assert s.flush() == []
