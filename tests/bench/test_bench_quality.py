"""bench-quality (lora_server/bench/quality.py): its figures against an independent computation. Perplexity, KL
divergence and top-1 agreement of two tiny checkpoints (and of an adapter on both) are computed here from HF
transformers + PEFT logits with torch's own kl_div; KL on a hand-computed pair; Engine.full_prompt_logprobs' rows
line up with prompt_logprobs; the command prints its table."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from lora_server.bench.quality import (
    BASE,
    REFERENCE,
    parse_mode,
    position_figures,
    reference_config,
    score,
    text_chunks,
)
from lora_server.cli import main
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.errors import ConfigError, InvalidRequestError
from lora_server.sampling_params import SamplingParams

CTX = 32


def test_kl_nll_and_agreement_of_a_hand_computed_pair():
    ref = torch.tensor([[0.5, 0.25, 0.25]]).log()
    mode = torch.tensor([[0.25, 0.5, 0.25]]).log()
    nll, kl, same = position_figures(ref, mode, torch.tensor([1]))
    # KL = 0.5 ln(0.5 / 0.25) + 0.25 ln(0.25 / 0.5) + 0.25 ln 1 = 0.25 ln 2
    assert kl.item() == pytest.approx(0.25 * math.log(2), abs=1e-6)
    assert nll.item() == pytest.approx(math.log(2), abs=1e-6)
    assert not same.item()
    nll, kl, same = position_figures(ref, ref, torch.tensor([0]))
    assert kl.item() == 0.0 and same.item() and nll.item() == pytest.approx(math.log(2), abs=1e-6)


def test_chunks_and_modes():
    assert text_chunks(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert text_chunks(list(range(10)), 4, 99, limit=1) == [[99, 1, 2, 3]]
    assert parse_mode("none+fp8kv").overrides == {"quantization": "none", "kv_cache_dtype": "fp8"}
    for bad in ("int3", "int8+fp4kv"):
        with pytest.raises(ConfigError):
            parse_mode(bad)


def test_full_prompt_logprobs_rows_and_contract():
    """Row j is the distribution that scores token j + 1 (what prompt_logprobs reports of it), over the whole
    vocabulary; scoring runs alone."""
    engine = Engine(EngineConfig(model="tiny-llama", load_format="dummy", kv_cache_bytes=16 << 20, show_progress=False))
    prompt = [5, 9, 3, 17, 4, 4, 30]
    rows = engine.full_prompt_logprobs(prompt)
    assert rows.shape == (len(prompt) - 1, engine.vocab_size) and rows.dtype == torch.float32
    assert torch.allclose(rows.exp().sum(-1), torch.ones(len(prompt) - 1), atol=1e-5)
    [done] = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert done.prompt_logprobs is not None and done.prompt_logprobs[0] is None
    for j, entry in enumerate(done.prompt_logprobs[1:]):
        assert entry is not None and entry.logprob == pytest.approx(rows[j, prompt[j + 1]].item(), abs=1e-5)
        assert [t for t, _ in entry.top] == rows[j].topk(2).indices.tolist()
    with pytest.raises(InvalidRequestError):
        engine.full_prompt_logprobs(prompt[:1])
    engine.add(engine.make_request(prompt, SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="alone"):
        engine.full_prompt_logprobs(prompt)
    with pytest.raises(RuntimeError, match="alone"):  # generate would take the queued request's outputs
        engine.generate([prompt], SamplingParams(max_tokens=1))


def _tiny_llama(path, vocab: int, noise: float = 0.0, seed: int = 0):
    """A tiny random Llama saved to ``path`` (``noise``: every weight then moved by that much Gaussian noise, a
    stand-in for a quantized copy of the same model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def _peft_adapter(hf_model, path) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    model = get_peft_model(hf_model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    model.save_pretrained(path)


def _hf_rows(model, adapter_dir, chunk: list[int]) -> torch.Tensor:
    """[len - 1, vocab] log-softmax of HF transformers' logits (+ PEFT's adapter when given)."""
    from peft import PeftModel

    run = model if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(model), adapter_dir).eval()
    with torch.no_grad():
        logits = run(input_ids=torch.tensor([chunk])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_figures_match_hf_and_peft(tmp_path):
    vocab = 256
    ref_hf = _tiny_llama(tmp_path / "ref", vocab)
    noisy_hf = _tiny_llama(tmp_path / "noisy", vocab, noise=0.01)
    _peft_adapter(_tiny_llama(tmp_path / "scratch", vocab), tmp_path / "ad")
    base = EngineConfig(model=str(tmp_path / "ref"), block_size=32, num_kv_blocks=32, show_progress=False)
    reference = Engine(reference_config(base))
    engines = {
        "self": Engine(base),  # the reference's own checkpoint: KL 0, agreement 1
        "noisy": Engine(dataclasses.replace(base, model=str(tmp_path / "noisy"))),
    }
    for engine in (reference, *engines.values()):
        engine.adapters.add("ad", tmp_path / "ad")
    gen = torch.Generator().manual_seed(3)
    chunks = text_chunks(torch.randint(3, vocab, (3 * CTX + 5,), generator=gen).tolist(), CTX, None)
    tallies = score(reference, engines, chunks, [None, "ad"])
    assert list(tallies) == [(m, a) for a in (BASE, "ad") for m in (REFERENCE, "self", "noisy")]

    first = CTX // 2
    for adapter, adapter_dir in ((BASE, None), ("ad", tmp_path / "ad")):
        ref_rows = torch.cat([_hf_rows(ref_hf, adapter_dir, c)[first:] for c in chunks])
        noisy_rows = torch.cat([_hf_rows(noisy_hf, adapter_dir, c)[first:] for c in chunks])
        targets = torch.tensor([t for c in chunks for t in c[first + 1 :]])
        n = len(targets)
        for label, rows in ((REFERENCE, ref_rows), ("self", ref_rows), ("noisy", noisy_rows)):
            t = tallies[label, adapter]
            assert t.positions == n == 3 * (CTX - 1 - first)
            nll = -rows.gather(1, targets[:, None]).mean().item()
            assert t.perplexity == pytest.approx(math.exp(nll), rel=1e-4), (label, adapter)
            kl = torch.nn.functional.kl_div(rows, ref_rows, reduction="sum", log_target=True).item() / n
            assert t.mean_kl == pytest.approx(kl, rel=1e-3, abs=1e-6), (label, adapter)
            assert t.same_top == int((rows.argmax(-1) == ref_rows.argmax(-1)).sum()), (label, adapter)
        assert tallies["self", adapter].mean_kl == pytest.approx(0.0, abs=1e-7)
        assert tallies["self", adapter].top1 == 1.0
        assert tallies["noisy", adapter].mean_kl > 1e-3  # the noise shows


def test_command_prints_the_table(tmp_path, capsys, smollm2_path):
    from lora_server.engine.tokenizer import Tokenizer

    _tiny_llama(tmp_path / "m", vocab=49152)  # the embedded model's tokenizer, so that the text tokenizes
    Tokenizer.from_gguf(smollm2_path).save_pretrained(tmp_path / "m", 256)
    out = tmp_path / "q.json"
    argv = ["bench-quality", "--model", str(tmp_path / "m"), "--modes", "int8,none+fp8kv", "--compare"]
    argv += [str(tmp_path / "m"), "--ctx", "64", "--chunks", "2", "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "mean KL" in printed and "top-1" in printed and "wall time" in printed
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [REFERENCE, "int8", "none+fp8kv", "m"]
    assert all(r["adapter"] == BASE and r["positions"] == 2 * 31 for r in rows.values())
    assert rows["m"]["mean_kl"] == 0.0 and rows["m"]["top1"] == 1.0  # the reference's checkpoint against itself
    assert rows["m"]["perplexity"] == rows[REFERENCE]["perplexity"]
    assert main(["bench-quality", "--modes", "int3"]) == 2
    assert main(["bench-quality", "--quantization", "int8"]) == 2


@pytest.mark.slow
def test_embedded_model_with_a_demo_adapter_matches_hf_and_peft(hf_smollm2, tmp_path):
    """The reference on the embedded model (its Q4_1 weights dequantized to float32) with the demo adapter emoji:
    its perplexity is HF transformers + PEFT's over the same chunk."""
    from lora_server.adapters import demo_adapters

    reference = Engine(reference_config(EngineConfig(kv_cache_bytes=64 << 20, show_progress=False)))
    emoji = demo_adapters()["emoji"]
    reference.adapters.add("emoji", emoji)
    assert reference.tokenizer is not None
    tokens = reference.tokenizer.encode("The river ran quietly past the old mill and under the bridge. " * 30)
    chunks = text_chunks(tokens, 128, None, limit=1)
    tallies = score(reference, {}, chunks, [None, "emoji"])
    targets = torch.tensor(chunks[0][65:])
    for adapter, adapter_dir in ((BASE, None), ("emoji", emoji)):
        rows = _hf_rows(hf_smollm2, adapter_dir, chunks[0])[64:]
        nll = -rows.gather(1, targets[:, None]).mean().item()
        assert tallies[REFERENCE, adapter].perplexity == pytest.approx(math.exp(nll), rel=1e-4)
