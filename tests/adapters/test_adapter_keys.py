"""adapter_config.json keys: every key of PEFT's LoraConfig that changes what PEFT computes and that the loader does
not implement is refused, naming it (adapters saved by real PEFT wherever PEFT makes them, else a config written by
hand); keys without effect are accepted, and an adapter that carries them computes what PEFT computes (our engine
on a tiny Llama against PEFT's forward on the same weights)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import warnings

import pytest
import torch

from lora_server.adapters.peft_format import (
    NO_EFFECT_KEYS,
    READ_KEYS,
    UNSUPPORTED_KEYS,
    AdapterError,
    BaseShapes,
    load_peft_adapter,
)

# the tiny Llama: 2 layers, hidden 64, 4 heads of 16 (q 64), 2 KV heads (kv 32), MLP 128
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
BASE = BaseShapes.llama(2, 64, 128, 64, 32)
QV = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama in HF's format (config.json + safetensors) and the model itself (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():  # weights large enough that the logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path, model


def save_peft(model, config, path, scale: float = 0.5) -> dict:
    """Save the adapter ``config`` makes on ``model`` with PEFT (lora weights drawn at random, so that it moves the
    model) and return its adapter_config.json."""
    from peft import get_peft_model

    with warnings.catch_warnings():  # PEFT's warnings about the odd configs these tests make on purpose
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(copy.deepcopy(model), config)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, scale)
        peft_model.save_pretrained(path)
    return json.loads((path / "adapter_config.json").read_text())


def _peft_configs():
    from peft import IA3Config, LoHaConfig, LoraConfig

    # case -> (the config PEFT saves, the key the refusal names)
    return {
        "exclude_modules": (LoraConfig(target_modules="all-linear", exclude_modules=["k_proj"]), "exclude_modules"),
        "layer_replication": (LoraConfig(target_modules=QV, layer_replication=[[0, 2], [1, 2]]), "layer_replication"),
        "target_parameters": (LoraConfig(target_modules=[], target_parameters=["q_proj.weight"]), "target_parameters"),
        "QA-LoRA": (LoraConfig(target_modules=QV, use_qalora=True), "use_qalora"),
        "modules_to_save": (LoraConfig(target_modules=QV, modules_to_save=["lm_head"]), "modules_to_save"),
        "bias all": (LoraConfig(target_modules=QV, bias="all"), "bias='all'"),
        "bias lora_only": (LoraConfig(target_modules=QV, bias="lora_only"), "bias='lora_only'"),
        "lora_bias": (LoraConfig(target_modules=QV, lora_bias=True), "lora_bias"),
        "BD-LoRA": (
            LoraConfig(
                target_modules=QV,
                use_bdlora={"target_modules_bd_a": ["q_proj"], "target_modules_bd_b": ["v_proj"], "nblocks": 2},
            ),
            "use_bdlora",
        ),
        "KaSA": (LoraConfig(target_modules=QV, kasa_config={}), "kasa_config"),
        "MonteCLoRA": (LoraConfig(target_modules=QV, monteclora_config={}), "monteclora_config"),
        "PiSSA": (LoraConfig(target_modules=QV, init_lora_weights="pissa"), "init_lora_weights 'pissa'"),
        "OLoRA": (LoraConfig(target_modules=QV, init_lora_weights="olora"), "init_lora_weights 'olora'"),
        "IA3": (IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]), "IA3"),
        "LoHa": (LoHaConfig(target_modules=QV), "LOHA"),
    }


PEFT_CASES = [  # trainable tokens are served (tests/adapters/test_vocab_lora.py)
    "exclude_modules",
    "layer_replication",
    "target_parameters",
    "QA-LoRA",
    "modules_to_save",
    "bias all",
    "bias lora_only",
    "lora_bias",
    "BD-LoRA",
    "KaSA",
    "MonteCLoRA",
    "PiSSA",
    "OLoRA",
    "IA3",
    "LoHa",
]


@pytest.mark.parametrize("case", PEFT_CASES)
def test_peft_adapters_that_compute_otherwise_are_refused_naming_the_key(tiny, tmp_path, case):
    config, named = _peft_configs()[case]
    save_peft(tiny[1], config, tmp_path / "adapter")
    with pytest.raises(AdapterError, match=re.escape(named)):
        load_peft_adapter("x", tmp_path / "adapter", BASE, max_rank=64)


# changes written by hand into a plain PEFT adapter's config (PEFT cannot make these on a tiny Llama without data
# or extra packages), and the words the refusal names
HAND_CASES = {
    "Arrow routing": ({"arrow_config": {"top_k": 2}}, "arrow_config"),
    "CorDA init": ({"init_lora_weights": "corda"}, "init_lora_weights 'corda'"),
    "LoftQ init": ({"init_lora_weights": "loftq", "loftq_config": {"loftq_bits": 4}}, "init_lora_weights 'loftq'"),
    "PiSSA fast SVD init": ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights 'pissa_niter_4'"),
    "an init unknown to us": ({"init_lora_weights": "something-new"}, "init_lora_weights 'something-new'"),
    "a layers_pattern the model lacks": ({"layers_to_transform": [0], "layers_pattern": "h"}, "layers_pattern 'h'"),
    "a key unknown to us, set": ({"use_something_new": True}, "use_something_new"),
    # DoRA beside another LoRA variant: PEFT refuses the combination (its registry of variants has none)
    "DoRA with aLoRA": ({"use_dora": True, "alora_invocation_tokens": [5, 6]}, "use_dora (DoRA) together with alora"),
    "DoRA with VeLoRA": ({"use_dora": True, "velora_config": {"rank": 1}}, "use_dora (DoRA) together with velora"),
    "DoRA with a MiCA init": ({"use_dora": True, "init_lora_weights": "mica"}, "with init_lora_weights 'mica'"),
    "an unknown list, set": ({"enable_lora": [True, False, True]}, "enable_lora"),
}


@pytest.mark.parametrize("case", sorted(HAND_CASES))
def test_hand_written_keys_that_compute_otherwise_are_refused(tiny, tmp_path, case):
    from peft import LoraConfig

    change, named = HAND_CASES[case]
    path = tmp_path / "adapter"
    save_peft(tiny[1], LoraConfig(target_modules=QV), path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(AdapterError, match=re.escape(named)):
        load_peft_adapter("x", path, BASE, max_rank=64)


def test_every_loraconfig_key_is_classified():
    """Each field of the installed PEFT's LoraConfig is read, known to have no effect, or refused when set: a new
    PEFT field shows up here (and is refused when set until it is classified)."""
    from peft import LoraConfig

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    groups = (READ_KEYS, NO_EFFECT_KEYS, set(UNSUPPORTED_KEYS))
    assert not (READ_KEYS & NO_EFFECT_KEYS) and not (set(UNSUPPORTED_KEYS) & (READ_KEYS | NO_EFFECT_KEYS))
    assert fields - set().union(*groups) == set()


def _accepted_configs():
    from peft import LoraConfig

    return {
        "metadata, dropout, fan_in_fan_out, Megatron and QA-LoRA group size": LoraConfig(
            target_modules=QV,
            task_type="CAUSAL_LM",
            lora_dropout=0.1,
            fan_in_fan_out=True,
            qalora_group_size=32,
            revision="main",
        ),
        "all-linear": LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"),
        "layers_pattern with layers_to_transform": LoraConfig(
            target_modules=["v_proj", "down_proj"], layers_to_transform=[1], layers_pattern="layers"
        ),
        "gaussian init, rsLoRA": LoraConfig(
            target_modules=["k_proj", "o_proj"], init_lora_weights="gaussian", use_rslora=True
        ),
        "orthogonal init": LoraConfig(r=4, target_modules=["gate_proj", "down_proj"], init_lora_weights="orthogonal"),
        "MiCA init": LoraConfig(target_modules=["up_proj"], init_lora_weights="mica"),
    }


@pytest.mark.slow
def test_accepted_keys_compute_what_peft_computes(tiny, tmp_path):
    """Adapters whose configs carry keys without effect (each saved by PEFT) give, in one batch with the base model,
    PEFT's log-probabilities (fp32, within 2e-3) on every prompt position; each adapter moves the model."""
    from peft import PeftModel

    from lora_server.config import EngineConfig
    from lora_server.engine import Engine
    from lora_server.sampling_params import SamplingParams

    path, model = tiny
    configs = _accepted_configs()
    engine = Engine(
        EngineConfig(
            model=str(path),
            quantization="none",
            kv_cache_bytes=16 << 20,
            block_size=64,
            max_loras=8,
            show_progress=False,
        )
    )
    names = [f"a{i}" for i in range(len(configs))]
    for name, config in zip(names, configs.values(), strict=True):
        save_peft(model, config, tmp_path / name)
        engine.adapters.add(name, tmp_path / name)
    prompt = [int(t) for t in torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(1))]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    plan = [None, *names]
    outs = engine.generate([prompt] * len(plan), params, adapters=plan)
    with torch.no_grad():
        base_ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    for adapter, out in zip(plan, outs, strict=True):
        if adapter is None:
            ref = base_ref
        else:
            peft_model = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / adapter).eval()
            with torch.no_grad():
                ref = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0], -1)
            assert (ref - base_ref).abs().max() > 0.05, adapter  # it moves the model
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        ours = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(ours, expected, atol=2e-3, rtol=0)
