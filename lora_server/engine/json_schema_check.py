"""JSON schemas from requests, checked before anything else reads them: within the server's limits and valid
(``check_json_schema``, for every schema a request gives: structured output's and each tool's parameters), and, where
a grammar will enforce one, using only what the grammar enforces (``check_enforceable``).

The depth is measured first and without recursion: JSON Schema validation, serializing, the chat template and the
grammar compiler all recurse through a schema, and one nested deeper than Python's recursion limit would otherwise
be a RecursionError (a 500 and a page of traceback per request) rather than a 400.

xgrammar (0.2.8, strict mode) turns a schema into a grammar, but some keywords it reads without enforcing: the
output would then not validate. Measured (tests/engine/test_grammar_limits.py holds each case): ``allOf`` is ignored
(any JSON passes), ``oneOf`` is read as ``anyOf`` (a value matching two branches passes), ``dependentRequired``,
``dependentSchemas`` and ``dependencies`` are ignored, keywords beside a ``$ref`` are ignored, a ``required``
name that ``properties`` lacks is never written, ``patternProperties`` is never written (strict mode writes no
property the schema does not name); ``uniqueItems``, ``contains``, ``not``, ``if``/``then``/``else`` and a
non-integer ``multipleOf`` are not enforced. xgrammar follows a ``$ref`` only inside the document (``#`` or
``#/`` and a JSON pointer, from the document's root): any other (a URL, a file name, an ``$anchor``, the document's
own ``$id`` written out) it reads as "any value", as it does ``$dynamicRef`` and ``$recursiveRef``, and a ``#/...``
inside a subschema with its own ``$id`` means that resource's root in JSON Schema, not the document's; the server
fetches nothing. A ``$ref`` recursion whose every path is required (``{"properties": {"a": {"$ref": "#"}},
"required": ["a"]}``) accepts no finite value: the grammar lets the model nest forever. Each is refused with a 400
naming the keyword. ``anyOf``, ``enum``, ``const``, ``pattern``, ``format``,
``propertyNames``, length, item and property counts and numeric bounds are enforced."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from lora_server.errors import InvalidRequestError
from lora_server.tools.spec import json_nesting

_UNENFORCED = (
    "allOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "patternProperties",
    "$dynamicRef",
    "$recursiveRef",
)
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf")
# what may stand beside a $ref: annotations and definitions, which change nothing the output must hold
_BESIDE_REF = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default"}
_BESIDE_REF |= {"examples", "deprecated", "readOnly", "writeOnly"}


def check_json_schema(schema: object, param: str, max_bytes: int, max_depth: int, where: str | None = None) -> None:
    """InvalidRequestError naming ``param`` (its message names ``where``, default ``param``) when the schema document
    nests deeper than ``max_depth`` objects and arrays (measured first, without recursion), is larger than
    ``max_bytes`` as compact JSON, or is not a valid JSON schema (by its own $schema's rules, else 2020-12)."""
    where = where or param
    depth = json_nesting(schema)
    if depth > max_depth:
        raise InvalidRequestError(
            f"{where} nests {depth} levels deep; the server's limit is {max_depth} (--max-json-schema-depth)",
            param=param,
            code="grammar_too_large",
        )
    try:
        size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())
        if size > max_bytes:
            raise InvalidRequestError(
                f"{where} has {size} bytes; the server's limit is {max_bytes} (--max-json-schema-kb)",
                param=param,
                code="grammar_too_large",
            )
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.path)
        raise InvalidRequestError(
            f"{where} is not a valid JSON schema{f' (at {at})' if at else ''}: {exc.message[:200]}", param=param
        ) from None
    except RecursionError:  # a --max-json-schema-depth above what Python can recurse through
        raise InvalidRequestError(
            f"{where} nests {depth} levels deep, more than the server can check", param=param, code="grammar_too_large"
        ) from None


