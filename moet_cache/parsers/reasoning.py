"""Stage 1: split the output into reasoning and the raw text after it.

The chat template ends the prompt with `<think>` (thinking on) or `</think>`
(thinking off), so in thinking mode the output starts inside the reasoning
and holds only the closing `</think>`. A stray `<think>` at the very start
(after optional whitespace) is dropped, and opens reasoning even when
thinking is off. Reasoning ends at `</think>` or at a marker that opens a
tool block; that marker and everything after it is passed on untouched
(`raw`), for the content stage to parse. Any other marker inside the
reasoning is markup and dropped.
"""

from __future__ import annotations

from enum import Enum

from .markers import BLOCK_OPENERS, Kind, Scanner, Token, TrimmedText

THINK_OPEN = "<think>"


class _Mode(Enum):
    START = 0  # deciding whether the output opens with `<think>`
    REASONING = 1
    DONE = 2  # reasoning over (or never started): text passes through raw


class ReasoningStage:
    """Incremental: `feed()`/`finish()` return (reasoning_delta, raw_content)."""

    def __init__(self, thinking: bool) -> None:
        self._thinking = thinking
        self._mode = _Mode.START
        self._start_buf = ""
        self._scanner = Scanner()
        self._sink = TrimmedText()

    @property
    def ended(self) -> bool:
        """True once everything further is content (raw pass-through)."""
        return self._mode is _Mode.DONE

    def feed(self, text: str) -> tuple[str, str]:
        if self._mode is _Mode.DONE:
            return "", text
        if self._mode is _Mode.START:
            buf = self._start_buf + text
            lead = buf.lstrip()
            if not lead or (len(lead) < len(THINK_OPEN) and THINK_OPEN.startswith(lead)):
                self._start_buf = buf  # can't tell yet
                return "", ""
            self._start_buf = ""
            if lead.startswith(THINK_OPEN):
                self._mode = _Mode.REASONING
                text = lead[len(THINK_OPEN) :]
            elif self._thinking:
                self._mode = _Mode.REASONING
                text = buf
            else:
                self._mode = _Mode.DONE
                return "", buf
        return self._tokens(self._scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        if self._mode is _Mode.START:
            buf, self._start_buf = self._start_buf, ""
            if not self._thinking:
                self._mode = _Mode.DONE
                return "", buf
            self._mode = _Mode.REASONING
            reasoning, raw = self._tokens(self._scanner.feed(buf))
        elif self._mode is _Mode.REASONING:
            reasoning, raw = "", ""
        else:
            return "", ""
        more_reasoning, more_raw = self._tokens(self._scanner.flush())
        self._sink.cut()  # trailing whitespace of unclosed reasoning is dropped
        self._mode = _Mode.DONE
        return reasoning + more_reasoning, raw + more_raw

    def _tokens(self, tokens: list[Token]) -> tuple[str, str]:
        if self._mode is _Mode.DONE:  # a marker in an earlier batch ended it
            return "", "".join(t if isinstance(t, str) else t.raw for t in tokens)
        reasoning: list[str] = []
        for i, tok in enumerate(tokens):
            if isinstance(tok, str):
                reasoning.append(self._sink.push(tok))
                continue
            if tok.kind is Kind.THINK_CLOSE or tok.kind in BLOCK_OPENERS:
                self._mode = _Mode.DONE
                self._sink.cut()
                rest = tokens[i + 1 :] if tok.kind is Kind.THINK_CLOSE else tokens[i:]
                raw = "".join(t if isinstance(t, str) else t.raw for t in rest)
                return "".join(reasoning), raw + self._scanner.take_held()
            # any other marker in reasoning is markup: dropped
        return "".join(reasoning), ""
