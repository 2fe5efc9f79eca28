"""Leak-free parsers of DeepSeek output: reasoning, content and tool calls.

Pure Python, no vLLM. `parse()` and `StreamParser` share one code path; see
docs/PARSERS.md for the formats and the policy on malformed output.
"""

from .reasoning import ReasoningStage
from .records import (
    ContentDelta,
    Event,
    Message,
    ReasoningDelta,
    ToolCall,
    ToolCallAborted,
    ToolCallDelta,
    collect,
)
from .stream import StreamParser, parse
from .tools import ContentStage

__all__ = [
    "ContentDelta",
    "ContentStage",
    "Event",
    "Message",
    "ReasoningDelta",
    "ReasoningStage",
    "StreamParser",
    "ToolCall",
    "ToolCallAborted",
    "ToolCallDelta",
    "collect",
    "parse",
]
