"""Pre-quantized checkpoints served whole: a tiny Llama whose every decoder linear is stored as GPTQ (asymmetric,
act-order), AWQ (GEMM) or compressed-tensors (W4A16 pack-quantized, FP8), written here with the formats' own bit
orders (tests/model/test_prequantized.py's packers) or by the compressed-tensors package, loads with its codes kept
resident, and gives HF transformers' greedy tokens and log-probabilities when HF runs the dequantized weights;
with a PEFT adapter trained on that base (QLoRA's case) in a mixed batch too."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.model.loader import open_checkpoint
from lora_server.sampling_params import SamplingParams
from tests.model.test_model_vs_hf import LOGPROB_TOL, _compare, _hf_logprobs
from tests.model.test_prequantized import _int32, awq_pack, calibrate, gptq_pack_rows

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CPU = torch.device("cpu")


def _hf_llama(tied: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _quantize(w: torch.Tensor, group: int, gen: torch.Generator):
    """Asymmetric 4-bit codes of w [out, in] per group of input columns: (codes [out, in], zeros [out, groups],
    fp16 scales [out, groups], and the float32 weight they stand for)."""
    out, n_in = w.shape
    groups = w.unflatten(1, (n_in // group, group))
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()
    zeros = (-lo / scales.float()).round().clamp(0, 15)
    codes = (groups / scales.float().unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, 15).flatten(1)
    dequant = scales.float().repeat_interleave(group, 1) * (codes - zeros.repeat_interleave(group, 1))
    return codes.to(torch.int64), zeros.to(torch.int64), scales, dequant


def _write_quantized(hf, path, fmt: str, group: int) -> None:
    """Every decoder linear of ``hf`` quantized to ``fmt`` ("gptq": act-order with a random permutation, v1
    zero points; "awq": GEMM) in path, config.json with its quantization_config; ``hf``'s weights replaced by
    the dequantized ones (the reference)."""
    gen = torch.Generator().manual_seed(1)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for i in range(hf.config.num_hidden_layers):
        for linear in LINEARS:
            name = f"model.layers.{i}.{linear}"
            w = state.pop(f"{name}.weight")
            n_in = w.shape[1]
            if fmt == "gptq":
                order = torch.randperm(n_in, generator=gen)  # act-order: column order[j] is quantized j-th
                codes_p, zeros, scales, _ = _quantize(w[:, order], group, gen)
                zeros = zeros.clamp(min=1)  # v1 stores zero - 1: a zero point of 0 cannot be stored
                dequant_p = scales.float().repeat_interleave(group, 1) * (codes_p - zeros.repeat_interleave(group, 1))
                codes, dequant = torch.empty_like(codes_p), torch.empty_like(dequant_p)
                codes[:, order], dequant[:, order] = codes_p, dequant_p
                g_idx = torch.empty(n_in, dtype=torch.int64)
                g_idx[order] = torch.arange(n_in) // group
                state[f"{name}.qweight"] = _int32(gptq_pack_rows(codes.t().numpy(), 4))
                # [groups, out / 8], packed along the output
                state[f"{name}.qzeros"] = _int32(np.ascontiguousarray(gptq_pack_rows((zeros - 1).numpy(), 4).T))
                state[f"{name}.scales"] = scales.t().contiguous()
                state[f"{name}.g_idx"] = g_idx.to(torch.int32)
            else:
                codes, zeros, scales, dequant = _quantize(w, group, gen)
                state[f"{name}.qweight"] = awq_pack(codes.t().contiguous())
                state[f"{name}.qzeros"] = awq_pack(zeros.t().contiguous())
                state[f"{name}.scales"] = scales.t().contiguous()
            hf.get_submodule(name).weight.data.copy_(dequant)
    path.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    config = hf.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    if fmt == "gptq":
        quant = dict(quant_method="gptq", bits=4, group_size=group, desc_act=True, sym=False, checkpoint_format="gptq")
    else:
        quant = dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm")
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))


def _engine(path, **kwargs) -> Engine:
    config = EngineConfig(model=str(path), block_size=16, num_kv_blocks=64, show_progress=False, **kwargs)
    return Engine(config)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 6, 19)]


@pytest.mark.parametrize(("fmt", "group"), [("gptq", 32), ("awq", 64)])
def test_awq_gptq_checkpoints_match_hf_on_their_dequantized_weights(tmp_path, fmt, group):
    hf = _hf_llama()
    _write_quantized(hf, tmp_path / "model", fmt, group)
    # dequantized exactly: --quantization none gives HF's tokens and log-probabilities on the dequantized weights
    _compare(_engine(tmp_path / "model", quantization="none"), hf, _prompts())
    # kept resident (auto): 4-bit codes with their scales, act-order's input gather; on the CPU the int4 matmul
    # takes bfloat16 inputs, so the log-probabilities agree to that precision
    engine = _engine(tmp_path / "model")
    layer = engine.model.layers[0]
    kept = repr(layer.attn.qkv_proj.base) + repr(layer.mlp.down_proj.base)
    assert "Int4" in kept and ("PermutedInput" in kept) == (fmt == "gptq"), kept
    assert "Int8" not in repr(layer.attn.qkv_proj.base)  # q|k|v fused as they are, not re-quantized
    # the resident codes and float32 scales are the checkpoint's weights exactly (the CPU's int4 kernel then rounds
    # its scales to bfloat16, as for any int4 weight)
    weights = open_checkpoint(EngineConfig(model=str(tmp_path / "model"))).weights
    for i, linear in itertools.product(range(2), LINEARS):
        module = weights[f"layers.{i}.{linear.split('.')[1].removesuffix('_proj')}"].linear("auto", torch.float32, CPU)
        assert torch.equal(module.dequantize(torch.float32), hf.get_submodule(f"model.layers.{i}.{linear}").weight)
    _close_to_hf(engine, hf, 0.3)


def _close_to_hf(engine: Engine, hf, tolerance: float) -> None:
    prompts = _prompts()
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf_logprobs(hf, prompt + out.token_ids)
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - ref[len(prompt) - 1 + step, lp.token_id].item()) < tolerance, step


def _ct_checkpoint(hf, path, fmt: str, weights: dict, acts: dict | None) -> None:
    """``hf`` quantized and compressed by the compressed-tensors package (every decoder linear; the head left
    float), saved to path; ``hf`` then holds the package's own decompression of it (the reference)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    w_args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(
        targets=["Linear"], weights=w_args, input_activations=None if acts is None else QuantizationArgs(**acts)
    )
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status="frozen", format=fmt
    )
    apply_quantization_config(hf, config, show_progress=False)
    for module in hf.modules():
        if hasattr(module, "weight_scale"):
            calibrate(module, w_args)
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    compressor.compress_model(hf)
    path.mkdir()
    tied = hf.config.tie_word_embeddings  # the head is the embedding: saved once, as save_pretrained does
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(path / "model.safetensors"))
    config_dict = hf.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config_dict))
    compressor.update_config(str(path))
    compressor.decompress_model(hf)


