"""Whether a ``guided_grammar`` (EBNF) can end, checked before it is compiled.

A grammar whose root derives no finite string (``root ::= "a" root``, ``root ::= x`` with ``x ::= x``) is valid to
xgrammar: its matcher lets the model write the rule's prefix until ``max_tokens`` (or, with nothing to write at all,
refuses the first token). The answer can never be text of the grammar, so such a grammar is refused with a 400
naming the rule. The check reads xgrammar's own normalized form of the grammar (``str(xgr.Grammar)``: each rule a
choice of sequences of string literals, character classes, ``[...]*`` stars and rule references, a reference
possibly repeated ``{m, n}``) and finds the productive rules, those deriving some finite string, as a least fixed
point. What it cannot read there is taken as productive: it never refuses a grammar it does not understand."""

from __future__ import annotations

import re

import xgrammar as xgr

from lora_server.errors import InvalidRequestError

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*")
    | (?P<cls>\[(?:[^\]\\]|\\.)*\]\*?)
    | (?P<ref>[A-Za-z_][A-Za-z0-9_.-]*)(?:\{(?P<low>-?\d+),\s*(?P<high>-?\d+)\})?
    | (?P<look>\(=)
    | (?P<punct>[()|])
    )""",
    re.VERBOSE,
)
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*) ::= (.*)$")


class _Unreadable(Exception):
    """The normalized form holds a construct this reader does not know."""


def check_terminates(grammar: xgr.Grammar, param: str) -> None:
    """InvalidRequestError naming ``param`` when the parsed ``grammar``'s root rule derives no finite string."""
    try:
        rules = {m.group(1): _parse(m.group(2)) for line in str(grammar).splitlines() if (m := _RULE.match(line))}
    except _Unreadable:
        return
    if "root" not in rules:
        return
    productive = _productive(rules)
    if "root" not in productive:
        raise InvalidRequestError(
            f"{param}: the grammar's root rule derives no finite text (every way through it recurses without end), "
            "so no answer could ever match it",
            param=param,
        )


# An expression: ("alt", [seq, ...]), ("seq", [expr, ...]), ("ref", name, low) or ("leaf",) (a literal or class).
def _parse(body: str) -> tuple:
    tokens = _tokens(body)
    expr, i = _alternatives(tokens, 0)
    if i != len(tokens):
        raise _Unreadable(body)
    return expr


def _tokens(body: str) -> list[tuple]:
    out: list[tuple] = []
    i = 0
    while i < len(body):
        if body[i:].strip() == "":
            break
        m = _TOKEN.match(body, i)
        if m is None:
            raise _Unreadable(body[i:])
        i = m.end()
        if m.group("look"):  # a lookahead asserts, it adds nothing to derive: skip its balanced group
            depth = 1
            while depth and i < len(body):
                t = _TOKEN.match(body, i)
                if t is None:
                    raise _Unreadable(body[i:])
                i = t.end()
                depth += (t.group("punct") == "(") + bool(t.group("look")) - (t.group("punct") == ")")
            continue
        if m.group("string") or m.group("cls"):
            out.append(("leaf",))
        elif m.group("ref"):
            low = int(m.group("low")) if m.group("low") is not None else 1
            out.append(("ref", m.group("ref"), low))
        else:
            out.append(("punct", m.group("punct")))
    return out


def _alternatives(tokens: list[tuple], i: int) -> tuple[tuple, int]:
    seqs = []
    while True:
        seq, i = _sequence(tokens, i)
        seqs.append(seq)
        if i < len(tokens) and tokens[i] == ("punct", "|"):
            i += 1
            continue
        return ("alt", seqs), i


def _sequence(tokens: list[tuple], i: int) -> tuple[tuple, int]:
    items = []
    while i < len(tokens):
        if tokens[i] == ("punct", "("):
            inner, i = _alternatives(tokens, i + 1)
            if i >= len(tokens) or tokens[i] != ("punct", ")"):
                raise _Unreadable("unbalanced parentheses")
            items.append(inner)
        elif tokens[i][0] == "punct":  # "|" or ")": the sequence ends
            break
        else:
            items.append(tokens[i])
        i += 1
    return ("seq", items), i


def _productive(rules: dict[str, tuple]) -> set[str]:
    """The rules that derive some finite string: the least fixed point, from none up. A rule is looked at again
    only when a rule it refers to has just become productive (linear in the grammar for chains of any length)."""
    users: dict[str, set[str]] = {name: set() for name in rules}
    for name, expr in rules.items():
        for ref in _refs(expr):
            if ref in users:
                users[ref].add(name)
    productive: set[str] = set()
    todo = list(rules)
    while todo:
        name = todo.pop()
        if name not in productive and _derives(rules[name], productive, rules):
            productive.add(name)
            todo.extend(users[name] - productive)
    return productive


def _refs(expr: tuple) -> list[str]:
    if expr[0] == "ref":
        return [expr[1]]
    if expr[0] == "leaf":
        return []
    return [ref for e in expr[1] for ref in _refs(e)]


def _derives(expr: tuple, productive: set[str], rules: dict[str, tuple]) -> bool:
    kind = expr[0]
    if kind == "leaf":
        return True
    if kind == "ref":
        _, name, low = expr
        return low <= 0 or name in productive or name not in rules
    if kind == "seq":
        return all(_derives(e, productive, rules) for e in expr[1])
    return any(_derives(e, productive, rules) for e in expr[1])
