"""LoRA on the embedding (embed_tokens) and the output head (lm_head), and PEFT's trainable tokens
(trainable_token_indices), served as PEFT 0.21 computes them.

End to end on tiny Llamas, one with its own head and one whose head is tied to the embedding: the engine's greedy
tokens and log-probabilities against HF transformers + PEFT at fp32, each adapter alone and all of them in one
batch with a plain LoRA and the base; prompt log-probabilities (the scoring path's head) too. Each adapter moves the
model (PEFT with it against PEFT without it), so a change the engine dropped fails the comparison. The trainable
tokens' prompts use the trained ids, and on the tied model a trained head row is made strongly preferred, so that
the greedy tokens are trained ids. Where they live: in the adapter's arena pages, which the pool counts. On CUDA
(GPU tier) through the decode graphs. Refusals: ids beyond the base's vocabulary (an adapter trained with added
tokens), and an engine whose BaseShapes say it does not apply these forms."""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_server.adapters.peft_format import AdapterError, BaseShapes, load_peft_adapter
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.adapters import test_adapter_keys
from tests.conftest import pool_of, runner_of
from tests.model.test_model_vs_hf import LOGPROB_TOL, _near_tie

tiny = test_adapter_keys.tiny  # a random tiny Llama with its own head (vocab 128, hidden 64), and its HF model
TRAINED = [7, 19, 42]  # the trainable tokens' ids
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    """The same tiny Llama with its head tied to the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**{**test_adapter_keys.TINY, "tie_word_embeddings": True})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("tiny-tied")
    model.save_pretrained(path)
    return path, model


def _save(model, config, path: Path, edit=None) -> Path:
    """PEFT's adapter ``config`` on a copy of ``model``, its LoRA weights drawn at random (B times 0.5 on top of
    PEFT's draw) and ``edit(peft_model)`` applied before saving."""
    from peft import get_peft_model

    torch.manual_seed(len(str(path)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = get_peft_model(copy.deepcopy(model), config)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.3)
            if edit is not None:
                edit(peft)
        peft.save_pretrained(path)
    return path


def _hidden_direction(model, prompts: list[list[int]]) -> torch.Tensor:
    """The unit mean of the base's final hidden states over ``prompts``: a head row along it wins the argmax."""
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts])
    mean = hidden.mean(0)
    return mean / mean.norm()


def _make_adapters(model, tmp_path: Path, prompts: list[list[int]]) -> dict[str, Path]:
    from peft import LoraConfig

    direction = _hidden_direction(model, prompts)

    def strong_rows(peft) -> None:  # the trained ids' rows: random, the last one along the hidden states (tied)
        for name, p in peft.named_parameters():
            if "trainable_tokens_delta" in name:
                p.copy_(torch.randn_like(p) * 0.5)
                p[-1] = direction * 12

    return {
        "plain": _save(
            model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False), tmp_path / "plain"
        ),
        "embed": _save(
            model,
            LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens"], init_lora_weights=False),
            tmp_path / "embed",
        ),
        "head": _save(
            model,
            LoraConfig(r=4, lora_alpha=4, target_modules=["lm_head", "v_proj"], init_lora_weights=False),
            tmp_path / "head",
        ),
        # q_proj's B is zero (PEFT's init): only the trained rows move the model
        "tokens": _save(
            model,
            LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=TRAINED),
            tmp_path / "tokens",
            strong_rows,
        ),
    }


