"""Hand-written cases: each is parsed whole and streamed under every
single-character and two-way chunking, and all must give the expected message."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from moet_cache.parsers import Message, ToolCall, parse

_spec = importlib.util.spec_from_file_location(
    "parser_harness", Path(__file__).parent / "parser_cases" / "harness.py"
)
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

# V3.1 markers
CB, CE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
B, SEP, E = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
EOS = "<｜end▁of▁sentence｜>"


def v31(*calls: tuple[str, str]) -> str:
    return CB + "".join(f"{B}{n}{SEP}{a}{E}" for n, a in calls) + CE


def dsml(*invokes: str, bar: str = "｜", wrap: str = "function_calls") -> str:
    body = "".join(invokes)
    return f"<{bar}DSML{bar}{wrap}>\n{body}</{bar}DSML{bar}{wrap}>"


def inv(name: str, *params: str, bar: str = "｜") -> str:
    return (
        f'<{bar}DSML{bar}invoke name="{name}">\n' + "".join(params) + f"</{bar}DSML{bar}invoke>\n"
    )


def par(name: str, value: str, string: str | None = "true", bar: str = "｜") -> str:
    attr = "" if string is None else f' string="{string}"'
    return f'<{bar}DSML{bar}parameter name="{name}"{attr}>{value}</{bar}DSML{bar}parameter>\n'


def M(reasoning=None, content=None, *calls: tuple[str, str]) -> Message:
    return Message(reasoning, content, tuple(ToolCall(n, a) for n, a in calls))


W = ("get_weather", '{"location": "Hangzhou", "days": 3}')

# (id, text, thinking, tools_enabled, expected)
CASES = [
    # --- thinking ---
    ("primed", "I should greet.</think>Hello!", True, True, M("I should greet.", "Hello!")),
    ("primed-unclosed", "still thinking <｜tool", True, True, M("still thinking <｜tool")),
    ("primed-empty-reasoning", "</think>\n\nHi", True, True, M(None, "Hi")),
    ("thinking-off", "Plain answer.", False, True, M(None, "Plain answer.")),
    ("stray-think-on", "<think>\nhmm\n</think>\n\nok", True, True, M("hmm", "ok")),
    ("stray-think-off", "<think>hmm</think>ok", False, True, M("hmm", "ok")),
    ("stray-think-after-ws", "\n <think>hmm</think>ok", False, True, M("hmm", "ok")),
    ("think-word-not-marker", "<thinking> is a tag", False, True, M(None, "<thinking> is a tag")),
    ("think-prefix-at-end", "a<thin", False, True, M(None, "a<thin")),
    ("think-prefix-only", "<thi", False, True, M(None, "<thi")),
    ("think-prefix-only-primed", "<thi", True, True, M("<thi")),
    ("second-think-close-dropped", "r</think>a</think>b", True, True, M("r", "ab")),
    ("think-open-in-reasoning-dropped", "a<think>b</think>c", True, True, M("ab", "c")),
    ("empty", "", True, True, M()),
    ("whitespace-only", " \n\t ", False, True, M()),
    ("eos-dropped", "answer" + EOS, False, True, M(None, "answer")),
    ("eos-in-reasoning", "r" + EOS, True, True, M("r")),
    ("bos-in-content", "<｜begin▁of▁sentence｜>x", False, True, M(None, "x")),
    # --- prose that looks like markup ---
    (
        "lt-gt-prose",
        "if a < b and c > d: x <| y",
        False,
        True,
        M(None, "if a < b and c > d: x <| y"),
    ),
    ("fragment-in-prose", "the <｜tool▁call token", False, True, M(None, "the <｜tool▁call token")),
    ("dsml-word-not-tag", "see <｜DSML｜invokes>", False, True, M(None, "see <｜DSML｜invokes>")),
    (
        "dsml-tag-with-lt",
        'x <｜DSML｜invoke name="a<b">',
        False,
        True,
        M(None, 'x <｜DSML｜invoke name="a<b">'),
    ),
    ("stray-call-end-dropped", "a" + E + "b", False, True, M(None, "ab")),
    # --- V3.1 ---
    ("v31-one", v31(("f", '{"a": 1}')), False, True, M(None, None, ("f", '{"a": 1}'))),
    (
        "v31-two-with-content",
        "Let me check.\n\n" + v31(("f", '{"a": 1}'), ("g", '{"b": {"c": [1, 2]}}')),
        False,
        True,
        M(None, "Let me check.", ("f", '{"a": 1}'), ("g", '{"b": {"c": [1, 2]}}')),
    ),
    (
        "v31-number-end",
        v31(("n", '{"x": 12345}')),
        False,
        True,
        M(None, None, ("n", '{"x": 12345}')),
    ),
    (
        "v31-nested-end",
        v31(("n", '{"x": {"y": {"z": []}}}')),
        False,
        True,
        M(None, None, ("n", '{"x": {"y": {"z": []}}}')),
    ),
    (
        "v31-marker-like-in-json",
        v31(("q", '{"s": "<｜tool <| </thi \\"q\\" \\\\ 中文"}')),
        False,
        True,
        M(None, None, ("q", '{"s": "<｜tool <| </thi \\"q\\" \\\\ 中文"}')),
    ),
    ("v31-ws-trim", v31((" f ", '\n {"a": 1} \n')), False, True, M(None, None, ("f", '{"a": 1}'))),
    ("v31-empty-args", v31(("f", "")), False, True, M(None, None, ("f", "{}"))),
    (
        "v31-ascii-bars",
        v31(("f", "{}")).replace("｜", "|"),
        False,
        True,
        M(None, None, ("f", "{}")),
    ),
    ("v31-bare-call", f"{B}f{SEP}{{}}{E}", False, True, M(None, None, ("f", "{}"))),
    ("v31-after-reasoning", "r</think>" + v31(("f", "{}")), True, True, M("r", None, ("f", "{}"))),
    (
        "v31-missing-call-end",
        f'{CB}{B}f{SEP}{{"a": 1}}{B}g{SEP}{{}}{CE}',
        False,
        True,
        M(None, None, ("f", '{"a": 1}'), ("g", "{}")),
    ),
    ("v31-no-name", f"{CB}{B}{SEP}{{}}{E}{CE}ok", False, True, M(None, "ok")),
    (
        "v31-text-in-block-dropped",
        f"{CB}junk{B}f{SEP}{{}}{E}junk{CE}",
        False,
        True,
        M(None, None, ("f", "{}")),
    ),
    # --- DSML ---
    (
        "dsml-brief",
        "Checking.\n\n"
        + dsml(inv("get_weather", par("location", "Hangzhou"), par("days", "3", "false"))),
        False,
        True,
        M(None, "Checking.", W),
    ),
    (
        "dsml-ascii",
        dsml(
            inv(
                "get_weather",
                par("location", "Hangzhou", bar="|"),
                par("days", "3", "false", bar="|"),
                bar="|",
            ),
            bar="|",
        ),
        False,
        True,
        M(None, None, W),
    ),
    (
        "dsml-v4-wrapper",
        dsml(
            inv("get_weather", par("location", "Hangzhou"), par("days", "3", "false")),
            wrap="tool_calls",
        ),
        False,
        True,
        M(None, None, W),
    ),
    (
        "dsml-invalid-literal",
        dsml(inv("f", par("x", " abc ", "false"), par("y", "NaN", "false"), par("z", "", "false"))),
        False,
        True,
        M(None, None, ("f", '{"x": "abc", "y": "NaN", "z": ""}')),
    ),
    (
        "dsml-literals",
        dsml(
            inv(
                "f",
                par("o", '{"a": [1, {"b": null}]}', "false"),
                par("t", "true", "false"),
                par("n", "-1.5e3", "false"),
            )
        ),
        False,
        True,
        M(None, None, ("f", '{"o": {"a": [1, {"b": null}]}, "t": true, "n": -1.5e3}')),
    ),
    (
        "dsml-string-escapes",
        dsml(inv("f", par("s", 'say "hi"\\n\n\ttab 中 <| </thi'))),
        False,
        True,
        M(
            None,
            None,
            ("f", json.dumps({"s": 'say "hi"\\n\n\ttab 中 <| </thi'}, ensure_ascii=False)),
        ),
    ),
    (
        "dsml-missing-string-attr",
        dsml(inv("f", par("n", "7", None), par("s", "x", None))),
        False,
        True,
        M(None, None, ("f", '{"n": 7, "s": "x"}')),
    ),
    ("dsml-no-params", dsml(inv("ping")), False, True, M(None, None, ("ping", "{}"))),
    (
        "dsml-two-calls",
        dsml(inv("a", par("x", "1", "false")), inv("b")),
        False,
        True,
        M(None, None, ("a", '{"x": 1}'), ("b", "{}")),
    ),
    (
        "dsml-unnamed-param-dropped",
        dsml(inv("f", '<｜DSML｜parameter string="true">v</｜DSML｜parameter>', par("k", "v"))),
        False,
        True,
        M(None, None, ("f", '{"k": "v"}')),
    ),
    (
        "dsml-missing-param-close",
        dsml(
            '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">1\n</｜DSML｜invoke>\n'
        ),
        False,
        True,
        M(None, None, ("f", '{"a": 1}')),
    ),
    ("dsml-bare-invoke", inv("f", par("k", "v")), False, True, M(None, None, ("f", '{"k": "v"}'))),
    ("dsml-name-with-gt", dsml(inv("a>b")), False, True, M(None, None, ("a>b", "{}"))),
    # --- policy cases ---
    (
        "text-after-block",
        "A\n" + v31(("f", "{}")) + "\n\nB",
        False,
        True,
        M(None, "A\n\nB", ("f", "{}")),
    ),
    (
        "text-after-block-no-before",
        v31(("f", "{}")) + "\n\nB",
        False,
        True,
        M(None, "B", ("f", "{}")),
    ),
    (
        "tool-block-in-unclosed-reasoning",
        "I will call it." + dsml(inv("f", par("k", "v"))),
        True,
        True,
        M("I will call it.", None, ("f", '{"k": "v"}')),
    ),
    ("other-tool-marker-in-reasoning-dropped", "a" + SEP + "b</think>c", True, True, M("ab", "c")),
    ("think-open-in-content-dropped", "a<think>b", False, True, M(None, "ab")),
    (
        "dsml-mixed-bars",
        (
            '<|DSML｜function_calls><｜DSML|invoke name="f">'
            '<|DSML|parameter name="k" string="false">[1]</｜DSML|parameter>'
            "</|DSML｜invoke></｜DSML｜function_calls>"
        ),
        False,
        True,
        M(None, None, ("f", '{"k": [1]}')),
    ),
    (
        "block-in-reasoning-then-late-think-close",
        "r" + v31(("f", "{}")) + "</think>c",
        True,
        True,
        M("r", "c", ("f", "{}")),
    ),
    (
        "fenced-marker-is-a-block",
        "Example:\n```\n" + v31(("f", "{}")) + "\n```",
        False,
        True,
        M(None, "Example:\n```\n```", ("f", "{}")),
    ),
    ("tools-disabled", "A " + v31(("f", '{"a": 1}')) + " B", False, False, M(None, "A B")),
    ("tools-disabled-dsml", "A\n\n" + dsml(inv("f", par("k", "v"))), False, False, M(None, "A")),
    # --- truncation ---
    (
        "trunc-v31-args",
        CB + f'{B}f{SEP}{{}}{E}{B}g{SEP}{{"a": 1',
        False,
        True,
        M(None, None, ("f", "{}")),
    ),
    ("trunc-v31-name", CB + f"{B}f{SEP}{{}}{E}{B}ge", False, True, M(None, None, ("f", "{}"))),
    ("trunc-v31-in-end-marker", CB + f"{B}f{SEP}{{}}<｜tool▁call▁e", False, True, M()),
    ("trunc-v31-before-end-marker", "x" + CB + f"{B}f{SEP}{{}}", False, True, M(None, "x")),
    ("trunc-block-opener", "x <｜tool▁calls▁be", False, True, M(None, "x <｜tool▁calls▁be")),
    (
        "trunc-dsml-param",
        dsml(inv("a"))[:-30]
        + '<｜DSML｜invoke name="b">\n<｜DSML｜parameter name="k" string="true">val',
        False,
        True,
        M(None, None, ("a", "{}")),
    ),
    ("trunc-dsml-tag", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="b', False, True, M()),
    (
        "trunc-dsml-after-invoke-close",
        dsml(inv("a"))[: -len("</｜DSML｜function_calls>")],
        False,
        True,
        M(None, None, ("a", "{}")),
    ),
]


@pytest.mark.parametrize(
    "text,thinking,tools,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_case(text: str, thinking: bool, tools: bool, expected: Message) -> None:
    assert parse(text, thinking=thinking, tools_enabled=tools) == expected
    harness.check_all_chunkings(text, thinking=thinking, tools_enabled=tools)


def test_case_ids_unique() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 60


@pytest.mark.parametrize(
    "text,thinking,tools,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_case_three_way_splits(text: str, thinking: bool, tools: bool, expected: Message) -> None:
    # every 3-way split of short cases; a sample of them for long ones
    n = len(text)
    step = max(1, n // 25)
    for a in range(1, n, step):
        for b in range(a + 1, n, step):
            harness.check_chunking(
                text,
                [text[:a], text[a:b], text[b:]],
                expected,
                thinking=thinking,
                tools_enabled=tools,
            )
