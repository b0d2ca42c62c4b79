"""Every adapter refusal: a clear AdapterError, nothing registered, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters.peft_format import AdapterError
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams

HIDDEN, KV, INTER, LAYERS = 576, 192, 1536, 30


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
    "dora": (lambda p: _edit_config(p, use_dora=True), "DoRA"),
    "modules_to_save": (lambda p: _edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "bias config": (lambda p: _edit_config(p, bias="all"), "bias"),
    "bias tensor": (lambda p: _edit_tensors(p, _bias), "bias"),
    "unknown target": (lambda p: _edit_config(p, target_modules=["q_proj", "c_attn"]), "not in the base model"),
    "regex matches nothing": (lambda p: _edit_config(p, target_modules=r".*\.c_fc"), "matches no module"),
    "shape mismatch": (lambda p: _edit_tensors(p, _wrong_shape), "do not match the base"),
    "nan": (lambda p: _edit_tensors(p, _nan), "NaN or Inf"),
    "inf": (lambda p: _edit_tensors(p, _inf), "NaN or Inf"),
    "layer out of range": (lambda p: _edit_config(p, layers_to_transform=[0, 31]), "do not exist"),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    return allowed, outside


@pytest.fixture(scope="module")
def engine(roots):
    return Engine(EngineConfig(quantization="none", kv_cache_bytes=32 << 20, max_lora_rank=16,
                               adapter_roots=(str(roots[0]),), show_progress=False))


@pytest.mark.parametrize("case", sorted(CASES))
def test_refusals_leave_the_engine_serving(engine, roots, case):
    break_it, reason = CASES[case]
    path = _good(roots[0] / case.replace(" ", "_"))
    break_it(path)
    before = engine.core.adapters.names()
    with pytest.raises(AdapterError, match=reason):
        engine.add_adapter("bad", path)
    assert engine.core.adapters.names() == before
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    engine.core.check_integrity()


def test_path_outside_roots_is_refused(engine, roots):
    path = _good(roots[1] / "elsewhere")
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
        engine.add_adapter("outside", path)
    link = roots[0] / "sneaky"
    link.symlink_to(path, target_is_directory=True)  # a link inside the root that leads out is refused too
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
        engine.add_adapter("outside", link)


def test_valid_adapter_registers_with_and_without_prefix(engine, roots):
    path = _good(roots[0] / "good")
    engine.add_adapter("good", path)
    plain = roots[0] / "good-no-prefix"
    shutil.copytree(path, plain)

    def strip(t):
        for k in list(t):
            t[k.removeprefix("base_model.model.")] = t.pop(k)
    _edit_tensors(plain, strip)
    engine.add_adapter("good-plain", plain)
    a = engine.core.adapters
    assert {"good", "good-plain"} <= set(a.names())
