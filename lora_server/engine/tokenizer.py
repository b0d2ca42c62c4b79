"""Tokenizer of one model, built from a GGUF file's metadata or a Hugging Face model directory.

The work is done by the `tokenizers` library; this module only assembles a `tokenizers.Tokenizer`
from the description a model ships with, and adds what a server needs around it: the special token
ids, whether BOS is prepended, and the chat template.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from lora_server.engine.spm_vocab import spm_backend
from lora_server.errors import ModelLoadError
from lora_server.json_types import JsonObject, JsonValue, TemplateMessage, ToolDefinition

# What transformers appends to the final message for continue_final_message, to find where it ends once rendered.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# A message field's value that no template writes by itself: found in the output, the template shows the field.
_SENTINEL = "Q7xWv3sentinel"
# The variables a chat template is rendered with, whatever the request says.
RENDER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})

# `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns, as the reference tokenizers of these model families use them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` values whose split is GPT-2's regex alone, or GPT-2's regex after isolating
# every digit (llama.cpp's `\p{N}` split), which is what HF's `Digits(individual_digits=True)` does.
_GPT2_PRES = frozenset({"gpt2", "mpt", "olmo", "jais"})
_DIGITS_GPT2_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_LLAMA3_PRES = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral"})
_QWEN2_PRES = frozenset({"qwen2", "deepseek-r1-qwen"})
_PRE_SPLITS = {**dict.fromkeys(_LLAMA3_PRES, _LLAMA3_SPLIT), **dict.fromkeys(_QWEN2_PRES, _QWEN2_SPLIT)}


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model.

    Build one with `from_gguf` or `from_hf_dir`. Attributes:
        vocab_size: size of the id space; every valid id is in `range(vocab_size)`.
        bos_token_id: the beginning-of-sequence id, or None if the model has none.
        eos_token_ids: every id that ends generation (may be empty).
        add_bos: whether `encode(text, add_special_tokens=True)` prepends `bos_token_id`.
        chat_template: the model's jinja chat template, or None.
        max_token_chars: the most characters one token can stand for, so a text of n characters needs at least
            n / max_token_chars tokens (how the engine refuses hopeless prompts without tokenizing them).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        """Wrap a ready `tokenizers.Tokenizer`; prefer the `from_*` constructors."""
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        self._special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self._compiled_template: jinja2.Template | None = None
        self._variables: frozenset[str] | None = None  # the template's undeclared variables, found on first use
        self._shown: dict[tuple[str, str], bool] = {}  # (role, message field) -> whether the template shows it
        self.max_token_chars = max(1, max(map(len, backend.get_vocab(with_added_tokens=True)), default=1))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's `tokenizer.*` metadata.

        Supports byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizers
        of the GPT-2, SmolLM/StarCoder, Llama 3 and Qwen2 families, and SentencePiece vocabularies ("llama":
        Llama 2, Mistral, Gemma, Phi-3; `spm_vocab`). Raises ValueError for anything else.
        Control tokens become special tokens (matched whole in text, skipped by
        `decode(skip_special_tokens=True)`); user-defined tokens become non-special added tokens.
        """
        from lora_server.model.gguf_checkpoint import gguf_reader  # a GGUF model only: a bare CUDA machine has no gguf

        fields = gguf_reader(Path(path)).fields

        def get(name: str, default: Any = None) -> Any:
            field = fields.get(f"tokenizer.{name}")
            return default if field is None else field.contents()

        model = get("ggml.model")
        tokens: list[str] = get("ggml.tokens")
        token_types: list[int] = get("ggml.token_type") or [1] * len(tokens)
        if model == "gpt2":
            merges = [_split_merge(merge) for merge in get("ggml.merges", [])]
            backend = _Backend(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
            backend.normalizer, backend.pre_tokenizer = _gguf_pre_tokenization(get("ggml.pre"), path)
            backend.decoder = decoders.ByteLevel()
        elif model == "llama":
            architecture = fields["general.architecture"].contents() if "general.architecture" in fields else ""
            backend = spm_backend(tokens, get("ggml.scores"), architecture, get("ggml.add_space_prefix"))
        else:
            raise ValueError(
                f"{os.fspath(path)}: unsupported tokenizer.ggml.model {model!r}; "
                "only 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) are supported"
            )
        backend.add_special_tokens(
            [
                AddedToken(token, special=True, normalized=False)
                for token, kind in zip(tokens, token_types, strict=True)
                if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN)
            ]
        )
        backend.add_tokens(
            [
                AddedToken(token, special=False, normalized=False)
                for token, kind in zip(tokens, token_types, strict=True)
                if kind == _TOKEN_TYPE_USER_DEFINED
            ]
        )
        end_ids = [get(f"ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_token_id=get("ggml.bos_token_id"),
            eos_token_ids=[token_id for token_id in end_ids if token_id is not None],
            add_bos=bool(get("ggml.add_bos_token", False)),
            chat_template=get("chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model directory.

        Reads `tokenizer.json` (required) and, where present, `tokenizer_config.json` (bos/eos tokens,
        `add_bos_token`, `chat_template`), `chat_template.jinja` (preferred over the config's template),
        and `eos_token_id` (int or list) from `generation_config.json` and `config.json` (its `text_config`
        too); the end ids are the union of all of these. Without `add_bos_token` in the config, BOS is prepended iff the
        tokenizer.json post-processor prepends it. Only BOS is ever added by `encode`; other additions a
        post-processor might make (such as a trailing EOS) are not.
        """
        root = Path(path)
        backend = _Backend.from_file(os.fspath(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")

        def token_id(value: str | dict[str, Any] | None) -> int | None:
            content = value.get("content") if isinstance(value, dict) else value
            return None if content is None else backend.token_to_id(content)

        bos_token_id = token_id(config.get("bos_token"))
        eos_ids = [token_id(config.get("eos_token"))]
        for name in ("generation_config.json", "config.json"):
            config_json = _read_json(root / name)
            # a multimodal model's config may hold the language model's end ids under text_config only
            for value in (config_json.get("eos_token_id"), (config_json.get("text_config") or {}).get("eos_token_id")):
                eos_ids.extend(value if isinstance(value, list) else [value])

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bool(probe) and probe[0] == bos_token_id

        template_file = root / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):
            named = {entry["name"]: entry["template"] for entry in template}
            template = named.get("default")

        vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        return cls(
            backend,
            vocab_size=vocab_size,
            bos_token_id=bos_token_id,
            eos_token_ids=[i for i in eos_ids if i is not None],
            add_bos=add_bos,
            chat_template=template,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special token strings in the text map to their ids.

        With `add_special_tokens` and `add_bos`, `bos_token_id` is prepended. Runs without holding the GIL
        (`encode_batch` releases it, `encode` does not), so other threads (the server's event loop) go on meanwhile.
        """
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of `ids` (byte-level spelling, e.g. 'Ġhello'); ValueError for unknown ids."""
        tokens = []
        for token_id in ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is not in the vocabulary")
            tokens.append(token)
        return tokens

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token, i.e. one `decode(skip_special_tokens=True)` drops."""
        return token_id in self._special_ids

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """The same tokenizer with another chat template (``--chat-template``); the vocabulary is shared."""
        return Tokenizer(
            self._backend,
            vocab_size=self.vocab_size,
            bos_token_id=self.bos_token_id,
            eos_token_ids=self.eos_token_ids,
            add_bos=self.add_bos,
            chat_template=chat_template,
        )

    @property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from outside (``messages``, ``tools``, ``add_generation_prompt``,
        and any others such as ``documents`` or ``enable_thinking``); raises ValueError if there is no template or
        it does not parse."""
        if self._variables is None:
            if self.chat_template is None:
                raise ValueError("this tokenizer has no chat template")
            try:
                ast = _jinja_env().parse(self.chat_template)
            except jinja2.TemplateError as error:
                raise ValueError(f"chat template failed: {error}") from error
            self._variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        return self._variables

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template reads the ``tools`` variable (so it can show the model a tool list); raises
        ValueError if there is no template or it does not parse."""
        return "tools" in self.template_variables

    def template_shows(self, role: str, field: str) -> bool:
        """Whether the chat template writes a ``role`` message's ``field`` (``name``, ``reasoning``...) into the
        prompt: a message carrying a value no template writes by itself is rendered (after a user message when
        it is not a user message), and the value looked for. A template that fails on that conversation does not
        show the field."""
        key = (role, field)
        if key not in self._shown:
            probe: TemplateMessage = {"role": role, "content": "x", field: _SENTINEL}
            messages: list[TemplateMessage] = [probe] if role == "user" else [{"role": "user", "content": "x"}, probe]
            try:
                self._shown[key] = _SENTINEL in self.apply_chat_template(messages, add_generation_prompt=False)
            except ValueError:
                self._shown[key] = False
        return self._shown[key]

    def apply_chat_template(
        self,
        messages: list[TemplateMessage],
        add_generation_prompt: bool = True,
        tools: list[ToolDefinition] | None = None,
        documents: list[JsonObject] | None = None,
        continue_final_message: bool = False,
        variables: Mapping[str, JsonValue] | None = None,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers' `apply_chat_template(tokenize=False)`
        does: `tools` (JSON schemas, as given), `documents` and the messages' own fields (an assistant's
        `tool_calls`, a tool message's `tool_call_id` and `name`) reach the template unchanged; `variables` are
        further template variables (transformers' keyword arguments: `chat_template_kwargs`, `reasoning_effort`),
        none of them one of RENDER_VARIABLES. With `continue_final_message` the text ends where the final message's
        content ends (no end-of-turn after it, no generation prompt), found as transformers finds it: by a tag
        appended to that content, cut off again after rendering.

        Raises ValueError if the model has no chat template, or the template is invalid or rejects the
        conversation (through `raise_exception`, or a type error such as adding None to a string), or the final
        message to continue is not a text the template writes.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        extra = dict(variables or {})
        if RENDER_VARIABLES & extra.keys():
            raise ValueError(f"template variables {sorted(RENDER_VARIABLES & extra.keys())} are set by the server")
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                raise ValueError("continue_final_message is set but the final message has no text to continue")
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        try:
            if self._compiled_template is None:
                self._compiled_template = _jinja_env().from_string(self.chat_template)
            text = self._compiled_template.render(
                **extra,
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_token_id),
                eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            )
        except (jinja2.TemplateError, TypeError) as error:
            raise ValueError(f"chat template failed: {error}") from error
        if not continue_final_message:
            return text
        tag = text.rfind(_CONTINUE_TAG.strip())
        if tag < 0:
            raise ValueError("continue_final_message is set but the chat template does not write the final message")
        # the tag's space kept: the template preserved spacing; else it trimmed the content's end, and so do we
        return text[:tag] if text[tag : tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:tag].rstrip()

    def save_pretrained(self, directory: str | os.PathLike[str], model_max_length: int) -> list[Path]:
        """Write this tokenizer as a Hugging Face tokenizer directory that `transformers.AutoTokenizer` loads as a
        fast tokenizer giving the same ids, special tokens and chat template output (for clients that tokenize
        locally: benchmark tools, lm-evaluation-harness): `tokenizer.json` (where BOS is prepended, a
        post-processor prepends it), `tokenizer_config.json` (the chat template, special tokens, `add_bos_token`,
        `model_max_length`) and `special_tokens_map.json`. Returns the files written."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        backend = _Backend.from_str(self._backend.to_str())  # a copy: the post-processor is the export's own
        bos = self._token_text(self.bos_token_id) or None
        eos = self._token_text(self.eos_token_ids[0]) if self.eos_token_ids else None
        if self.add_bos and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_token_id)]
            )
        else:
            backend.post_processor = None
        special = {name: token for name, token in (("bos_token", bos), ("eos_token", eos)) if token is not None}
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        files = [root / "tokenizer.json", root / "tokenizer_config.json", root / "special_tokens_map.json"]
        backend.save(os.fspath(files[0]))
        for file, content in zip(files[1:], (config, special), strict=True):
            file.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return files

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._backend.id_to_token(token_id) or ""


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or " " in right:
        raise ValueError(f"malformed merge {merge!r}")
    return left, right


def _gguf_pre_tokenization(
    pre: str | None, path: str | os.PathLike[str]
) -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer]:
    """(normalizer, pre-tokenizer) for a byte-level vocabulary with `tokenizer.ggml.pre == pre`."""
    if pre in _GPT2_PRES:
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_GPT2_PRES:
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _PRE_SPLITS.get(pre or "")
    if split is None:
        raise ValueError(f"{os.fspath(path)}: unsupported tokenizer.ggml.pre {pre!r}")
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return (normalizers.NFC() if pre in _QWEN2_PRES else None), pre_tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} if the file does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        return json.load(file)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson` filter: JSON without HTML escaping, with json.dumps' layout options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in: blocks trimmed, loop controls on."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def open_tokenizer(fmt: str, path: Path | None, chat_template: str | None) -> Tokenizer | None:
    """The checkpoint's tokenizer, with ``chat_template`` (a file, or the template's text) instead of its own."""
    tokenizer = None
    try:
        if fmt == "gguf" and path is not None:
            tokenizer = Tokenizer.from_gguf(path)
        elif fmt == "hf" and path is not None and (path / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_hf_dir(path)
    except Exception as exc:  # noqa: BLE001 (the tokenizers package raises plain Exception on a bad file)
        where = path if fmt == "gguf" else path / "tokenizer.json" if path is not None else "the model"
        raise ModelLoadError(f"{where}: its tokenizer cannot be read: {type(exc).__name__}: {exc}") from exc
    if chat_template is None:
        return tokenizer
    if tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer")
    if "{" in chat_template:  # Jinja markup: the template itself (a file name has none)
        return tokenizer.with_chat_template(chat_template)
    if not Path(chat_template).is_file():
        raise ValueError(f"--chat-template {chat_template!r} is neither a file nor a Jinja template")
    return tokenizer.with_chat_template(Path(chat_template).read_text(encoding="utf-8"))
