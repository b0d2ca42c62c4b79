"""LoRA adapters in llama.cpp's GGUF, written from real PEFT adapters the way llama.cpp's convert_lora_to_gguf.py
writes them (convert_lora, each rule citing its source): the engine serving the .gguf file gives HF transformers +
PEFT's greedy tokens on the PEFT adapter at fp32, alone and in one batch with a PEFT-directory adapter and the base;
the loader reads the same A and scaled B as from the PEFT directory (q's and k's rows un-permuted, f16 and q8_0
files as their rounding says), Phi-3's fused attn_qkv / ffn_up included; an activated LoRA's invocation tokens; and
every refusal names what it refuses. Where llama.cpp's sources are (LLAMA_CPP_DIR), its converter's output is
checked byte for byte against convert_lora's."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, QuantError
from gguf.quants import dequantize, quantize

from lora_server.adapters.load import load_adapter
from lora_server.adapters.peft_format import AdapterError, BaseShapes, content_hash, load_peft_adapter
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.model.test_architectures import FAMILIES, _build, _peft_greedy, _prompts, assert_mixed_batch_matches_peft

ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=2)  # 4 heads of 16


# ---- the writer: llama.cpp's convert_lora_to_gguf.py (with conversion/base.py and conversion/llama.py) ----------

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Phi3ForCausalLM": "phi3"}  # model_arch
GGUF_LAYER = {  # gguf-py tensor_mapping: HF module path in a layer -> GGUF tensor
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
OUTTYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0}


def convert_lora(peft_dir: Path, config: dict, outtype: str = "f32") -> tuple[str, list[tuple], list[tuple]]:
    """(general.architecture, metadata [(key, value, type, element type)], tensors [(name, array, ggml type)]) of
    convert_lora_to_gguf.py's file for ``peft_dir`` on the base of HF ``config`` (the file's general.name and the
    model card's tags aside: prepare_metadata's, which change nothing llama.cpp computes)."""
    from safetensors.torch import load_file

    lparams = json.loads((peft_dir / "adapter_config.json").read_text())
    metadata = [
        ("general.type", "adapter", GGUFValueType.STRING, None),  # LoraModel.set_type
        ("adapter.type", "lora", GGUFValueType.STRING, None),
        ("adapter.lora.alpha", float(lparams["lora_alpha"]), GGUFValueType.FLOAT32, None),  # set_gguf_parameters
    ]
    if lparams.get("alora_invocation_tokens"):
        tokens = lparams["alora_invocation_tokens"]
        metadata.append(("adapter.alora.invocation_tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.UINT32))
    metadata.append(("general.quantization_version", GGML_QUANT_VERSION, GGUFValueType.UINT32, None))
    arch = GGUF_ARCH[config["architectures"][0]]
    pairs: dict[str, dict[str, torch.Tensor]] = {}  # get_tensors: pairs by base name, in the file's key order
    for key, tensor in load_file(peft_dir / "adapter_model.safetensors").items():
        base_name = key.removeprefix("base_model.model.").replace(".lora_A.weight", "").replace(".lora_B.weight", "")
        pairs.setdefault(base_name, {})["lora_a" if ".lora_A." in key else "lora_b"] = tensor
    tensors = []
    for base_name, pair in pairs.items():
        _, _, layer, *module = base_name.split(".")  # model.layers.N.self_attn.q_proj
        a, b = pair["lora_a"].float(), pair["lora_b"].float()
        if arch == "llama" and module[-1] in ("q_proj", "k_proj"):  # LlamaModel.modify_tensors: permute
            heads = config["num_attention_heads"] if module[-1] == "q_proj" else config["num_key_value_heads"]
            b = b.reshape(heads, 2, b.shape[0] // heads // 2, b.shape[1]).swapaxes(1, 2).reshape(b.shape)
        name = f"blk.{layer}.{GGUF_LAYER['.'.join(module)]}.weight"
        for half, data in (("lora_a", a.numpy()), ("lora_b", b.numpy())):
            kind = OUTTYPES[outtype]
            try:  # prepare_tensors: the outtype, F16 where q8_0's blocks do not fit a row
                tensors.append((f"{name}.{half}", quantize(data, kind), kind))
            except QuantError:
                tensors.append((f"{name}.{half}", quantize(data, GGMLQuantizationType.F16), GGMLQuantizationType.F16))
    return arch, metadata, tensors


def write_gguf(path: Path, arch: str, metadata: list[tuple], tensors: list[tuple]) -> Path:
    writer = GGUFWriter(str(path), arch)  # general.architecture first
    for key, value, kind, element in metadata:
        writer.add_key_value(key, value, kind, element)
    for name, data, kind in tensors:
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf_lora(path: Path, peft_dir: Path, config: dict, outtype: str = "f32") -> Path:
    return write_gguf(path, *convert_lora(peft_dir, config, outtype))


# ---- the models -----------------------------------------------------------------------------------------------


def _base_and_adapters(root: Path, family: dict, adapters: list[tuple[int, int, list[str]]]):
    """A tiny HF model of ``family`` (test_architectures._build, saved to root / "base") and a PEFT adapter per
    (rank, alpha, targets), saved to root / "a0", "a1"...; the HF model without adapters."""
    from peft import LoraConfig, get_peft_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, "gguf-lora", family)
        hf = _build(root / "base", "gguf-lora")
    for i, (rank, alpha, targets) in enumerate(adapters):
        torch.manual_seed(100 + i)
        peft = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for pname, p in peft.named_parameters():
                if "lora_B" in pname:
                    p.mul_(0.5)
        peft.save_pretrained(root / f"a{i}")
        hf = peft.unload()
    return hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (4 query heads, 2 KV heads of 16); a0 (r 8 on every projection, alpha 16: q's and k's rows
    permuted in its GGUF) as a0.gguf, a1 (r 4 on k and down) as a PEFT directory; PEFT's model with both."""
    from peft import PeftModel

    root = tmp_path_factory.mktemp("gguf-lora")
    hf = _base_and_adapters(root, TINY_LLAMA, [(8, 16, ALL_LLAMA), (4, 8, ["k_proj", "down_proj"])])
    config = json.loads((root / "base" / "config.json").read_text())
    gguf_path = write_gguf_lora(root / "a0.gguf", root / "a0", config)
    model = PeftModel.from_pretrained(hf, root / "a0", adapter_name="a0")
    model.load_adapter(root / "a1", adapter_name="a1")
    shapes = BaseShapes.llama(3, 64, 96, 64, 32, architecture="LlamaForCausalLM", head_dim=16)
    return SimpleNamespace(root=root, config=config, gguf=gguf_path, model=model.eval(), shapes=shapes)