def _reference(model, adapter: Path | None):
    from peft import PeftModel

    if adapter is None:
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(copy.deepcopy(model), adapter).eval()


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def _prompts() -> list[list[int]]:
    """Prompts that use the trained ids (and tokens the embedding LoRA changes: all of them)."""
    gen = torch.Generator().manual_seed(3)
    prompts = []
    for n in (5, 13, 9, 21, 3, 17):
        ids = torch.randint(0, 128, (n,), generator=gen).tolist()
        ids[n // 2] = TRAINED[len(prompts) % len(TRAINED)]
        ids[-1] = TRAINED[(len(prompts) + 1) % len(TRAINED)]
        prompts.append(ids)
    return prompts


def _engine(path: Path, adapters: dict[str, Path], **kw) -> Engine:
    config = dict(quantization="none", kv_cache_bytes=16 << 20, block_size=64, max_loras=8, show_progress=False)
    engine = Engine(EngineConfig(model=str(path), **{**config, **kw}))
    for name, adapter in adapters.items():
        engine.adapters.add(name, adapter)
    return engine


def _check(engine: Engine, base_model, adapters: dict[str, Path], plan: list[str | None]) -> list[list[int]]:
    """The requests of ``plan`` (an adapter name or None each, on _prompts()) in one batch: logprobs within
    LOGPROB_TOL of PEFT's with that adapter alone, greedy tokens PEFT's but for near ties, and each adapter moving the
    model. Returns the generated tokens."""
    prompts = _prompts()[: len(plan)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    outs = engine.generate(prompts, params, adapters=plan)
    refs = {name: _reference(base_model, adapters[name]) for name in set(plan) if name is not None}
    generated = []
    for prompt, adapter, out in zip(prompts, plan, outs, strict=True):
        model = base_model if adapter is None else refs[adapter]
        ref = _log_softmax(model, prompt + out.token_ids)
        if adapter is not None:
            moved = (ref - _log_softmax(base_model, prompt + out.token_ids)).abs().max()
            assert moved > 0.05, (adapter, float(moved))
        for step, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + step]
            assert abs(lp.logprob - row[lp.token_id].item()) <= LOGPROB_TOL, (adapter, step)
            assert lp.token_id == int(row.argmax()) or _near_tie(row), (adapter, step)
        generated.append(out.token_ids)
    return generated


@pytest.fixture(scope="module")
def untied_setup(tiny, tmp_path_factory):
    path, model = tiny
    adapters = _make_adapters(model, tmp_path_factory.mktemp("untied-adapters"), _prompts())
    return path, model, adapters, _engine(path, adapters)


@pytest.fixture(scope="module")
def tied_setup(tiny_tied, tmp_path_factory):
    path, model = tiny_tied
    adapters = _make_adapters(model, tmp_path_factory.mktemp("tied-adapters"), _prompts())
    return path, model, adapters, _engine(path, adapters)


@pytest.mark.parametrize("form", ["embed", "head", "tokens"])
@pytest.mark.parametrize("setup", ["untied_setup", "tied_setup"])
def test_each_form_alone_matches_peft(request, setup, form):
    _, model, adapters, engine = request.getfixturevalue(setup)
    generated = _check(engine, model, adapters, [form, form, form])
    if form == "tokens" and setup == "tied_setup":  # the tied head's trained row wins: the greedy token is its id
        assert all(TRAINED[-1] in tokens for tokens in generated), generated


@pytest.mark.parametrize("setup", ["untied_setup", "tied_setup"])
def test_mixed_batch_matches_peft(request, setup):
    _, model, adapters, engine = request.getfixturevalue(setup)
    _check(engine, model, adapters, ["tokens", None, "embed", "plain", "head", "tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["untied_setup", "tied_setup"])
def test_tensor_parallel_mixed_batch_and_prompt_logprobs_match_peft(request, setup):
    """At TP=2 (the vocabulary-parallel embedding and head): every rank applies the embedding's changes to the
    all-reduced rows and rank 0 the head's to the gathered logits; the mixed batch and the scoring path's head as
    PEFT computes them, with the integrity check on every rank."""
    path, model, adapters, _ = request.getfixturevalue(setup)
    engine = _engine(path, adapters, tensor_parallel_size=2, host_kv_bytes=0)
    try:
        _check(engine, model, adapters, ["tokens", None, "embed", "plain", "head", "tokens"])
        prompt = _prompts()[3]
        for form in ("embed", "head", "tokens"):
            scores = engine.full_prompt_logprobs(prompt, form)
            assert (scores - _log_softmax(_reference(model, adapters[form]), prompt)[:-1]).abs().max() <= LOGPROB_TOL
        engine.check_integrity()
    finally:
        engine.close()


@pytest.mark.parametrize("form", ["embed", "head", "tokens"])
def test_prompt_logprobs_match_peft(tied_setup, form):
    """The scoring path's head: every prompt token's logprob under the adapter, as PEFT's."""
    _, model, adapters, engine = tied_setup
    prompt = _prompts()[3]
    scores = engine.full_prompt_logprobs(prompt, form)
    ref = _log_softmax(_reference(model, adapters[form]), prompt)[:-1]
    assert (scores - ref).abs().max() <= LOGPROB_TOL


def test_peft_keeps_the_full_rows_and_ties_the_head(tiny_tied, tmp_path):
    """What the engine relies on: trainable_tokens_delta holds the listed ids' whole new rows, and on a tied model
    PEFT's head uses them too."""
    from peft import LoraConfig

    _, model = tiny_tied
    path = _save(model, LoraConfig(target_modules=["q_proj"], trainable_token_indices=[5, 9]), tmp_path / "a")
    delta = next(v for k, v in load_file(str(path / "adapter_model.safetensors")).items() if "trainable_tokens" in k)
    assert torch.equal(delta, model.model.embed_tokens.weight[[5, 9]])  # PEFT's init: the rows as they were
    peft = _reference(model, path)
    with torch.no_grad():
        new = torch.randn(2, 64)
        next(p for n, p in peft.named_parameters() if "trainable_tokens_delta" in n).copy_(new)
        h = torch.randn(1, 1, 64)
        assert torch.allclose(peft.get_output_embeddings()(h)[0, 0, [5, 9]], new @ h[0, 0])


def test_ids_beyond_the_vocabulary_are_refused(tiny, tmp_path):
    from peft import LoraConfig

    _, model = tiny
    path = _save(model, LoraConfig(target_modules=["q_proj"], trainable_token_indices=[3, 4, 5]), tmp_path / "a")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "trainable_token_indices": [3, 128, 130]}))
    shapes = BaseShapes.llama(2, 64, 128, 64, 32, vocab_size=128, vocab_refusal="")
    with pytest.raises(
        AdapterError, match=re.escape("2 token id(s) (e.g. 128) are beyond the base model's vocabulary of 128")
    ):
        load_peft_adapter("x", path, shapes, max_rank=16)


