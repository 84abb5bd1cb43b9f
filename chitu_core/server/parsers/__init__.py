"""Parsers that split a chat model's output text into OpenAI's fields, per model family.

A reasoning parser (reasoning.py) splits ``<think>...</think>`` off into ``reasoning_content``;
a tool-call parser (tools.py) turns a family's tool-call syntax into ``tool_calls``. Both are fed
the output as it streams (``feed(delta)``), then ``finish()``; what they return over all the
deltas does not depend on where the text was split. Each is chosen by name
(``--reasoning-parser``, ``--tool-call-parser``) from the registries below.
"""

from chitu_core.server.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from chitu_core.server.parsers.tools import TOOL_CALL_PARSERS, ToolCall, ToolCallDelta, ToolCallParser

__all__ = ["REASONING_PARSERS", "ReasoningParser", "TOOL_CALL_PARSERS", "ToolCall", "ToolCallDelta", "ToolCallParser"]