@pytest.fixture(scope="module")
def engine(llama):
    engine = Engine(
        EngineConfig(
            model=str(llama.root / "base"), block_size=16, num_kv_blocks=128, max_lora_rank=8, show_progress=False
        )
    )
    engine.adapters.add("a0", llama.gguf)
    engine.adapters.add("a1", llama.root / "a1")
    return engine


# ---- what it computes -----------------------------------------------------------------------------------------


def test_engine_serves_the_gguf_adapter_as_peft_computes_it(llama, engine):
    prompts = _prompts((3, 12, 20))
    outs = engine.generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), adapters=["a0"] * len(prompts)
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _peft_greedy(llama.model, "a0", prompt, 10)


def test_gguf_peft_directory_and_base_in_one_batch_match_peft(llama, engine):
    assert_mixed_batch_matches_peft(engine, llama.model)  # a0 from its .gguf, a1 from its directory


def test_gguf_adapter_reads_as_its_peft_directory(llama):
    """The same A and scaled B (alpha / r folded in) as the PEFT directory, bit for bit at f32, though the file
    holds q's and k's lora_b rows permuted; so the same content hash."""
    gguf_adapter = load_adapter("g", llama.gguf, llama.shapes, 8)
    peft_adapter = load_peft_adapter("p", llama.root / "a0", llama.shapes, 8)
    assert gguf_adapter.weights.keys() == peft_adapter.weights.keys() and len(gguf_adapter.weights) == 21
    for key, (a, b) in peft_adapter.weights.items():
        assert torch.equal(gguf_adapter.weights[key][0], a) and torch.equal(gguf_adapter.weights[key][1], b), key
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(str(llama.gguf)).tensors}
    assert not torch.equal(stored["blk.0.attn_q.weight.lora_b"] * 2.0, peft_adapter.weights[(0, "q")][1])
    assert (gguf_adapter.rank, gguf_adapter.invocation_tokens) == (8, ())
    assert content_hash(gguf_adapter) == content_hash(peft_adapter)  # the same weights: one content


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_f16_and_q8_0_files_read_as_their_rounding(llama, tmp_path, outtype):
    """convert_lora_to_gguf --outtype f16 / q8_0: A and B as gguf's quantize rounds them (q8_0: A, whose rows are
    whole blocks; B's rows of 8 fall back to f16), B then scaled."""
    path = write_gguf_lora(tmp_path / f"a0-{outtype}.gguf", llama.root / "a0", llama.config, outtype)
    adapter = load_adapter("g", path, llama.shapes, 8)
    a_kind = GGMLQuantizationType.Q8_0 if outtype == "q8_0" else GGMLQuantizationType.F16
    for key, (a, b) in load_peft_adapter("p", llama.root / "a0", llama.shapes, 8).weights.items():
        ref_a = torch.from_numpy(dequantize(quantize(a.numpy(), a_kind), a_kind).astype(np.float32))
        ref_b = (b / 2.0).half().float() * 2.0  # B as stored (before alpha / r = 2), rounded to f16, scaled
        assert torch.equal(adapter.weights[key][0], ref_a) and torch.equal(adapter.weights[key][1], ref_b), key
        assert not torch.equal(ref_a, a)


