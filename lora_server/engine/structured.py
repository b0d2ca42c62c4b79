"""Structured output: grammars that constrain what a request may generate, enforced by masking logits.

The grammar engine is xgrammar (vLLM's and SGLang's default): its token masks are precomputed per grammar state
for most of the vocabulary, it fills the bitmask of a whole batch in one call, and it applies the mask on the CPU
(a C++ kernel) and on CUDA alike. ``StructuredOutputs`` owns xgrammar's view of our tokenizer, the compiler, and
the compiled grammars by constraint (an LRU of ``cache_size`` entries: a schema is compiled once while it is in
use); each request owns its own matcher (``Request.grammar``), advanced once per token it appends, so preemption
and recompute (which only recompute KV) never advance it twice.

Threads: ``matcher`` runs where requests are made (the server's worker threads: compiling is not the engine
thread's work) and is safe from several at once; ``mask_logits`` and ``accept`` run on the engine thread."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import jsonschema
import torch
import xgrammar as xgr

from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import InvalidRequestError
from lora_server.model.batch import ScheduledSequence
from lora_server.sampling_params import StructuredOutput

GrammarMatcher = xgr.GrammarMatcher
# JSON schema keywords xgrammar compiles but does not enforce (multipleOf only on integers): refused, not ignored
_UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else")
_SUBSCHEMA = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")


class StructuredOutputs:
    """Compiles constraints into grammars (cached by constraint) and masks a batch's logits by its requests'
    matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        """vocab_size: the model's (the logits' width); ids the tokenizer lacks are never allowed. Special tokens
        are never allowed either, except the end-of-sequence ids once the grammar is complete."""
        ids = range(min(tokenizer.vocab_size, vocab_size))
        # xgrammar would read a control token's spelling ("<|im_start|>") as text: an empty string marks it special
        vocab = [
            "" if tokenizer.is_special(i) else t for i, t in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True)
        ]
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType.BYTE_LEVEL,
            vocab_size=vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids),
            add_prefix_space=False,
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)  # the cache is ours
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._grammars: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.num_compiled = 0  # grammars compiled so far (cache misses)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [rows, ceil(vocab / 32)] int32, grown on demand

    # ---- where requests are made (any thread) ----------------------------------------------------------------

    def matcher(self, constraint: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of ``constraint``'s grammar; InvalidRequestError when the schema or the
        regular expression is invalid or uses what the grammar engine does not support."""
        return xgr.GrammarMatcher(self.compiled(constraint))

    def compiled(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        with self._lock:
            grammar = self._grammars.get(constraint)
            if grammar is not None:
                self._grammars.move_to_end(constraint)
                return grammar
        grammar = self._compile(constraint)  # outside the lock: a slow schema does not hold up the others
        with self._lock:
            self.num_compiled += 1
            self._grammars[constraint] = grammar
            self._grammars.move_to_end(constraint)
            while len(self._grammars) > self.cache_size:
                self._grammars.popitem(last=False)
        return grammar

    def _compile(self, c: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._compiler
        if c.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if c.kind == "choice":
            assert isinstance(c.spec, tuple)
            # EBNF string literals take JSON's escapes
            ebnf = "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in c.spec)
            return _or_invalid(lambda: compiler.compile_grammar(ebnf), c.param, "cannot be compiled")
        spec = c.spec
        assert isinstance(spec, str)
        if c.kind == "regex":
            return _or_invalid(lambda: compiler.compile_regex(spec), c.param, "is not a valid regular expression")
        if c.kind == "grammar":
            return _or_invalid(lambda: compiler.compile_grammar(spec), c.param, "is not a valid EBNF grammar")
        if c.kind == "structural_tag":
            tag = json.dumps(_compact_schemas(json.loads(spec), c.param))
            return _or_invalid(
                lambda: compiler.compile_structural_tag(tag), c.param, "is a structure the grammar engine cannot build"
            )
        # compact JSON (no free whitespace): a small model otherwise wanders into endless blanks
        return compiler.compile_grammar(_compact_json_grammar(json.loads(spec), c.param))

    # ---- the engine thread -------------------------------------------------------------------------------------

    def mask_logits(self, logits: torch.Tensor, requests: Sequence[ScheduledSequence]) -> None:
        """The sampler's hook. logits: [S, vocab] (row i is requests[i]'s), changed in place: the tokens that the
        grammar of a constrained request does not allow next become -inf; unconstrained rows are untouched. The
        bitmask of all constrained rows is filled in one call."""
        # a draft position's row (lora_server.model.batch.DraftPosition) has no grammar: constrained requests are
        # never speculated
        grammars = [getattr(r, "grammar", None) for r in requests]
        rows = [i for i, g in enumerate(grammars) if g is not None]
        matchers = [g for g in grammars if g is not None]
        if not rows:
            return
        if self._bitmask.shape[0] < len(requests):
            self._bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        bitmask = self._bitmask[: len(requests)]  # [S, ceil(vocab / 32)] int32, bit t of row i: token t allowed
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows
        )

    @staticmethod
    def accept(grammar: GrammarMatcher, token: int) -> bool:
        """Advance a request's matcher by the token it appended; returns whether its output is now complete (the
        grammar took an end-of-sequence token). RuntimeError when the grammar refuses the token."""
        if not grammar.accept_token(token):
            raise RuntimeError(f"the structured output grammar refused token {token}")
        return grammar.is_terminated()


def _compact_json_grammar(schema: object, param: str) -> xgr.Grammar:
    """The grammar of compact JSON valid under ``schema``, no properties beyond its own; InvalidRequestError when
    it is not valid JSON Schema or uses what the grammar cannot enforce."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise InvalidRequestError(
            f"{param} is not a valid JSON schema{f' (at {where})' if where else ''}: {exc.message[:200]}",
            param=param,
        ) from None
    _check_enforceable(schema, param)
    text = json.dumps(schema, ensure_ascii=False)
    try:
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequestError(
            f"{param} is a JSON schema the grammar engine cannot enforce: {_reason(exc)}", param=param
        ) from None


