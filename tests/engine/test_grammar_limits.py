"""What a structured-output constraint may cost, and what of a JSON schema the grammar enforces, on the real
xgrammar with the embedded model's tokenizer: limits on bytes, choices and depth refused before compiling (a 400
naming the field), a compile past its budget a 400 while the compile pool stays at its size, the grammar cache
bounded in bytes, and every JSON schema keyword the grammar does not enforce refused naming it. Each refused
schema comes with a value the grammar would have let through that ``jsonschema`` (the independent judge) rejects,
or with the proof that the schema accepts no finite value. EBNF grammars whose root derives no finite text are
refused; each one that can end comes with a finite text of it that xgrammar accepts whole."""

from __future__ import annotations

import json
import random
import string
import threading
import time

import jsonschema
import pytest
import xgrammar.testing as xgr_testing

from lora_server.config import EngineConfig
from lora_server.engine.json_schema_check import check_json_schema
from lora_server.engine.structured import StructuredOutputs, _compact_json_grammar
from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import InvalidRequestError
from lora_server.model.loader import default_model_path
from lora_server.sampling_params import StructuredOutput


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def _outputs(tokenizer: Tokenizer, **limits) -> StructuredOutputs:
    return StructuredOutputs(tokenizer, tokenizer.vocab_size, EngineConfig(**limits))


def _words(n: int, size: int, seed: int = 0) -> tuple[str, ...]:
    rng = random.Random(seed)
    return tuple("".join(rng.choices(string.ascii_letters, k=size)) for _ in range(n))


def _refused(outputs: StructuredOutputs, constraint: StructuredOutput) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        outputs.matcher(constraint)
    assert err.value.http_status == 400 and err.value.param == constraint.param
    return err.value


# ---- EBNF grammars that cannot end ----------------------------------------------------------------------------

# (grammar, a finite text of it written by hand; None: judged by hand to derive none)
ENDLESS_OR_NOT = [
    ('root ::= "a" root', None),
    ('root ::= root "a"', None),
    ("root ::= x\nx ::= x", None),
    ('root ::= ("a" root) | ("b" root)', None),
    ("root ::= [a-z]+ root", None),
    ('root ::= "(" root ")"', None),
    ('root ::= "a" x\nx ::= "b" root', None),
    ("root ::= x{1,3}\nx ::= x", None),
    ('root ::= obj\nobj ::= "{" pair "}"\npair ::= [a-z]+ ":" obj', None),
    ('root ::= "a" | root "b"', "abb"),
    ('root ::= "a"*', ""),
    ("root ::= x{0,3}\nx ::= x", ""),
    ('root ::= "a"{2,} x\nx ::= "b" (= "c")', "aab"),
    ('root ::= x\nx ::= "(" x ")" | ""', "(())"),
    ('root ::= "a" | "b" x\nx ::= x "c"', "a"),
    (
        'root ::= obj\nobj ::= "{" (pair ("," pair)*)? "}"\npair ::= [a-z]+ ":" val\nval ::= obj | [0-9]+',
        "{a:{b:1},c:2}",
    ),
    ('root ::= [\\u0100-\\u0200]* "\\"|()"', 'ĀĂ"|()'),
]


@pytest.mark.parametrize("ebnf, text", ENDLESS_OR_NOT)
def test_a_grammar_that_cannot_end_is_refused(tokenizer, ebnf, text):
    outputs, constraint = _outputs(tokenizer), StructuredOutput("grammar", ebnf)
    if text is None:
        with pytest.raises(InvalidRequestError) as err:
            outputs.check(constraint)
        assert err.value.param == "guided_grammar" and "derives no finite text" in err.value.message
    else:
        assert xgr_testing._is_grammar_accept_string(ebnf, text)
        outputs.check(constraint)


