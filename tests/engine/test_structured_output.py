"""Structured output on the real engine and server: every constrained output parses and validates against its
schema with the ``jsonschema`` library (with and without an adapter, greedy and seeded sampling), choices and
regexes hold by Python's ``re``, an unconstrained request in the same batch is unchanged, and invalid constraints
are a 400 through the HTTP server with the official ``openai`` client."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from lora_server.adapters import demo_adapters
from lora_server.errors import InvalidRequestError
from lora_server.sampling_params import SamplingParams, StructuredOutput
from tests.servers import BASE, Server

ADAPTER = "structured-upper"  # the demo `upper` adapter, under a name of this module's own
MAX_TOKENS = 48

# each schema bounds its output's size (maxLength, maxItems, enum, integer ranges): the JSON completes in MAX_TOKENS
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
            },
            "city": {"type": "string", "maxLength": 10},
        },
        "required": ["user", "city"],
    },
    "enum_array": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 3,
    },
    "enum_field": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "calm"]}, "level": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["mood", "level"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -50, "maximum": 50},
            "ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
        },
        "required": ["count", "ratio", "step"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "boolean"}},
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 2,
    },
    "optional_and_const": {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["kind"],
    },
}
VARIANTS = {  # (adapter, sampling)
    "base-greedy": (None, dict(temperature=0)),
    "base-sampled": (None, dict(temperature=0.9, seed=11)),
    "adapter-greedy": (ADAPTER, dict(temperature=0)),
    "adapter-sampled": (ADAPTER, dict(temperature=0.9, top_p=0.95, seed=12)),
}
CHOICES = ["Paris", "London", "New York"]
REGEX = r"[0-9]{3}-[a-z]{2,6}"
FREE = SamplingParams(max_tokens=12, temperature=0)  # the unconstrained request that shares the batch


@pytest.fixture(scope="module")
def engine(engine_fp32):
    engine_fp32.adapters.add(ADAPTER, demo_adapters()["upper"])
    yield engine_fp32
    engine_fp32.adapters.remove(ADAPTER)


def _prompt(engine, text):
    return engine.chat_prompt([{"role": "user", "content": text}])


EXTRAS = {
    "choice": (StructuredOutput("choice", tuple(CHOICES)), "Name a big city."),
    "regex": (StructuredOutput("regex", REGEX), "Give me a code."),
    "json_object": (StructuredOutput("json_object"), "Describe a cat in JSON."),
}
ALL_KEYS = [(name, variant) for name in [*SCHEMAS, *EXTRAS] for variant in VARIANTS]
# the quick tier: every schema and extra once, the variants taking turns (each variant, and flat both ways)
VARIANT_NAMES = list(VARIANTS)
QUICK_KEYS = [(name, VARIANT_NAMES[i % 4]) for i, name in enumerate([*SCHEMAS, *EXTRAS])] + [("flat", "adapter-greedy")]


def _run_batch(engine, keys):
    """The constrained requests of ``keys`` and one free request, generated in one batch."""
    prompts, params, adapters = [], [], []
    for name, variant in keys:
        adapter, sampling = VARIANTS[variant]
        if name in SCHEMAS:
            constraint, text = StructuredOutput.json_schema(SCHEMAS[name]), f"Answer in JSON ({name})."
        else:
            constraint, text = EXTRAS[name]
        prompts.append(_prompt(engine, text))
        params.append(SamplingParams(max_tokens=MAX_TOKENS, structured=constraint, **sampling))
        adapters.append(adapter)
    prompts.append(_prompt(engine, "Write a haiku about the sea."))
    params.append(FREE)
    adapters.append(None)
    outputs = engine.generate(prompts, params, adapters)
    engine.check_integrity()
    return dict(zip([*keys, ("free", "base-greedy")], outputs, strict=True))


@pytest.fixture(scope="module")
def quick_batch(engine):
    return _run_batch(engine, QUICK_KEYS)


@pytest.fixture(scope="module")
def full_batch(engine):
    return _run_batch(engine, ALL_KEYS)


def _check(out, name):
    """The output holds its constraint, checked by jsonschema and Python's re (not by the grammar engine)."""
    if name == "json_object":
        if out.finish_reason == "stop":  # free-form JSON may outgrow max_tokens; when it ends, it is an object
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")
        return
    assert out.finish_reason == "stop", f"{out.text!r} did not complete"
    if name in SCHEMAS:
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    elif name == "choice":
        assert out.text in CHOICES
    else:
        assert re.fullmatch(REGEX, out.text), out.text


