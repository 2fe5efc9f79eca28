"""The vLLM adapters driven through vLLM's own Parser plumbing (needs vLLM).

Skipped where vLLM is absent (the default CI environment). A small fake
tokenizer maps each DeepSeek marker to one token id, as the real ones do.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings

pytest.importorskip("vllm")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
from vllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

from moet_cache.integrations.vllm import parsers as vp
from moet_cache.parsers import parse
from moet_cache.parsers.markers import FIXED

pytestmark = pytest.mark.vllm

EOS = "<｜end▁of▁sentence｜>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
        },
    }
]
DSML = (
    "Checking.\n\n<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Hangzhou</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
)
V31 = (
    "Sure. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>"
    '{"a": {"b": [1, 2]}, "n": 10}<｜tool▁call▁end｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
TEXTS = [
    ("I think it is sunny.</think>" + DSML, True),
    ("hmm <｜tool▁ca </thi</think>" + V31, True),
    (V31, False),
    ("Just text with a fragment <｜DSML｜par and </thi", False),
    ("unclosed reasoning, then a call" + DSML, True),
    ("cut off: " + V31[:-60], False),
]


class FakeTokenizer:
    """Just enough of a tokenizer for the parsers: a vocab and an EOS id."""

    def __init__(self) -> None:
        self._vocab = {m: 100_000 + i for i, m in enumerate(FIXED)}
        self.eos_token_id = self._vocab[EOS]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def tokens(self, text: str) -> list[tuple[str, int]]:
        """Markers as single tokens, other text one character a token."""
        out: list[tuple[str, int]] = []
        i = 0
        while i < len(text):
            for m, tid in self._vocab.items():
                if text.startswith(m, i):
                    out.append((m, tid))
                    i += len(m)
                    break
            else:
                out.append((text[i], ord(text[i])))
                i += 1
        return out


TOK = FakeTokenizer()


def _request(tools: bool = True) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS if tools else None,
    )


def _parser(request: ChatCompletionRequest, thinking: bool):
    cls = ParserManager.get_parser(
        tool_parser_name=vp.PARSER_NAME,
        reasoning_parser_name=vp.PARSER_NAME,
        enable_auto_tools=True,
    )
    parser = cls(TOK, request.tools, chat_template_kwargs={"thinking": thinking})
    return parser


def _prompt(thinking: bool) -> list[int]:
    marker = "<think>" if thinking else "</think>"
    return [ord("h"), ord("i"), TOK.get_vocab()[marker]]


def test_registered_under_documented_name() -> None:
    assert vp.HAVE_VLLM
    assert (
        ReasoningParserManager.get_reasoning_parser("moet_deepseek")
        is vp.MoetDeepSeekReasoningParser
    )
    assert ToolParserManager.get_tool_parser("moet_deepseek") is vp.MoetDeepSeekToolParser


def test_adjust_request_keeps_special_tokens() -> None:
    request = _request()
    assert request.skip_special_tokens in (None, True)
    parser = _parser(request, thinking=True)
    request = parser.adjust_request(request)
    assert request.skip_special_tokens is False


@pytest.mark.parametrize("text,thinking", TEXTS)
def test_non_streaming_matches_core(text: str, thinking: bool) -> None:
    request = _request()
    parser = _parser(request, thinking)
    parser.set_prompt_token_ids(_prompt(thinking))
    reasoning, content, calls = parser.parse(text, request, enable_auto_tools=True)
    want = parse(text, thinking=thinking)
    assert reasoning == want.reasoning
    assert (content or None) == want.content
    got_calls = [(c.name, c.arguments) for c in calls or []]
    assert got_calls == [(c.name, c.arguments) for c in want.tool_calls]


@pytest.mark.parametrize("text,thinking", TEXTS)
def test_streaming_matches_core(text: str, thinking: bool) -> None:
    request = _request()
    parser = _parser(request, thinking)
    reasoning, content = [], []
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    tokens = TOK.tokens(text)
    if not text.startswith("cut off"):
        tokens.append(("", TOK.eos_token_id))  # the EOS token: its text is not output
    for i, (piece, tid) in enumerate(tokens):
        delta = parser.parse_delta(
            piece, [tid], request, prompt_token_ids=_prompt(thinking), finished=i == len(tokens) - 1
        )
        if delta is None:
            continue
        if delta.reasoning:
            reasoning.append(delta.reasoning)
        if delta.content:
            content.append(delta.content)
        for tc in delta.tool_calls:
            if tc.function and tc.function.name:
                assert tc.index not in names, "name sent twice"
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (
                (tc.function and tc.function.arguments) or ""
            )
    want = parse(text, thinking=thinking)
    assert ("".join(reasoning) or None) == want.reasoning
    assert ("".join(content) or None) == want.content
    complete = [(names[i], args[i]) for i in sorted(names)][: len(want.tool_calls)]
    assert complete == [(c.name, c.arguments) for c in want.tool_calls]


def test_no_tools_requested_hides_markup() -> None:
    # vLLM never calls a tool parser without tools; the reasoning adapter
    # (which non-streaming parse() always calls) removes the markup then.
    request = _request(tools=False)
    parser = _parser(request, thinking=False)
    parser.set_prompt_token_ids(_prompt(False))
    reasoning, content, calls = parser.parse("A " + V31 + " B", request, enable_auto_tools=True)
    assert (reasoning, content, calls or []) == (None, "A Sure. B", [])
    assert parse("A " + V31 + " B", thinking=False, tools_enabled=False).content == content


def test_module_imports_without_vllm_flag() -> None:
    assert vp.register() is True


def _props():
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "parser_props", Path(__file__).parent / "test_parsers_props.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


_PROPS = _props()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(_PROPS.messages())
def test_generated_messages_through_vllm_match_core(gen) -> None:
    # vLLM skips the reasoning parser when the prompt closed reasoning, so a
    # stray `<think>` with thinking off is outside what the adapters can see.
    assume(gen.thinking or not gen.text.lstrip().startswith("<think>"))
    # EOS ends a vLLM stream (the adapters finish there): none in the middle
    assume(gen.text.find(EOS) in (-1, len(gen.text) - len(EOS)))
    request = _request()
    parser = _parser(request, gen.thinking)
    tokens = TOK.tokens(gen.text) + [("", TOK.eos_token_id)]
    reasoning, content, names, args = [], [], {}, {}
    for i, (piece, tid) in enumerate(tokens):
        delta = parser.parse_delta(
            piece,
            [tid],
            request,
            prompt_token_ids=_prompt(gen.thinking),
            finished=i == len(tokens) - 1,
        )
        if delta is None:
            continue
        reasoning.append(delta.reasoning or "")
        content.append(delta.content or "")
        for tc in delta.tool_calls:
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (
                (tc.function and tc.function.arguments) or ""
            )
    assert ("".join(reasoning) or None) == gen.expected.reasoning
    assert ("".join(content) or None) == gen.expected.content
    assert [(names[i], args[i]) for i in sorted(names)] == [
        (c.name, c.arguments) for c in gen.expected.tool_calls
    ]
    # and the non-streaming path
    parser = _parser(request, gen.thinking)
    parser.set_prompt_token_ids(_prompt(gen.thinking))
    r, c, calls = parser.parse(gen.text, request, enable_auto_tools=True)
    assert (r, c or None) == (gen.expected.reasoning, gen.expected.content)
    assert [(x.name, x.arguments) for x in calls or []] == [
        (x.name, x.arguments) for x in gen.expected.tool_calls
    ]
