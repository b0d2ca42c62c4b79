"""Tensor parallelism on quantized weights: a rank's share of a linear is the whole weight's codes, cut along the
same axis with their scales (distributed.shard.shard_linear), never a re-quantization of the rank's slice. Checked
format by format against the whole weight's dequantized slice (gguf's own decoder for GGUF blocks), on every split
tensor of the embedded model's GGUF, and end to end: the tiny Llama in int8 at TP=2 gives TP=1's greedy tokens; the
embedded model in its own Q4_1 / Q8_0 blocks with a demo adapter at TP=3 scores a text as TP=1 does, within the
CPU's int4 kernel's bfloat16 roundings."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from lora_server.adapters import demo_adapters
from lora_server.config import EngineConfig
from lora_server.distributed.shard import Shard, ShardedWeight, shard_checkpoint, shard_linear
from lora_server.engine import Engine
from lora_server.errors import ConfigError
from lora_server.kernels.quant_reference import dequantize_fp8, dequantize_int4, dequantize_int8
from lora_server.model.gguf_linear import GGUFBlockLinear
from lora_server.model.loader import open_checkpoint
from lora_server.model.quant import Int4Linear, Int8Linear, PermutedInput, make_linear, quantize_int8
from lora_server.sampling_params import SamplingParams
from tests.distributed.test_tensor_parallel import GREEDY, prompts, tiny, tiny_engine  # noqa: F401 (tiny: a fixture)
from tests.model.test_gguf_quants import random_blocks

ROWS, COLS = 64, 512  # a weight [out, in]: rows [16, 48) a column-parallel share, columns [256, 512) a row-parallel


def _weight() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)) * 0.1


def _reference(module) -> torch.Tensor:
    """The whole weight as the format's twin decodes it (kernels.quant_reference), float32 [out, in]."""
    if isinstance(module, Int4Linear):
        return dequantize_int4(module.packed, module.scales, module.mins, torch.float32, module.pack)
    if isinstance(module, Int8Linear):
        return dequantize_int8(module.qweight, module.scales, torch.float32)
    return dequantize_fp8(module.qweight, module.scales, torch.float32)


FORMATS = {
    "int8 per channel": lambda: make_linear(_weight(), "int8"),
    "int8 groups of 32 (Q8_0)": lambda: Int8Linear(*quantize_int8(_weight(), 32)),
    "int4 groups of 32 (Q4_1)": lambda: make_linear(_weight(), "int4"),
    "fp8": lambda: make_linear(_weight(), "fp8"),
}


@pytest.mark.parametrize("name", FORMATS)
def test_a_share_is_the_whole_weights_codes(name):
    whole = FORMATS[name]()
    reference = _reference(whole)
    rows = shard_linear(whole, 0, 16, 48, "layers.0.q")
    columns = shard_linear(whole, 1, 256, 512, "layers.0.o")
    assert torch.equal(_reference(rows), reference[16:48])
    assert torch.equal(_reference(columns), reference[:, 256:])
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(1))
    if name != "fp8":  # fp8 quantizes its input per token: a share of a token is scaled by its own maximum
        halves = shard_linear(whole, 1, 0, 256, "layers.0.o")(x[:, :256]) + columns(x[:, 256:])
        torch.testing.assert_close(halves, x @ reference.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_1", "Q4_K", "Q6_K"])
def test_a_share_of_gguf_blocks_is_the_files_blocks(kind):
    """Rows and whole blocks of columns (32 or 256 values), decoded by the gguf package itself."""
    raw = random_blocks(kind, rows=ROWS, blocks=COLS // 256 if kind.endswith("K") else COLS // 32, seed=3)
    reference = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[kind]))
    whole = GGUFBlockLinear(kind, torch.from_numpy(raw))
    assert torch.equal(shard_linear(whole, 0, 16, 48, "layers.0.q").dequantize(torch.float32), reference[16:48])
    share = shard_linear(whole, 1, 256, 512, "layers.0.down")
    assert torch.equal(share.dequantize(torch.float32), reference[:, 256:])


def test_a_cut_inside_a_quantization_group_is_refused_naming_the_tensor():
    with pytest.raises(ConfigError, match=r"layers\.3\.o cannot be split .* input column 48: .* groups of 32"):
        shard_linear(make_linear(_weight(), "int4"), 1, 48, 512, "layers.3.o")
    k_quant = GGUFBlockLinear("Q4_K", torch.from_numpy(random_blocks("Q4_K", rows=ROWS, blocks=2, seed=0)))
    with pytest.raises(ConfigError, match=r"layers\.0\.down .* groups of 256"):
        shard_linear(k_quant, 1, 0, 192, "layers.0.down")
    permuted = PermutedInput(make_linear(_weight(), "int4"), torch.randperm(COLS))  # act-order GPTQ
    with pytest.raises(ConfigError, match=r"layers\.0\.o gathers its input columns \(act-order GPTQ\)"):
        shard_linear(permuted, 1, 256, 512, "layers.0.o")
    assert shard_linear(permuted, 0, 16, 48, "layers.0.q").out_features == 32  # its rows split as any


