"""Every field of OpenAI's and vLLM's chat and completions requests, and what this server does with it: the table
behind docs/http-api.md's "Request fields" (tests/server/test_request_fields.py keeps the two equal and sends every
row) and the refusals ``parse_body`` makes before a body is validated.

- honoured: the request gets what the field asks for;
- refused: a 400 naming the field, unless its value is one that asks for nothing (``accepts``: the default);
- no effect: accepted, and nothing a client gets from this server depends on it (``note`` says why).

A field in neither API is refused as OpenAI refuses it ("Unrecognized request argument supplied"): a misspelt
field never passes for an honoured one. Message fields are the chat template's (lora_server/server/chat_prompt.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lora_server.errors import InvalidRequestError

Status = Literal["honoured", "refused", "no effect"]
CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)


@dataclass(frozen=True)
class RequestField:
    name: str  # dotted for a nested field: "stream_options.include_usage"
    endpoints: tuple[str, ...]
    status: Status
    note: str = ""
    accepts: tuple[Any, ...] = (None,)  # refused fields: the values that ask for nothing

    def refuses(self, value: Any) -> bool:
        return self.status == "refused" and not any(value == ok and type(value) is type(ok) for ok in self.accepts)


def _f(name: str, endpoints: str | tuple[str, ...], status: Status, note: str = "", accepts: tuple = (None,)):
    return RequestField(name, (endpoints,) if isinstance(endpoints, str) else endpoints, status, note, accepts)


FIELDS: tuple[RequestField, ...] = (
    # ---- OpenAI ----
    _f("model", BOTH, "honoured", "an adapter name or the base model's id"),
    _f("messages", CHAT, "honoured", "see the message table"),
    _f("prompt", COMPLETIONS, "honoured", "a text, token ids, or a list of either"),
    _f("max_tokens", BOTH, "honoured", "0 with echo scores the prompt"),
    _f("max_completion_tokens", CHAT, "honoured", "wins over max_tokens"),
    _f("temperature", BOTH, "honoured"),
    _f("top_p", BOTH, "honoured"),
    _f("n", BOTH, "honoured", "at most 16"),
    _f("stream", BOTH, "honoured"),
    _f("stream_options", BOTH, "honoured", "with stream"),
    _f("stream_options.include_usage", BOTH, "honoured"),
    _f("stream_options.include_obfuscation", BOTH, "no effect", "no obfuscation padding is sent"),
    _f("stop", BOTH, "honoured"),
    _f("seed", BOTH, "honoured", "choice i of n uses seed + i"),
    _f("frequency_penalty", BOTH, "honoured"),
    _f("presence_penalty", BOTH, "honoured"),
    _f("logit_bias", BOTH, "honoured"),
    _f("logprobs", BOTH, "honoured", "chat: a bool; completions: the top-k"),
    _f("top_logprobs", CHAT, "honoured"),
    _f("echo", BOTH, "honoured", "chat: vLLM's (the final message, if the assistant's, starts the answer)"),
    _f("response_format", BOTH, "honoured", "text, json_object, json_schema"),
    _f("response_format.json_schema.strict", BOTH, "no effect", "the output always follows the schema"),
    _f("tools", CHAT, "honoured"),
    _f("tool_choice", CHAT, "honoured", "none, auto (with a tool-call parser), required, a named function"),
    _f("parallel_tool_calls", CHAT, "honoured"),
    _f("reasoning_effort", CHAT, "honoured", "a chat template variable: 400 if the template does not read it"),
    _f("modalities", CHAT, "refused", "only text is produced", accepts=(None, ["text"])),
    _f("audio", CHAT, "refused", "no audio output"),
    _f("prediction", CHAT, "refused", "predicted outputs are not implemented"),
    _f("web_search_options", CHAT, "refused", "no web search"),
    _f("verbosity", CHAT, "refused", "no verbosity control for these models"),
    _f("store", BOTH, "refused", "completions are not stored", accepts=(None, False)),
    _f("service_tier", BOTH, "refused", "one tier", accepts=(None, "auto", "default")),
    _f("suffix", COMPLETIONS, "refused", "insertion is not implemented"),
    _f("best_of", COMPLETIONS, "refused", "accepted when equal to n (or 1)", accepts=(None, 1)),
    _f("functions", CHAT, "refused", "OpenAI's deprecated form of tools; send tools"),
    _f("function_call", CHAT, "refused", "OpenAI's deprecated form of tool_choice; send tool_choice"),
    _f("user", BOTH, "no effect", "an end-user id for the provider's abuse monitoring; tenants are keys here"),
    _f("safety_identifier", BOTH, "no effect", "as user"),
    _f("metadata", BOTH, "no effect", "tags for stored completions (store is refused)"),
    _f("prompt_cache_key", BOTH, "no effect", "prefix caching is automatic, per adapter and tenant"),
    _f("prompt_cache_retention", BOTH, "no effect", "cached KV lives as long as the pool keeps it"),
    # ---- vLLM ----
    _f("top_k", BOTH, "honoured"),
    _f("min_p", BOTH, "honoured"),
    _f("repetition_penalty", BOTH, "honoured"),
    _f("ignore_eos", BOTH, "honoured"),
    _f("min_tokens", BOTH, "honoured"),
    _f("stop_token_ids", BOTH, "honoured"),
    _f("skip_special_tokens", BOTH, "honoured"),
    _f("include_stop_str_in_output", BOTH, "honoured"),
    _f("allowed_token_ids", BOTH, "honoured"),
    _f("bad_words", BOTH, "honoured", "each word's tokens, with and without a leading space, as vLLM bans them"),
    _f("priority", BOTH, "honoured", "among the tenant's waiting requests"),
    _f("prompt_logprobs", BOTH, "honoured", "not with stream"),
    _f("truncate_prompt_tokens", BOTH, "honoured", "keeps the prompt's last k tokens (-1: the context length)"),
    _f("cache_salt", BOTH, "honoured", "prompts share cached KV only under the same salt (and tenant)"),
    _f("request_id", BOTH, "honoured", "the response id's, unless an x-request-id header gives one"),
    _f("add_special_tokens", BOTH, "honoured", "chat default false, completions default true"),
    _f("add_generation_prompt", CHAT, "honoured"),
    _f("continue_final_message", CHAT, "honoured", "not with add_generation_prompt"),
    _f("documents", CHAT, "honoured", "a chat template variable: 400 if the template does not read it"),
    _f("chat_template_kwargs", CHAT, "honoured", "template variables: 400 for one the template does not read"),
    _f("guided_json", BOTH, "honoured"),
    _f("guided_regex", BOTH, "honoured"),
    _f("guided_choice", BOTH, "honoured"),
    _f("guided_grammar", BOTH, "honoured", "xgrammar's EBNF"),
    _f("structured_outputs", BOTH, "honoured", "json, regex, choice, grammar, json_object"),
    _f("guided_decoding_backend", BOTH, "refused", "xgrammar is the one backend", accepts=(None, "auto", "xgrammar")),
    _f("guided_whitespace_pattern", BOTH, "refused", "JSON output is written compact"),
    _f("stream_options.continuous_usage_stats", BOTH, "refused", "usage comes in the last chunk", (None, False)),
    _f("use_beam_search", BOTH, "refused", "no beam search", accepts=(None, False)),
    _f("length_penalty", BOTH, "refused", "beam search only", accepts=(None, 1, 1.0)),
    _f("spaces_between_special_tokens", BOTH, "refused", "special tokens are detokenized as they are", (None, True)),
    _f("logits_processors", BOTH, "refused", "no custom logits processors", accepts=(None, [])),
    _f("return_tokens_as_token_ids", BOTH, "refused", "logprobs name tokens by their text", (None, False)),
    _f("return_token_ids", BOTH, "refused", "the answer has no token ids", accepts=(None, False)),
    _f("chat_template", CHAT, "refused", "--chat-template sets it at start-up (vLLM's default too)"),
    _f("mm_processor_kwargs", BOTH, "refused", "text models only", accepts=(None, {})),
    _f("prompt_embeds", COMPLETIONS, "refused", "prompts are text or token ids"),
    _f("kv_transfer_params", BOTH, "refused", "no disaggregated prefill"),
    _f("vllm_xargs", BOTH, "refused", "no custom extensions"),
)

# The fields a request body may carry at its top level, by endpoint (nested rows are checked by their models).
_TOP: dict[str, dict[str, RequestField]] = {
    endpoint: {f.name: f for f in FIELDS if "." not in f.name and endpoint in f.endpoints}
    for endpoint in (CHAT, COMPLETIONS)
}
NESTED_REFUSED = {f.name: f for f in FIELDS if "." in f.name and f.status == "refused"}


def refuse_fields(body: dict[str, Any], endpoint: str) -> None:
    """Raise InvalidRequestError naming the first field of ``body`` that asks for what is refused here, or that
    neither API defines for ``endpoint``; then drop the refused fields (their values ask for nothing)."""
    known = _TOP[endpoint]
    for name in list(body):
        field = known.get(name)
        if field is None:
            raise InvalidRequestError(f"Unrecognized request argument supplied: {name}", param=name)
        if field.status != "refused":
            continue
        value = body[name]
        if field.refuses(value) and not (name == "best_of" and value == body.get("n", 1)):
            raise InvalidRequestError(f"{name} is not supported: {field.note}", param=name)
        del body[name]
    options = body.get("stream_options")
    if isinstance(options, dict):
        field = NESTED_REFUSED["stream_options.continuous_usage_stats"]
        if field.refuses(options.get("continuous_usage_stats")):
            raise InvalidRequestError(f"{field.name} is not supported: {field.note}", param="stream_options")
