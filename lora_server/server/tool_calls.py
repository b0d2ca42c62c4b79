"""A chat choice's tool calls in OpenAI's shapes: the stream's deltas (a call's ``index``, ``id``, ``type`` and
function name first, then its ``arguments`` in pieces) and the whole answer's ``message`` (``tool_calls``, with
``content`` null when the model said nothing else). A stream and a whole answer come from the same reader fed the
same text, so the stream's deltas join into the answer's calls."""

from __future__ import annotations

from typing import Any

from lora_server.tools.readers import Arguments, CallStart, Event, Text, ToolCallReader


class ChoiceToolCalls:
    """One choice's output read for tool calls (lora_server.tools.readers), and what has been told of it."""

    def __init__(self, reader: ToolCallReader) -> None:
        self._reader = reader
        self.content = ""
        self.calls: list[dict[str, Any]] = []  # OpenAI's tool_calls entries, each call's arguments as told so far

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The stream deltas that the output's next ``text`` allows (with everything held back once
        ``finished``)."""
        events = self._reader.feed(text) if text else []
        if finished:
            events += self._reader.finish()
        return [self._told(e) for e in events]

    def _told(self, event: Event) -> dict[str, Any]:
        if isinstance(event, Text):
            self.content += event.text
            return {"content": event.text}
        if isinstance(event, CallStart):
            function = {"name": event.name, "arguments": ""}
            self.calls.append({"id": event.id, "type": "function", "function": dict(function)})
            return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": function}]}
        assert isinstance(event, Arguments)
        self.calls[event.index]["function"]["arguments"] += event.text
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def message(self) -> dict[str, Any]:
        """The answer's message, once every delta has been told."""
        if not self.calls:
            return {"role": "assistant", "content": self.content}
        content = self.content if self.content.strip() else None
        return {"role": "assistant", "content": content, "tool_calls": self.calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for an answer that made calls and ended by itself; other endings keep their reason: one cut
        by max_tokens stays ``length``, which tells the client that its last call may be incomplete."""
        return "tool_calls" if self.calls and reason == "stop" else reason
