"""The grammars that make a model write tool calls, as xgrammar structural tags (plain JSON: this module does not
import xgrammar; engine/structured.py compiles them, each call's arguments as compact JSON under the function's
parameter schema).

- ``forced_calls``: the whole output is calls in the format's CallSyntax, at least one, exactly one unless
  parallel calls are allowed (``tool_choice`` "required" or a named function).
- ``triggered_calls``: free text, and wherever the format's trigger appears a call follows; after one call the
  output ends unless parallel calls are allowed (``tool_choice`` "auto" with a strict function, or
  ``parallel_tool_calls`` false)."""

from __future__ import annotations

import json
from typing import Any

from lora_server.errors import InvalidRequestError
from lora_server.sampling_params import StructuredOutput
from lora_server.tools.readers import CallSyntax
from lora_server.tools.spec import FunctionTool


def forced_calls(syntax: CallSyntax, tools: tuple[FunctionTool, ...], parallel: bool) -> StructuredOutput:
    calls: dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": _call_tags(syntax, tools),
        "separator": syntax.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if syntax.open or syntax.close:
        calls = {"type": "tag", "begin": syntax.open, "content": calls, "end": syntax.close}
    return _constraint(calls)


def triggered_calls(syntax: CallSyntax, tools: tuple[FunctionTool, ...], parallel: bool) -> StructuredOutput:
    if syntax.trigger is None or syntax.open:
        raise ValueError("this call syntax cannot follow free text")
    return _constraint(
        {
            "type": "triggered_tags",
            "triggers": [syntax.trigger],
            "tags": _call_tags(syntax, tools),
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    )


def _call_tags(syntax: CallSyntax, tools: tuple[FunctionTool, ...]) -> list[dict[str, Any]]:
    return [
        {
            "type": "tag",
            "begin": f"{syntax.prefix}{tool.name}{syntax.infix}",
            "content": {"type": "json_schema", "json_schema": tool.parameters},
            "end": syntax.suffix,
        }
        for tool in tools
    ]


def _constraint(format_: dict[str, Any]) -> StructuredOutput:
    """The structural tag as a constraint. The server bounds each tool's parameters after planning the calls
    (lora_server.server.chat_prompt): a schema nested near Python's recursion limit reaches this unbounded, and is
    refused here."""
    tag = {"type": "structural_tag", "format": format_}
    try:
        return StructuredOutput("structural_tag", json.dumps(tag, ensure_ascii=False), "tools")
    except RecursionError:
        raise InvalidRequestError(
            "tools: a function's parameters nest too deeply for the server (see --max-json-schema-depth)",
            param="tools",
            code="grammar_too_large",
        ) from None
