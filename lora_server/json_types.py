"""JSON values as they cross between the server and the engine, typed as JSON rather than Any: a chat conversation
as a chat template reads it (OpenAI's message shape: the server builds it from validated request models, the engine
hands it to the template as it is, or writes tools into plain messages first), a JSON schema, a report's JSON."""

from __future__ import annotations

from typing import TypeAlias

JsonValue: TypeAlias = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject: TypeAlias = dict[str, JsonValue]

# one message: "role", "content" (a string, a list of content parts or None) and the other fields a template may
# write (an assistant's "tool_calls" with their arguments as objects, a tool message's "tool_call_id", "name"...)
TemplateMessage: TypeAlias = JsonObject
# one function tool as sent: {"type": "function", "function": {"name", "description", "parameters" (a JSON schema)}}
ToolDefinition: TypeAlias = JsonObject