@pytest.mark.parametrize("name, variant", QUICK_KEYS)
def test_outputs_hold_their_constraint(quick_batch, name, variant):
    _check(quick_batch[(name, variant)], name)


@pytest.mark.slow
@pytest.mark.parametrize("name, variant", ALL_KEYS)
def test_every_schema_with_and_without_adapter_greedy_and_sampled(full_batch, name, variant):
    _check(full_batch[(name, variant)], name)


def test_the_adapter_applies_to_a_constrained_request(quick_batch):
    """A request's adapter applies under a grammar too: the same schema, greedy, gives another answer with it."""
    assert quick_batch[("flat", "base-greedy")].text != quick_batch[("flat", "adapter-greedy")].text


@pytest.mark.slow
def test_the_adapter_applies_to_constrained_requests(full_batch):
    """The adapter changes what the grammar lets through (the same schema, greedy, with and without it)."""
    differ = [full_batch[(n, "base-greedy")].text != full_batch[(n, "adapter-greedy")].text for n in SCHEMAS]
    assert sum(differ) >= len(SCHEMAS) // 2, differ


def test_unconstrained_request_is_unchanged_by_its_batch(engine, quick_batch):
    alone = engine.generate([_prompt(engine, "Write a haiku about the sea.")], FREE)[0]
    assert quick_batch[("free", "base-greedy")].token_ids == alone.token_ids


def test_grammar_ends_the_request_even_with_ignore_eos(engine):
    params = SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, structured=StructuredOutput("choice", ("yes", "no"))
    )
    out = engine.generate([_prompt(engine, "Is water wet?")], params)[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_grammars_are_compiled_once_per_constraint(engine):
    structured = engine.admission.structured_outputs()
    schema = {"type": "object", "properties": {"only": {"type": "boolean"}}, "required": ["only"]}
    before = structured.num_compiled
    for _ in range(3):
        engine.make_request([1, 2, 3], SamplingParams(structured=StructuredOutput.json_schema(json.dumps(schema))))
    assert structured.num_compiled == before + 1


@pytest.mark.parametrize(
    "constraint, param",
    [
        (StructuredOutput.json_schema({"type": "bogus"}), "guided_json"),
        (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"minLength": -1}}}), "guided_json"),
        (StructuredOutput("regex", "([a-z]+"), "guided_regex"),
        (StructuredOutput.json_schema({"type": "array", "uniqueItems": True}), "guided_json"),
        (StructuredOutput.json_schema({"properties": {"x": {"type": "number", "multipleOf": 0.5}}}), "guided_json"),
    ],
)
def test_invalid_constraints_are_refused_when_made(engine, constraint, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.make_request([1, 2, 3], SamplingParams(structured=constraint))
    assert err.value.param == param and err.value.http_status == 400


# ---- through the HTTP server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    s = Server(root, [root], ["--allow-anonymous"])
    yield s
    s.stop()


PERSON = SCHEMAS["flat"]


def test_response_format_json_schema_over_http(server):
    client = server.client()
    for model in (BASE, "upper"):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Give me a person as JSON."}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(
        model=BASE,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": CHOICES},
    )
    assert r.choices[0].text in CHOICES and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_constraints_are_400_over_http(server, fields, param):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=fields
        )
    error = err.value.body  # the client hands back the inside of OpenAI's {"error": {...}}
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    assert err.value.status_code == 400 and error["param"] == param and error["message"], error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # nothing else changed


@pytest.mark.parametrize("ref", ["http://example.com/person.json", "person.json", "#person"])
def test_a_ref_outside_the_schema_is_400_naming_it_over_http(server, ref):
    """The server never fetches a URL, and xgrammar reads such a $ref as any value: refused, never unconstrained."""
    schema = {"type": "object", "properties": {"who": {"$ref": ref}}, "required": ["who"]}
    chat = server.client().chat.completions
    asks = [
        lambda: chat.create(
            model=BASE,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        ),
        lambda: chat.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body={"guided_json": schema}
        ),
        lambda: server.client().completions.create(
            model=BASE, prompt="hi", max_tokens=4, extra_body={"guided_json": schema}
        ),
    ]
    for ask, param in zip(asks, ["response_format", "guided_json", "guided_json"], strict=True):
        with pytest.raises(openai.BadRequestError) as err:
            ask()
        error = err.value.body
        assert error["param"] == param and "$ref" in error["message"] and ref in error["message"], error
