"""Stage 2: content and tool-call blocks (DeepSeek V3.1 and DSML).

Policy (docs/PARSERS.md has the full table):
- In content, a block opener starts a tool block; every other marker is
  markup and dropped. Whitespace next to a block is a separator, not content.
- Inside a block, text between calls is dropped; a call is started when its
  name is complete (V3.1: at `<｜tool▁sep｜>`, DSML: at the invoke tag) and
  from then on its name and arguments stream out.
- A call ends at its end marker, or leniently at the next call's start or
  the block's end. A call still open when the output ends is aborted
  (`ToolCallAborted`): never completed, never faked.
- V3.1 arguments are the JSON text as the model wrote it (outer whitespace
  trimmed; `{}` when empty). DSML arguments are a JSON object built as the
  parameters arrive: string="true" values are escaped and streamed chunk by
  chunk, other values are kept verbatim when they are a valid JSON literal
  and become a JSON string otherwise (so they are held until complete).
- With tools disabled, blocks are parsed the same way but produce nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from .markers import BLOCK_OPENERS, Kind, Marker, Scanner, Token, TrimmedText
from .records import ContentDelta, Event, ToolCallAborted, ToolCallDelta


class _Mode(Enum):
    CONTENT = 0
    V31_BLOCK = 1
    V31_NAME = 2
    V31_ARGS = 3
    DSML_BLOCK = 4
    DSML_INVOKE = 5
    DSML_PARAM = 6


@dataclass
class _Call:
    index: int
    args: TrimmedText  # V3.1 only
    sent_args: bool = False  # any argument text emitted yet
    params: int = 0  # DSML: parameters emitted so far


@dataclass
class _Param:
    is_string: bool
    literal: list[str]  # non-string value, held until its end


# A bare call opener met in content (no block around it) starts a call only if what must follow it does
# (DSML: whitespace, then a parameter or the call's end; V3.1: a function name, then the separator).
# Anything else (words, another marker, the end of the output) makes it prose that quotes the marker:
# the marker and all the text after it are content. A block opener always opens its block.
_FOLLOWS: dict[Kind, frozenset[Kind]] = {
    Kind.DSML_INVOKE_OPEN: frozenset({Kind.DSML_PARAM_OPEN, Kind.DSML_INVOKE_CLOSE, Kind.DSML_BLOCK_CLOSE}),
    Kind.V31_CALL_OPEN: frozenset({Kind.V31_SEP}),
}
_MAX_NAME = 256  # a bare V3.1 call's function name (with its whitespace) is never longer


def literal_json(raw: str) -> str:
    """A DSML string="false" value as JSON: verbatim if valid, else a string."""
    text = raw.strip()
    try:
        json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return json.dumps(text, ensure_ascii=False)
    return text


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity: Python-only


class ContentStage:
    """Incremental parser of the text after the reasoning."""

    def __init__(self, tools_enabled: bool = True) -> None:
        self._tools = tools_enabled
        self._scanner = Scanner()
        self._mode = _Mode.CONTENT
        self._content = TrimmedText()
        self._name: list[str] = []
        self._call: _Call | None = None
        self._param: _Param | None = None
        self._next_index = 0
        self._out: list[Event] = []
        # An opener met in content, and what followed it, until we know whether it starts a call
        # (then replayed as one) or is prose that quotes a marker (then all of it is content).
        self._held: list[Token] | None = None

    def feed(self, text: str) -> list[Event]:
        for tok in self._scanner.feed(text):
            self._token(tok)
        return self._take()

    def finish(self) -> list[Event]:
        for tok in self._scanner.flush():
            self._token(tok)
        if self._held is not None:
            self._release_held()  # the output ended before a call formed: it was prose
        self._content.cut()
        if self._call is not None and self._mode in (
            _Mode.V31_ARGS,
            _Mode.DSML_INVOKE,
            _Mode.DSML_PARAM,
        ):
            self._tool(ToolCallAborted(self._call.index))
        self._call = self._param = None
        self._mode = _Mode.CONTENT
        return self._take()

    # -- plumbing -------------------------------------------------------

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _tool(self, ev: Event) -> None:
        if self._tools:
            self._out.append(ev)

    def _args(self, text: str) -> None:
        if self._call is not None and text:
            self._call.sent_args = True
            self._tool(ToolCallDelta(self._call.index, None, text))

    def _token(self, tok: Token) -> None:
        if self._held is not None:
            self._held_token(tok)
        elif isinstance(tok, str):
            self._text(tok)
        elif self._mode is _Mode.CONTENT:
            if tok.kind in _FOLLOWS:
                self._held = [tok]  # a call, or prose that mentions the marker: the next tokens tell
            elif tok.kind in BLOCK_OPENERS:
                self._enter_block(tok)
            # any other marker in content is markup: dropped
        elif self._mode in (_Mode.V31_BLOCK, _Mode.V31_NAME, _Mode.V31_ARGS):
            self._v31_marker(tok)
        else:
            self._dsml_marker(tok)

    # -- an opener in content: a call, or prose? ------------------------

    def _held_token(self, tok: Token) -> None:
        held = self._held
        assert held is not None
        opener = held[0]
        assert isinstance(opener, Marker)
        if isinstance(tok, str):
            held.append(tok)
            text = "".join(t for t in held[1:] if isinstance(t, str))
            if opener.kind is Kind.V31_CALL_OPEN:  # a bare V3.1 call: a function name comes first
                name = text.strip()
                if len(text) > _MAX_NAME or any(c.isspace() for c in name):
                    self._release_held()
            elif text.strip():  # a DSML call opener is followed by tags, not by words
                self._release_held()
            return
        if tok.kind in _FOLLOWS.get(opener.kind, ()):
            self._held = None
            self._enter_block(opener)
            for t in held[1:]:
                self._token(t)
            self._token(tok)
        else:
            self._release_held()
            self._token(tok)

    def _release_held(self) -> None:
        """The held opener did not start a call: it and the text after it are content, as written."""
        held, self._held = self._held or [], None
        for t in held:
            out = self._content.push(t if isinstance(t, str) else t.raw)
            if out:
                self._out.append(ContentDelta(out))

    def _enter_block(self, tok: Marker) -> None:
        """A confirmed opener in content: the block (and, for a bare call opener, the call) starts."""
        self._content.cut()
        v31 = tok.kind in (Kind.V31_BLOCK_OPEN, Kind.V31_CALL_OPEN)
        self._mode = _Mode.V31_BLOCK if v31 else _Mode.DSML_BLOCK
        if tok.kind in (Kind.V31_CALL_OPEN, Kind.DSML_INVOKE_OPEN):
            self._token(tok)  # a bare call opener: block and call at once

    def _text(self, text: str) -> None:
        mode = self._mode
        if mode is _Mode.CONTENT:
            out = self._content.push(text)
            if out:
                self._out.append(ContentDelta(out))
        elif mode is _Mode.V31_NAME:
            self._name.append(text)
        elif mode is _Mode.V31_ARGS and self._call is not None:
            self._args(self._call.args.push(text))
        elif mode is _Mode.DSML_PARAM and self._param is not None:
            if self._param.is_string:
                self._args(json.dumps(text, ensure_ascii=False)[1:-1])
            else:
                self._param.literal.append(text)
        # text between calls and tags inside a block is dropped

    def _start_call(self, name: str) -> None:
        self._call = _Call(self._next_index, TrimmedText())
        self._next_index += 1
        self._tool(ToolCallDelta(self._call.index, name, ""))

    # -- V3.1 -----------------------------------------------------------

    def _v31_marker(self, tok: Marker) -> None:
        kind = tok.kind
        if kind is Kind.V31_CALL_OPEN:
            self._v31_end_call()
            self._mode = _Mode.V31_NAME
            self._name = []
        elif kind is Kind.V31_SEP and self._mode is _Mode.V31_NAME:
            name = "".join(self._name).strip()
            self._mode = _Mode.V31_ARGS
            if name:
                self._start_call(name)
        elif kind is Kind.V31_CALL_CLOSE:
            self._v31_end_call()
            self._mode = _Mode.V31_BLOCK
        elif kind is Kind.V31_BLOCK_CLOSE:
            self._v31_end_call()
            self._mode = _Mode.CONTENT
        # other markers inside a V3.1 block are dropped

    def _v31_end_call(self) -> None:
        # A call whose name never completed was never started: nothing to end.
        if self._mode is _Mode.V31_ARGS and self._call is not None and not self._call.sent_args:
            self._args("{}")
        self._call = None

    # -- DSML -----------------------------------------------------------

    def _dsml_marker(self, tok: Marker) -> None:
        kind, mode = tok.kind, self._mode
        if kind is Kind.DSML_INVOKE_OPEN:
            self._dsml_end_invoke()
            self._mode = _Mode.DSML_INVOKE
            name = (tok.attr("name") or "").strip()
            if name:
                self._start_call(name)
        elif kind is Kind.DSML_PARAM_OPEN and mode in (_Mode.DSML_INVOKE, _Mode.DSML_PARAM):
            self._dsml_end_param()
            self._mode = _Mode.DSML_PARAM
            self._dsml_start_param(tok)
        elif kind is Kind.DSML_PARAM_CLOSE and mode is _Mode.DSML_PARAM:
            self._dsml_end_param()
            self._mode = _Mode.DSML_INVOKE
        elif kind is Kind.DSML_INVOKE_CLOSE and mode is not _Mode.DSML_BLOCK:
            self._dsml_end_invoke()
            self._mode = _Mode.DSML_BLOCK
        elif kind is Kind.DSML_BLOCK_CLOSE:
            self._dsml_end_invoke()
            self._mode = _Mode.CONTENT
        # anything else inside a DSML block is dropped

    def _dsml_start_param(self, tok: Marker) -> None:
        key = tok.attr("name")
        if self._call is None or not key:
            self._param = None  # a parameter of a skipped call, or unnamed: dropped
            return
        self._param = _Param(is_string=tok.attr("string") == "true", literal=[])
        head = "{" if self._call.params == 0 else ", "
        self._call.params += 1
        quote = '"' if self._param.is_string else ""
        self._args(f"{head}{json.dumps(key, ensure_ascii=False)}: {quote}")

    def _dsml_end_param(self) -> None:
        if self._mode is _Mode.DSML_PARAM and self._param is not None:
            if self._param.is_string:
                self._args('"')
            else:
                self._args(literal_json("".join(self._param.literal)))
        self._param = None

    def _dsml_end_invoke(self) -> None:
        self._dsml_end_param()
        if self._mode in (_Mode.DSML_INVOKE, _Mode.DSML_PARAM) and self._call is not None:
            self._args("}" if self._call.params else "{}")
        self._call = None
