"""The prompt of a chat request: its messages, tools and template options checked against what the model's chat
template reads and writes, then rendered and tokenized (blocking: the server calls it in a worker thread).

A field that reaches the template only means something if the template uses it: a message's ``name`` or other extra
field the template does not write, ``documents``, ``reasoning_effort`` or a ``chat_template_kwargs`` variable it does
not read, is a 400 naming it rather than a prompt that silently lacks it.

Each tool's ``parameters`` is checked against the server's JSON schema limits first (``check_tool_schemas``): the
template, the tool prompt and the grammar engine all recurse through it."""

from __future__ import annotations

from typing import Any

from lora_server.engine import Engine
from lora_server.engine.json_schema_check import check_json_schema
from lora_server.engine.tokenizer import RENDER_VARIABLES
from lora_server.errors import InvalidRequestError
from lora_server.server.protocol import ChatCompletionRequest


def chat_prompt(engine: Engine, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> list[int]:
    """The request's prompt token ids (``tools``: the function tools as sent, None without tools), truncated to
    its last ``truncate_prompt_tokens`` where asked."""
    check_tool_schemas(engine, tools)
    messages = req.template_messages()
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
        )
    for i, message in enumerate(req.messages):
        for field in message.template_fields:
            if not engine.template_shows(message.role, field):
                raise InvalidRequestError(
                    f"messages[{i}].{field}: this model's chat template does not write a {message.role} message's "
                    f"{field}; leave it out",
                    param="messages",
                )
    variables = template_variables(engine, req)
    prompt = engine.chat_prompt(
        messages,
        tools,
        add_generation_prompt=req.add_generation_prompt,
        add_special_tokens=bool(req.add_special_tokens),
        documents=req.documents,
        continue_final_message=req.continue_final_message,
        variables=variables,
    )
    return truncated(prompt, req.truncate_prompt_tokens, engine.max_model_len)


def check_tool_schemas(engine: Engine, tools: list[dict[str, Any]] | None) -> None:
    """InvalidRequestError (param ``tools``, the message naming the tool) when a tool's parameters are deeper or
    larger than the server's JSON schema limits or not a valid JSON schema, whether or not the tool may be called.
    ``tools``: the function tools as sent (lora_server.tools.spec checked their shape)."""
    cfg = engine.config
    for i, tool in enumerate(tools or []):
        parameters = tool["function"].get("parameters")
        if parameters is not None:
            where = f"tools[{i}].function.parameters"
            check_json_schema(parameters, "tools", cfg.max_json_schema_bytes, cfg.max_json_schema_depth, where)


def template_variables(engine: Engine, req: ChatCompletionRequest) -> dict[str, Any]:
    """The template variables the request sets beyond the messages and tools: ``chat_template_kwargs`` and
    ``reasoning_effort``; each must be one the template reads, as must ``documents`` when given."""
    variables = dict(req.chat_template_kwargs or {})
    server_set = sorted(RENDER_VARIABLES & variables.keys())
    if server_set:
        raise InvalidRequestError(
            f"chat_template_kwargs.{server_set[0]} is set by the server (send it as a request field)",
            param="chat_template_kwargs",
        )
    if req.reasoning_effort is not None:
        variables["reasoning_effort"] = req.reasoning_effort
    reads = engine.template_reads() if variables or req.documents is not None else frozenset()
    for name in variables:
        if name not in reads:
            field = "reasoning_effort" if name == "reasoning_effort" else f"chat_template_kwargs.{name}"
            raise InvalidRequestError(
                f"{field}: this model's chat template does not read {name!r}", param=field.split(".")[0]
            )
    if req.documents is not None and "documents" not in reads:
        raise InvalidRequestError("documents: this model's chat template does not read documents", param="documents")
    return variables


def truncated(prompt: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens (-1: the context length; None: all)."""
    if keep is None:
        return prompt
    keep = max_model_len if keep == -1 else keep
    if keep == 0:
        raise InvalidRequestError("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    return prompt[-keep:]
