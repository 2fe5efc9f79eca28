"""Property tests: generated messages (known ground truth) and arbitrary
marker-rich text, under random chunkings."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from moet_cache.parsers import (
    ContentDelta,
    Message,
    ReasoningDelta,
    StreamParser,
    ToolCall,
    ToolCallDelta,
    collect,
    parse,
)

_spec = importlib.util.spec_from_file_location(
    "parser_harness", Path(__file__).parent / "parser_cases" / "harness.py"
)
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

EXAMPLES = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

FRAGMENTS = [
    "<",
    ">",
    "|",
    "｜",
    "/",
    "<|",
    "<｜",
    "</",
    "<thi",
    "</thi",
    "think>",
    "<think",
    "</think",
    "<｜tool",
    "<｜tool▁call",
    "<｜tool▁calls▁be",
    "▁sep｜>",
    "<|tool▁sep",
    "<｜DSML",
    "<|DSML|",
    "<｜DSML｜param",
    "<｜DSML｜invoke",
    "</｜DSML｜",
    "｜DSML｜",
    "<｜end▁of",
    '"',
    "\\",
    "{",
    "}",
    "中文",
    "é",
    "😀",
    "```",
    "\n",
    " ",
    "\t",
    "a < b",
    "x > y",
]
prose = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=12).map(
    "".join
)
STRAYS = [
    "<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>",
    "</think>",
    "<think>",
    "<｜tool▁sep｜>",
]

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(FRAGMENTS),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.text(max_size=5), inner, max_size=3),
    ),
    max_leaves=8,
)
key = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=8)
name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.-0123456789", min_size=1, max_size=10)
ws = st.sampled_from(["", " ", "\n", "\n\n", " \n\t"])


@dataclass
class Generated:
    text: str
    thinking: bool
    expected: Message
    # for each call: (text index where its end marker starts, args expected by then)
    call_ends: list[tuple[int, str]] = field(default_factory=list)
    content_end: int | None = None  # index where the tool block starts
    content_before: str = ""  # expected content before the tool block
    reasoning_end: int | None = None  # index where `</think>` starts


@st.composite
def dsml_param(draw) -> tuple[str, str, str]:
    """(attributes' string value, raw value text, JSON text of the value)."""
    kind = draw(st.sampled_from(["str", "literal", "pretty", "invalid"]))
    if kind == "str":
        v = draw(prose)
        return "true", v, json.dumps(v, ensure_ascii=False)
    if kind == "invalid":
        v = draw(prose)
        try:
            json.loads(v)
            assume(False)
        except ValueError:
            pass
        return "false", v, json.dumps(v.strip(), ensure_ascii=False)
    value = draw(json_value)
    text = json.dumps(
        value, ensure_ascii=draw(st.booleans()), indent=2 if kind == "pretty" else None
    )
    return "false", text, text


@st.composite
def messages(draw) -> Generated:
    thinking = draw(st.booleans())
    bar = draw(st.sampled_from(["｜", "|"]))
    fmt = draw(st.sampled_from(["v31", "dsml"]))
    reasoning = draw(prose) if thinking or draw(st.booleans()) else None
    content = draw(prose)
    after = draw(prose)
    strays_r = draw(
        st.lists(st.tuples(st.integers(0, 50), st.sampled_from(STRAYS[:2])), max_size=2)
    )
    # a `<think>` at the very start of the output would open reasoning (policy)
    c_strays = (
        STRAYS if reasoning is not None or thinking else [m for m in STRAYS if m != "<think>"]
    )
    strays_c = draw(st.lists(st.tuples(st.integers(0, 50), st.sampled_from(c_strays)), max_size=2))

    def with_strays(s: str, strays: list[tuple[int, str]]) -> str:
        # positions in the original text, so no stray lands inside another
        clamped = [(min(pos, len(s)), m) for pos, m in strays]
        for pos, m in sorted(clamped, key=lambda p: -p[0]):
            s = s[:pos] + m + s[pos:]
        return s

    for piece in (reasoning or "", content, after):
        assume(not harness.has_marker(piece))
    r_text = with_strays(reasoning, strays_r) if reasoning is not None else None
    c_text = with_strays(content, strays_c)

    text = ""
    reasoning_end = None
    if reasoning is not None:
        text += ("<think>" + draw(ws) if not thinking or draw(st.booleans()) else "") + r_text
        reasoning_end = len(text)
        text += "</think>"
        text += draw(ws)
    elif thinking:
        text += "</think>"
    text += c_text
    n_calls = draw(st.integers(0, 3))
    calls: list[ToolCall] = []
    call_ends: list[tuple[int, str]] = []
    content_end = None
    if n_calls:
        text += draw(ws)
        content_end = len(text)
        if fmt == "v31":
            text += f"<{bar}tool▁calls▁begin{bar}>"
            for _ in range(n_calls):
                n = draw(name)
                args = draw(st.dictionaries(key, json_value, max_size=4))
                args_text = json.dumps(
                    args, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1]))
                )
                assume(not harness.has_marker(args_text))
                text += (
                    f"<{bar}tool▁call▁begin{bar}>{n}<{bar}tool▁sep{bar}>"
                    + draw(ws)
                    + args_text
                    + draw(ws)
                )
                call_ends.append((len(text), args_text))
                text += f"<{bar}tool▁call▁end{bar}>" + draw(ws)
                calls.append(ToolCall(n, args_text))
            text += f"<{bar}tool▁calls▁end{bar}>"
        else:
            wrap = draw(st.sampled_from(["function_calls", "tool_calls"]))
            text += f"<{bar}DSML{bar}{wrap}>\n"
            for _ in range(n_calls):
                n = draw(name)
                params = draw(
                    st.lists(st.tuples(key, dsml_param()), max_size=4, unique_by=lambda p: p[0])
                )
                text += f'<{bar}DSML{bar}invoke name="{n}">\n'
                parts = []
                for k, (string, raw, value_json) in params:
                    assume(not harness.has_marker(raw))
                    text += (
                        f'<{bar}DSML{bar}parameter name="{k}" string="{string}">{raw}</{bar}DSML{bar}parameter>'
                        + draw(ws)
                    )
                    parts.append(f"{json.dumps(k)}: {value_json}")
                args_text = "{" + ", ".join(parts) + "}"
                call_ends.append((len(text), args_text[:-1] if parts else ""))
                text += f"</{bar}DSML{bar}invoke>\n"
                calls.append(ToolCall(n, args_text))
                assert json.loads(args_text) == {k: _value(p) for k, p in params}
            text += f"</{bar}DSML{bar}{wrap}>"
        text += after
    if draw(st.booleans()):
        text += "<｜end▁of▁sentence｜>"

    # strays are dropped, which gives back the marker-free prose
    exp_r = reasoning.strip() if reasoning is not None else ""
    exp_c = content.strip()
    before = exp_c
    if n_calls:
        exp_c += after.rstrip() if exp_c else after.strip()
    expected = Message(exp_r or None, exp_c or None, tuple(calls))
    return Generated(text, thinking, expected, call_ends, content_end, before, reasoning_end)