def _compact_schemas(node: object, param: str) -> object:
    """A structural tag with each of its JSON schema contents replaced by the grammar of compact JSON under it
    (xgrammar's own json_schema format allows any whitespace)."""
    if isinstance(node, list):
        return [_compact_schemas(item, param) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema":
        return {"type": "grammar", "grammar": str(_compact_json_grammar(node["json_schema"], param))}
    return {key: _compact_schemas(value, param) for key, value in node.items()}


def _check_enforceable(schema: object, param: str, depth: int = 0) -> None:
    """InvalidRequestError when the schema, or one of its subschemas, uses a keyword the grammar cannot enforce."""
    if not isinstance(schema, dict) or depth > 64:
        return
    used = [k for k in _UNENFORCED if k in schema and schema[k] is not False]
    if "multipleOf" in schema and not (schema.get("type") == "integer" and isinstance(schema["multipleOf"], int)):
        used.append("multipleOf (other than an integer's)")
    if used:
        raise InvalidRequestError(f"{param}: structured output cannot enforce the JSON schema keyword {used[0]}", param)
    children: list[object] = [schema.get(k) for k in _SUBSCHEMA]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children.extend(schema[key].values())
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children.extend(schema[key])
    for child in children:
        _check_enforceable(child, param, depth + 1)


def _or_invalid(compile_: Callable[[], xgr.CompiledGrammar], param: str, what: str) -> xgr.CompiledGrammar:
    """Run a compile call; xgrammar's errors (RuntimeError with the parser's message) become a 400."""
    try:
        return compile_()
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequestError(f"{param} {what}: {_reason(exc)}", param=param) from None


def _reason(exc: Exception) -> str:
    """xgrammar's message, without the "[time] file:line: " it prefixes."""
    reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return (reason.split(": ", 1)[-1] if reason.startswith("[") else reason)[:200]
