"""The tool-call formats of the model families the server loads, by vLLM's ``--tool-call-parser`` names.

A format says how the family writes calls in its own output (a FreeSyntax, read for ``tool_choice: "auto"``),
how a grammar makes it write them (a CallSyntax, for forced calls and for auto calls that must follow their
schema), how its chat templates show they know it, and how its call ids look. ``TOOL_PARSERS`` is the registry;
``parser_for_template`` picks one from a chat template."""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_server.tools.readers import CallSyntax, FreeCallReader, FreeSyntax, GrammarCallReader, ToolCallReader


def openai_call_id() -> str:
    """``call_`` and 24 hex digits, like OpenAI's."""
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Nine letters or digits: Mistral's chat templates refuse any other id in the history."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True, slots=True)
class ToolParser:
    """One family's tool-call format. ``free``: where its own output holds calls; ``grammar``: what the call
    grammar makes it write; ``template_marks``: text whose presence in a chat template that reads ``tools`` shows
    the family; ``special_markers``: its markers are special tokens, so its output is detokenized with them."""

    name: str
    free: FreeSyntax
    grammar: CallSyntax
    template_marks: tuple[str, ...]
    special_markers: bool = False
    new_id: Callable[[], str] = field(default=openai_call_id)

    def reader(self, mode: str) -> ToolCallReader:
        """A reader of one choice's output: ``mode`` "forced" (the call grammar wrote all of it), "triggered"
        (free text and calls the grammar wrote) or "free" (the model's own output)."""
        if mode == "free":
            return FreeCallReader(self.free, self.new_id)
        return GrammarCallReader(self.grammar, self.new_id, triggered=mode == "triggered")


# Hermes (NousResearch), Qwen2.5 / Qwen3, SmolLM2: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one
# block per call (SmolLM2's card writes one block holding a list); also the default rendering's format
HERMES = ToolParser(
    "hermes",
    free=FreeSyntax(markers=("<tool_call>",), closer="</tool_call>"),
    grammar=CallSyntax(
        prefix='<tool_call>\n{"name": "',
        infix='", "arguments": ',
        suffix="}\n</tool_call>",
        separator="\n",
        trigger="<tool_call>",
    ),
    template_marks=("<tool_call>",),
)

# Llama 3.1 / 3.2 / 3.3 JSON tool calling: the answer is {"name": ..., "parameters": {...}} (after
# <|python_tag|> at times: a special token, dropped from the text unless skip_special_tokens is false), several
# separated by ";"
LLAMA3_JSON = ToolParser(
    "llama3_json",
    free=FreeSyntax(markers=("<|python_tag|>",), separator=";", at_start=True, bare=True),
    grammar=CallSyntax(prefix='{"name": "', infix='", "parameters": ', suffix="}", separator="; ", trigger='{"name": '),
    template_marks=("<|python_tag|>", '"parameters": dictionary'),
)

# Mistral (v0.3 tokenizer and later): [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}}; the
# grammar writes the list alone (the marker is a special token the grammar cannot emit)
MISTRAL = ToolParser(
    "mistral",
    free=FreeSyntax(markers=("[TOOL_CALLS]",)),
    grammar=CallSyntax(prefix='{"name": "', infix='", "arguments": ', suffix="}", separator=", ", open="[", close="]"),
    template_marks=("[TOOL_CALLS]",),
    special_markers=True,
    new_id=mistral_call_id,
)

TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HERMES, LLAMA3_JSON, MISTRAL)}
DEFAULT_PARSER = HERMES  # forced calls on a model whose format is unknown; the default rendering's format


def parser_for_template(chat_template: str, renders_tools: bool) -> ToolParser | None:
    """The format a chat template shows: the default rendering's (hermes) for a template that does not read
    ``tools``, else the first format whose marks it holds; None when it shows none."""
    if not renders_tools:
        return DEFAULT_PARSER
    return next((p for p in TOOL_PARSERS.values() if any(m in chat_template for m in p.template_marks)), None)
