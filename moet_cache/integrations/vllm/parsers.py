"""vLLM adapters for `moet_cache.parsers` (DeepSeek reasoning and tool calls).

Both adapters are registered as "moet_deepseek" when this module is imported
with vLLM installed. Serve with:

    vllm serve MODEL \\
        --reasoning-parser-plugin moet_cache.integrations.vllm.parsers --reasoning-parser moet_deepseek \\
        --tool-parser-plugin moet_cache.integrations.vllm.parsers --tool-call-parser moet_deepseek \\
        --enable-auto-tool-choice

(a path to this file works for either plugin flag too).
Without vLLM the module still imports; `HAVE_VLLM` is False and the adapter
classes are absent. How the two halves split the work: the reasoning adapter
runs stage 1 (`ReasoningStage`: reasoning vs. the raw text after it) and the
tool adapter runs stage 2 (`ContentStage`: content and tool calls) on the
text vLLM hands it after reasoning ends, so together they give exactly what
`moet_cache.parsers.parse` gives. Limits of vLLM's plumbing are listed in
docs/PARSERS.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moet_cache.parsers import (
    ContentDelta,
    ContentStage,
    Event,
    ReasoningStage,
    ToolCallDelta,
    collect,
)

PARSER_NAME = "moet_deepseek"

THINK_START = "<think>"
THINK_END = "</think>"
# Tokens that open a tool block and so also end reasoning (canonical spelling;
# absent ones are skipped: the text-level parser still sees them).
BLOCK_OPENER_TOKENS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜DSML｜function_calls>",
    "<｜DSML｜tool_calls>",
)

try:
    from vllm.entrypoints.generate.base.protocol import (
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
        ExtractedToolCallInformation,
        FunctionCall,
        ToolCall,
    )
    from vllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
    from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
except ImportError:  # vLLM absent: the adapters are simply not defined
    HAVE_VLLM = False
else:
    HAVE_VLLM = True


def tools_requested(request: Any) -> bool:
    """Whether the request asks for tool calls (vLLM skips the tool parser otherwise)."""
    return bool(getattr(request, "tools", None)) and getattr(request, "tool_choice", None) != "none"


def _clean_content(raw: str, tools_enabled: bool) -> tuple[str | None, list]:
    stage = ContentStage(tools_enabled=tools_enabled)
    msg = collect(stage.feed(raw) + stage.finish())
    return msg.content, list(msg.tool_calls)


if HAVE_VLLM:
    from vllm.renderers.chat_utils import make_tool_call_id

    def _token_id(vocab: dict[str, int], token: str) -> int | None:
        return vocab.get(token)

    def _ends_with(token_ids: Sequence[int], token_id: int | None) -> bool:
        return token_id is not None and len(token_ids) > 0 and token_ids[-1] == token_id

    class MoetDeepSeekReasoningParser(ReasoningParser):
        """Stage 1 of the moet parser: reasoning, then raw text for the tool parser."""

        def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(tokenizer, *args, **kwargs)
            chat_kwargs = kwargs.get("chat_template_kwargs") or {}
            # DeepSeek templates read either key; the prompt (when given) wins.
            self._thinking = bool(chat_kwargs.get("thinking") or chat_kwargs.get("enable_thinking"))
            vocab = self.vocab
            self._start_id = _token_id(vocab, THINK_START)
            self._end_id = _token_id(vocab, THINK_END)
            self._opener_ids = frozenset(
                i for i in (_token_id(vocab, t) for t in BLOCK_OPENER_TOKENS) if i is not None
            )
            self._eos_id = getattr(tokenizer, "eos_token_id", None)
            self._stage: ReasoningStage | None = None

        # -- thinking mode from the prompt --------------------------------

        def _thinking_from_prompt(self, prompt_token_ids: Sequence[int]) -> None:
            for tok in reversed(prompt_token_ids):
                if tok == self._start_id:
                    self._thinking = True
                    return
                if tok == self._end_id:
                    self._thinking = False
                    return

        def set_prompt_token_ids(self, prompt_token_ids: Sequence[int]) -> None:
            if self._stage is None:
                self._thinking_from_prompt(prompt_token_ids)

        def adjust_initial_state_from_prompt(self, prompt_token_ids: Sequence[int]) -> None:
            if self._stage is None:
                self._thinking_from_prompt(prompt_token_ids)

        @property
        def reasoning_start_str(self) -> str | None:
            return THINK_START

        @property
        def reasoning_end_str(self) -> str | None:
            return THINK_END

        def adjust_request(self, request: Any) -> Any:
            # `</think>` and the tool markers must reach the parser as text.
            request.skip_special_tokens = False
            return request

        # -- token-level checks (also used by structured outputs) -----------

        def _last_boundary(self, input_ids: Sequence[int]) -> tuple[int, int | None]:
            for pos in range(len(input_ids) - 1, -1, -1):
                tok = input_ids[pos]
                if tok == self._end_id or tok == self._start_id or tok in self._opener_ids:
                    return pos, tok
            return -1, None

        def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
            _, tok = self._last_boundary(input_ids)
            if tok is None:
                return not self._thinking
            return tok != self._start_id

        def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Any) -> bool:
            if self._stage is not None:  # this instance parses the stream: trust its state
                return self._stage.ended
            return self.is_reasoning_end(input_ids)

        def extract_content_ids(self, input_ids: list[int]) -> list[int]:
            pos, tok = self._last_boundary(input_ids)
            if tok is None:
                return [] if self._thinking else list(input_ids)
            if tok == self._start_id:
                return []
            return list(input_ids[pos + 1 :]) if tok == self._end_id else list(input_ids[pos:])

        def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
            start = 0
            if not self._thinking:
                if not token_ids or token_ids[0] != self._start_id:
                    return 0
                start = 1
            for pos in range(start, len(token_ids)):
                if token_ids[pos] == self._end_id or token_ids[pos] in self._opener_ids:
                    return pos - start
            return len(token_ids) - start

        # -- text ---------------------------------------------------------

        def extract_reasoning(
            self, model_output: str, request: Any
        ) -> tuple[str | None, str | None]:
            stage = ReasoningStage(self._thinking)
            r1, raw1 = stage.feed(model_output)
            r2, raw2 = stage.finish()
            raw = raw1 + raw2
            if not tools_requested(request):
                # vLLM returns this content as is when no tools are asked for,
                # so the markup is removed here (tool blocks yield nothing).
                content, _ = _clean_content(raw, tools_enabled=False)
                return (r1 + r2) or None, content
            return (r1 + r2) or None, raw or None

        def extract_reasoning_streaming(
            self,
            previous_text: str,
            current_text: str,
            delta_text: str,
            previous_token_ids: Sequence[int],
            current_token_ids: Sequence[int],
            delta_token_ids: Sequence[int],
        ) -> DeltaMessage | None:
            if self._stage is None:
                self._stage = ReasoningStage(self._thinking)
            reasoning, raw = self._stage.feed(delta_text)
            if _ends_with(delta_token_ids, self._eos_id) and not self._stage.ended:
                r2, raw2 = self._stage.finish()
                reasoning, raw = reasoning + r2, raw + raw2
            if not reasoning and not raw:
                return None
            return DeltaMessage(reasoning=reasoning or None, content=raw or None)

    class MoetDeepSeekToolParser(ToolParser):
        """Stage 2 of the moet parser: content and V3.1 / DSML tool calls."""

        # The calls are DeepSeek markup, never the JSON that vLLM's
        # required/named tool_choice path expects: parse them as for "auto".
        supports_required_and_named = False

        def __init__(self, tokenizer: Any, tools: list | None = None) -> None:
            super().__init__(tokenizer, tools)
            self._stage = ContentStage(tools_enabled=True)
            self._eos_id = getattr(tokenizer, "eos_token_id", None)
            self._done = False
            self._ids: dict[int, str] = {}

        def adjust_request(self, request: Any) -> Any:
            request = super().adjust_request(request)
            # The V3.1 markers, BOS/EOS and (V3.2+) DSML tool tokens would be
            # stripped by the detokenizer; the parser must see them.
            request.skip_special_tokens = False
            return request

        def extract_tool_calls(
            self, model_output: str, request: Any
        ) -> ExtractedToolCallInformation:
            content, calls = _clean_content(model_output, tools_enabled=True)
            tool_calls = [
                ToolCall(type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls
            ]
            # tools_called is also set when only markup was removed, so that
            # vLLM returns our cleaned content instead of the raw text.
            return ExtractedToolCallInformation(
                tools_called=bool(tool_calls) or content != model_output,
                tool_calls=tool_calls,
                content=content,
            )

        def extract_tool_calls_streaming(
            self,
            previous_text: str,
            current_text: str,
            delta_text: str,
            previous_token_ids: Sequence[int],
            current_token_ids: Sequence[int],
            delta_token_ids: Sequence[int],
            request: Any,
        ) -> DeltaMessage | None:
            if self._done:
                return None
            events = self._stage.feed(delta_text)
            if _ends_with(delta_token_ids, self._eos_id):
                # vLLM never tells a tool parser that the stream ended; EOS
                # does. Release held text, abort an open call, stop parsing.
                events += self._stage.finish()
                self._done = True
            return self._delta(events)

        def _delta(self, events: list[Event]) -> DeltaMessage | None:
            content = "".join(e.text for e in events if isinstance(e, ContentDelta))
            calls: list[DeltaToolCall] = []
            for ev in events:
                if not isinstance(ev, ToolCallDelta):
                    continue  # ToolCallAborted: the client already has the pieces
                self._record(ev)
                if calls and calls[-1].index == ev.index and ev.name is None:
                    fn = calls[-1].function
                    assert fn is not None
                    fn.arguments = (fn.arguments or "") + ev.arguments_delta
                    continue
                calls.append(
                    DeltaToolCall(
                        index=ev.index,
                        id=self._ids[ev.index] if ev.name is not None else None,
                        type="function" if ev.name is not None else None,
                        function=DeltaFunctionCall(name=ev.name, arguments=ev.arguments_delta),
                    )
                )
            if not content and not calls:
                return None
            return DeltaMessage(content=content or None, tool_calls=calls)

        def _record(self, ev: ToolCallDelta) -> None:
            # Keep the base class's bookkeeping consistent, so that vLLM's
            # end-of-stream "unstreamed arguments" top-up finds nothing left.
            if ev.name is not None:
                self._ids[ev.index] = make_tool_call_id()
                self.current_tool_id = ev.index
                self.current_tool_name_sent = True
                self.prev_tool_call_arr.append({"name": ev.name, "arguments": ""})
                self.streamed_args_for_tool.append("")
            self.streamed_args_for_tool[ev.index] += ev.arguments_delta
            self.prev_tool_call_arr[ev.index]["arguments"] = self.streamed_args_for_tool[ev.index]


def register() -> bool:
    """Register both adapters as PARSER_NAME; False (and nothing done) without vLLM."""
    if not HAVE_VLLM:
        return False
    ReasoningParserManager.register_module(PARSER_NAME, module=MoetDeepSeekReasoningParser)
    ToolParserManager.register_module(PARSER_NAME, module=MoetDeepSeekToolParser)
    return True


# `--reasoning-parser-plugin` / `--tool-parser-plugin` import this module.
register()
