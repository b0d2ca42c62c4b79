"""The GPU tier's correctness checks on synthetic checkpoints built at test time, so that every lent machine runs them
(nothing to download or carry; the embedded model's GPU tests, test_gpu_engine.py, stay where it is installed): a
small Llama and a small Qwen3 (its q/k norms) in HF's layout (config.json + safetensors, random weights) and PEFT
adapters of them, served in fp32 against HF transformers (+ PEFT) in fp32 on the CPU, by test_gpu_engine's check
(the engine's own tokens teacher-forced through the reference): the none, int8 and int4 modes against HF holding the
weights the mode holds (the modes' torch twins, below; fp8 quantizes activations too and has no such twin), a batch
of three adapters and the base against PEFT, KV pushed to the host tier and back. On CUDA the decode steps replay
their CUDA graphs (the engine's default), so the graphs are checked against HF and PEFT too. Each check runs on the
CPU as well (the CPU tier: it keeps the checks honest where no GPU is lent)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.conftest import peft_log_softmax, pool_counters
from tests.engine.test_gpu_engine import NEAR_TIE, _follows
from tests.model.test_model_vs_hf import LOGPROB_TOL, _hf_logprobs

COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
SHAPES = {  # HF's config and model classes, and what a shape adds
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
}
DEVICES = [  # the CPU tier's run of the GPU checks is slow-marked: the quick tier has the model's own CPU checks
    pytest.param("cpu", id="cpu", marks=pytest.mark.slow),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
ADAPTERS = {  # PEFT configs of different ranks and targets
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp-r16": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
NEW_TOKENS = 12
# int4 on the CPU is no fp32 path (model.quant.Int4CpuLinear): it keeps the scales and zeros in bfloat16 (the
# twin's are fp16), and its prefill multiplies in bfloat16 where the CPU has bfloat16 matmuls. Measured on these
# shapes: logprobs within 0.026 of HF's holding the twin's weights (CUDA's int4 kernel multiplies the fp16 scales in
# fp32: LOGPROB_TOL). These 6 prompts decode 6 rows a step, above CPU_GEMV_MAX_ROWS: the CPU's int4 decode kernel
# and its fused step are checked by tests/model/test_fused_decode.py and tests/kernels/test_cpu_decode_kernels.py.
INT4_CPU_TOL = 0.06


@pytest.fixture(scope="module", params=list(SHAPES))
def synthetic(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A random model of the shape in HF's layout (safetensors) and HF's own model of it (fp32, CPU)."""
    import transformers

    config_name, model_name, extra = SHAPES[request.param]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # weights large enough that the logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(f"synthetic-{request.param}")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def adapters(synthetic, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """ADAPTERS saved by PEFT (random A and B), and the PEFT model holding them all."""
    from peft import LoraConfig, PeftModel, get_peft_model

    _, model = synthetic
    root = tmp_path_factory.mktemp("synthetic-adapters")
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **cfg))
        with torch.no_grad():
            for pname, p in peft.named_parameters():
                if "lora_B" in pname:
                    p.mul_(0.3)
        peft.save_pretrained(root / name)
    names = list(ADAPTERS)
    both = PeftModel.from_pretrained(copy.deepcopy(model), root / names[0], adapter_name=names[0])
    for name in names[1:]:
        both.load_adapter(root / name, adapter_name=name)
    return root, both.eval()


def _engine(path: Path, device: str, **kw) -> Engine:
    config = dict(quantization="none", kv_cache_bytes=32 << 20, block_size=16, show_progress=False)
    engine = Engine(EngineConfig(model=str(path), device=device, dtype="float32", **{**config, **kw}))
    assert engine.describe().device.type == device  # the path under test is what runs
    return engine


def _prompts(n: int, lengths=(9, 23, 40, 5, 17, 31)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    vocab = int(COMMON["vocab_size"])
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


# The modes' torch twins (lora_server/model/quant.py's formats, round to nearest, fp16 scales):
def _int8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output channel: w = scale * q, scale = max |row| / 127, q in -127..127."""
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-10).half().float()
    return (w / scale).round().clamp(-127, 127) * scale


def _int4_round_trip(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Asymmetric int4 per group of 32 inputs: w = scale * q + min, scale = (max - min) / 15, q in 0..15."""
    g = w.unflatten(1, (-1, group))
    low = g.amin(-1, keepdim=True).half().float()
    scale = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).clamp(min=1e-10).half().float()
    return (((g - low) / scale).round().clamp(0, 15) * scale + low).flatten(1)


def _hf_holding(model: torch.nn.Module, quantization: str) -> torch.nn.Module:
    """HF's model holding what the engine holds in ``quantization``: int8 every matrix; int4 the decoder's linears,
    the embedding and the head int8 (quant.tensor_mode)."""
    if quantization == "none":
        return model
    held = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in held.named_parameters():
            if p.dim() != 2:
                continue
            vocab = "embed_tokens" in name or "lm_head" in name
            p.copy_(_int4_round_trip(p) if quantization == "int4" and not vocab else _int8_round_trip(p))
    return held.eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_each_mode_follows_hf_holding_its_weights(synthetic, device, quantization):
    path, model = synthetic
    engine = _engine(path, device, quantization=quantization)
    reference = functools.partial(_hf_logprobs, _hf_holding(model, quantization))
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    tol = INT4_CPU_TOL if (device, quantization) == ("cpu", "int4") else LOGPROB_TOL
    for prompt, completion in zip(prompts, engine.generate(prompts, params), strict=True):  # one batch
        _follows(completion, prompt, reference, tol, 2 * tol)
    engine.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_a_mixed_adapter_batch_follows_peft(synthetic, adapters, device):
    path, _ = synthetic
    root, peft_model = adapters
    engine = _engine(path, device, block_size=64, max_lora_rank=16, max_loras=4)  # a page holds an adapter's rows
    for name in ADAPTERS:
        engine.adapters.add(name, root / name)
    plan = [None, *ADAPTERS, None, "qv-r4"]
    prompts = _prompts(len(plan))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    for prompt, adapter, out in zip(prompts, plan, engine.generate(prompts, params, adapters=plan), strict=True):
        _follows(out, prompt, functools.partial(peft_log_softmax, peft_model, adapter), LOGPROB_TOL, NEAR_TIE)
    engine.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_kv_swapped_to_the_host_and_back_stays_exact(synthetic, device):
    """Two conversations on a device budget so small that a long filler request between their turns pushes their
    cached KV to the host tier and back; each turn follows HF on the whole conversation."""
    path, model = synthetic
    engine = _engine(path, device, num_kv_blocks=24, host_kv_bytes=8 << 20)
    reference = functools.partial(_hf_logprobs, model)
    chats = _prompts(2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    for turn in range(3):
        for i, out in enumerate(engine.generate(chats, params)):
            assert (out.num_cached_tokens > 0) == (turn > 0)
            _follows(out, chats[i], reference, LOGPROB_TOL, NEAR_TIE)
            chats[i] = chats[i] + out.token_ids + _prompts(1, (4,))[0]
        engine.generate([_prompts(1, (16 * 20,))[0]], SamplingParams(max_tokens=1))  # the filler: 21 blocks
        engine.check_integrity()
    counters = pool_counters(engine)
    assert counters["kv_swap_out"] > 0 and counters["kv_swap_in"] > 0, dict(counters)