def test_a_long_chain_of_rules_is_checked_in_one_pass(tokenizer):
    """3,000 rules each needing the next: a naive fixed point would take 3,000 passes over them."""
    chain = "\n".join(["root ::= r0", *(f'r{i} ::= "a" r{i + 1}' for i in range(3000)), 'r3000 ::= "end"'])
    _outputs(tokenizer).check(StructuredOutput("grammar", chain))
    assert xgr_testing._is_grammar_accept_string(chain, "a" * 3000 + "end")
    endless = chain.replace('r3000 ::= "end"', 'r3000 ::= "end" r0')
    with pytest.raises(InvalidRequestError):
        _outputs(tokenizer).check(StructuredOutput("grammar", endless))


# ---- sizes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "limits, constraint, field",
    [
        (dict(max_guided_choices=3), StructuredOutput("choice", ("a", "b", "c", "d")), "guided_choice"),
        (dict(max_choice_bytes=1024), StructuredOutput("choice", _words(2, 600)), "guided_choice"),
        (dict(max_regex_bytes=1024), StructuredOutput("regex", "x" * 1025), "guided_regex"),
        (dict(max_grammar_bytes=64), StructuredOutput("grammar", 'root ::= "' + "y" * 64 + '"'), "guided_grammar"),
        (
            dict(max_json_schema_bytes=1024),
            StructuredOutput.json_schema({"enum": list(_words(20, 60))}),
            "guided_json",
        ),
    ],
)
def test_constraints_over_a_limit_are_400_naming_the_field(tokenizer, limits, constraint, field):
    outputs = _outputs(tokenizer, **limits)
    err = _refused(outputs, constraint)
    assert err.param == field and err.code == "grammar_too_large", err.message
    assert outputs.num_compiled == 0  # refused before compiling
    _outputs(tokenizer).matcher(constraint)  # within the default limits the same constraint compiles


def test_a_schema_nested_100_deep_is_400_not_a_crash(tokenizer):
    schema: dict = {"type": "integer"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    err = _refused(_outputs(tokenizer), StructuredOutput.json_schema(schema))
    assert "--max-json-schema-depth" in err.message


# ---- what the grammar enforces ------------------------------------------------------------------------------

# (schema, keyword the 400 names, a value jsonschema rejects that the grammar xgrammar builds accepts)
UNENFORCED = [
    (
        {
            "allOf": [
                {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"type": "object", "properties": {"y": {"type": "string"}}, "required": ["y"]},
            ]
        },
        "allOf",
        {"x": 1},
    ),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}, "allOf", 9),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", 3),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        "dependentRequired",
        {"a": 1},
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        "dependentSchemas",
        {"a": 1},
    ),
    ({"$defs": {"p": {"type": "integer", "minimum": 3}}, "$ref": "#/$defs/p", "maximum": 5}, "beside $ref", 9),
    ({"type": "object", "required": ["zz"]}, "required", {}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]}, "required", {"a": 1}),
]


@pytest.mark.parametrize("schema, keyword, slipped", UNENFORCED)
def test_keywords_the_grammar_ignores_are_400_naming_them(tokenizer, schema, keyword, slipped):
    # the reason: xgrammar's grammar of this schema accepts a value that the schema does not
    assert xgr_testing._is_grammar_accept_string(_compact_json_grammar(schema, "p"), json.dumps(slipped))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(slipped, schema)
    err = _refused(_outputs(tokenizer), StructuredOutput.json_schema(schema))
    assert keyword in err.message, err.message


def test_pattern_properties_are_refused(tokenizer):
    """Strict mode writes no property a schema does not name: a patternProperties schema's properties never come."""
    schema = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "minProperties": 0}
    grammar = _compact_json_grammar(schema, "p")
    assert not xgr_testing._is_grammar_accept_string(grammar, json.dumps({"xa": 1}))
    jsonschema.validate({"xa": 1}, schema)
    assert "patternProperties" in _refused(_outputs(tokenizer), StructuredOutput.json_schema(schema)).message