def _value(param: tuple[str, str, str]):
    string, raw, _ = param
    if string == "true":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw.strip()


@EXAMPLES
@given(messages(), st.lists(st.integers(0, 400), max_size=12))
def test_generated_message_parses_to_ground_truth(gen: Generated, cuts: list[int]) -> None:
    assert parse(gen.text, thinking=gen.thinking) == gen.expected
    harness.check_chunking(
        gen.text, harness.split_at(gen.text, cuts), gen.expected, thinking=gen.thinking
    )
    no_tools = Message(gen.expected.reasoning, gen.expected.content, ())
    assert parse(gen.text, thinking=gen.thinking, tools_enabled=False) == no_tools


@EXAMPLES
@given(messages())
def test_generated_message_single_characters_stream_promptly(gen: Generated) -> None:
    """Fed one character at a time: everything matches, and arguments and
    content are out before the marker that ends them arrives."""
    parser = StreamParser(thinking=gen.thinking)
    events = []
    checkpoints = {end: args for end, args in gen.call_ends}
    call = 0
    for i, ch in enumerate(gen.text):
        if i in checkpoints:
            so_far = "".join(
                e.arguments_delta
                for e in events
                if isinstance(e, ToolCallDelta) and e.index == call
            )
            assert so_far == checkpoints[i], "arguments held back"
            call += 1
        if i == gen.reasoning_end:
            so_far = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
            want = gen.expected.reasoning or ""
            assert want.startswith(so_far)
            rest = want[len(so_far) :]
            assert harness.may_hold(rest), f"reasoning held back: {rest!r}"
        if i == gen.content_end:
            so_far = "".join(e.text for e in events if isinstance(e, ContentDelta))
            want = gen.content_before
            assert want.startswith(so_far)
            rest = want[len(so_far) :]
            assert harness.may_hold(rest), f"content held back: {rest!r}"
        events += parser.feed(ch)
    events += parser.finish()
    harness.check_events(events)
    assert collect(events) == gen.expected


@EXAMPLES
@given(messages(), st.data())
def test_truncated_output_keeps_only_complete_calls(gen: Generated, data) -> None:
    cut = data.draw(st.integers(0, len(gen.text)))
    text = gen.text[:cut]
    msg = parse(text, thinking=gen.thinking)
    assert msg.tool_calls == gen.expected.tool_calls[: len(msg.tool_calls)], (
        "a faked or partial call"
    )
    for c in msg.tool_calls:
        json.loads(c.arguments)
    harness.check_chunking(
        text,
        harness.split_at(text, data.draw(st.lists(st.integers(0, cut), max_size=6))),
        msg,
        thinking=gen.thinking,
    )


marker_soup = st.lists(
    st.one_of(
        st.sampled_from(FRAGMENTS),
        st.sampled_from(list(harness.FIXED)),
        st.sampled_from(
            [
                '<｜DSML｜invoke name="f">',
                '<|DSML|parameter name="k" string="true">',
                '<｜DSML｜parameter name="n" string="false">',
            ]
        ),
        st.text(max_size=4),
    ),
    max_size=25,
).map("".join)


@EXAMPLES
@given(marker_soup, st.booleans(), st.booleans(), st.lists(st.integers(0, 300), max_size=10))
def test_arbitrary_text_is_chunking_invariant(
    text: str, thinking: bool, tools: bool, cuts: list[int]
) -> None:
    expected = parse(text, thinking=thinking, tools_enabled=tools)
    harness.check_chunking(
        text, harness.split_at(text, cuts), expected, thinking=thinking, tools_enabled=tools
    )
    harness.check_chunking(text, list(text), expected, thinking=thinking, tools_enabled=tools)
    for call in expected.tool_calls:
        assert call.name and call.name == call.name.strip()
    if not tools:
        assert expected.tool_calls == ()


@EXAMPLES
@given(marker_soup, st.booleans())
def test_reasoning_never_follows_content(text: str, thinking: bool) -> None:
    """Reasoning comes first: once content has been sent, no more reasoning."""
    parser = StreamParser(thinking=thinking)
    events = []
    for ch in text:
        events += parser.feed(ch)
    events += parser.finish()
    kinds = [type(e) for e in events if isinstance(e, (ReasoningDelta, ContentDelta))]
    if ContentDelta in kinds:
        assert ReasoningDelta not in kinds[kinds.index(ContentDelta) :], "reasoning after content"