def test_activated_lora_invocation_tokens(llama, tmp_path):
    """PEFT's alora_invocation_tokens, which the converter writes as adapter.alora.invocation_tokens (uint32s)."""
    alora = tmp_path / "alora"
    shutil.copytree(llama.root / "a0", alora)
    config = json.loads((alora / "adapter_config.json").read_text())
    (alora / "adapter_config.json").write_text(json.dumps(dict(config, alora_invocation_tokens=[5, 9, 7])))
    arch, metadata, tensors = convert_lora(alora, llama.config)
    adapter = load_adapter("g", write_gguf(tmp_path / "alora.gguf", arch, metadata, tensors), llama.shapes, 8)
    assert adapter.invocation_tokens == (5, 9, 7) == load_peft_adapter("p", alora, llama.shapes, 8).invocation_tokens
    wrong = [m if m[0] != "adapter.alora.invocation_tokens" else (*m[:3], GGUFValueType.INT32) for m in metadata]
    with pytest.raises(AdapterError, match="invocation_tokens must be an array of uint32"):
        load_adapter("g", write_gguf(tmp_path / "int32.gguf", arch, wrong, tensors), llama.shapes, 8)


def test_invocation_tokens_that_can_never_occur_are_refused(llama, tmp_path):
    """Against the tiny Llama's 256 tokens and 16 positions: an id of 256 or beyond, or 17 ids, never occur in a
    prompt: refused naming the key (unknown sizes, 0: nothing checked)."""
    shapes = dataclasses.replace(llama.shapes, vocab_size=256, max_positions=16)
    arch, metadata, tensors = convert_lora(llama.root / "a0", llama.config)
    for name, tokens, words in (
        ("fits", [0] * 15 + [255], None),
        ("beyond", [5, 256, 2**32 - 1], r"invocation_tokens: 2 token id\(s\) \(e.g. 256\) are beyond"),
        ("long", [5] * 17, "invocation_tokens holds 17 tokens, more than the base model's context of 16 positions"),
    ):
        key = "adapter.alora.invocation_tokens"
        metadata[:] = [m for m in metadata if m[0] != key] + [(key, tokens, GGUFValueType.ARRAY, GGUFValueType.UINT32)]
        path = write_gguf(tmp_path / f"{name}.gguf", arch, metadata, tensors)
        assert load_adapter("g", path, llama.shapes, 8).invocation_tokens == tuple(tokens)
        if words is None:
            assert load_adapter("g", path, shapes, 8).invocation_tokens == tuple(tokens)
        else:
            error = _refused(path, shapes, words)
            assert "adapter.alora.invocation_tokens" in str(error) and "can never occur" in str(error)


