"""GGUF SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) against transformers' reading of the same
file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, an independent implementation): ids and decoded text
equal for the Llama / Mistral, Gemma and Phi-3 variants. The vocabulary is trained here (a BPE over the shipped
quality text, as SentencePiece BPE pieces: ``▁`` for a space, merge rank as score, byte pieces for fallback), with
Gemma's pieces of real spaces and two control tokens."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from lora_server.bench.quality import TEXT_PATH
from lora_server.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces and  double  spaces   three",
    "line\nbreak\n\nend\t tab",
    "naïve café — ünïcödé 你好 🙂",  # characters outside the vocabulary: byte fallback
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "x",
    "",
]


def _sentencepiece_pieces(vocab_size: int = 600) -> tuple[list[str], list[float]]:
    """Pieces and scores of a SentencePiece-style BPE trained on the quality text: merged pieces scored by their
    merge rank (-0, -1, ...), single characters below every merge."""
    trained = Backend(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trained.train_from_iterator(
        [TEXT_PATH.read_text()], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    )
    model = json.loads(trained.to_str())["model"]
    pieces: dict[str, float] = {}
    for rank, merge in enumerate(model["merges"]):
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        pieces.setdefault(left + right, -float(rank))
    for i, char in enumerate(p for p in model["vocab"] if len(p) == 1):
        pieces.setdefault(char, -float(len(model["merges"]) + i))
    return list(pieces), list(pieces.values())


def write_spm_gguf(path: Path, architecture: str, add_space_prefix: bool | None = None) -> Path:
    """A tokenizer-only GGUF: <unk> <s> </s>, two control tokens, the 256 byte pieces, Gemma-style pieces of two
    and three real spaces, then the trained pieces."""
    pieces, scores = _sentencepiece_pieces()
    specials = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), "  ", "   ", *pieces]
    types = [2, 3, 3, 3, 3, *[6] * 256, 1, 1, *[1] * len(pieces)]  # unknown, control, byte, normal
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * (len(specials) + 256) + [-1e4, -1e4] + scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("spm")
    for architecture in ("llama", "gemma2", "phi3"):
        write_spm_gguf(root / f"{architecture}.gguf", architecture)
    return root


@pytest.mark.parametrize("architecture", ["llama", "gemma2", "phi3"])
def test_ids_and_text_equal_transformers(files: Path, architecture: str):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(files), gguf_file=f"{architecture}.gguf")
    ours = Tokenizer.from_gguf(files / f"{architecture}.gguf")
    paragraph = TEXT_PATH.read_text()[:2000]
    for text in [*TEXTS, paragraph]:
        for special in (False, True):
            ids = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (architecture, text[:40], special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and ours.is_special(3)


def test_the_families_differ_where_their_tokenizers_do(files: Path):
    """The per-family choices matter on these texts (else the test above could not tell them apart): Llama's dummy
    prefix, Gemma's none and its pieces of real spaces, Phi-3's prefix on every leading space."""
    encoded = {a: Tokenizer.from_gguf(files / f"{a}.gguf") for a in ("llama", "gemma2", "phi3")}

    def pieces(architecture: str, text: str) -> list[str]:
        tokenizer = encoded[architecture]
        return tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))

    assert pieces("llama", "the")[0].startswith("\u2581") and not pieces("gemma2", "the")[0].startswith("\u2581")
    assert pieces("gemma2", "a  b")[1] == "\u2581\u2581"  # the file's "  " piece, respelled
    assert pieces("phi3", "  the") != pieces("llama", "  the")


def test_add_space_prefix_false_is_honoured(tmp_path: Path):
    """A Llama-type vocabulary whose file turns SentencePiece's dummy prefix off: the first word is cut without a
    ``▁`` (the trained pieces hold "▁the" and "he", not "the": "t" "he"; with the prefix, "▁the"), and the text
    decodes back unchanged."""
    plain = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "off.gguf", "llama", add_space_prefix=False))
    prefixed = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "on.gguf", "llama", add_space_prefix=True))
    ids = plain.encode("the end", add_special_tokens=False)
    assert plain.convert_ids_to_tokens(ids)[:2] == ["t", "he"]
    assert prefixed.convert_ids_to_tokens(prefixed.encode("the end", add_special_tokens=False))[0] == "\u2581the"
    assert plain.decode(ids) == prefixed.decode(prefixed.encode("the end")) == "the end"
