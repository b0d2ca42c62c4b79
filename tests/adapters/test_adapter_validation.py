"""Every adapter refusal: a clear AdapterError, nothing registered, and the engine keeps serving."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_server.adapters.peft_format import AdapterError, BaseShapes, load_peft_adapter, read_peft_adapter
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams

HIDDEN, KV, INTER, LAYERS = 576, 192, 1536, 30
BASE = BaseShapes.llama(LAYERS, HIDDEN, INTER, HIDDEN, KV)  # SmolLM2-135M
FILES = ("adapter_model.safetensors", "adapter_config.json")


def _write(path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _good(path, r: int = 4):
    """A valid hand-made PEFT adapter on q_proj and v_proj of every layer."""
    tensors = {}
    for i in range(LAYERS):
        for proj, out in (("q_proj", HIDDEN), ("v_proj", KV)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, HIDDEN) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r) * 0.01
    config = dict(peft_type="LORA", r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], bias="none")
    _write(path, config, tensors)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "adapter_model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _pickle_only(p):
    (p / "adapter_model.safetensors").unlink()
    (p / "adapter_model.bin").write_bytes(b"\x80\x04not really")


def _nan(t):
    t[next(iter(t))][0, 0] = float("nan")


def _inf(t):
    t[next(k for k in t if "lora_B" in k)][1, 0] = float("inf")


def _wrong_shape(t):
    key = next(k for k in t if "v_proj.lora_B" in k)
    t[key] = torch.zeros(HIDDEN, 4)  # v_proj outputs 192 features, not 576


def _bias(t):
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = torch.zeros(HIDDEN)


CASES = {
    "pickle": (_pickle_only, "pickle"),
    "rank above max": (lambda p: _edit_config(p, r=4, rank_pattern={"q_proj": 128}), "maximum LoRA rank"),
    "dora without magnitudes": (lambda p: _edit_config(p, use_dora=True), "lacks its DoRA magnitude"),
    "modules_to_save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "bias config": (lambda p: _edit_config(p, bias="all"), "bias"),
    "bias tensor": (lambda p: _edit_tensors(p, _bias), "bias"),
    "unknown target": (lambda p: _edit_config(p, target_modules=["q_proj", "c_attn"]), "not in the base model"),
    "regex matches nothing": (lambda p: _edit_config(p, target_modules=r".*\.c_fc"), "matches no module"),
    "shape mismatch": (lambda p: _edit_tensors(p, _wrong_shape), "do not match the base"),
    "nan": (lambda p: _edit_tensors(p, _nan), "NaN or Inf"),
    "inf": (lambda p: _edit_tensors(p, _inf), "NaN or Inf"),
    "layer out of range": (lambda p: _edit_config(p, layers_to_transform=[0, 31]), "do not exist"),
    # an activated LoRA whose invocation can never occur in a prompt (SmolLM2: 49152 tokens, 8192 positions)
    "alora id beyond the vocabulary": (
        lambda p: _edit_config(p, alora_invocation_tokens=[5, 49152, 2**80]),
        r"alora_invocation_tokens: 2 token id\(s\) \(e.g. 49152\) are beyond the base model's vocabulary of 49152",
    ),
    "alora longer than the context": (
        lambda p: _edit_config(p, alora_invocation_tokens=[5] * 200_000),
        "alora_invocation_tokens holds 200000 tokens, more than the base model's context of 8192 positions",
    ),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    return allowed, outside


@pytest.fixture(scope="module")
def engine(roots):
    return Engine(
        EngineConfig(
            quantization="none",
            kv_cache_bytes=32 << 20,
            max_lora_rank=16,
            adapter_roots=(str(roots[0]),),
            show_progress=False,
        )
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_refusals_leave_the_engine_serving(engine, roots, case):
    break_it, reason = CASES[case]
    path = _good(roots[0] / case.replace(" ", "_"))
    break_it(path)
    before = engine.adapters.names()
    with pytest.raises(AdapterError, match=reason):
        engine.adapters.add("bad", path)
    assert engine.adapters.names() == before
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    engine.check_integrity()


def test_path_outside_roots_is_refused(engine, roots):
    path = _good(roots[1] / "elsewhere")
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
        engine.adapters.add("outside", path)
    link = roots[0] / "sneaky"
    link.symlink_to(path, target_is_directory=True)  # a link inside the root that leads out is refused too
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
        engine.adapters.add("outside", link)


def test_valid_adapter_registers_with_and_without_prefix(engine, roots):
    path = _good(roots[0] / "good")
    engine.adapters.add("good", path)
    plain = roots[0] / "good-no-prefix"
    shutil.copytree(path, plain)

    def strip(t):
        for k in list(t):
            t[k.removeprefix("base_model.model.")] = t.pop(k)

    _edit_tensors(plain, strip)
    engine.adapters.add("good-plain", plain)
    assert {"good", "good-plain"} <= set(engine.adapters.names())


NAN, INF = float("nan"), float("inf")
# case -> (the whole adapter_config.json as bytes, or fields changed in the valid config; a substring of the reason)
MALFORMED_CONFIGS = {
    "not utf-8": (b'{"r": 4, "lora_alpha": 8, "target_modules": ["q_\xff"]}', "not UTF-8"),
    "not json": (b'{"r": 4,', "not valid JSON"),
    "nested too deep": (b"[" * 100_000, "not valid JSON"),
    "integer of 5000 digits": (b'{"r": ' + b"9" * 5000 + b"}", "not valid JSON"),
    "an array": (b'[{"r": 4}]', "must hold a JSON object, not an array"),
    "a string": (b'"LORA"', "must hold a JSON object, not a string"),
    "a number": (b"8", "must hold a JSON object, not a number"),
    "r zero": ({"r": 0}, "r must be a positive integer, got 0"),
    "r negative": ({"r": -1}, "r must be a positive integer"),
    "r string": ({"r": "8"}, "r must be a positive integer, got '8'"),
    "r float": ({"r": 8.5}, "r must be a positive integer"),
    "r true": ({"r": True}, "r must be a positive integer, got True"),
    "lora_alpha string": ({"lora_alpha": "16"}, "lora_alpha must be a finite number"),
    "lora_alpha NaN": ({"lora_alpha": NAN}, "lora_alpha must be a finite number"),
    "lora_alpha Infinity": ({"lora_alpha": INF}, "lora_alpha must be a finite number"),
    "lora_alpha -Infinity": ({"lora_alpha": -INF}, "lora_alpha must be a finite number"),
    "lora_alpha beyond float32": ({"lora_alpha": 1e39}, "lora_alpha must be a finite number"),
    "lora_alpha huge integer": ({"lora_alpha": 10**400}, "lora_alpha must be a finite number"),
    "lora_alpha true": ({"lora_alpha": True}, "lora_alpha must be a finite number"),
    "rank_pattern a list": ({"rank_pattern": [["q_proj", 4]]}, "rank_pattern must be an object"),
    "rank_pattern zero": ({"rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj'] must be a positive integer"),
    "rank_pattern string": ({"rank_pattern": {"q_proj": "4"}}, "rank_pattern['q_proj'] must be a positive integer"),
    "rank_pattern float": ({"rank_pattern": {"q_proj": 4.0}}, "rank_pattern['q_proj'] must be a positive integer"),
    "rank_pattern bad regex": ({"rank_pattern": {"q_proj(": 4}}, "rank_pattern key 'q_proj(' is not a valid regular"),
    "alpha_pattern a string": ({"alpha_pattern": "q_proj"}, "alpha_pattern must be an object"),
    "alpha_pattern string": ({"alpha_pattern": {"q_proj": "8"}}, "alpha_pattern['q_proj'] must be a finite number"),
    "alpha_pattern NaN": ({"alpha_pattern": {"q_proj": NAN}}, "alpha_pattern['q_proj'] must be a finite number"),
    "alpha_pattern Infinity": ({"alpha_pattern": {"q_proj": INF}}, "alpha_pattern['q_proj'] must be a finite number"),
    "alpha_pattern boolean": ({"alpha_pattern": {"q_proj": False}}, "alpha_pattern['q_proj'] must be a finite number"),
    "alpha_pattern bad regex": ({"alpha_pattern": {"[q": 8}}, "alpha_pattern key '[q' is not a valid regular"),
    "target regex invalid": ({"target_modules": "q_proj("}, "is not a valid regular expression"),
    "target regex too large": ({"target_modules": "q_proj{99999999999}"}, "is not a valid regular expression"),
    "target numbers": ({"target_modules": [1, 2]}, "target_modules must be a non-empty list of module names"),
    "target mixed": ({"target_modules": ["q_proj", 7]}, "target_modules must be a non-empty list of module names"),
    "target empty": ({"target_modules": []}, "target_modules must be a non-empty list of module names"),
    "target missing": ({"target_modules": None}, "target_modules must be a non-empty list of module names"),
    "layers strings": ({"layers_to_transform": ["0", "1"]}, "layers_to_transform must be a layer index or a list"),
    "layers booleans": ({"layers_to_transform": [True]}, "layers_to_transform must be a layer index or a list"),
    "layers floats": ({"layers_to_transform": [0.0, 1.5]}, "layers_to_transform must be a layer index or a list"),
    "layers a string": ({"layers_to_transform": "0-3"}, "layers_to_transform must be a layer index or a list"),
    "layers an object": ({"layers_to_transform": {"0": 1}}, "layers_to_transform must be a layer index or a list"),
    "layers with a regex target": (
        {"target_modules": r".*\.q_proj", "layers_to_transform": [0]},
        "layers_to_transform cannot be used with a regex target_modules",
    ),
    "use_rslora a string": ({"use_rslora": "false"}, "use_rslora must be true or false"),
    "use_dora a string": ({"use_dora": "false"}, "use_dora must be true or false"),
    "use_dora one": ({"use_dora": 1}, "use_dora must be true or false"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CONFIGS))
def test_malformed_config_is_refused_with_the_reason(tmp_path, case):
    change, reason = MALFORMED_CONFIGS[case]
    path = _good(tmp_path / "adapter")
    if isinstance(change, bytes):
        (path / "adapter_config.json").write_bytes(change)
    else:
        _edit_config(path, **change)
    with pytest.raises(AdapterError, match=re.escape(reason)):
        load_peft_adapter("bad", path, BASE, max_rank=16, allowed_roots=[tmp_path])


# case -> (fields changed in the valid config, hand-computed scaling of q_proj's and v_proj's B); r is 4
ACCEPTED_CONFIGS = {
    "float alpha": ({"lora_alpha": 6.5}, 6.5 / 4, 6.5 / 4),
    "nulls and false flags": ({"use_rslora": None, "use_dora": False, "rank_pattern": None, "alpha_pattern": {}}, 2, 2),
    "rsLoRA": ({"use_rslora": True}, 4, 4),
    "empty layers_to_transform means every layer (as in PEFT)": ({"layers_to_transform": []}, 2, 2),
    "alpha_pattern": ({"alpha_pattern": {"v_proj": 1000}}, 2, 250),
    "alpha_pattern with an alternation": ({"alpha_pattern": {"k_proj|v_proj": 12}}, 2, 3),
    "alpha near float32's limit": ({"lora_alpha": 3e38}, 7.5e37, 7.5e37),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED_CONFIGS))
def test_edge_configs_load_with_the_peft_scaling(tmp_path, case):
    change, q_scale, v_scale = ACCEPTED_CONFIGS[case]
    path = _good(tmp_path / "adapter")
    _edit_config(path, **change)
    adapter = load_peft_adapter("edge", path, BASE, max_rank=16, allowed_roots=[tmp_path])
    raw = load_file(str(path / "adapter_model.safetensors"))
    assert len(adapter.weights) == 2 * LAYERS
    for layer in (0, LAYERS - 1):
        for module, scale in (("q", q_scale), ("v", v_scale)):
            b = raw[f"base_model.model.model.layers.{layer}.self_attn.{module}_proj.lora_B.weight"]
            torch.testing.assert_close(adapter.weights[layer, module][1], b * scale)


def _large_b(tensors):
    for key in tensors:
        if "lora_B" in key:
            tensors[key] = torch.full_like(tensors[key], 100.0)


@pytest.mark.parametrize(
    "change", [{"lora_alpha": 1e38}, {"lora_alpha": 1e38, "use_rslora": True}, {"alpha_pattern": {"v_proj": 1e38}}]
)
def test_scaling_that_overflows_float32_is_refused(tmp_path, change):
    path = _good(tmp_path / "adapter")
    _edit_config(path, **change)
    _edit_tensors(path, _large_b)  # 100 * 1e38 / 4 (or / sqrt(4)) is beyond float32's 3.4e38
    with pytest.raises(AdapterError, match="overflows float32"):
        load_peft_adapter("bad", path, BASE, max_rank=16)


def _absurd_layer(tensors):
    tensors[f"model.layers.{'9' * 5000}.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, HIDDEN)


def test_tensor_with_an_absurd_layer_index_is_refused(tmp_path):
    path = _good(tmp_path / "adapter")
    _edit_tensors(path, _absurd_layer)  # 5000 digits: more than Python converts to an int by default
    with pytest.raises(AdapterError, match="unexpected tensor"):
        load_peft_adapter("bad", path, BASE, max_rank=16)


@pytest.mark.parametrize("file", FILES)
def test_file_linking_outside_the_roots_is_refused(tmp_path, file):
    source = _good(tmp_path / "outside" / "adapter")
    path = tmp_path / "root" / "adapter"
    shutil.copytree(source, path)
    (path / file).unlink()
    (path / file).symlink_to(source / file)
    with pytest.raises(AdapterError, match=f"{file} in adapter path .* outside the allowed adapter roots"):
        load_peft_adapter("sneaky", path, BASE, max_rank=16, allowed_roots=[tmp_path / "root"])
    # the same directory loads when the link's target is inside a root too
    load_peft_adapter("fine", path, BASE, max_rank=16, allowed_roots=[tmp_path / "root", tmp_path / "outside"])


def test_links_within_the_roots_are_followed(tmp_path):
    source = _good(tmp_path / "root" / "original")
    path = tmp_path / "root" / "linked"
    path.mkdir()
    for file in FILES:
        (path / file).symlink_to(source / file)
    assert load_peft_adapter("linked", path, BASE, max_rank=16, allowed_roots=[tmp_path / "root"]).rank == 4


def test_symlink_loop_is_refused(tmp_path):
    path = _good(tmp_path / "adapter")
    (path / "adapter_config.json").unlink()
    (path / "adapter_config.json").symlink_to(path / "adapter_config.json")
    with pytest.raises(AdapterError, match="adapter_config.json"):
        load_peft_adapter("loop", path, BASE, max_rank=16)


def test_path_outside_the_roots_names_the_roots(tmp_path):
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    path = _good(tmp_path / "elsewhere")
    with pytest.raises(AdapterError) as info:
        load_peft_adapter("outside", path, BASE, max_rank=16, allowed_roots=roots)
    assert f"adapter path {path} is outside the allowed adapter roots" in str(info.value)
    assert f"({roots[0].resolve()}, {roots[1].resolve()})" in str(info.value)


def _no_weights(p):
    (p / "adapter_model.safetensors").unlink()


def _looped_config(p):
    (p / "adapter_config.json").unlink()
    (p / "adapter_config.json").symlink_to(p / "adapter_config.json")


def _cut(file: str, keep: int):
    def cut(p):
        raw = (p / file).read_bytes()
        (p / file).write_bytes(raw[: keep if keep >= 0 else len(raw) + keep])

    return cut


# refusals whose full reason names a path: (break it, what the reason without paths still says)
PATH_CASES = {
    "not a directory": (lambda p: shutil.rmtree(p) or p.write_text("x"), "not a directory"),
    "no weights": (_no_weights, "no adapter_model.safetensors"),
    "no config": (lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
    "config a symlink loop": (_looped_config, "adapter_config.json"),
    "weights empty": (_cut("adapter_model.safetensors", 0), "adapter_model.safetensors cannot be read"),
    "weights cut in the header": (_cut("adapter_model.safetensors", 7), "adapter_model.safetensors cannot be read"),
    "weights one byte short": (_cut("adapter_model.safetensors", -1), "adapter_model.safetensors cannot be read"),
    "config cut short": (_cut("adapter_config.json", 20), "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(PATH_CASES))
def test_public_reasons_name_no_path(tmp_path, case):
    """Files missing, unreadable or cut short are refused; the reason callers without the admin key see names the
    file, never the directory."""
    break_it, reason = PATH_CASES[case]
    path = _good(tmp_path / "adapter")
    break_it(path)
    with pytest.raises(AdapterError) as info:
        load_peft_adapter("bad", path, BASE, max_rank=16, allowed_roots=[tmp_path])
    assert reason in info.value.public and str(tmp_path) not in info.value.public


def test_a_path_outside_the_roots_is_not_shown_publicly(tmp_path):
    (tmp_path / "root").mkdir()
    path = _good(tmp_path / "elsewhere")
    with pytest.raises(AdapterError) as info:
        load_peft_adapter("outside", path, BASE, max_rank=16, allowed_roots=[tmp_path / "root"])
    assert str(path) in str(info.value)  # the operator's reason names it
    assert info.value.public == "the adapter's directory is outside the adapter roots"


def _digest(path) -> str:
    return read_peft_adapter("a", path, BASE, max_rank=16).digest()


def test_the_digest_hashes_the_stored_weights_and_their_scaling(tmp_path):
    """The content digest, computed by hand: sha256 over each (layer, module)'s stored A and B (dtype, shape,
    bytes) and its scaling, in order."""
    path = _good(tmp_path / "adapter")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    expected = hashlib.sha256(b"peft-lora-v1;")
    for i in range(LAYERS):
        for proj in ("q_proj", "v_proj"):  # sorted: self_attn.q_proj < self_attn.v_proj
            a = tensors[f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_A.weight"]
            b = tensors[f"base_model.model.model.layers.{i}.self_attn.{proj}.lora_B.weight"]
            expected.update(
                f"{i}.self_attn.{proj}.torch.float32{tuple(a.shape)}.torch.float32{tuple(b.shape)}.2.0;".encode()
            )
            expected.update(a.numpy().tobytes() + b.numpy().tobytes())
    assert _digest(path) == expected.hexdigest()


def test_the_digest_follows_what_is_served_not_the_files_bytes(tmp_path):
    """Other bytes, the same weights (a config rewritten, keys renamed the older PEFT way, metadata): the same
    digest; another scaling, one weight changed, another stored dtype: another."""
    path = _good(tmp_path / "adapter")
    digest = _digest(path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config, indent=4) + "\n")
    assert _digest(path) == digest
    tensors = load_file(str(path / "adapter_model.safetensors"))
    renamed = {k.replace(".lora_A.weight", ".lora_A.default.weight"): v for k, v in tensors.items()}
    save_file(renamed, str(path / "adapter_model.safetensors"), metadata={"format": "pt", "note": "re-saved"})
    assert _digest(path) == digest
    _edit_config(path, lora_alpha=3 * 4)
    assert _digest(path) != digest
    _edit_config(path, lora_alpha=2 * 4)
    assert _digest(path) == digest
    key = next(iter(tensors))
    save_file({**tensors, key: tensors[key] * 2}, str(path / "adapter_model.safetensors"))
    assert _digest(path) != digest
    save_file({k: v.half() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    assert _digest(path) != digest


REWRITE_LOOP = """
import sys, threading, time
from pathlib import Path
from lora_server.adapters.peft_format import AdapterError, BaseShapes, load_peft_adapter

path = Path(sys.argv[1])
weights = path / "adapter_model.safetensors"
raw = weights.read_bytes()
stop = threading.Event()

def rewrite():
    while not stop.is_set():
        with weights.open("r+b") as file:  # in place: truncated, then written in two parts
            file.truncate(0)
            file.flush()
            file.write(raw[: len(raw) // 2])
            file.flush()
            file.write(raw[len(raw) // 2 :])

threading.Thread(target=rewrite, daemon=True).start()
loaded = refused = 0
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        load_peft_adapter("moving", path, BaseShapes.llama(30, 576, 1536, 576, 192), 16)
        loaded += 1
    except AdapterError as exc:
        assert str(path) not in exc.public, exc.public
        refused += 1
stop.set()
print(loaded, refused)
"""


@pytest.mark.slow
def test_weights_rewritten_while_read_are_refused_never_a_crash(tmp_path):
    """safetensors' load_file maps the file: truncated under the mapping, the process died of SIGBUS (exit -7)."""
    path = _good(tmp_path / "adapter")
    done = subprocess.run(
        [sys.executable, "-c", REWRITE_LOOP, str(path), "4"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    loaded, refused = map(int, done.stdout.split())
    assert refused > 0 and loaded + refused > 10, done.stdout