def _other_architecture(root: Path, name: str) -> dict:
    """A tiny Qwen2 or Phi-3 at root / "base", a0 (r 4 on every projection PEFT names in it) at root / "a0"; the
    base's config."""
    family = dict(FAMILIES["qwen2-bias" if name == "qwen2" else name])
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if name == "phi3" else ALL_LLAMA
    _base_and_adapters(root, family, [(4, 8, targets)])
    return json.loads((root / "base" / "config.json").read_text())


@pytest.mark.parametrize("name", ["qwen2", "phi3"])
def test_other_architectures_read_as_their_peft_directories(tmp_path, name):
    """Qwen2 (the converter permutes no rows) and Phi-3, whose fused attn_qkv and ffn_up (gate|up) lora_b split
    between q, k, v and gate, up with one lora_a, as the PEFT directory's fused qkv_proj and gate_up_proj."""
    config = _other_architecture(tmp_path, name)
    shapes = BaseShapes.llama(
        3, 64, 96, 64, 32, fused=name == "phi3", architecture=config["architectures"][0], head_dim=16
    )
    adapter = load_adapter("g", write_gguf_lora(tmp_path / "a0.gguf", tmp_path / "a0", config), shapes, 8)
    reference = load_peft_adapter("p", tmp_path / "a0", shapes, 8).weights
    assert adapter.weights.keys() == reference.keys() and len(reference) == 21
    for key, (a, b) in reference.items():
        assert torch.equal(adapter.weights[key][0], a) and torch.equal(adapter.weights[key][1], b), key


# ---- refusals -------------------------------------------------------------------------------------------------


def _refused(path, shapes, match: str, roots=None) -> AdapterError:
    with pytest.raises(AdapterError, match=match) as info:
        load_adapter("bad", path, shapes, 8, roots)
    return info.value


def _variant(llama, path: Path, edit) -> Path:
    """a0's file with ``edit(metadata, tensors)`` applied to the lists in place; a str it returns is the file's
    architecture."""
    arch, metadata, tensors = convert_lora(llama.root / "a0", llama.config)
    result = edit(metadata, tensors)
    return write_gguf(path, result if isinstance(result, str) else arch, metadata, tensors)


def _set(metadata: list, key: str, value, kind=GGUFValueType.STRING) -> None:
    metadata[:] = [m for m in metadata if m[0] != key] + [(key, value, kind, None)]


def _lora_pair(name: str, rank: int, cols: int, rows_b: int) -> list[tuple]:
    a, b = np.ones((rank, cols), np.float32), np.ones((rows_b, rank), np.float32)
    return [(f"{name}.lora_a", a, GGMLQuantizationType.F32), (f"{name}.lora_b", b, GGMLQuantizationType.F32)]


def _int8(tensor: tuple) -> tuple:
    return tensor[0], np.zeros(tensor[1].shape, np.int8), GGMLQuantizationType.I8


