"""What a chat request asks of tools, checked and typed: its functions (OpenAI's ``tools``), how they may be called
(``tool_choice``, ``parallel_tool_calls``), and its messages' tool-call history in the shape chat templates read
(transformers' ``apply_chat_template``: an assistant's ``tool_calls`` with their arguments as objects, a tool
message's ``tool_call_id``). Every check raises InvalidRequestError naming the request field, and changes nothing.

Nothing here walks a function's ``parameters``: a schema may nest deeper than Python can recurse. The server bounds
and validates them against its limits (lora_server.server.chat_prompt.check_tool_schemas) before the chat template,
the tool prompt or the grammar engine read them."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from lora_server.errors import InvalidRequestError

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit
# the deepest a past call's arguments may nest: the tool prompt and the chat template write them back as JSON, which
# recurses (Python's JSON parser takes nearly 1000 levels, its writer fewer)
MAX_ARGUMENTS_DEPTH = 256
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a function without parameters takes {}

ToolChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function the model may call. ``parameters``: the JSON schema of its arguments, an object (NO_PARAMETERS
    when the tool gives none); ``strict``: the client asked that its arguments always follow that schema;
    ``definition``: the tool exactly as the client sent it (what the chat template shows the model)."""

    name: str
    parameters: dict[str, Any]
    strict: bool
    definition: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools and how they may be called. ``mode``: "none" (the model sees the tools and calls
    none), "auto" (it may call them), "required" (it calls at least one), "function" (it calls ``function``);
    ``parallel``: it may make more than one call in an answer."""

    tools: tuple[FunctionTool, ...]
    mode: ToolChoiceMode
    function: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The answer must be tool calls."""
        return self.mode in ("required", "function")

    @property
    def callable(self) -> tuple[FunctionTool, ...]:
        """The functions the answer may call: the named one, or all of them."""
        if self.mode == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools if self.mode != "none" else ()

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as the client sent them, for the chat template."""
        return [t.definition for t in self.tools]


def parse_tool_request(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolRequest | None:
    """The request's tools and tool choice (None when it gives no tools). ``tool_choice`` defaults to "auto" when
    tools are given; "none" without tools asks for nothing and is accepted, any other choice needs tools."""
    if tools is None:
        if tool_choice is not None and tool_choice != "none":
            raise InvalidRequestError("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise InvalidRequestError(f"tools must be a list of 1 to {MAX_TOOLS} tools", param="tools")
    functions = tuple(_function_tool(i, tool) for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidRequestError(f"tools: two functions are named {duplicate!r}", param="tools")
    mode, function = _tool_choice(tool_choice, names)
    return ToolRequest(functions, mode, function, True if parallel_tool_calls is None else parallel_tool_calls)


def _function_tool(index: int, tool: Any) -> FunctionTool:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function must be an object", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes", param="tools"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string", param="tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.function.strict must be a boolean", param="tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequestError(
            f"{where}.function.parameters must be a JSON schema of an object (the arguments)", param="tools"
        )
    return FunctionTool(name, parameters, bool(strict), tool)


def _tool_choice(choice: Any, names: list[str]) -> tuple[ToolChoiceMode, str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {str(name)[:64]!r}, which is not among the tools", param="tool_choice"
            )
        return "function", name
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


# ---- the tool-call history of a conversation -------------------------------------------------------------------


def history_tool_calls(tool_calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call as sent, its
    ``function.arguments`` (OpenAI's JSON text) parsed into the value it stands for."""
    if not isinstance(tool_calls, list):
        raise InvalidRequestError("an assistant message's tool_calls must be a list", param="messages")
    calls = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise InvalidRequestError(
                'each of tool_calls must be {"id", "type": "function", "function": {"name", "arguments"}} with '
                "arguments as JSON text",
                param="messages",
            )
        try:
            arguments = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            raise InvalidRequestError(
                f"the arguments of tool call {call['id'][:40]!r} are not valid JSON", param="messages"
            ) from None
        if json_nesting(arguments) > MAX_ARGUMENTS_DEPTH:
            raise InvalidRequestError(
                f"the arguments of tool call {call['id'][:40]!r} nest deeper than {MAX_ARGUMENTS_DEPTH} levels",
                param="messages",
            )
        call = copy.deepcopy(call)
        call["function"]["arguments"] = arguments
        calls.append(call)
    return calls


def json_nesting(value: Any) -> int:
    """How many objects and arrays deep a JSON value goes (iterative: any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest
