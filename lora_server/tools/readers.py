"""Reading tool calls out of a choice's output text as it streams.

A reader is fed the output text in pieces (``feed``) and told when it ends (``finish``); it answers with events:
``Text`` (content), ``CallStart`` (a call's id and function name, told once the name is whole) and ``Arguments``
(a piece of a call's arguments, JSON text). Text that may be the start of a call is held back until the reader
knows. The events, joined, are the same however the output is split into pieces, so a stream and a whole answer
agree (call ids aside: each reader draws its own).

- ``GrammarCallReader`` reads output written under a call grammar (lora_server.tools.grammar): the literal parts
  of each call are exact, so a call's arguments are told as they come. An output cut short (max_tokens) keeps every
  word: a call whose name was whole is told with its arguments as far as they were written (the answer's finish
  reason, ``length``, says it is cut), and the text of a call whose name was not whole yet is content.
- ``FreeCallReader`` reads a model's own, unconstrained output: a call is told once its JSON is whole and reads
  as a call; anything else, markers included, is content."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Text:
    """Content text."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """Call ``index`` (0, 1... in the choice) begins: its id and the function it calls."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class Arguments:
    """The next piece of call ``index``'s arguments (JSON text; the pieces joined are the whole arguments)."""

    index: int
    text: str


Event = Text | CallStart | Arguments


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a format writes calls under a grammar, literally: ``open``, calls separated by ``separator``,
    ``close``; one call is ``prefix`` NAME ``infix`` ARGUMENTS ``suffix``, ARGUMENTS a JSON object. ``trigger``:
    the text that starts a call inside free text (a prefix of ``prefix``; None: this format cannot have free text
    before calls under a grammar). No literal holds a name's closing quote: names cannot contain one."""

    prefix: str
    infix: str
    suffix: str
    separator: str
    open: str = ""
    close: str = ""
    trigger: str | None = None


@dataclass(frozen=True, slots=True)
class FreeSyntax:
    """Where calls are in a model's own output: after one of ``markers``, or (``bare``) a JSON value opening the
    output, come one or more JSON values separated by ``separator``, up to ``closer``; each value is a call object
    ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``) or a list of them. ``at_start``: calls only at the
    start of the output (after whitespace), else anywhere with text around them."""

    markers: tuple[str, ...]
    closer: str = ""
    separator: str = ""
    at_start: bool = False
    bare: bool = False


class ToolCallReader(ABC):
    """Reads one choice's output for tool calls (see the module's docstring). ``new_id`` draws a call's id."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._pending = ""  # text received and not yet told
        self._after_call = False  # no content has been told since the last call
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        """Events that the output so far, with ``text`` appended, allows telling now."""
        self._pending += text
        events: list[Event] = []
        while self._pending and self._advance(events):
            pass
        return _merged(events)

    def finish(self) -> list[Event]:
        """The output has ended: what was held back."""
        events: list[Event] = []
        self._end(events)
        self._pending = ""
        return _merged(events)

    def _start_call(self, events: list[Event], name: str) -> int:
        index = self.num_calls
        self.num_calls += 1
        self._after_call = True
        events.append(CallStart(index, self._new_id(), name))
        return index

    def _text_until(self, events: list[Event], markers: tuple[str, ...]) -> str | None:
        """Free text: tell it up to the first of ``markers`` and return that marker (``_pending`` then starts with
        it), or tell what cannot begin one and return None. Blanks after a call are not content unless text
        follows them: they are held, and dropped before a marker or at the end."""
        found = [(at, m) for m in markers if (at := self._pending.find(m)) >= 0]
        if found:
            at, marker = min(found)
            self._tell(events, self._pending[:at])
            self._pending = self._pending[at:]
            return marker
        keep = _partial_suffix(self._pending, markers)
        told = self._pending[: len(self._pending) - keep]
        if self._after_call and not told.strip():
            return None
        self._tell(events, told)
        self._pending = self._pending[len(told) :]
        return None

    def _tell(self, events: list[Event], text: str) -> None:
        if text.strip() or (text and not self._after_call):
            events.append(Text(text))
            self._after_call = False

    def _end_text(self, events: list[Event]) -> None:
        """The output ended in free text."""
        self._tell(events, self._pending)

    @abstractmethod
    def _advance(self, events: list[Event]) -> bool:
        """Consume what it can of ``_pending`` (appending to ``events``); False when it must wait for more."""

    @abstractmethod
    def _end(self, events: list[Event]) -> None:
        """Tell what ``_pending`` and the state still hold, the output having ended."""


_LITERAL_NEXT = {"open": "prefix", "prefix": "name", "infix": "arguments", "suffix": "between"}


class GrammarCallReader(ToolCallReader):
    """Output written under a CallSyntax grammar. Forced (``triggered`` False): calls from the first character.
    Triggered: free text until the syntax's trigger, then a call, then free text again."""

    def __init__(self, syntax: CallSyntax, new_id: Callable[[], str], triggered: bool = False) -> None:
        super().__init__(new_id)
        if triggered and syntax.trigger is None:
            raise ValueError("this call syntax has no trigger")
        self.syntax = syntax
        self._triggered = triggered
        self._state = "text" if triggered else "open"
        self._call = -1  # the index of the call whose arguments are read
        self._scan: _JsonEnd | None = None
        self._unsaid = ""  # the syntax consumed since the last call was told (open, separator, the next one's prefix)

    def _advance(self, events: list[Event]) -> bool:
        if self._state in _LITERAL_NEXT:  # a literal of the syntax, named as the state is
            return self._literal(getattr(self.syntax, self._state), _LITERAL_NEXT[self._state])
        return {
            "text": self._text,
            "name": self._name,
            "arguments": self._arguments,
            "between": self._between,
            "done": self._done,
        }[self._state](events)

    def _literal(self, literal: str, following: str) -> bool:
        """The grammar writes ``literal`` here: consume it whole (kept in ``_unsaid`` until a call is told, when it
        comes before one)."""
        if self._pending.startswith(literal):
            if self._state in ("open", "prefix"):
                self._unsaid += literal
            self._pending, self._state = self._pending[len(literal) :], following
            return True
        if literal.startswith(self._pending):
            return False
        self._state = "done"  # not the grammar's output: unreachable
        return True

    def _name(self, events: list[Event]) -> bool:
        end = self._pending.find('"')
        if end < 0:
            return False
        self._call = self._start_call(events, self._pending[:end])
        self._pending, self._state, self._unsaid = self._pending[end:], "infix", ""
        return True

    def _between(self, events: list[Event]) -> bool:
        """After a call: free text again (triggered), or the separator and the next call, or the close."""
        s = self.syntax
        if self._triggered:
            self._state = "text"
            return True
        if s.separator and self._pending.startswith(s.separator):
            self._unsaid += s.separator
            self._pending, self._state = self._pending[len(s.separator) :], "prefix"
            return True
        if s.close and self._pending.startswith(s.close):
            self._pending, self._state = self._pending[len(s.close) :], "done"
            return True
        if any(literal.startswith(self._pending) for literal in (s.separator, s.close) if literal):
            return False
        self._state = "done"  # the grammar allows nothing else: unreachable
        return True

    def _done(self, events: list[Event]) -> bool:
        """Nothing follows the calls under the grammar; told as text should it ever."""
        events.append(Text(self._unsaid + self._pending))
        self._unsaid = self._pending = ""
        return False

    def _text(self, events: list[Event]) -> bool:
        assert self.syntax.trigger is not None
        if self._text_until(events, (self.syntax.trigger,)) is None:
            return False
        self._state = "prefix"  # the trigger begins the call's prefix
        return True

    def _arguments(self, events: list[Event]) -> bool:
        if self._scan is None:
            self._scan = _JsonEnd()
        end = self._scan.scan(self._pending)
        piece = self._pending if end is None else self._pending[:end]
        events.append(Arguments(self._call, piece))
        self._pending = self._pending[len(piece) :]
        if end is None:
            return False
        self._scan, self._state = None, "suffix"
        return True

    def _end(self, events: list[Event]) -> None:
        """The output ended (by its grammar, or cut short at its length): free text still held is content, and so
        is all that was written after the last call told, when the next call's name is not whole (its syntax
        included, word for word); the rest of a told call's own syntax, cut short, is not."""
        closing = self._state == "between" and self.syntax.close.startswith(self._pending)
        if self._state in ("text", "done"):
            self._end_text(events)
        elif self._state in ("open", "prefix", "name", "between") and not closing:
            self._tell(events, self._unsaid + self._pending)
        self._unsaid = ""


