"""What of a JSON schema the structured-output grammar enforces, checked before it is compiled.

xgrammar (0.2.8, strict mode) turns a schema into a grammar, but some keywords it reads without enforcing: the
output would then not validate. Measured (tests/test_grammar_limits.py holds each case): ``allOf`` is ignored
(any JSON passes), ``oneOf`` is read as ``anyOf`` (a value matching two branches passes), ``dependentRequired``,
``dependentSchemas`` and ``dependencies`` are ignored, keywords beside a ``$ref`` are ignored, a ``required``
name that ``properties`` lacks is never written, ``patternProperties`` is never written (strict mode writes no
property the schema does not name); ``uniqueItems``, ``contains``, ``not``, ``if``/``then``/``else`` and a
non-integer ``multipleOf`` are not enforced. A ``$ref`` recursion whose every path is required (``{"properties":
{"a": {"$ref": "#"}}, "required": ["a"]}``) accepts no finite value: the grammar lets the model nest forever.
Each is refused with a 400 naming the keyword. ``anyOf``, ``enum``, ``const``, ``pattern``, ``format``,
``propertyNames``, length, item and property counts and numeric bounds are enforced."""

from __future__ import annotations

from typing import Any

from lora_server.errors import InvalidRequestError

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
)
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf")
# what may stand beside a $ref: annotations and definitions, which change nothing the output must hold
_BESIDE_REF = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default"}
_BESIDE_REF |= {"examples", "deprecated", "readOnly", "writeOnly"}


def check_enforceable(schema: object, param: str, max_depth: int) -> None:
    """InvalidRequestError (naming ``param`` and the keyword) when the schema document nests deeper than
    ``max_depth`` objects and arrays, uses a keyword the grammar would not enforce, or accepts no finite value."""
    depth = _nesting(schema)
    if depth > max_depth:
        raise InvalidRequestError(
            f"{param} nests {depth} levels deep; the server's limit is {max_depth} (--max-json-schema-depth)",
            param=param,
            code="grammar_too_large",
        )
    refs: set[str] = set()
    for node in _subschemas(schema):
        _check_node(node, param)
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            refs.add(node["$ref"])
    finite = _finite_refs(schema, refs)
    if not _finite(schema, finite):
        cause = next((ref for ref in sorted(refs) if not finite[ref]), None)
        raise InvalidRequestError(
            f"{param}: the JSON schema accepts no finite value"
            + (f" ($ref {cause!r} recurses through required properties or items without end)" if cause else ""),
            param=param,
        )


def _nesting(document: object) -> int:
    """How many objects and arrays deep ``document`` goes (iterative: any depth is measured)."""
    deepest, stack = 0, [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _subschemas(schema: object) -> list[dict[str, Any]]:
    """Every object subschema of ``schema``, itself included (its nesting is bounded: see ``_nesting``)."""
    found: list[dict[str, Any]] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found.append(node)
        stack.extend(node.get(k) for k in _SUBSCHEMA)
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
    return found


def _check_node(node: dict[str, Any], param: str) -> None:
    used = [k for k in _UNENFORCED if k in node and node[k] is not False]
    if "multipleOf" in node and not (node.get("type") == "integer" and isinstance(node["multipleOf"], int)):
        used.append("multipleOf (other than an integer's)")
    if "$ref" in node:
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
