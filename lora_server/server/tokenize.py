"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: text or a conversation to the server's token ids, and back,
with vLLM's request and response shapes. An adapter has its base model's tokenizer; ``model`` is resolved anyway
(an unknown name is a 404, one a tenant may not use a 403), as on the completion endpoints. Blocking: the app runs
these in a worker thread."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt

from lora_server.engine import Engine
from lora_server.errors import InvalidRequestError
from lora_server.server.chat_prompt import chat_prompt
from lora_server.server.protocol import ChatCompletionRequest, ChatMessage
from lora_server.tools.spec import parse_tool_request

# vLLM's TokenizeChatRequest fields this server does not implement: refused when given
_UNSUPPORTED = {
    "chat_template": "a chat template per request (--chat-template sets it at start-up)",
    "mm_processor_kwargs": "multimodal inputs",
}


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``): exactly one of them.
    ``add_special_tokens`` defaults to true for a prompt (BOS where the model adds one) and false for messages (the
    chat template places its own)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


def tokenize(engine: Engine, req: TokenizeRequest) -> dict[str, Any]:
    """vLLM's TokenizeResponse: ``tokens``, ``count``, ``max_model_len`` and ``token_strs`` (the vocabulary's
    spelling of each token when asked, else null). The ids are exactly those a completion or chat request with the
    same prompt or messages is served with."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer", param="model")
    for field, what in _UNSUPPORTED.items():
        if getattr(req, field) is not None:
            raise InvalidRequestError(f"{field} ({what}) is not supported", param=field)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give either prompt or messages", param="prompt" if req.prompt else "messages")
    if req.messages is not None:  # as a chat request with these messages, tools and template options
        chat = ChatCompletionRequest(
            messages=req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        tools = parse_tool_request(req.tools, None, None)
        ids = chat_prompt(engine, chat, None if tools is None else tools.definitions())
    else:
        assert req.prompt is not None
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }


def detokenize(engine: Engine, req: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's DetokenizeResponse: ``prompt``, the text of the ids (special tokens written out)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer", param="model")
    bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (0..{tokenizer.vocab_size - 1})", param="tokens"
        )
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
