"""Streaming detokenization: output token ids in, text deltas out, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from lora_server.engine.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output, so that the first output token decodes as it does in context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, correct across multi-byte characters
    (a token that ends mid-UTF-8 character yields no text until the character completes) and stop strings.

    Contract, for a byte-level tokenizer: the concatenation of every delta returned by `add_tokens` and
    `flush` equals `output_text`, which equals `tokenizer.decode(all output ids, skip_special_tokens)`
    cut at the first stop string: the request stops at the earliest point of the text where any stop
    string is complete, independently of how the text is split into tokens. The text is cut just before
    that stop string, or just after it with `include_stop_str_in_output`. Text that may be the start of
    a stop string is held back until it is disambiguated or `flush` releases it.

    `output_text` is the text emitted so far; once the request has ended (a stop string matched, or
    `flush` was called) it is the final output text and `add_tokens` may no longer be called.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        """Raises ValueError if a stop string is empty."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        # Decode window: ids[prefix_offset:read_offset] is already-decoded context, ids[read_offset:] the rest.
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""  # every character decoded so far; output_text is a prefix of it
        self._finished = False
        self.output_text = ""

    def add_tokens(self, new_ids: Sequence[int]) -> tuple[str, str | None]:
        """Append output token ids; return (text delta safe to emit now, the stop string matched or None).

        When a stop string is returned, the request has ended: the delta completes `output_text`.
        Raises RuntimeError if the request has already ended.
        """
        if self._finished:
            raise RuntimeError("add_tokens called after the output ended")
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """When the request ends for another reason: return the text still held back.

        This includes an incomplete trailing character (as U+FFFD, as `Tokenizer.decode` gives it) and
        text that could have begun a stop string. Returns "" if the request has already ended.
        """
        if self._finished:
            return ""
        delta, _ = self._advance(final=True)
        self._finished = True
        return delta

    def _advance(self, final: bool) -> tuple[str, str | None]:
        """Decode what is new in the window, then emit up to the stop string or the held-back tail."""
        old_length = len(self._text)
        self._text += self._decode_new(final)
        matched, cut = self._find_stop(old_length)
        if matched is None:
            cut = len(self._text) if final else len(self._text) - self._stop_prefix_length()
        else:
            self._finished = True
        delta = self._text[len(self.output_text) : cut]
        self.output_text += delta
        return delta, matched

    def _decode_new(self, final: bool) -> str:
        """Text of ids[read_offset:], given ids[prefix_offset:read_offset] as context; "" while it ends
        in an incomplete character (unless `final`)."""
        window = self._ids[self._prefix_offset :]
        context_text = self._tokenizer.decode(
            window[: self._read_offset - self._prefix_offset], self._skip_special_tokens
        )
        window_text = self._tokenizer.decode(window, self._skip_special_tokens)
        if len(window_text) <= len(context_text) or (window_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window_text[len(context_text) :]

    def _find_stop(self, old_length: int) -> tuple[str | None, int]:
        """(stop string completed earliest in the text after `old_length`, the cut position) or (None, 0)."""
        candidates = []
        for s in self._stop:
            start = self._text.find(s, max(0, old_length - len(s) + 1))
            if start >= 0:
                candidates.append((start + len(s), -start, s))
        if not candidates:
            return None, 0
        end, negated_start, matched = min(candidates)
        return matched, end if self._include_stop else -negated_start

    def _stop_prefix_length(self) -> int:
        """Length of the longest not-yet-emitted suffix of the text that is a proper prefix of a stop string."""
        unsent = len(self._text) - len(self.output_text)
        longest = 0
        for s in self._stop:
            for length in range(min(len(s) - 1, unsent), longest, -1):
                if self._text.endswith(s[:length]):
                    longest = length
                    break
        return longest