def _plain_copy(hf):
    """An HF model without compressed-tensors' hooks, holding hf's (decompressed) weights."""
    reference = _hf_llama(hf.config.tie_word_embeddings)
    reference.load_state_dict({k: v for k, v in hf.state_dict().items() if k in reference.state_dict()})
    return reference.eval()


def test_compressed_tensors_w4a16_matches_hf(tmp_path):
    hf = _hf_llama()
    weights = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    _ct_checkpoint(hf, tmp_path / "model", "pack-quantized", weights, None)
    reference = _plain_copy(hf)
    _compare(_engine(tmp_path / "model", quantization="none"), reference, _prompts())
    _close_to_hf(_engine(tmp_path / "model"), reference, 0.3)


def test_fp8_compressed_tensors_checkpoint_loads_its_scales(tmp_path):
    """W8A8-FP8 (per-channel weight scales, dynamic per-token activations): exact dequantization (none), and the
    fp8 codes resident with their scales, the activations quantized per token as the scheme says: within 0.02 of
    the package's own quantized forward (which quantizes activations likewise)."""
    hf = _hf_llama()
    weights = dict(num_bits=8, type="float", symmetric=True, strategy="channel")
    acts = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    _ct_checkpoint(hf, tmp_path / "model", "float-quantized", weights, acts)
    reference = _plain_copy(hf)
    _compare(_engine(tmp_path / "model", quantization="none"), reference, _prompts())
    engine = _engine(tmp_path / "model")
    assert "Fp8Linear" in repr(engine.model.layers[0].attn.qkv_proj.base)
    _close_to_hf(engine, hf, 0.02)  # the package's model: it quantizes the activations per token too


@pytest.mark.slow
def test_qlora_adapter_on_a_gptq_base_matches_peft(tmp_path):
    """An adapter trained on the quantized base (PEFT on the dequantized weights) in a mixed batch."""
    from peft import LoraConfig, PeftModel, get_peft_model

    hf = _hf_llama()
    _write_quantized(hf, tmp_path / "model", "gptq", 32)
    torch.manual_seed(5)
    peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    peft.save_pretrained(tmp_path / "qlora")
    model = PeftModel.from_pretrained(peft.unload(), tmp_path / "qlora", adapter_name="qlora").eval()
    engine = _engine(tmp_path / "model", max_lora_rank=8, quantization="none")
    engine.adapters.add("qlora", tmp_path / "qlora")
    plan = [None, "qlora", "qlora", None]
    prompts = _prompts() + [[5, 6, 7]]
    outs = engine.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1), adapters=plan
    )
    for prompt, adapter, out in zip(prompts, plan, outs, strict=True):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    logits = model(input_ids=ids).logits[0]
            else:
                logits = model(input_ids=ids).logits[0]
        ref = torch.log_softmax(logits.float(), -1)
        for step, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + step]
            assert abs(lp.logprob - row[lp.token_id].item()) <= LOGPROB_TOL, (adapter, step)
            assert lp.token_id == int(row.argmax()), (adapter, step)
    assert np.isfinite([lp.logprob for out in outs for lp in out.logprobs]).all()


@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
def test_w8a8_int8_checkpoint_quantizes_its_activations(tmp_path, tied):
    """W8A8-int8 (per-channel int8 weights, dynamic symmetric int8 activations per token): exact dequantization
    (none); with its codes resident, the activations quantized per token as the scheme says: the package's own
    quantized forward (which quantizes the activations likewise) within 2e-3, and not the weight-only model's (the
    activations' quantization is really applied). Tied: a model whose head is its embedding (no lm_head tensor;
    the quantization_config's ignore names lm_head all the same)."""
    hf = _hf_llama(tied)
    weights = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
    acts = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    _ct_checkpoint(hf, tmp_path / "model", "int-quantized", weights, acts)
    reference = _plain_copy(hf)
    _compare(_engine(tmp_path / "model", quantization="none"), reference, _prompts())
    engine = _engine(tmp_path / "model")
    assert "Int8TokenInput" in repr(engine.model.layers[0].attn.qkv_proj.base)
    assert engine.model.layers[0].attn.cpu_kernels is None  # quantized codes: the twins' sums (quant.py)
    _close_to_hf(engine, hf, LOGPROB_TOL)  # the package's model, activations quantized per token
    with pytest.raises(AssertionError):
        _close_to_hf(engine, reference, LOGPROB_TOL)  # weight-only is measurably another function