def check_enforceable(schema: object, param: str) -> None:
    """InvalidRequestError (naming ``param`` and the keyword) when the schema uses a keyword or a $ref the grammar
    would not enforce, or accepts no finite value. Call ``check_json_schema`` first: this walk recurses."""
    refs: set[str] = set()
    walked: set[int] = set()  # the subschemas checked, by id()
    starts = [schema]  # the root, then what each $ref points at (a $ref may point outside the walk's keywords)
    while starts:
        for node, in_resource in _subschemas(starts.pop(), schema, walked):
            _check_node(node, param)
            ref = node.get("$ref")
            if not isinstance(ref, str):
                continue
            if in_resource:
                raise InvalidRequestError(
                    f"{param}: structured output cannot enforce the JSON schema keyword $ref inside a subschema "
                    "with an $id of its own (the $ref would point into that subschema; give only the root an $id)",
                    param,
                )
            if ref not in refs:
                refs.add(ref)
                starts.append(_resolve(schema, ref))
    finite = _finite_refs(schema, refs)
    if not _finite(schema, finite):
        cause = next((ref for ref in sorted(refs) if not finite[ref]), None)
        raise InvalidRequestError(
            f"{param}: the JSON schema accepts no finite value"
            + (f" ($ref {cause!r} recurses through required properties or items without end)" if cause else ""),
            param=param,
        )


def _subschemas(start: object, root: object, walked: set[int]) -> list[tuple[dict[str, Any], bool]]:
    """Every object subschema of ``start`` (a subschema of ``root``, or ``root``) not yet in ``walked`` (ids, which
    this adds to), each with whether it lies in a subschema other than ``root`` that has an ``$id`` of its own (a
    resource within the document). The nesting is bounded: see ``json_nesting``."""
    found: list[tuple[dict[str, Any], bool]] = []
    stack = [(start, False)]
    while stack:
        node, in_resource = stack.pop()
        if not isinstance(node, dict) or id(node) in walked:
            continue
        walked.add(id(node))
        in_resource = in_resource or (node is not root and "$id" in node)
        found.append((node, in_resource))
        children = [node.get(k) for k in _SUBSCHEMA]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children.extend(node[key].values())
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children.extend(node[key])
        stack.extend((child, in_resource) for child in children)
    return found


def _check_node(node: dict[str, Any], param: str) -> None:
    used = [k for k in _UNENFORCED if k in node and node[k] is not False]
    if "multipleOf" in node and not (node.get("type") == "integer" and isinstance(node["multipleOf"], int)):
        used.append("multipleOf (other than an integer's)")
    if "$ref" in node:
        ref = node["$ref"]
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            inside = "only references inside the schema, '#' or '#/...', are followed: the server fetches nothing"
            used.append(f"$ref {ref[:200]!r} ({inside})")
        beside = sorted(set(node) - _BESIDE_REF)
        if beside:
            used.append(f"{beside[0]} beside $ref")
    properties, required = _of(node, "properties", dict), _of(node, "required", list)
    missing = [name for name in required if name not in properties]
    if missing:
        used.append(f"required (names {missing[0]!r}, which properties does not define)")
    if used:
        raise InvalidRequestError(f"{param}: structured output cannot enforce the JSON schema keyword {used[0]}", param)


def _finite_refs(root: object, refs: set[str]) -> dict[str, bool]:
    """Which local $refs can produce a finite value: the least fixed point, from "none" up (a recursion that
    only a required path continues never becomes finite)."""
    finite = dict.fromkeys(refs, False)
    changed = True
    while changed:
        changed = False
        for ref in refs:
            target = _resolve(root, ref)
            if not finite[ref] and (target is _MISSING or _finite(target, finite)):
                finite[ref] = changed = True
    return finite


_MISSING = object()


def _resolve(root: object, ref: str) -> object:
    """The subschema a local $ref (a JSON pointer after "#") points at, or _MISSING (xgrammar then refuses it)."""
    node = root
    for part in ref[1:].lstrip("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _finite(node: object, finite_refs: dict[str, bool]) -> bool:
    """Whether ``node`` accepts some finite value, given which $refs do."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    if isinstance(node.get("$ref"), str):
        return finite_refs.get(node["$ref"], True)
    branches = node.get("anyOf")
    if isinstance(branches, list) and branches and not any(_finite(b, finite_refs) for b in branches):
        return False
    kind = node.get("type", "object" if "properties" in node else None)
    if kind == "object":
        properties, required = _of(node, "properties", dict), _of(node, "required", list)
        return all(_finite(properties.get(name, True), finite_refs) for name in required)
    if kind == "array":
        least = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
        prefix = _of(node, "prefixItems", list)
        if not all(_finite(item, finite_refs) for item in prefix[:least]):
            return False
        return least <= len(prefix) or _finite(node.get("items", True), finite_refs)
    return True


def _of(node: dict[str, Any], key: str, kind: type) -> Any:
    """``node[key]`` when it is a ``kind`` (dict or list), else an empty one."""
    value = node.get(key)
    return value if isinstance(value, kind) else kind()
