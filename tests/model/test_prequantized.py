"""Pre-quantized checkpoints (lora_server.model.prequant): AWQ and GPTQ tensors packed here, by packers written
from AutoAWQ's WQLinear_GEMM.from_linear and AutoGPTQ's QuantLinear.pack (numpy, not the module's unpacking),
from known codes, zero points and scales; compressed-tensors checkpoints written by the compressed-tensors package
itself (ModelCompressor on a tiny model) and decompressed by it as the reference. Then the refusals, each naming
what it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from lora_server.errors import ModelLoadError
from lora_server.model.prequant import Fp8Weight, IntWeight, read_linear, scheme_of

OUT, IN = 64, 256
Q = "model.layers.0.self_attn.q_proj"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scales(groups: int, gen: torch.Generator) -> torch.Tensor:
    """fp16 [groups, OUT], positive, as AWQ and GPTQ store them."""
    return (torch.rand(groups, OUT, generator=gen) * 0.02 + 0.001).half()


def _read(quantization_config: dict, tensors: dict[str, torch.Tensor], module: str = Q):
    scheme = scheme_of({"quantization_config": quantization_config})
    return read_linear(scheme, module, tensors.__getitem__, set(tensors))


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


# ---- AWQ --------------------------------------------------------------------------------------------------------


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] values in 0..15 -> int32 [rows, cols / 8], AutoAWQ's order: nibble i of word c holds column
    c * 8 + order_map[i]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    v = values.numpy().astype(np.uint32)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= v[:, col * 8 + order_map[i]] << (i * 4)
    return _int32(packed)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_awq_gemm(group_size: int) -> None:
    gen = _gen(group_size + 7)
    group = IN if group_size == -1 else group_size
    groups = IN // group
    q = torch.randint(0, 16, (OUT, IN), generator=gen)
    z = torch.randint(0, 16, (OUT, groups), generator=gen)
    s = _scales(groups, gen)  # [groups, out]
    tensors = {
        f"{Q}.qweight": awq_pack(q.t()),  # [in, out / 8]
        f"{Q}.qzeros": awq_pack(z.t()),  # [groups, out / 8]
        f"{Q}.scales": s,
        "lm_head.weight": torch.randn(32, OUT),
    }
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "GEMM", "zero_point": True}
    packed = _read(config, tensors)
    assert isinstance(packed, IntWeight)
    assert packed.codes.dtype == torch.uint8 and torch.equal(packed.codes, q.to(torch.uint8))
    assert packed.zeros is not None and torch.equal(packed.zeros, z.float())
    assert torch.equal(packed.scales, s.t().float())
    assert (packed.bits, packed.group, packed.in_perm, packed.activations) == (4, group, None, "none")
    expected = s.t().float().repeat_interleave(group, 1) * (q.float() - z.float().repeat_interleave(group, 1))
    assert torch.equal(packed.dequantize(), expected)
    assert _read(config, tensors, "lm_head") is None  # AWQ leaves lm_head float


def test_awq_modules_to_not_convert() -> None:
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "modules_to_not_convert": ["self_attn"]}
    assert _read(config, {f"{Q}.weight": torch.randn(OUT, IN)}) is None
    with pytest.raises(ModelLoadError, match="qweight"):
        _read(config, {f"{Q}.qweight": torch.zeros(IN, OUT // 8, dtype=torch.int32), f"{Q}.weight": torch.ones(1)})


# ---- GPTQ -------------------------------------------------------------------------------------------------------


def gptq_pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qweight packing: [in, out] -> [in * bits / 32, out], row r's bits (k * bits ...) holding input
    feature r * 32 / bits + k."""
    per = 32 // bits
    v = values.astype(np.uint32)
    packed = np.zeros((v.shape[0] // per, v.shape[1]), dtype=np.uint32)
    for row in range(packed.shape[0]):
        for j in range(row * per, (row + 1) * per):
            packed[row] |= v[j] << (bits * (j - row * per))
    return packed


def gptq_pack(q, z, s, bits, group, g_idx, v1: bool) -> dict[str, torch.Tensor]:
    """q [out, in], z [out, groups] (real zero points), s fp16 [groups, out], g_idx [in] -> a GPTQ module's
    tensors. v1 stores z - 1 (AutoGPTQ's ``zeros -= 1`` before packing)."""
    stored = (z - 1 if v1 else z).t().numpy()  # [groups, out]
    return {
        f"{Q}.qweight": _int32(gptq_pack_rows(q.t().numpy(), bits)),
        f"{Q}.qzeros": _int32(gptq_pack_rows(stored.T, bits).T),  # packed along out
        f"{Q}.scales": s,
        f"{Q}.g_idx": g_idx.to(torch.int32),
    }


def gptq_case(bits: int, group_size: int, sym: bool, desc_act: bool, v1: bool, seed: int = 0):
    gen = _gen(seed + bits * 1000 + group_size)
    group = IN if group_size == -1 else group_size
    groups = IN // group
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (OUT, IN), generator=gen)
    if sym:
        z = torch.full((OUT, groups), 1 << (bits - 1))
    else:  # v1 cannot store a zero point of 0 (z - 1 = -1 overflows the field)
        z = torch.randint(1 if v1 else 0, top + 1, (OUT, groups), generator=gen)
        z[0, 0], z[1, 0] = (1 if v1 else 0), top  # the ends of the range
    s = _scales(groups, gen)
    g_idx = torch.arange(IN) // group
    if desc_act:  # columns quantized in a random order, each run of `group` of them one group
        order = torch.randperm(IN, generator=gen)
        g_idx = torch.empty(IN, dtype=torch.int64)
        g_idx[order] = torch.arange(IN) // group
    expected = s.t().float()[:, g_idx] * (q.float() - z.float()[:, g_idx])  # w[o, c] = s[g(c)] * (q - z[g(c)])
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
    }
    return config, gptq_pack(q, z, s, bits, group, g_idx, v1), (q, z, s, g_idx, group, expected)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq(bits: int, group_size: int, sym: bool, desc_act: bool) -> None:
    config, tensors, (q, z, s, g_idx, group, expected) = gptq_case(bits, group_size, sym, desc_act, v1=True)
    packed = _read(config, tensors)
    assert isinstance(packed, IntWeight) and (packed.bits, packed.group) == (bits, group)
    assert torch.equal(packed.scales, s.t().float())
    if sym:
        assert packed.zeros is None
    else:
        assert packed.zeros is not None and torch.equal(packed.zeros, z.float())
    if desc_act and group_size != -1:
        perm = packed.in_perm
        assert perm is not None and torch.equal(g_idx[perm], torch.arange(IN) // group)  # groups made contiguous
        assert torch.equal(packed.codes, q[:, perm].to(torch.uint8))
    else:
        assert packed.in_perm is None and torch.equal(packed.codes, q.to(torch.uint8))
    assert torch.equal(packed.dequantize(), expected)
    if sym:
        assert torch.equal(packed.signed_codes().float(), packed.codes.float() - (1 << (bits - 1)))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_v2(bits: int, desc_act: bool) -> None:
    config, tensors, (_, z, _, _, _, expected) = gptq_case(bits, 64, False, desc_act, v1=False, seed=3)
    assert (z == 0).any()  # the zero point v1 cannot store
    packed = _read(config, tensors)
    assert isinstance(packed, IntWeight) and packed.zeros is not None and torch.equal(packed.zeros, z.float())
    assert torch.equal(packed.dequantize(), expected)


def test_gptq_without_g_idx_and_transformers_configs() -> None:
    from transformers import AwqConfig, GPTQConfig

    config, tensors, (*_, expected) = gptq_case(4, 128, True, False, v1=True)
    del tensors[f"{Q}.g_idx"]
    written = json.loads(json.dumps(GPTQConfig(bits=4, group_size=128, sym=True).to_dict()))
    packed = _read(written, tensors)
    assert packed is not None and torch.equal(packed.dequantize(), expected)
    awq = scheme_of({"quantization_config": json.loads(json.dumps(AwqConfig(bits=4, group_size=128).to_dict()))})
    assert awq.groups[0][2].layout == "awq_gemm"


def test_gptq_refusals() -> None:
    config, tensors, _ = gptq_case(4, 32, False, False, v1=True)
    overflow = dict(tensors, **{f"{Q}.qzeros": tensors[f"{Q}.qzeros"] | 0xF})  # a stored nibble of 15
    with pytest.raises(ModelLoadError, match=r"qzeros.*holds 15"):
        _read(config, overflow)
    with pytest.raises(ModelLoadError, match="sym is true"):
        _read(dict(config, sym=True), tensors)
    shuffled = dict(tensors, **{f"{Q}.g_idx": tensors[f"{Q}.g_idx"].flip(0)})
    with pytest.raises(ModelLoadError, match=r"g_idx.*desc_act is false"):
        _read(config, shuffled)
    with pytest.raises(ModelLoadError, match=r"qzeros is missing"):
        _read(config, {k: v for k, v in tensors.items() if not k.endswith("qzeros")})


# ---- compressed-tensors, written and decompressed by the package ------------------------------------------------


class _Tiny(nn.Module):
    """HF module paths: model.layers.0.self_attn.q_proj [OUT, IN] and lm_head (left float by the ignore list)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        attn = nn.Module()
        attn.q_proj = nn.Linear(IN, OUT, bias=False, dtype=dtype)
        layer = nn.Module()
        layer.self_attn = attn
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.lm_head = nn.Linear(OUT, 32, bias=False, dtype=dtype)


def calibrate(linear: nn.Module, w_args) -> None:
    """A compressed-tensors quantized linear's weight_scale (and weight_zero_point) from its weight's min and max
    per group, channel or tensor (the package's calculate_qparams)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = linear.weight.data
    if w_args.strategy == "group":
        lo, hi = w.unflatten(1, (-1, w_args.group_size)).amin(-1), w.unflatten(1, (-1, w_args.group_size)).amax(-1)
    elif w_args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.amin(), w.amax()
    scale, zero_point = calculate_qparams(lo, hi, w_args)
    linear.weight_scale.data.copy_(scale.reshape(linear.weight_scale.shape))
    if hasattr(linear, "weight_zero_point"):
        linear.weight_zero_point.data.copy_(zero_point.reshape(linear.weight_zero_point.shape))


def ct_checkpoint(fmt: str, weights: dict, acts: dict | None, tmp_path, dtype=torch.float32):
    """(config.json dict, state dict, the package's decompressed q_proj weight) of the tiny model quantized with
    compressed-tensors: scales and zero points from each group's min and max (its calculate_qparams)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    torch.manual_seed(0)
    model = _Tiny(dtype)
    w_args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(
        targets=["Linear"], weights=w_args, input_activations=None if acts is None else QuantizationArgs(**acts)
    )
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status="frozen", format=fmt
    )
    apply_quantization_config(model, config, show_progress=False)
    linear = model.model.layers[0].self_attn.q_proj
    calibrate(linear, w_args)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "config.json").write_text("{}")
    compressor.update_config(str(tmp_path))
    compressor.decompress_model(model)
    return json.loads((tmp_path / "config.json").read_text()), state, linear.weight.data


def _check_ct(config: dict, state: dict, reference: torch.Tensor):
    scheme = scheme_of(config)
    names = set(state)
    packed = read_linear(scheme, Q, state.__getitem__, names)
    assert packed is not None
    assert torch.equal(packed.dequantize().to(reference.dtype), reference)
    assert read_linear(scheme, "lm_head", state.__getitem__, names) is None
    # every tensor is the float lm_head's or one that q_proj's quantized form reads: nothing left unread
    assert names - set(scheme.consumed(Q)) == {"lm_head.weight"} and scheme.consumed("lm_head") == []
    return packed


@pytest.mark.parametrize(
    ("num_bits", "group_size", "symmetric", "dtype"),
    [
        (4, 32, True, torch.float32),
        (4, 32, False, torch.float32),
        (4, 128, True, torch.float32),
        (4, 128, False, torch.float32),
        (4, -1, True, torch.float32),
        (8, 128, False, torch.float32),
        (4, 128, False, torch.bfloat16),  # bf16 scales: the package dequantizes in bf16, once rounded from ours
    ],
)
def test_ct_pack_quantized(num_bits: int, group_size: int, symmetric: bool, dtype: torch.dtype, tmp_path) -> None:
    weights = dict(num_bits=num_bits, type="int", symmetric=symmetric, group_size=group_size)
    weights["strategy"] = "channel" if group_size == -1 else "group"
    config, state, reference = ct_checkpoint("pack-quantized", weights, None, tmp_path, dtype)
    packed = _check_ct(config, state, reference)
    assert isinstance(packed, IntWeight) and packed.bits == num_bits and packed.activations == "none"
    assert packed.group == (IN if group_size == -1 else group_size)
    assert (packed.zeros is None) == symmetric
    assert int(packed.codes.max()) < (1 << num_bits)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("dynamic_acts", [True, False])
def test_ct_float_quantized(strategy: str, dynamic_acts: bool, tmp_path) -> None:
    weights = dict(num_bits=8, type="float", symmetric=True, strategy=strategy)
    acts = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True) if dynamic_acts else None
    config, state, reference = ct_checkpoint("float-quantized", weights, acts, tmp_path)
    packed = _check_ct(config, state, reference)
    assert isinstance(packed, Fp8Weight) and packed.scales.shape == (OUT,)
    assert packed.activations == ("fp8_token" if dynamic_acts else "none")


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_ct_int_quantized(strategy: str, tmp_path) -> None:
    weights = dict(num_bits=8, type="int", symmetric=True, strategy=strategy)
    acts = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    config, state, reference = ct_checkpoint("int-quantized", weights, acts, tmp_path)
    packed = _check_ct(config, state, reference)
    assert isinstance(packed, IntWeight) and packed.zeros is None and packed.activations == "int8_token"
    assert torch.equal(packed.signed_codes(), state[f"{Q}.weight"])


# ---- refusals ---------------------------------------------------------------------------------------------------

_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
        }
    },
}


def _w4a16(**group_changes) -> dict:
    config = json.loads(json.dumps(_W4A16))
    config["config_groups"]["group_0"].update(group_changes)
    return {"quantization_config": config}


def _weights(**changes) -> dict:
    return {**_W4A16["config_groups"]["group_0"]["weights"], **changes}


_FP8_STATIC = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method = 'bitsandbytes'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version = 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "backend": "llm-awq"}, "backend = 'llm-awq'"),
        ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits = 3"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point = False"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits = 3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size = 0"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*": {}}}, "dynamic"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "rotation": "hadamard"}, "rotation"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, "pack_dtype"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq", "checkpoint_format": "gptq_v2"},
            "disagree",
        ),
    ],
)
def test_awq_gptq_refusals(quantization_config: dict, named: str) -> None:
    with pytest.raises(ModelLoadError, match=named.replace("(", r"\(")):
        scheme_of({"quantization_config": quantization_config})


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (dict(_w4a16(), quantization_config=dict(_W4A16, kv_cache_scheme=_FP8_STATIC)), "kv_cache_scheme"),
        (dict(_w4a16(), quantization_config=dict(_W4A16, sparsity_config={"format": "sparse-24"})), "sparsity_conf"),
        (dict(_w4a16(), quantization_config=dict(_W4A16, quantization_status="frozen")), "quantization_status"),
        (dict(_w4a16(), quantization_config=dict(_W4A16, transform_config={"x": 1})), "transform_config"),
        (_w4a16(format="naive-quantized"), "format = 'naive-quantized'"),
        (_w4a16(format="nvfp4-pack-quantized"), "nvfp4"),
        (_w4a16(weights=_weights(actorder="group")), "actorder = 'group'"),
        (_w4a16(weights=_weights(num_bits=3)), "num_bits = 3"),
        (_w4a16(weights=_weights(observer_x=1)), "observer_x"),
        (_w4a16(input_activations=_FP8_STATIC), "input_activations"),
        (_w4a16(output_activations=_FP8_STATIC), "output_activations"),
        (_w4a16(targets=["LlamaDecoderLayer"]), "LlamaDecoderLayer"),
        (
            _w4a16(format="float-quantized", weights=_FP8_STATIC, input_activations=_FP8_STATIC),
            "input_activations.dynamic = False: static activation scales",
        ),
        (
            _w4a16(format="float-quantized", weights=dict(_FP8_STATIC, strategy="block", block_structure=[128, 128])),
            "block_structure",
        ),
        (
            _w4a16(
                format="int-quantized",
                weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                input_activations=dict(num_bits=8, type="int", symmetric=False, strategy="token", dynamic=True),
            ),
            "input_activations.symmetric = False",
        ),
        ({"compression_config": {"quantization_config": _W4A16}}, "compression_config|quant_method"),
    ],
)
def test_compressed_tensors_refusals(config: dict, named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        scheme_of(config)


def test_static_input_scale_tensor_is_refused(tmp_path) -> None:
    """A checkpoint whose config says dynamic activations but which holds a static input_scale is refused."""
    weights = dict(num_bits=8, type="float", symmetric=True, strategy="channel")
    acts = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    config, state, _ = ct_checkpoint("float-quantized", weights, acts, tmp_path)
    state[f"{Q}.input_scale"] = torch.ones(1)
    with pytest.raises(ModelLoadError, match=r"q_proj\.input_scale: static activation quantization"):
        read_linear(scheme_of(config), Q, state.__getitem__, set(state))


def test_float_layer_checks() -> None:
    scheme = scheme_of(_w4a16())
    fp8 = {"lm_head.weight": torch.zeros(32, OUT, dtype=torch.float8_e4m3fn)}
    with pytest.raises(ModelLoadError, match="lm_head.weight is torch.float8_e4m3fn"):
        read_linear(scheme, "lm_head", fp8.__getitem__, set(fp8))
    leftover = {"lm_head.weight": torch.zeros(32, OUT), "lm_head.weight_scale": torch.ones(32, 1)}
    with pytest.raises(ModelLoadError, match="lm_head.weight_scale"):
        read_linear(scheme, "lm_head", leftover.__getitem__, set(leftover))
    with pytest.raises(ModelLoadError, match=r"q_proj.weight_shape is missing"):
        read_linear(scheme, Q, leftover.__getitem__, set(leftover))


def test_ct_targets_and_ignore() -> None:
    """Each layer takes the one group whose targets match it; ignore wins; two matching groups are refused."""
    config = _w4a16(targets=["re:.*self_attn\\..*_proj$"])
    qc = config["quantization_config"]
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    qc["config_groups"]["group_1"] = {"targets": ["re:.*mlp\\."], "weights": fp8, "format": "float-quantized"}
    qc["ignore"] = ["lm_head", "model.layers.1.mlp.down_proj"]
    scheme = scheme_of(config)
    layouts = {m: getattr(scheme.format_of(m), "layout", None) for m in (Q, "model.layers.0.mlp.up_proj")}
    assert layouts == {Q: "ct_packed", "model.layers.0.mlp.up_proj": "ct_float"}
    assert scheme.format_of("model.layers.1.mlp.down_proj") is None
    assert scheme.consumed("model.layers.0.mlp.up_proj")[0] == "model.layers.0.mlp.up_proj.weight"
    qc["config_groups"]["group_1"]["targets"].append(Q)
    with pytest.raises(ModelLoadError, match="group_0, group_1"):
        scheme_of(config).format_of(Q)
