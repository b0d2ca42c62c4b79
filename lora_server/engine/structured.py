"""Structured output: grammars that constrain what a request may generate, enforced by masking logits.

The grammar engine is xgrammar (vLLM's and SGLang's default): its token masks are precomputed per grammar state
for most of the vocabulary, it fills the bitmask of a whole batch in one call, and it applies the mask on the CPU
(a C++ kernel) and on CUDA alike. ``StructuredOutputs`` owns xgrammar's view of our tokenizer, the compiler, the
compile pool, and the compiled grammars by constraint (an LRU bounded in bytes by xgrammar's own estimate of each:
a schema is compiled once while it is in use); each request owns its own matcher (``Request.grammar``), advanced
once per token it appends, so preemption and recompute (which only recompute KV) never advance it twice.

What a constraint may cost is bounded before anything is compiled (``check``: the config's limits on bytes, depth
and choices; JSON schema keywords the grammar would not enforce are refused, never ignored, as are a JSON schema and
an EBNF grammar that accept no finite text), and while it compiles:
on ``grammar_compile_threads`` threads of its own, each caller waiting at most ``grammar_compile_timeout``. xgrammar
cannot be interrupted: a compile past the budget runs on in its thread (it is bounded by the size limits) and its
grammar is cached; its caller has had its 400. Identical constraints compiling at once share one compile.

Threads: ``check``, ``compile`` and ``matcher`` run where requests are made (the server's worker threads, or the
event loop for ``matcher_async``) and are safe from several at once; ``mask_logits`` and ``accept`` run on the
engine thread."""

from __future__ import annotations

import asyncio
import ctypes
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import torch
import xgrammar as xgr

from lora_server.config import EngineConfig
from lora_server.engine.ebnf_check import check_terminates
from lora_server.engine.json_schema_check import check_enforceable, check_json_schema
from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import InvalidRequestError
from lora_server.model.batch import ScheduledSequence
from lora_server.sampling_params import StructuredOutput

GrammarMatcher = xgr.GrammarMatcher
T = TypeVar("T")
INVALID_EBNF = "is not a valid EBNF grammar"