# name -> (edit of a0's metadata and tensors, the refusal's words)
REFUSED_FILES = {
    "general.type model": (lambda m, t: _set(m, "general.type", "model"), "is a model"),
    "no general.type": (lambda m, t: m.pop(0), r"not an adapter \(general.type None"),
    "adapter.type": (lambda m, t: _set(m, "adapter.type", "control_vector"), "'control_vector' is not supported"),
    "unknown adapter key": (lambda m, t: _set(m, "adapter.lora.dropout_mode", "x"), "adapter.lora.dropout_mode"),
    # LoRA on the embeddings, as the converter writes mergekit-extract-lora's (lora_a transposed), and on the head
    "token_embd": (lambda m, t: t.extend(_lora_pair("token_embd.weight", 256, 8, 64)), "token_embd.weight.lora_a"),
    "output": (lambda m, t: t.extend(_lora_pair("output.weight", 8, 64, 256)), "output.weight.lora_a"),
    "norm": (
        lambda m, t: t.append(("blk.0.attn_norm.weight", np.ones(64, np.float32), t[0][2])),
        "blk.0.attn_norm.weight",
    ),
    "another architecture": (lambda m, t: "qwen2", "for the qwen2 architecture"),
    "unknown architecture": (lambda m, t: "rwkv6", "'rwkv6' is not supported"),
    "alpha's type": (lambda m, t: _set(m, "adapter.lora.alpha", 16, GGUFValueType.UINT32), "adapter.lora.alpha"),
    "lora_b missing": (lambda m, t: t.pop(1), "lacks its lora_a or lora_b"),
    "an unreadable type": (lambda m, t: t.__setitem__(0, _int8(t[0])), "of type I8, which cannot be read"),
    "a 3D lora_a": (lambda m, t: t.__setitem__(0, (t[0][0], t[0][1][None], t[0][2])), "do not fit"),
    "a tensor of another layer": (lambda m, t: t.extend(_lora_pair("blk.3.attn_v.weight", 8, 64, 32)), "lacks"),
    "a tensor the base lacks": (lambda m, t: t.extend(_lora_pair("blk.0.attn_qkv.weight", 8, 64, 128)), "lacks"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_FILES))
def test_refused_files_name_the_reason(llama, tmp_path, case):
    edit, words = REFUSED_FILES[case]
    path = _variant(llama, tmp_path / "bad.gguf", edit)
    error = _refused(path, llama.shapes, words)
    assert str(tmp_path) not in error.public


def test_a_base_model_file_is_not_an_adapter(smollm2_path):
    """A real llama.cpp model file (the embedded SmolLM2's) is refused as what it is."""
    shapes = BaseShapes.llama(30, 576, 1536, 576, 192, architecture="LlamaForCausalLM", head_dim=64)
    _refused(smollm2_path, shapes, r"the GGUF file is a model \(general.type 'model', not 'adapter'\)")


@pytest.mark.parametrize(
    ("shapes", "words"),
    [
        (BaseShapes.llama(3, 32, 96, 32, 16, architecture="LlamaForCausalLM", head_dim=8), "do not fit the base's"),
        (
            BaseShapes.llama(2, 64, 96, 64, 32, architecture="LlamaForCausalLM", head_dim=16),
            r"blk\.2\.\w+\.weight\.lora_[ab] targets a module the base model lacks \(2 layers",
        ),
        (BaseShapes.llama(3, 64, 96, 64, 32, architecture="Qwen2ForCausalLM", head_dim=16), "base model is qwen2"),
        (BaseShapes.llama(3, 64, 96, 64, 32, fused=True), "the base model's are fused"),
        (BaseShapes.llama(3, 64, 96, 64, 32), "head width is not known"),
    ],
    ids=["hidden", "layers", "architecture", "fused", "no head width"],
)
def test_base_mismatches_are_refused(llama, shapes, words):
    _refused(llama.gguf, shapes, words)