def test_every_share_of_the_embedded_models_blocks_is_the_files():
    """The embedded GGUF at TP=3, as each rank reads it in its own blocks (auto): every split tensor (q, k, v, o,
    gate, up, down of every layer, the embedding and the head) holds the whole tensor's codes where its share
    lies."""
    checkpoint = open_checkpoint(EngineConfig(show_progress=False))
    checked = 0
    for rank in range(3):
        shard = Shard(checkpoint.arch, rank, 3)
        for name, source in shard_checkpoint(checkpoint, shard).weights.items():
            if not isinstance(source, ShardedWeight) or (name.startswith("layers.") and int(name.split(".")[1]) > 3):
                continue
            whole = checkpoint.weights[name].linear("auto", torch.float32, torch.device("cpu"))
            expected = whole.dequantize(torch.float32).narrow(source.dim, source.start, source.end - source.start)
            share = source.linear("auto", torch.float32, torch.device("cpu"))
            assert type(share) is type(whole), name
            assert torch.equal(share.dequantize(torch.float32), expected), (rank, name)
            checked += 1
    assert checked == 3 * (4 * 7 + 2) - 3 * ("lm_head" not in checkpoint.weights)


@pytest.mark.slow
def test_tiny_int8_tp2_greedy_equals_tp1(tiny):  # noqa: F811
    """Per-channel int8 at TP=2 computes TP=1's products (the same codes; the CPU's int8 matmul in float32)."""
    batch = prompts([3, 17, 40])
    expected = [o.token_ids for o in tiny_engine(tiny[0], 1, quantization="int8").generate(batch, GREEDY)]
    engine = tiny_engine(tiny[0], 2, quantization="int8")
    try:
        assert [o.token_ids for o in engine.generate(batch, GREEDY)] == expected
    finally:
        engine.close()


def _text_logprobs(engine: Engine, ids: list[int], adapter: str | None) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = engine.generate([ids], params, adapters=adapter)[0]
    return torch.tensor([p.logprob for p in out.prompt_logprobs[1:]])


@pytest.mark.slow
def test_embedded_model_in_its_own_blocks_with_an_adapter_at_tp3():
    """What `lora-server serve --tensor-parallel-size 3` serves: SmolLM2's Q4_1 / Q8_0 blocks as they are and the
    demo adapter `upper` on every module. A text scored at TP=3 as at TP=1, the base model and the adapter: the
    same codes, the int4 kernel's bfloat16 results rounded per rank's partial sum instead of once (measured: a
    mean gap of 0.018 nats a token over 330 tokens, a mean log-probability equal to 4 digits)."""
    config = dict(kv_cache_bytes=64 << 20, host_kv_bytes=0, show_progress=False)
    text = (
        "The tide came in slowly over the flat grey sand, and the gulls rose from the water as the boats "
        "returned to the harbour one by one, their lamps already lit against the coming dark."
    )
    scores = {}
    for tp in (1, 3):
        engine = Engine(EngineConfig(tensor_parallel_size=tp, **config))
        try:
            engine.adapters.add("upper", demo_adapters()["upper"])
            ids = engine.encode(text)
            scores[tp] = [_text_logprobs(engine, ids, adapter) for adapter in (None, "upper")]
        finally:
            engine.close()
    for one, three in zip(scores[1], scores[3], strict=True):
        gap = (one - three).abs()
        assert gap.mean() < 0.05 and gap.max() < 0.5, (gap.mean(), gap.max())
        assert abs(one.mean() - three.mean()) < 0.01
    assert (scores[1][0] - scores[1][1]).abs().mean() > 0.1  # the adapter moves the scores: the check means something
    assert np.isfinite(scores[3][1].numpy()).all()


def test_awq_checkpoint_at_tp2_matches_hf_and_act_order_gptq_is_refused(tmp_path):
    """A pre-quantized checkpoint at TP=2: AWQ's 4-bit codes (groups of 64; o and down cut at 64 and 128 input
    columns) kept resident and split, HF's log-probabilities on the dequantized weights within the CPU int4
    kernel's bfloat16 precision (test_prequant_models' tolerance); act-order GPTQ's o cannot be split: refused at
    start-up, naming it."""
    from tests.model.test_prequant_models import _close_to_hf, _hf_llama, _write_quantized

    hf = _hf_llama()
    _write_quantized(hf, tmp_path / "awq", "awq", 64)
    config = dict(block_size=16, num_kv_blocks=64, host_kv_bytes=0, show_progress=False, tensor_parallel_size=2)
    engine = Engine(EngineConfig(model=str(tmp_path / "awq"), **config))
    try:
        assert "Int4" in repr(engine.model.layers[0].mlp.down_proj.base)  # its codes, not re-quantized
        _close_to_hf(engine, hf, 0.3)
    finally:
        engine.close()
    _write_quantized(_hf_llama(), tmp_path / "gptq", "gptq", 32)
    children = set(multiprocessing.active_children())
    with pytest.raises(ConfigError, match=r"layers\.0\.o gathers its input columns \(act-order GPTQ\)"):
        Engine(EngineConfig(model=str(tmp_path / "gptq"), **config))
    assert not set(multiprocessing.active_children()) - children  # no worker outlives the failed start