CITY = "http://example.com/city.json"
CITY_SCHEMA = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "string", "maxLength": 4}
# (schema, the $ref or keyword the 400 names, a value jsonschema rejects that the grammar xgrammar builds accepts):
# xgrammar follows only "#" and "#/..." and reads any other reference as "any value"
OUTSIDE_REFS = [
    ({"type": "object", "properties": {"a": {"$ref": CITY}}, "required": ["a"]}, CITY, {"a": 12345}),
    ({"type": "object", "properties": {"a": {"$ref": "city.json"}}, "required": ["a"]}, "city.json", {"a": 12345}),
    (  # an $anchor
        {
            "type": "object",
            "$defs": {"c": {"$anchor": "city", "type": "string"}},
            "properties": {"a": {"$ref": "#city"}},
            "required": ["a"],
        },
        "#city",
        {"a": 12345},
    ),
    (  # the schema's own $id, written out: jsonschema resolves it in the document, xgrammar does not
        {
            "$id": "http://example.com/root",
            "type": "object",
            "$defs": {"c": {"type": "string"}},
            "properties": {"a": {"$ref": "http://example.com/root#/$defs/c"}},
            "required": ["a"],
        },
        "http://example.com/root#/$defs/c",
        {"a": 12345},
    ),
    (  # an $id inside: its "#/..." points into its own resource, xgrammar reads it from the document's root
        {
            "type": "object",
            "$defs": {
                "c": {"type": "string"},
                "inner": {
                    "$id": "http://example.com/inner",
                    "type": "object",
                    "$defs": {"c": {"type": "integer"}},
                    "properties": {"v": {"$ref": "#/$defs/c"}},
                    "required": ["v"],
                },
            },
            "properties": {"a": {"$ref": "#/$defs/inner"}},
            "required": ["a"],
        },
        "$id",
        {"a": {"v": "x"}},
    ),
    (
        {"type": "object", "$defs": {"c": {"type": "string"}}, "properties": {"a": {"$dynamicRef": "#/$defs/c"}}},
        "$dynamicRef",
        {"a": 12345},
    ),
    (
        {
            "$schema": "https://json-schema.org/draft/2019-09/schema",
            "type": "object",
            "properties": {"a": {"anyOf": [{"type": "string"}, {"$recursiveRef": "#"}]}},
            "required": ["a"],
        },
        "$recursiveRef",
        {"a": 12345},
    ),
]


@pytest.mark.parametrize("schema, named, slipped", OUTSIDE_REFS)
def test_references_the_grammar_does_not_follow_are_400_naming_them(tokenizer, schema, named, slipped):
    """The server never fetches a URL: a reference outside the schema (or one xgrammar reads from the wrong place)
    would leave its value unconstrained."""
    from referencing import Registry, Resource

    assert xgr_testing._is_grammar_accept_string(_compact_json_grammar(schema, "p"), json.dumps(slipped))
    registry = Registry().with_resources([(CITY, Resource.from_contents(CITY_SCHEMA))])
    registry = registry.with_resources([("city.json", Resource.from_contents(CITY_SCHEMA))])
    validator = jsonschema.validators.validator_for(schema)(schema, registry=registry)
    assert not validator.is_valid(slipped)
    for param in ("response_format", "tools"):
        err = _refused(_outputs(tokenizer), StructuredOutput.json_schema(schema, param))
        assert named in err.message and err.param == param, err.message


def test_local_references_are_served(tokenizer):
    schema = {
        "$id": "http://example.com/root",
        "type": "object",
        "$defs": {"c": {"type": "string", "maxLength": 4}, "a/b": {"type": "integer"}},
        "properties": {"a": {"$ref": "#/$defs/c"}, "b": {"$ref": "#/$defs/a~1b"}},
        "required": ["a", "b"],
    }
    _outputs(tokenizer).matcher(StructuredOutput.json_schema(schema))
    grammar = _compact_json_grammar(schema, "p")
    assert xgr_testing._is_grammar_accept_string(grammar, json.dumps({"a": "abc", "b": 3}))
    assert not xgr_testing._is_grammar_accept_string(grammar, json.dumps({"a": "abcdef", "b": 3}))


