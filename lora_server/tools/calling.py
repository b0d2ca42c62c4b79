"""How one chat request's tool calls are made and read: ``plan_tool_calls`` joins what the request asks
(lora_server.tools.spec) with the server's tool-call format into a ToolCalling: the grammar its output must follow,
if any, and how each choice's output is read.

- "none": nothing is parsed or forced (the model still sees the tools).
- "required", or a named function: the output is calls only, written under the format's call grammar (the
  server's parser's, else hermes's), read by the grammar's reader; a named function is called once (as OpenAI and
  vLLM answer it: clients such as instructor read exactly one call), "required" makes one call or, with
  ``parallel_tool_calls`` (the default), several.
- "auto": the model's own output (text, calls or both), read by the parser's free reader; without a parser, 400.
- "auto" with a strict function or ``parallel_tool_calls`` false: free text, and once the format's trigger
  appears, a call written under the call grammar (one at most unless parallel), read by the grammar's reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lora_server.errors import InvalidRequestError
from lora_server.sampling_params import StructuredOutput
from lora_server.tools.grammar import forced_calls, triggered_calls
from lora_server.tools.parsers import DEFAULT_PARSER, ToolParser
from lora_server.tools.readers import ToolCallReader
from lora_server.tools.spec import ToolRequest

ReadMode = Literal["forced", "triggered", "free"]


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """A request's tool calling: its format, how its output is read, the grammar that output follows (None: the
    model's own output, read leniently)."""

    parser: ToolParser
    mode: ReadMode
    constraint: StructuredOutput | None

    def reader(self) -> ToolCallReader:
        """A fresh reader for one choice."""
        return self.parser.reader(self.mode)

    @property
    def special_tokens_in_text(self) -> bool:
        """The model's own markers are special tokens: its output must be detokenized with them to be read."""
        return self.mode != "forced" and self.parser.special_markers


def plan_tool_calls(request: ToolRequest, parser: ToolParser | None) -> ToolCalling | None:
    """The tool calling of a request under the server's ``parser`` (None: the model's format is unknown); None for
    tool_choice "none". InvalidRequestError for "auto" without a parser, or asking for guarantees (a strict
    function, parallel_tool_calls false) that the parser's format cannot give in free text."""
    if request.mode == "none":
        return None
    if request.forced:
        chosen = parser or DEFAULT_PARSER
        parallel = request.parallel and request.mode == "required"
        return ToolCalling(chosen, "forced", forced_calls(chosen.grammar, request.callable, parallel))
    if parser is None:
        raise InvalidRequestError(
            'tool_choice "auto" needs the model\'s tool-call format, which this server does not know: start it with '
            '--tool-call-parser NAME, or ask for tool_choice "required" or a named function',
            param="tool_choice",
        )
    strict = any(t.strict for t in request.tools)
    if not strict and request.parallel:
        return ToolCalling(parser, "free", None)
    if parser.grammar.trigger is None:
        param = "tools" if strict else "parallel_tool_calls"
        raise InvalidRequestError(
            f"with tool_choice auto, the {parser.name} format cannot guarantee "
            f"{'strict arguments' if strict else 'a single call'}: ask for tool_choice required or a named function",
            param=param,
        )
    return ToolCalling(parser, "triggered", triggered_calls(parser.grammar, request.callable, request.parallel))