class FreeCallReader(ToolCallReader):
    """A model's own output under a FreeSyntax. A call is told (its start, then its arguments in one piece) once
    its JSON value is whole and reads as a call; a value that does not, or that the output cuts short, is content
    together with its marker."""

    def __init__(self, syntax: FreeSyntax, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self.syntax = syntax
        self._state = "start" if syntax.at_start else "text"
        self._region = ""  # the text of the calls region not yet told (marker, blanks, the value so far)
        self._value_start = 0  # where in _region the value being scanned starts
        self._scan: _JsonEnd | None = None

    def _advance(self, events: list[Event]) -> bool:
        return {
            "start": self._start,
            "text": self._text,
            "plain": self._plain,
            "value": self._value,
            "scan": self._scan_value,
            "after": self._after,
        }[self._state](events)

    def _start(self, events: list[Event]) -> bool:
        """Only at the start of the output may calls begin (after blanks)."""
        body = self._pending.lstrip()
        if not body:
            return False
        blanks = self._pending[: len(self._pending) - len(body)]
        if self.syntax.bare and body[0] in "{[":
            self._open_region(blanks, "")
            return True
        marker = next((m for m in self.syntax.markers if body.startswith(m)), None)
        if marker is not None:
            self._open_region(blanks, marker)
            return True
        if any(m.startswith(body) for m in self.syntax.markers):
            return False
        self._state = "plain"
        return True

    def _open_region(self, before: str, marker: str) -> None:
        self._region = before + marker
        self._pending = self._pending[len(before) + len(marker) :]
        self._state = "value"

    def _plain(self, events: list[Event]) -> bool:
        if self._after_call and not self._pending.strip():
            return False
        self._tell(events, self._pending)
        self._pending = ""
        return False

    def _text(self, events: list[Event]) -> bool:
        marker = self._text_until(events, self.syntax.markers)
        if marker is None:
            return False
        self._open_region("", marker)
        return True

    def _value(self, events: list[Event]) -> bool:
        """Inside a calls region, before a value: blanks, then the value."""
        body = self._pending.lstrip()
        self._region += self._pending[: len(self._pending) - len(body)]
        self._pending = body
        if not body:
            return False
        if body[0] in "{[":
            self._scan, self._state, self._value_start = _JsonEnd(), "scan", len(self._region)
            return True
        self._leave_region(events)  # a marker with no call after it: it was text
        return True

    def _scan_value(self, events: list[Event]) -> bool:
        assert self._scan is not None
        end = self._scan.scan(self._pending)
        piece = self._pending if end is None else self._pending[:end]
        self._region += piece
        self._pending = self._pending[len(piece) :]
        if end is None:
            return False
        calls = _calls(self._region[self._value_start :])
        if calls is None:
            self._leave_region(events)
            return True
        for name, arguments in calls:
            index = self._start_call(events, name)
            events.append(Arguments(index, arguments))
        self._region, self._state = "", "after"
        return True

    def _after(self, events: list[Event]) -> bool:
        """After a call: blanks, then a separator (another call), the closer, or the end of the calls."""
        s = self.syntax
        body = self._pending.lstrip()
        if not body:
            return False
        blanks = self._pending[: len(self._pending) - len(body)]
        if s.separator and body.startswith(s.separator):  # another value: told as text should it not be a call
            self._region, self._pending = blanks + s.separator, body[len(s.separator) :]
            self._state = "value"
            return True
        if s.closer and body.startswith(s.closer):  # the closer is syntax, not content
            self._pending, self._state = body[len(s.closer) :], "plain" if s.at_start else "text"
            return True
        if any(literal.startswith(body) for literal in (s.separator, s.closer) if literal):
            return False
        self._state = "plain" if s.at_start else "text"
        return True

    def _leave_region(self, events: list[Event]) -> None:
        """The region held no call: its text is content, and reading goes on after it."""
        self._tell(events, self._region)
        self._region, self._scan = "", None
        self._state = "plain" if self.syntax.at_start else "text"

    def _end(self, events: list[Event]) -> None:
        if self._state in ("value", "scan"):  # a marker, or a call cut short: content
            self._tell(events, self._region + self._pending)
        elif self._state in ("start", "text", "plain"):
            self._end_text(events)


def _calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments as JSON text) of each call in a JSON call object or list of them; None when the text is
    not that."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        key = next((k for k in ("arguments", "parameters") if k in item), None)
        if key is None:
            return None
        arguments = _arguments_object(item[key])
        if arguments is None:
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _arguments_object(value: Any) -> dict[str, Any] | None:
    """A call's arguments: a JSON object, or JSON text of one (some models write them as a string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


class _JsonEnd:
    """Finds where a JSON object or array ends in text that arrives in pieces, by its nesting, strings and escapes.
    Not a validator: json.loads checks the value once it is whole."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """Consume ``text`` (the value's first piece starts with its bracket); the index just past the value's
        last character, or None while it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers`` (held back: it may become one)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


def _merged(events: list[Event]) -> list[Event]:
    """Neighbouring events of one kind told as one: text with text, one call's argument pieces together."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Text) and isinstance(last, Text):
            out[-1] = Text(last.text + e.text)
        elif isinstance(e, Arguments) and isinstance(last, Arguments) and last.index == e.index:
            out[-1] = Arguments(e.index, last.text + e.text)
        elif not (isinstance(e, Text | Arguments) and not e.text):
            out.append(e)
    return out
