"""OpenAI-compatible request bodies (pydantic, used only at the HTTP edge) and their mapping to SamplingParams.
Every field is one of lora_server.server.request_fields' table: honoured, refused unless it asks for nothing, or of
no effect here; any other field is refused (a 400 naming it), as OpenAI refuses it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from lora_server.errors import InvalidRequestError
from lora_server.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutput
from lora_server.server.request_fields import CHAT, COMPLETIONS, refuse_fields
from lora_server.tools.spec import ToolRequest, history_tool_calls, parse_tool_request

BodyModel = TypeVar("BodyModel", bound=BaseModel)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no effect: no obfuscation padding is sent
    continuous_usage_stats: bool | None = None  # vLLM's: refused when true (request_fields)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted: the output always follows the schema exactly


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of its constraints."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ENDPOINT: ClassVar[str]

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    echo: bool = False
    # no effect here (request_fields says why)
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's extra sampling fields
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) -> bias in [-100, 100]
    ignore_eos: bool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: StrictInt = 0  # vLLM's: lower values are admitted first among the tenant's waiting requests
    prompt_logprobs: StrictInt | None = None  # vLLM's: each prompt token's logprob and the top-k (not streamed)
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None  # tokenized by the server (OpenAIServing: vLLM's rule)
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)  # keep the prompt's last k (-1: context)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    add_special_tokens: bool | None = None  # None: the endpoint's default (chat false, completions true)
    # structured output: OpenAI's response_format, or one of vLLM's guided fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint on the output the request asks for, if any (InvalidRequestError for two, or for a
        json_schema response_format without a schema)."""
        given: list[StructuredOutput] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(StructuredOutput("json_object", None, "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema", param="response_format"
                )
            given.append(StructuredOutput.json_schema(fmt.json_schema.schema_, "response_format"))
        if self.guided_json is not None:
            given.append(StructuredOutput.json_schema(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            given.append(StructuredOutput("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            given.append(StructuredOutput("choice", tuple(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            given.append(StructuredOutput("grammar", self.guided_grammar, "guided_grammar"))
        given.extend(_structured_outputs(self.structured_outputs))
        if len(given) > 1:
            raise InvalidRequestError(
                f"only one output constraint may be given, not {' and '.join(c.param for c in given)}",
                param=given[1].param,
            )
        return given[0] if given else None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, default_max: int, prompt_logprobs: int | None
    ) -> SamplingParams:
        """default_max: what max_tokens becomes when the request gives none (the room left in the context);
        prompt_logprobs: the top-k the engine computes for each prompt token (None: none)."""
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs cannot be streamed (as in vLLM)", param="prompt_logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values: dict[str, Any] = dict(
            max_tokens=max(1, default_max) if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=_token_bias(self.logit_bias),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured=self.structured_output(),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
        )
        return SamplingParams(**values)


def _structured_outputs(given: StructuredOutputs | None) -> list[StructuredOutput]:
    """vLLM's structured_outputs as constraints (one expected; more are refused by the caller)."""
    if given is None:
        return []
    param = "structured_outputs"
    out = []
    if given.json_ is not None:
        out.append(StructuredOutput.json_schema(given.json_, param))
    if given.regex is not None:
        out.append(StructuredOutput("regex", given.regex, param))
    if given.choice is not None:
        out.append(StructuredOutput("choice", tuple(given.choice), param))
    if given.grammar is not None:
        out.append(StructuredOutput("grammar", given.grammar, param))
    if given.json_object:
        out.append(StructuredOutput("json_object", None, param))
    if not out:
        raise InvalidRequestError("structured_outputs names no constraint", param=param)
    return out


def _token_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            raise InvalidRequestError(f"logit_bias key {key[:20]!r} is not a token id", param="logit_bias")
        out[int(key)] = value
    return out


# Content part types a message may carry; any other (image_url, input_audio, file, video_url...) is refused.
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


class ChatMessage(BaseModel):
    """A message as OpenAI sends it. Fields beyond OpenAI's (vLLM's reasoning_content, a template's own) are kept
    for the chat template, which must write them (lora_server.server.chat_prompt checks)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls: [{"id", "type", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # a tool message's: the call it answers
    refusal: str | None = None  # an assistant's refusal: its text, when it has no content
    annotations: list[Any] | None = None  # no effect: an answer's citations, which no template writes
    audio: Any = None  # an assistant's earlier audio answer: refused
    function_call: Any = None  # the deprecated form of tool_calls: refused

    def text(self, index: int) -> str:
        """Its content's text: text and refusal parts joined; any other part type is a 400 naming it."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind not in TEXT_PARTS or not isinstance(part.get(TEXT_PARTS[kind]), str):
                raise InvalidRequestError(
                    f"messages[{index}].content[{j}]: {str(kind)[:40]} content parts are not supported (this "
                    "model reads text: text and refusal parts)",
                    param="messages",
                )
            texts.append(part[TEXT_PARTS[kind]])
        return "".join(texts)

    def template_message(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape): its text, ``name``, an assistant's
        ``tool_calls`` with their arguments parsed, a tool message's ``tool_call_id``, and its other fields as sent
        (null ones left out). Beside tool calls, a null content is left out, as transformers leaves out every None
        (templates test whether it is defined)."""
        where = f"messages[{index}]"
        if self.function_call is not None:
            raise InvalidRequestError(
                f"{where}.function_call is OpenAI's deprecated form of tool_calls; send tool_calls", param="messages"
            )
        if self.audio is not None:
            raise InvalidRequestError(f"{where}.audio: audio is not supported", param="messages")
        message: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.refusal is not None:
            if self.role != "assistant" or self.content is not None:
                raise InvalidRequestError(
                    f"{where}.refusal: only an assistant message without content carries a refusal", param="messages"
                )
            message["content"] = self.refusal
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequestError(f"{where}: only assistant messages carry tool_calls", param="messages")
            message["tool_calls"] = history_tool_calls(self.tool_calls)
            if self.content is None and self.refusal is None:
                del message["content"]
        if self.role == "tool":
            if self.tool_call_id is None:
                raise InvalidRequestError(
                    f"{where}: a tool message needs the tool_call_id it answers", param="messages"
                )
            message["tool_call_id"] = self.tool_call_id
        elif self.tool_call_id is not None:
            raise InvalidRequestError(f"{where}: only tool messages carry a tool_call_id", param="messages")
        for key, value in (self.model_extra or {}).items():
            if value is not None:
                message[key] = value
        return message

    @property
    def template_fields(self) -> list[str]:
        """The fields beyond role and content that the template must write for the message to mean what it says:
        its name (but a tool message's, whose call its tool_call_id names) and its extra fields."""
        fields = [] if self.name is None or self.role == "tool" else ["name"]
        return fields + [key for key, value in (self.model_extra or {}).items() if value is not None]


class ChatCompletionRequest(_Sampling):
    ENDPOINT = CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    # tool calling (checked by lora_server.tools.spec: the tools reach the chat template as sent)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # the chat template's inputs (lora_server.server.chat_prompt)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def tool_request(self) -> ToolRequest | None:
        """The tools and tool choice asked for (None: no tools); InvalidRequestError naming the field at fault."""
        return parse_tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message(i) for i, m in enumerate(self.messages)]

    @property
    def echo_text(self) -> str | None:
        """vLLM's chat echo: the final message's text starts the answer when it is the assistant's (the role the
        answer has); None when nothing is echoed."""
        last = self.messages[-1]
        return last.text(len(self.messages) - 1) if self.echo and last.role == "assistant" else None

    def to_params(self, default_max: int) -> SamplingParams:
        if self.top_logprobs is not None:  # checked as itself: SamplingParams' refusal would name logprobs
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}", param="top_logprobs"
                )
        k = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, k, default_max, self.prompt_logprobs)


class CompletionRequest(_Sampling):
    ENDPOINT = COMPLETIONS
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None

    def to_params(self, default_max: int) -> SamplingParams:
        """With echo, the prompt's logprobs are computed for the logprobs object (top ``logprobs``), and max_tokens
        0 scores the prompt (lm-evaluation-harness's loglikelihood requests): then they are computed even when
        not shown, since a request of no tokens exists only to score its prompt."""
        k = self.prompt_logprobs
        if self.echo:
            if self.logprobs is not None:
                k = max(k or 0, self.logprobs)
            elif self.max_tokens == 0 and k is None:
                k = 0
        return self.sampling_params(self.max_tokens, self.logprobs, default_max, k)

    @property
    def echoes_logprobs(self) -> bool:
        """The logprobs object starts with the prompt's tokens (echo with logprobs)."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def parse_body(raw: bytes, model: type[BodyModel]) -> BodyModel:
    """A request body as ``model`` (blocking: the server runs it off the event loop). Raises InvalidRequestError
    with a short message for invalid JSON, JSON nested too deeply, a body that is not an object, or a field that
    does not validate (its name in ``param``)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError("the JSON body is nested too deeply") from None
    except ValueError:  # JSONDecodeError and invalid UTF-8
        raise InvalidRequestError("invalid JSON body") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the JSON body must be an object")
    endpoint = getattr(model, "ENDPOINT", None)
    if endpoint is not None:
        refuse_fields(data, endpoint)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequestError(*validation_message(exc.errors())) from None
    except RecursionError:
        raise InvalidRequestError("the JSON body is nested too deeply") from None


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) of the first of pydantic's validation errors, e.g. ("max_tokens: Input should be a valid
    integer", "max_tokens")."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {'.'.join(loc)}", (loc[0] if loc else None)
    return f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", (loc[0] if loc else None)
