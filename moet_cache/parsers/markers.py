"""DeepSeek markers and an incremental scanner that never splits one.

The scanner turns text into plain-text pieces and `Marker`s. When the text
ends with something that could still grow into a marker (`<｜tool▁ca`, or a
DSML tag whose closing `>` has not arrived), that suffix is held back and
released as soon as it can no longer be one (or at `flush()`). Whether a
piece of text is a marker never depends on how the text was chunked.

Markers spell their bars as U+FF5C `｜`; the ASCII variant `|` is accepted
at every bar position (`<|DSML|invoke ...>`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

BAR = "\uff5c"  # ｜


class Kind(Enum):
    THINK_OPEN = "think_open"
    THINK_CLOSE = "think_close"
    V31_BLOCK_OPEN = "v31_block_open"
    V31_BLOCK_CLOSE = "v31_block_close"
    V31_CALL_OPEN = "v31_call_open"
    V31_SEP = "v31_sep"
    V31_CALL_CLOSE = "v31_call_close"
    DSML_BLOCK_OPEN = "dsml_block_open"
    DSML_BLOCK_CLOSE = "dsml_block_close"
    DSML_INVOKE_OPEN = "dsml_invoke_open"
    DSML_INVOKE_CLOSE = "dsml_invoke_close"
    DSML_PARAM_OPEN = "dsml_param_open"
    DSML_PARAM_CLOSE = "dsml_param_close"
    SPECIAL = "special"  # BOS/EOS/role/tool-output tokens: never carry text


# Fixed markers, written with the canonical bar. No fixed marker is a prefix
# of another one (checked in tests), so a full match is never ambiguous.
FIXED: dict[str, Kind] = {
    "<think>": Kind.THINK_OPEN,
    "</think>": Kind.THINK_CLOSE,
    "<｜tool▁calls▁begin｜>": Kind.V31_BLOCK_OPEN,
    "<｜tool▁calls▁end｜>": Kind.V31_BLOCK_CLOSE,
    "<｜tool▁call▁begin｜>": Kind.V31_CALL_OPEN,
    "<｜tool▁sep｜>": Kind.V31_SEP,
    "<｜tool▁call▁end｜>": Kind.V31_CALL_CLOSE,
    # V3.2 wraps calls in function_calls, V4 in tool_calls.
    "<｜DSML｜function_calls>": Kind.DSML_BLOCK_OPEN,
    "</｜DSML｜function_calls>": Kind.DSML_BLOCK_CLOSE,
    "<｜DSML｜tool_calls>": Kind.DSML_BLOCK_OPEN,
    "</｜DSML｜tool_calls>": Kind.DSML_BLOCK_CLOSE,
    "</｜DSML｜invoke>": Kind.DSML_INVOKE_CLOSE,
    "</｜DSML｜parameter>": Kind.DSML_PARAM_CLOSE,
    "<｜begin▁of▁sentence｜>": Kind.SPECIAL,
    "<｜end▁of▁sentence｜>": Kind.SPECIAL,
    "<｜User｜>": Kind.SPECIAL,
    "<｜Assistant｜>": Kind.SPECIAL,
    "<｜tool▁outputs▁begin｜>": Kind.SPECIAL,
    "<｜tool▁outputs▁end｜>": Kind.SPECIAL,
    "<｜tool▁output▁begin｜>": Kind.SPECIAL,
    "<｜tool▁output▁end｜>": Kind.SPECIAL,
}

# Tags with attributes: the prefix, whitespace, attributes, then `>`.
TAGGED: dict[str, Kind] = {
    "<｜DSML｜invoke": Kind.DSML_INVOKE_OPEN,
    "<｜DSML｜parameter": Kind.DSML_PARAM_OPEN,
}

# A tag whose `>` has not come within this many characters is not a tag.
MAX_TAG_ATTRS = 512

# Markers that start a tool block (in content), or end reasoning and start
# one (in reasoning). The bare call openers are accepted leniently.
BLOCK_OPENERS = frozenset(
    {Kind.V31_BLOCK_OPEN, Kind.V31_CALL_OPEN, Kind.DSML_BLOCK_OPEN, Kind.DSML_INVOKE_OPEN}
)

_ATTR_RE = re.compile(r'([A-Za-z_][\w-]*)\s*=\s*"([^"]*)"')


@dataclass(frozen=True)
class Marker:
    kind: Kind
    raw: str  # the exact text it was made of, bars as written
    attrs: tuple[tuple[str, str], ...] = ()

    def attr(self, name: str) -> str | None:
        for key, value in self.attrs:
            if key == name:
                return value
        return None


Token = str | Marker

_PARTIAL = object()  # sentinel: could still become a marker


def _norm(s: str) -> str:
    return s.replace("|", BAR)


def _match_at(buf: str, j: int) -> Marker | object | None:
    """Marker starting at buf[j] (which is '<'), _PARTIAL, or None."""
    longest = max(len(p) for p in TAGGED) + 1 + MAX_TAG_ATTRS
    window = buf[j : j + max(longest, 64)]
    norm = _norm(window)
    partial = False
    for text, kind in FIXED.items():
        if norm.startswith(text):
            return Marker(kind, window[: len(text)])
        if len(norm) < len(text) and text.startswith(norm):
            partial = True
    for prefix, kind in TAGGED.items():
        if norm.startswith(prefix):
            found = _tag_end(window, len(prefix))
            if found is _PARTIAL:
                partial = True
            elif isinstance(found, int):
                raw = window[: found + 1]
                attrs = tuple(_ATTR_RE.findall(raw[len(prefix) : -1]))
                return Marker(kind, raw, attrs)
        elif len(norm) < len(prefix) and prefix.startswith(norm):
            partial = True
    return _PARTIAL if partial else None


def _tag_end(window: str, start: int) -> int | object | None:
    """Index of the `>` closing a tag whose attributes begin at `start`."""
    if start == len(window):
        return _PARTIAL
    if not (window[start].isspace() or window[start] == ">"):
        return None  # e.g. `<｜DSML｜invokes`: another word, not this tag
    in_quote = False
    limit = min(len(window), start + MAX_TAG_ATTRS)
    for k in range(start, limit):
        ch = window[k]
        if ch == "<":
            return None  # another marker starts inside: this is not a tag
        if ch == '"':
            in_quote = not in_quote
        elif ch == ">" and not in_quote:
            return k
    return _PARTIAL if len(window) < start + MAX_TAG_ATTRS else None


def scan(buf: str, final: bool) -> tuple[list[Token], str]:
    """Split `buf` into tokens and a held-back suffix ("" when `final`)."""
    out: list[Token] = []
    text_start = 0
    i = 0
    while True:
        j = buf.find("<", i)
        if j < 0:
            break
        found = _match_at(buf, j)
        if found is None or (found is _PARTIAL and final):
            i = j + 1
            continue
        if j > text_start:
            out.append(buf[text_start:j])
        if found is _PARTIAL:
            return out, buf[j:]
        assert isinstance(found, Marker)
        out.append(found)
        i = text_start = j + len(found.raw)
    if text_start < len(buf):
        out.append(buf[text_start:])
    return out, ""


class Scanner:
    """Incremental `scan`: holds back a suffix that may still become a marker."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> list[Token]:
        tokens, self._held = scan(self._held + text, final=False)
        return tokens

    def flush(self) -> list[Token]:
        tokens, _ = scan(self._held, final=True)
        self._held = ""
        return tokens

    def take_held(self) -> str:
        """Hand the held-back text to someone else (it is not scanned here)."""
        held, self._held = self._held, ""
        return held


class TrimmedText:
    """Streams one text channel without its outer whitespace.

    Leading whitespace is dropped; trailing whitespace is held until more text
    follows, and dropped at `cut()` (markup follows) or when the stream ends.
    """

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, s: str) -> str:
        if not self._started:
            s = s.lstrip()
            if not s:
                return ""
            self._started = True
        s = self._held + s
        body = s.rstrip()
        self._held = s[len(body) :]
        return body

    def cut(self) -> None:
        self._held = ""