def test_the_depth_is_measured_before_anything_recurses():
    """A schema nested past what Python can recurse through is a 400 naming the limit, whatever limit the server
    was given (a limit above what the checks can walk is a 400 too, never a RecursionError)."""
    schema: dict = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(InvalidRequestError) as err:
        check_json_schema(schema, "tools", 64 * 1024, 32, where="tools[0].function.parameters")
    assert err.value.param == "tools" and "tools[0].function.parameters" in err.value.message
    assert "10001 levels" in err.value.message and "--max-json-schema-depth" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        check_json_schema(schema, "tools", 1 << 30, 100_000)
    assert err.value.param == "tools"
    check_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "tools", 1024, 3)
    with pytest.raises(InvalidRequestError) as err:
        check_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "tools", 1024, 2)
    assert "3 levels" in err.value.message


RECURSIVE_NOTHING = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {
        "$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
        },
        "$ref": "#/$defs/a",
    },
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
]


@pytest.mark.parametrize("schema", RECURSIVE_NOTHING)
def test_recursive_schemas_that_accept_nothing_are_400(tokenizer, schema):
    err = _refused(_outputs(tokenizer), StructuredOutput.json_schema(schema))
    assert "$ref" in err.message and "no finite value" in err.message


RECURSIVE_FINE = [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, {"a": {"a": {}}}),
    (
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                    "required": ["c"],
                }
            },
            "$ref": "#/$defs/n",
        },
        {"c": [{"c": []}]},
    ),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}, "ab"),
]


@pytest.mark.parametrize("schema, value", RECURSIVE_FINE)
def test_recursion_with_an_end_and_any_of_are_served(tokenizer, schema, value):
    jsonschema.validate(value, schema)
    _outputs(tokenizer).matcher(StructuredOutput.json_schema(schema))
    assert xgr_testing._is_grammar_accept_string(_compact_json_grammar(schema, "p"), json.dumps(value))


# ---- compile budget, pool and cache -------------------------------------------------------------------------

SLOW_CHOICE = StructuredOutput("choice", _words(50, 1000, seed=1))  # ~50 KB: ~0.3 s to compile on one core
BIG = dict(max_choice_bytes=1 << 20)


def test_a_compile_past_its_budget_is_400_and_the_pool_stays_bounded(tokenizer):
    before = set(threading.enumerate())
    outputs = _outputs(tokenizer, grammar_compile_timeout=0.05, grammar_compile_threads=2, **BIG)
    errors: list[InvalidRequestError] = []

    def ask(seed: int) -> None:
        try:
            outputs.matcher(StructuredOutput("choice", _words(100, 1000, seed=seed)))
        except InvalidRequestError as exc:
            errors.append(exc)

    callers = [threading.Thread(target=ask, args=(seed,)) for seed in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=60)
    assert len(errors) == 8 and all(e.code == "grammar_too_complex" and e.param == "guided_choice" for e in errors)
    compiling = [t for t in set(threading.enumerate()) - before if t.name.startswith("grammar-compile")]
    assert len(compiling) <= 2
    # the 6 compiles nobody waits for any more were dropped before they started: at most the 2 running finish
    deadline = time.monotonic() + 60
    while any(t.is_alive() and "grammar-compile" in t.name for t in threading.enumerate()) and outputs._compiling:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert outputs.num_compiled <= 2


def test_identical_compiles_in_flight_share_one(tokenizer):
    outputs = _outputs(tokenizer, **BIG)
    callers = [threading.Thread(target=outputs.matcher, args=(SLOW_CHOICE,)) for _ in range(6)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert outputs.num_compiled == 1


def test_the_grammar_cache_is_bounded_in_bytes(tokenizer):
    budget = 8 << 20
    outputs = _outputs(tokenizer, grammar_cache_bytes=budget)
    sizes = []
    for seed in range(12):
        regex = "".join(_words(1, 12_000, seed=seed))  # a 12 KB literal: about 2 MB of compiled grammar
        sizes.append(outputs.compiled(StructuredOutput("regex", regex)).memory_size_bytes)
    assert sum(sizes) > 2 * budget  # the cache had to let grammars go
    assert 0 < outputs.cached_bytes <= budget
    assert outputs.num_compiled == 12
