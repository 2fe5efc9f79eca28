"""Prose that mentions a tool-call marker without forming a call keeps all its text."""

from __future__ import annotations

import pytest

from moet_cache.parsers import parse
from moet_cache.parsers.records import ContentDelta, ToolCallDelta
from moet_cache.parsers.tools import ContentStage

# A stray marker that means nothing in content (here the V3.1 separator after released prose) is still
# dropped, as docs/PARSERS.md says; everything else of the prose is kept, the quoted opener included.
def _want(text: str) -> str:
    return text.replace("<｜tool▁sep｜>", "").strip()


PROSE = [
    'To call a tool, write `<｜DSML｜invoke name="get_weather">` and then the parameters. That is all.',
    'The tag <|DSML|invoke name="x"> opens a call; see the docs.',
    "V3.1 wraps each call in <｜tool▁call▁begin｜>get the weather, please<｜tool▁sep｜> and so on.",
    'Quote at the very end: <｜DSML｜invoke name="f">',
]


@pytest.mark.parametrize("text", PROSE)
def test_prose_quoting_a_call_opener_is_content(text: str) -> None:
    msg = parse(text, thinking=False)
    assert msg.tool_calls == ()
    assert msg.content == _want(text)


@pytest.mark.parametrize("text", PROSE)
def test_streamed_one_character_at_a_time_the_same(text: str) -> None:
    stage = ContentStage()
    events = [ev for ch in text for ev in stage.feed(ch)] + stage.finish()
    assert not any(isinstance(ev, ToolCallDelta) for ev in events)
    assert "".join(ev.text for ev in events if isinstance(ev, ContentDelta)) == _want(text)


def test_a_real_bare_call_still_calls() -> None:
    text = 'Sure.\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n</｜DSML｜invoke>'
    msg = parse(text, thinking=False)
    assert msg.content == "Sure." and [(c.name, c.arguments) for c in msg.tool_calls] == [("f", '{"a": "x"}')]
    msg = parse("ok<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>", thinking=False)
    assert msg.content == "ok" and [c.name for c in msg.tool_calls] == ["get_weather"]