class StructuredOutputs:
    """Checks constraints against the limits, compiles them into grammars in its own pool (cached by constraint)
    and masks a batch's logits by its requests' matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: EngineConfig) -> None:
        """vocab_size: the model's (the logits' width); ids the tokenizer lacks are never allowed. Special tokens
        are never allowed either, except the end-of-sequence ids once the grammar is complete. ``config``: the
        limits (max_json_schema_bytes ... grammar_cache_bytes)."""
        ids = range(min(tokenizer.vocab_size, vocab_size))
        # xgrammar would read a control token's spelling ("<|im_start|>") as text: an empty string marks it special
        vocab = [
            "" if tokenizer.is_special(i) else t for i, t in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True)
        ]
        self.vocab_size = vocab_size
        self.config = config
        self._info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType.BYTE_LEVEL,
            vocab_size=vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids),
            add_prefix_space=False,
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)  # the cache is ours
        self._pool = ThreadPoolExecutor(config.grammar_compile_threads, thread_name_prefix="grammar-compile")
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._lock = threading.RLock()  # guards the four below (re-entered: a cancel runs _compiled at once)
        self._grammars: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0  # the cached grammars' memory_size_bytes together
        self._compiling: dict[StructuredOutput, Future[xgr.CompiledGrammar]] = {}
        self._waiters: dict[StructuredOutput, int] = {}  # callers still waiting on each compile in flight
        self.num_compiled = 0  # grammars compiled so far (cache misses)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [rows, ceil(vocab / 32)] int32, grown on demand

    # ---- where requests are made (any thread) ----------------------------------------------------------------

    def check(self, c: StructuredOutput) -> None:
        """InvalidRequestError (naming the request field) when ``c`` exceeds a limit of the config, is not a valid
        schema, or uses what the grammar cannot enforce. Cheap: nothing is compiled."""
        cfg = self.config
        if c.kind == "choice":
            assert isinstance(c.spec, tuple)
            _limit(len(c.spec), cfg.max_guided_choices, c.param, "strings", "--max-guided-choices")
            size = sum(len(choice.encode()) for choice in c.spec)
            _limit(size, cfg.max_choice_bytes, c.param, "bytes together", "--max-choice-kb")
        elif c.kind == "regex":
            assert isinstance(c.spec, str)
            _limit(len(c.spec.encode()), cfg.max_regex_bytes, c.param, "bytes", "--max-regex-kb")
        elif c.kind == "grammar":
            assert isinstance(c.spec, str)
            spec = c.spec
            _limit(len(spec.encode()), cfg.max_grammar_bytes, c.param, "bytes", "--max-grammar-kb")
            check_terminates(_or_invalid(lambda: xgr.Grammar.from_ebnf(spec), c.param, INVALID_EBNF), c.param)
        elif c.kind == "structural_tag":
            assert isinstance(c.spec, str)
            _limit(len(c.spec.encode()), cfg.max_grammar_bytes, c.param, "bytes", "--max-grammar-kb")
            for schema in _tag_schemas(json.loads(c.spec)):
                self._check_schema(schema, c.param)
        elif c.kind == "json":
            assert isinstance(c.spec, str)
            self._check_schema(json.loads(c.spec), c.param)

    def _check_schema(self, schema: object, param: str) -> None:
        cfg = self.config
        check_json_schema(schema, param, cfg.max_json_schema_bytes, cfg.max_json_schema_depth)
        check_enforceable(schema, param)

    def compile(self, c: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """``c``'s grammar: cached (a done future), the compile of an identical constraint in flight, or a new
        compile queued in the pool. The caller counts as waiting on it until it calls ``_gave_up`` or it is done.
        Call ``check`` first."""
        with self._lock:
            grammar = self._grammars.get(c)
            if grammar is not None:
                self._grammars.move_to_end(c)
                done: Future[xgr.CompiledGrammar] = Future()
                done.set_result(grammar)
                return done
            future = self._compiling.get(c)
            if future is not None:
                self._waiters[c] += 1
                return future
            future = self._pool.submit(self._compile, c)
            self._compiling[c], self._waiters[c] = future, 1
            future.add_done_callback(lambda f: self._compiled(c, f))  # last: it runs here if the compile is done
            return future

    def compiled(self, c: StructuredOutput) -> xgr.CompiledGrammar:
        """``c`` checked and compiled, waiting at most the budget (blocking); InvalidRequestError otherwise."""
        self.check(c)
        future = self.compile(c)
        try:
            return future.result(timeout=self.config.grammar_compile_timeout)
        except FutureTimeout:
            self._gave_up(c, future)
            raise self._too_slow(c) from None

    def matcher(self, c: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of ``c``'s grammar (blocking); InvalidRequestError when the constraint is
        refused, invalid, or takes longer than the budget to compile."""
        return xgr.GrammarMatcher(self.compiled(c))

    async def matcher_async(self, c: StructuredOutput) -> GrammarMatcher:
        """``matcher`` on the event loop: waits for the compile without holding a thread. Call ``check`` first."""
        future = self.compile(c)
        try:
            grammar = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), self.config.grammar_compile_timeout
            )
        except TimeoutError:
            self._gave_up(c, future)
            raise self._too_slow(c) from None
        return xgr.GrammarMatcher(grammar)

    def _too_slow(self, c: StructuredOutput) -> InvalidRequestError:
        return InvalidRequestError(
            f"{c.param} takes longer than {self.config.grammar_compile_timeout:g} s to compile into a grammar "
            "(the server's --grammar-compile-timeout): make it smaller or simpler",
            param=c.param,
            code="grammar_too_complex",
        )

    def _gave_up(self, c: StructuredOutput, future: Future[xgr.CompiledGrammar]) -> None:
        """A caller stopped waiting: a compile nobody waits for any more and that has not started is dropped."""
        with self._lock:
            if self._compiling.get(c) is not future:
                return
            self._waiters[c] -= 1
            if self._waiters[c] == 0:
                future.cancel()  # a compile not yet started is dropped: its callback, run here, forgets it

    def _compiled(self, c: StructuredOutput, future: Future[xgr.CompiledGrammar]) -> None:
        """A compile ended (in the pool's thread): its grammar enters the cache, least recently used ones leave
        while the cache holds more than grammar_cache_bytes (one larger than the whole budget is not kept)."""
        evicted = 0
        with self._lock:
            if self._compiling.get(c) is future:
                del self._compiling[c], self._waiters[c]
            if future.cancelled() or future.exception() is not None:
                return
            self.num_compiled += 1
            grammar = future.result()
            size = grammar.memory_size_bytes
            if c in self._grammars or size > self.config.grammar_cache_bytes:
                return
            self._grammars[c] = grammar
            self._cached_bytes += size
            while self._cached_bytes > self.config.grammar_cache_bytes:
                _, old = self._grammars.popitem(last=False)
                self._cached_bytes -= old.memory_size_bytes
                evicted += 1
        if evicted:
            _release_freed_memory()

    @property
    def cached_bytes(self) -> int:
        """xgrammar's estimate of the memory the cached grammars hold."""
        with self._lock:
            return self._cached_bytes

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
            return _or_invalid(lambda: compiler.compile_grammar(spec), c.param, INVALID_EBNF)
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
    """The grammar of compact JSON valid under ``schema`` (checked by ``StructuredOutputs.check``), no properties
    beyond its own."""
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


def _tag_schemas(node: object) -> list[object]:
    """The JSON schemas of a structural tag's json_schema contents."""
    if isinstance(node, list):
        return [schema for item in node for schema in _tag_schemas(item)]
    if not isinstance(node, dict):
        return []
    if node.get("type") == "json_schema":
        return [node.get("json_schema")]
    return [schema for value in node.values() for schema in _tag_schemas(value)]


def _release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing): without it the
    memory of evicted grammars mostly stays in the process (docs/structured-output.md)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _limit(size: int, limit: int, param: str, unit: str, flag: str) -> None:
    if size > limit:
        raise InvalidRequestError(
            f"{param} has {size} {unit}; the server's limit is {limit} ({flag})", param=param, code="grammar_too_large"
        )


def _or_invalid(compile_: Callable[[], T], param: str, what: str) -> T:
    """Run a parse or compile call; xgrammar's errors (RuntimeError with the parser's message) become a 400."""
    try:
        return compile_()
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequestError(f"{param} {what}: {_reason(exc)}", param=param) from None


def _reason(exc: Exception) -> str:
    """xgrammar's message, without the "[time] file:line: " it prefixes."""
    reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return (reason.split(": ", 1)[-1] if reason.startswith("[") else reason)[:200]
