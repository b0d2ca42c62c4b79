"""SentencePiece vocabularies of GGUF files (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral, Gemma, Phi-3) as a
``tokenizers`` BPE with byte fallback, built the way transformers builds them from the same metadata
(``transformers.integrations.gguf.gguf_tokenizer_mapping``; ``tests/engine/test_spm_vocab.py`` checks against it).

A GGUF SentencePiece vocabulary is pieces (a space spelled ``▁``, a byte ``<0xAB>``) with scores and no merges. Its
merges are recovered from the vocabulary: every split of a piece into two pieces that are both in the vocabulary is a
merge, ranked by the merged piece's priority (its score; for Gemma, whose scores do not follow its merge order, its
place in the file). Around the BPE model, per family:

- Llama / Mistral (and any other architecture): a ``▁`` prepended to the text's first piece (SentencePiece's
  dummy prefix, ``tokenizer.ggml.add_space_prefix``, true unless the file says otherwise), spaces as ``▁``; the
  decoder drops that first space again;
- Gemma: no dummy prefix; pieces of two or more spaces, which the file spells with real spaces, renamed to ``▁``s;
- Phi-3: the dummy prefix from a normalizer (so a text of leading spaces keeps one more ``▁``).

Anything else the file describes (another tokenizer model) is refused by the caller."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def spm_backend(
    tokens: Sequence[str], scores: Sequence[float] | None, architecture: str, add_space_prefix: bool | None
) -> Backend:
    """The BPE backend of a SentencePiece vocabulary (special and added tokens are the caller's to add).
    tokens: the pieces in id order; scores: one per piece (None: all equal, the file order ranks them)."""
    gemma = architecture in GEMMA_ARCHITECTURES
    if gemma:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = {token: -float(i) for i, token in enumerate(tokens)}
    else:
        values = scores if scores is not None else [-float(i) for i in range(len(tokens))]
        priority = dict(zip(tokens, map(float, values), strict=True))
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = merges_from_vocab(vocab, priority)
    unk = "<unk>" if gemma and "<unk>" in vocab else None  # as transformers' GemmaTokenizer / LlamaTokenizer
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps: list[decoders.Decoder] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE)
    elif architecture == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        steps.append(decoders.Strip(content=" ", left=1))
    else:
        prefix = add_space_prefix is not False
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_vocab(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a piece, best first: by the merged piece's priority, then the
    longer left and right part; the pieces' own order breaks the remaining ties (transformers'
    ``generate_merges``)."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in priority.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece)) if {piece[:i], piece[i:]} <= vocab.keys()]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