def test_an_engine_that_does_not_apply_them_refuses_them(untied_setup):
    """An engine that does not apply these forms says why in its BaseShapes, and registration fails."""
    _, _, adapters, _ = untied_setup
    shapes = BaseShapes.llama(2, 64, 128, 64, 32, vocab_size=128, vocab_refusal="not under this engine's mode")
    for form, named in (("embed", "embed_tokens"), ("head", "lm_head"), ("tokens", "trainable_token_indices")):
        with pytest.raises(AdapterError, match=re.escape(named) + ".*not under this engine's mode"):
            load_peft_adapter(form, adapters[form], shapes, max_rank=16)
    load_peft_adapter("plain", adapters["plain"], shapes, max_rank=16)


def test_their_rows_are_in_the_adapters_arena_pages(untied_setup):
    """The embedding's and head's pieces are views of the adapter's own arena pages, the pages the pool gave it and
    counts (how many a piece takes: test_page_layout's vocabulary case, by hand)."""
    _, _, _, engine = untied_setup
    engine.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=1), adapters=["embed", "head", "tokens", "plain"])
    runner, pool = runner_of(engine), pool_of(engine)
    resident = {node.key.adapter_id: node for node in pool.tree.adapters() if node.blocks}
    ids = {name: p.adapter_id for p in engine.pool_report().adapters for name in p.names}
    for name in ("embed", "head", "tokens", "plain"):
        node = resident[ids[name]]
        terms = runner.adapters.vocab(node.blocks[0])
        if name == "plain":
            assert terms is None
            continue
        assert terms is not None and terms.pieces
        page_bytes, base = runner.arena.page_bytes, runner.arena.pages.data_ptr()
        owned = set(runner.adapters.pages_of(node.blocks[0]))
        assert owned == set(node.blocks)
        for runs in terms.pieces.values():
            for _, _, rows in runs:
                first, last = rows.data_ptr() - base, rows.data_ptr() - base + rows.nbytes - 1
                assert {first // page_bytes, last // page_bytes} <= owned


def test_the_pieces_may_span_pages():
    """VocabTerms over pieces held in several runs of rows (what a vocabulary-long matrix becomes when it spans
    pages) computes PEFT's formulas on the whole matrices (adapters.peft_format.VocabLora)."""
    from lora_server.adapters.peft_format import VocabLora
    from lora_server.model.lora import VocabTerms

    gen = torch.Generator().manual_seed(5)
    vocab, hidden, r = 40, 8, 3

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    lora = VocabLora(
        embed_lora=(rand(vocab, r), rand(r, hidden)),
        head_lora=(rand(r, hidden), rand(r, vocab)),
        embed_tokens=(torch.tensor([3, 17, 31]), rand(3, hidden)),
        head_tokens=(torch.tensor([5, 38]), rand(2, hidden)),
    )

    def runs(matrix, cuts):
        bounds = [0, *cuts, matrix.shape[0]]
        return [(a, b, matrix[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]

    pieces = {
        "embed_a_t": runs(lora.embed_lora[0], [11, 12, 30]),
        "embed_b_t": runs(lora.embed_lora[1], [1]),
        "head_a": runs(lora.head_lora[0], [2]),
        "head_b": runs(lora.head_lora[1].t(), [7, 25]),
        "embed_rows": runs(lora.embed_tokens[1], [1]),
        "head_rows": runs(lora.head_tokens[1], [1]),
    }
    terms = VocabTerms(pieces, lora.token_ids, vocab, torch.device("cpu"))
    ids = torch.tensor([0, 3, 11, 12, 17, 29, 30, 31, 39])
    x = rand(ids.numel(), hidden)
    embed = x + lora.embed_lora[0][ids] @ lora.embed_lora[1]
    for i, t in enumerate(ids.tolist()):
        if t in (3, 17, 31):
            embed[i] = lora.embed_tokens[1][[3, 17, 31].index(t)]
    terms.embed_(x, ids)
    assert torch.allclose(x, embed)
    h = rand(4, hidden)
    logits = rand(4, vocab + 2).float()  # a head padded past the vocabulary
    want = logits.clone()
    want[:, :vocab] += ((h @ lora.head_lora[0].T) @ lora.head_lora[1]).float()
    want[:, [5, 38]] = (h @ lora.head_tokens[1].T).float()
    terms.head_(logits, h)
    assert torch.allclose(logits, want, atol=1e-5)


@pytest.mark.gpu
def test_each_form_on_cuda_matches_peft(untied_setup, tied_setup):
    """The CUDA path (GPU tier), fp32: the embedding's changes make a decode step run eagerly (its graph holds none),
    the head's apply after a replayed graph; mixed with plain LoRA and the base, on both tiny Llamas."""
    for path, model, adapters, _ in (untied_setup, tied_setup):
        config = dict(kv_cache_bytes=16 << 20, block_size=64, max_loras=8, show_progress=False)
        engine = Engine(EngineConfig(model=str(path), quantization="none", device="cuda", dtype="float32", **config))
        for name, adapter in adapters.items():
            engine.adapters.add(name, adapter)
        assert runner_of(engine).graphs is not None
        _check(engine, model, adapters, ["tokens", None, "embed", "plain", "head", "tokens"])
        _check(engine, model, adapters, ["head", None, "plain"])  # decode steps replay their graph


def test_the_saved_base_embedding_must_be_the_bases_shape(untied_setup, tmp_path):
    """PEFT saves the base's embedding beside a LoRA on it; one of another vocabulary (resized) is refused."""
    _, _, adapters, _ = untied_setup
    out = tmp_path / "resized"
    out.mkdir()
    tensors = load_file(str(adapters["embed"] / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("embed_tokens.base_layer.weight"))
    tensors[key] = torch.zeros(130, 64)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((adapters["embed"] / "adapter_config.json").read_text())
    shapes = BaseShapes.llama(2, 64, 128, 64, 32, vocab_size=128, vocab_refusal="")
    with pytest.raises(AdapterError, match="resized vocabulary"):
        load_peft_adapter("x", out, shapes, max_rank=16)


def test_speculative_decoding_verifies_with_the_adapters_head(tied_setup):
    """Prompt-lookup drafts are verified on logits rows that carry the request's adapter: with the tied trained row
    repeating, drafts are proposed and accepted, and the tokens and logprobs stay PEFT's."""
    path, model, adapters, _ = tied_setup
    config = dict(quantization="none", kv_cache_bytes=16 << 20, block_size=64, max_loras=8, show_progress=False)
    engine = Engine(EngineConfig(model=str(path), speculative_ngram=3, speculative_ngram_min=1, **config))
    for name, adapter in adapters.items():
        engine.adapters.add(name, adapter)
    _check(engine, model, adapters, ["tokens", "head", None, "embed", "tokens"])
    snap = engine.snapshot()
    assert snap.spec_draft_tokens > 0 and snap.spec_accepted_tokens > 0


@pytest.mark.slow
def test_gemma_embedding_scale_and_soft_cap(tmp_path):
    """Gemma 2 (tied head, embeddings times sqrt(hidden), soft-capped logits): PEFT scales an embedding LoRA's rows
    and trainable tokens' rows like the base's, and a head LoRA's logits are capped with the base's; LoRA on both
    the tied embedding and head changes each independently."""
    from peft import LoraConfig

    from tests.model.test_architectures import _build

    model = _build(tmp_path / "base", "gemma2")
    adapters = _make_adapters(model, tmp_path, _prompts())
    both = LoraConfig(r=4, target_modules=["embed_tokens", "lm_head"], init_lora_weights=False)  # on a tied model
    adapters["both"] = _save(model, both, tmp_path / "both")
    engine = Engine(
        EngineConfig(
            model=str(tmp_path / "base"), block_size=16, num_kv_blocks=128, max_lora_rank=8, show_progress=False
        )
    )
    for name, adapter in adapters.items():
        engine.adapters.add(name, adapter)
    _check(engine, model, adapters, ["embed", "tokens", "head", None, "plain", "both"])


@pytest.mark.slow
def test_the_server_serves_each_form_streamed_and_not(tmp_path_factory, hf_smollm2):
    """``lora-server serve`` on the embedded model (its head tied to its embedding): an embedding LoRA, a head LoRA
    and trainable tokens registered through the admin API answer the openai client's completions with HF + PEFT's
    greedy tokens, streamed and not, beside the base model (prompts as token ids: no tokenizer between the sides)."""
    from peft import LoraConfig

    from tests.model.test_architectures import _peft_greedy
    from tests.servers import BASE, assert_serves_greedy

    root = tmp_path_factory.mktemp("vocab-server")
    prompt = [1, 9690, 314, 253, 2914, 1005, 28, 2]
    trained = [253, 2914, 28]

    def rows(peft) -> None:  # the trained ids' own rows, far from the base's
        for name, p in peft.named_parameters():
            if "trainable_tokens_delta" in name:
                p.copy_(torch.randn_like(p) * 0.5)

    def lora(target: str) -> LoraConfig:
        return LoraConfig(r=4, target_modules=[target], init_lora_weights=False)

    adapters = {
        "embed": _save(hf_smollm2, lora("embed_tokens"), root / "e"),
        "head": _save(hf_smollm2, lora("lm_head"), root / "h"),
        "tokens": _save(
            hf_smollm2, LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=trained), root / "t", rows
        ),
    }
    refs = {name: _reference(hf_smollm2, path) for name, path in adapters.items()}  # PEFT loads them one by one
    expected = {name: _peft_greedy(refs[name], "default", prompt, 8) for name in adapters}
    expected[BASE] = _peft_greedy(refs["embed"], None, prompt, 8)
    assert all(expected[name] != expected[BASE] for name in adapters), expected
    assert_serves_greedy(root, adapters, prompt, expected)
