"""Tools and tool-call history for a chat template that cannot show them.

A template that reads the ``tools`` variable gets the tool list and the messages as they are (transformers'
``apply_chat_template(messages, tools=...)``). One that does not (SmolLM2's, Llama 2's...) would drop the tools,
and most such templates fail on an assistant message without content or a ``tool`` role. For those the
conversation is rewritten into plain system / user / assistant messages in the Hermes format, which the ``hermes``
parser reads back:

- the tool list goes at the end of the system message (one is added first when the conversation has none):
  ``TOOLS_HEADER``, each tool's JSON on its own line between ``<tools>`` and ``</tools>``, then ``TOOLS_FOOTER``;
- an assistant message's ``tool_calls`` follow its text, each as ``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>`` on its own line;
- tool results become a user message, one ``<tool_response>\\n...\\n</tool_response>`` block per result
  (consecutive results share the message)."""

from __future__ import annotations

import json

from lora_server.json_types import JsonValue, TemplateMessage, ToolDefinition

TOOLS_HEADER = (
    "You can call functions to help answer. Their definitions, as JSON schemas, are listed between <tools> and "
    "</tools>:\n<tools>"
)
TOOLS_FOOTER = (
    "</tools>\n\nTo call a function, answer with a <tool_call></tool_call> block holding a JSON object with its "
    'name and arguments, one block per call:\n<tool_call>\n{"name": "<function name>", "arguments": '
    "{<arguments as JSON>}}\n</tool_call>"
)


def tool_call_text(name: str, arguments: JsonValue) -> str:
    """One call in the Hermes format (what the default rendering writes and the hermes parser reads)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def tools_system_text(tools: list[ToolDefinition]) -> str:
    listed = "".join(f"\n{json.dumps(tool, ensure_ascii=False)}" for tool in tools)
    return f"{TOOLS_HEADER}{listed}\n{TOOLS_FOOTER}"


def render_tools_in_messages(
    messages: list[TemplateMessage], tools: list[ToolDefinition] | None
) -> list[TemplateMessage]:
    """The conversation with its tools and tool-call history written into plain messages (see the module's
    docstring); messages without tool fields are kept as they are."""
    out: list[TemplateMessage] = []
    after_tool = False  # the last message written holds tool results
    for message in messages:
        role = message["role"]
        if role == "tool":
            block = f"<tool_response>\n{_text(message)}\n</tool_response>"
            if after_tool:
                out[-1]["content"] = f"{_text(out[-1])}\n{block}"
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        history = message.get("tool_calls")
        if role == "assistant" and isinstance(history, list) and history:
            calls = [tool_call_text(*_name_and_arguments(c)) for c in history]
            text = _text(message)
            out.append({"role": "assistant", "content": "\n".join([text, *calls] if text else calls)})
        else:
            out.append(dict(message))
    if tools:
        block = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            system = _text(out[0])
            out[0] = {**out[0], "content": f"{system}\n\n{block}" if system else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _text(message: TemplateMessage) -> str:
    """A template message's text ("" without one: the server writes content as a string, or leaves it out)."""
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _name_and_arguments(call: JsonValue) -> tuple[str, JsonValue]:
    """A history tool call's function name and arguments (the shape of lora_server.tools.spec.history_tool_calls);
    ValueError for another shape."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(function, dict) or not isinstance(name, str):
        raise ValueError("a tool call in the history has no function name")
    return name, function.get("arguments")