def test_rank_above_the_maximum_and_cut_files_are_refused(llama, tmp_path):
    with pytest.raises(AdapterError, match="rank 8 is above the server's maximum LoRA rank 4"):
        load_adapter("bad", llama.gguf, llama.shapes, 4)
    data = llama.gguf.read_bytes()
    for cut in (10, 200, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        _refused(tmp_path / "cut.gguf", llama.shapes, "cut short")
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    _refused(tmp_path / "text.gguf", llama.shapes, "not a GGUF file")


def test_files_outside_the_roots_are_refused(llama, tmp_path):
    inside, outside = tmp_path / "roots", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    shutil.copy(llama.gguf, outside / "a.gguf")
    (inside / "link.gguf").symlink_to(outside / "a.gguf")
    for path in (outside / "a.gguf", inside / "link.gguf"):
        error = _refused(path, llama.shapes, "outside the allowed adapter roots", [inside])
        assert error.public == "the adapter's file is outside the adapter roots"
    shutil.copy(llama.gguf, inside / "a.gguf")
    assert load_adapter("ok", inside / "a.gguf", llama.shapes, 8, [inside]).rank == 8
    (inside / "dir.gguf").mkdir()
    _refused(inside / "dir.gguf", llama.shapes, "not a file", [inside])


def test_a_link_to_a_blob_is_served_by_its_gguf_name(llama, engine, tmp_path):
    """A .gguf link to a file named otherwise (Hugging Face's cache links snapshots to blobs): the adapter keeps
    the link's path, which is read again when a request stages it."""
    shutil.copy(llama.gguf, tmp_path / "blob")
    (tmp_path / "a0-linked.gguf").symlink_to(tmp_path / "blob")
    assert load_adapter("g", tmp_path / "a0-linked.gguf", llama.shapes, 8).path == tmp_path / "a0-linked.gguf"
    engine.adapters.add("linked", tmp_path / "a0-linked.gguf")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    linked, a0 = engine.generate([[5, 6, 7]] * 2, params, adapters=["linked", "a0"])
    assert linked.token_ids == a0.token_ids
    engine.adapters.remove("linked")


def test_a_refused_file_registers_nothing(llama, engine, tmp_path):
    path = _variant(llama, tmp_path / "embd.gguf", REFUSED_FILES["token_embd"][0])
    before = engine.adapters.names()
    with pytest.raises(AdapterError, match="token_embd"):
        engine.adapters.add("embd", path)
    assert engine.adapters.names() == before and "embd" not in before


# ---- against llama.cpp's own converter, where its sources are -------------------------------------------------


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="LLAMA_CPP_DIR (llama.cpp's sources) is not set")
@pytest.mark.parametrize(
    ("case", "outtype"),
    [("llama", "f32"), ("llama", "f16"), ("llama", "q8_0"), ("alora", "f32"), ("qwen2", "f32"), ("phi3", "f32")],
)
def test_convert_lora_is_llama_cpp_s_converter(llama, tmp_path, case, outtype):
    """convert_lora_to_gguf.py (llama.cpp at LLAMA_CPP_DIR, with its gguf-py, offline) writes convert_lora's file
    byte for byte, given the general.* metadata it takes from the PEFT model card: a0 at three outtypes, a0 as an
    activated LoRA, and the other architectures' adapters."""
    if case in ("qwen2", "phi3"):
        _other_architecture(tmp_path, case)
        base, adapter = tmp_path / "base", tmp_path / "a0"
    else:
        base, adapter = llama.root / "base", llama.root / "a0"
    if case == "alora":
        adapter = shutil.copytree(adapter, tmp_path / "alora")
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps(dict(config, alora_invocation_tokens=[5, 9, 7])))
    source = Path(os.environ["LLAMA_CPP_DIR"])
    out = tmp_path / "llama-cpp.gguf"
    env = dict(os.environ, PYTHONPATH=f"{source / 'gguf-py'}{os.pathsep}{source}", HF_HUB_OFFLINE="1")
    subprocess.run(
        [sys.executable, str(source / "convert_lora_to_gguf.py"), "--base", str(base)]
        + ["--outfile", str(out), "--outtype", outtype, str(adapter)],
        env=env,
        check=True,
        capture_output=True,
    )
    fields = GGUFReader(str(out)).fields.items()
    card = [
        (key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
        for key, field in fields
        if key.startswith("general.")
        and key not in ("general.architecture", "general.type")
        and key != "general.quantization_version"
    ]
    arch, metadata, tensors = convert_lora(adapter, json.loads((base / "config.json").read_text()), outtype)
    ours = write_gguf(tmp_path / "ours.gguf", arch, metadata[:2] + card + metadata[2:], tensors)
    assert ours.read_bytes() == out.read_bytes()
