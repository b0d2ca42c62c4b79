"""Activated LoRA (PEFT's alora_invocation_tokens) against HF transformers + PEFT at fp32, and the base model's KV
it shares. An aLoRA applies from the last occurrence of its invocation sequence in the prompt on (every generated
token included); the tokens before it are the base model's, so their KV is the base's: matched in and offered to
the base model's prefix tree. Without an occurrence it applies to no token (PEFT's rule).

The reference runs each row alone (PEFT computes the offsets of one adapter per batch row itself, in generate);
the engine runs them in one batch with a plain LoRA of the same weights and the base model."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

from lora_server.adapters.peft_format import AdapterError, BaseShapes, load_peft_adapter
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.engine.request import activation_start
from lora_server.sampling_params import SamplingParams
from tests.conftest import scheduler_of

BLOCK = 16
NEW_TOKENS = 8
LOGPROB_TOL = 2e-3
CHECKS = ("<|im_start|>check\n", "<|im_start|>judge\n")  # the two aLoRAs' invocation texts


def test_activation_start_is_the_last_occurrence():
    """Hand-worked cases of PEFT's calculate_alora_offsets rule (offset = len - start of the last occurrence)."""
    assert activation_start([5, 1, 2, 7, 1, 2, 9], [1, 2]) == 4
    assert activation_start([1, 2], [1, 2]) == 0
    assert activation_start([1, 2, 1], [1, 2]) == 0
    assert activation_start([3, 4], [1, 2]) == sys.maxsize  # absent: the adapter applies nowhere
    assert activation_start([1], [1, 2]) == sys.maxsize  # a prefix of the sequence at the end is no occurrence
    assert activation_start([3, 4], []) == 0  # a plain LoRA: every token


def _alora(path, tokens: list[int]):
    """tests.servers.write_adapter's SmolLM2 LoRA made an aLoRA invoked by ``tokens``."""
    from tests.servers import write_adapter

    write_adapter(path, seed=3)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "alora_invocation_tokens": tokens}))
    return path


def test_invocations_that_can_never_occur_are_refused(tmp_path):
    """Against a base of 100 tokens and 6 positions: ids up to 99 and up to 6 of them are an invocation a prompt
    can hold; an id of 100 or beyond (up to 2**80), or 7 ids, never occur in a prompt, and are refused naming the
    key and why, without echoing the list. Where the base does not say (0: unknown), nothing is checked."""
    base = BaseShapes.llama(30, 576, 1536, 576, 192, vocab_size=100, max_positions=6)
    unknown = BaseShapes.llama(30, 576, 1536, 576, 192)
    for tokens in ([99], [0, 1, 2, 3, 4, 99]):
        assert load_peft_adapter("ok", _alora(tmp_path / "ok", tokens), base, 8).invocation_tokens == tuple(tokens)
    refusals = {
        "beyond": (
            [5, 100, 2**80],
            r"alora_invocation_tokens: 2 token id\(s\) \(e.g. 100\) are beyond the base "
            r"model's vocabulary of 100 tokens",
        ),
        "long": ([5] * 7, "alora_invocation_tokens holds 7 tokens, more than the base model's context of 6 positions"),
        "huge": ([5] * 200_000 + [100], "beyond the base model's vocabulary"),
    }
    for name, (tokens, words) in refusals.items():
        path = _alora(tmp_path / name, tokens)
        with pytest.raises(AdapterError, match=words) as refused:
            load_peft_adapter(name, path, base, 8)
        assert "can never occur in a prompt" in str(refused.value) and len(str(refused.value)) < 400
        assert load_peft_adapter(name, path, unknown, 8).invocation_tokens == tuple(tokens)


@pytest.mark.slow
def test_the_admin_api_refuses_invocations_that_can_never_occur(tmp_path):
    """A real server on SmolLM2 (49152 tokens, 8192 positions): POST /admin/adapters answers 400 naming
    alora_invocation_tokens for an id beyond the vocabulary (2**80) and for a 200,000-token sequence, and registers
    nothing; an aLoRA whose invocation can occur registers."""
    from tests.servers import Server

    (tmp_path / "data").mkdir()
    server = Server(tmp_path / "data", [tmp_path])
    try:
        for name, tokens, words in (
            ("beyond", [5, 2**80], "beyond the base model's vocabulary of 49152 tokens"),
            ("long", [5] * 200_000, "holds 200000 tokens, more than the base model's context of 8192 positions"),
        ):
            path = _alora(tmp_path / name, tokens)
            r = server.admin("POST", "/admin/adapters", json={"name": name, "path": str(path)})
            assert r.status_code == 400 and "alora_invocation_tokens" in r.text and words in r.text, r.text
            assert server.admin("GET", f"/admin/adapters/{name}").status_code == 404
        path = _alora(tmp_path / "fine", [5, 17])
        assert server.admin("POST", "/admin/adapters", json={"name": "fine", "path": str(path)}).status_code == 200
    finally:
        server.stop()


def _engine(**kw) -> Engine:
    config = {"quantization": "none", "kv_cache_bytes": 64 << 20, "max_lora_rank": 8, "show_progress": False}
    return Engine(EngineConfig(**{**config, **kw}))


@pytest.fixture(scope="module")
def alora(tmp_path_factory, hf_smollm2, smollm2_path):
    """Two aLoRAs (their own weights and invocation sequences) and, for each, a plain LoRA of the same weights;
    the PEFT model holding all four. Returns (root, {name: invocation ids}, peft model)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    tokenizer = _engine(kv_cache_bytes=8 << 20).tokenizer
    assert tokenizer is not None
    root, invocations = tmp_path_factory.mktemp("alora"), {}
    for i, text in enumerate(CHECKS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        name = f"check{i}"
        invocations[name] = ids
        torch.manual_seed(40 + i)
        config = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules="all-linear",
            init_lora_weights=False,
            alora_invocation_tokens=ids,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(copy.deepcopy(hf_smollm2), config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(1.5)  # strong enough that the answers move
        model.save_pretrained(root / name)
        config.alora_invocation_tokens = None  # the same weights as a plain LoRA
        model.peft_config["default"] = config
        model.save_pretrained(root / f"plain{i}")
    names = [*invocations, "plain0", "plain1"]
    peft = PeftModel.from_pretrained(copy.deepcopy(hf_smollm2), root / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(root / name, adapter_name=name)
    return root, invocations, peft.eval()


def _peft_generate(peft, adapter: str | None, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF + PEFT greedy tokens, each from a forward over the whole sequence so far (PEFT's forward finds an aLoRA's
    invocation in it itself), and the log-softmax of every position of the last one."""
    import contextlib

    if adapter is not None:
        peft.set_adapter(adapter)
    ids = list(prompt)
    with torch.no_grad(), peft.disable_adapter() if adapter is None else contextlib.nullcontext():
        for _ in range(NEW_TOKENS):
            logits = peft(input_ids=torch.tensor([ids])).logits[0]
            ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :], torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.slow
def test_alora_alone_and_mixed_matches_peft(alora, engine_alora):
    """One batch: each aLoRA with its invocation, the same weights as plain LoRAs, an aLoRA whose prompt lacks its
    invocation, the base model. Every row's greedy tokens equal HF + PEFT's with only its adapter, logprobs
    within 2e-3; the masking matters (an aLoRA is neither its plain LoRA nor the base model)."""
    _assert_alone_and_mixed_match_peft(alora, engine_alora)


@pytest.mark.slow
def test_alora_at_tp3_matches_peft(alora):
    """The same at --tensor-parallel-size 3: rank 0 decides where each request's adapter starts, and the workers
    follow its runs of tokens."""
    root, invocations, _ = alora
    engine = _engine(block_size=BLOCK, kv_cache_bytes=64 << 20, host_kv_bytes=0, tensor_parallel_size=3)
    try:
        for name in [*invocations, "plain0", "plain1"]:
            engine.adapters.add(name, root / name)
        _assert_alone_and_mixed_match_peft(alora, engine)
    finally:
        engine.close()


def _assert_alone_and_mixed_match_peft(alora, engine: Engine) -> None:
    _, invocations, peft = alora
    conversation = engine.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    answer = engine.encode("The capital of France is Paris.<|im_end|>\n", add_special_tokens=False)
    asks = {name: conversation + answer + ids for name, ids in invocations.items()}
    plan = [
        ("check0", asks["check0"]),
        ("plain0", asks["check0"]),
        (None, asks["check0"]),
        ("check1", asks["check1"]),
        ("check1", conversation),  # no invocation: the base model answers
        ("plain1", asks["check1"]),
    ]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    outs = engine.generate([p for _, p in plan], params, adapters=[a for a, _ in plan])
    alone = engine.generate([asks["check0"]], params, adapters="check0")[0]
    assert alone.token_ids == outs[0].token_ids  # alone and mixed
    for (adapter, prompt), out in zip(plan, outs, strict=True):
        tokens, ref = _peft_generate(peft, adapter, prompt)
        assert out.token_ids == tokens, adapter
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - ref[len(prompt) - 1 + step, lp.token_id].item()) <= LOGPROB_TOL, adapter
    check0, plain0, base, _, unasked, _ = outs
    assert check0.token_ids != base.token_ids and check0.token_ids != plain0.token_ids
    assert unasked.token_ids == engine.generate([conversation], params)[0].token_ids  # the base model's answer
    engine.check_integrity()


@pytest.fixture(scope="module")
def engine_alora(alora):
    root, invocations, _ = alora
    engine = _engine(block_size=BLOCK, kv_cache_bytes=256 << 20)
    for name in [*invocations, "plain0", "plain1"]:
        engine.adapters.add(name, root / name)
    return engine


@pytest.mark.slow
def test_alora_prefix_is_the_base_models_kv(alora, engine_alora):
    """After a base request on a conversation, an aLoRA request on the conversation plus its invocation reuses the
    base's blocks (the same block ids: held once), and its own blocks from the invocation on are not cached; its
    plain LoRA twin (same weights) reuses nothing."""
    engine = engine_alora
    _, invocations, _ = alora
    conversation = engine.chat_prompt([{"role": "user", "content": "Describe the water cycle in a few sentences."}])
    assert len(conversation) > 2 * BLOCK
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    [base] = engine.generate([conversation], params, cache_salt="blocks")
    prompt = conversation + base.token_ids + invocations["check0"]
    computed = len(conversation) + NEW_TOKENS - 1  # the base request's KV: all but its last token
    described = [
        engine.make_request(prompt, params, adapter, "blocks", f"held-{i}")
        for i, adapter in enumerate(["check0", "check0", None])
    ]
    engine.adapters.stage(["check0"])
    for request in described:
        engine.add(request)
    engine.step()
    running = {r.request_id: r for r in scheduler_of(engine).running}  # the scheduler's state of each
    assert len(running) == 3
    shared = computed // BLOCK  # the base request's full blocks, all before the invocation
    tables = [running[f"held-{i}"].block_table[:shared] for i in range(3)]
    assert tables[0] == tables[1] == tables[2]  # one copy of the conversation's KV for all three
    assert [running[f"held-{i}"].num_cached_tokens for i in range(3)] == [shared * BLOCK] * 3
    while engine.has_work():
        engine.step()
    [twin] = engine.generate([prompt], params, adapters="plain0", cache_salt="blocks")
    assert twin.num_cached_tokens == 0  # a plain LoRA never reuses the base model's KV
    placement = {name: p for p in engine.pool_report().adapters for name in p.names}
    for name in invocations:  # nothing is ever cached under an aLoRA's own node
        assert placement[name].kv_blocks_gpu == placement[name].kv_blocks_host == 0
    engine.check_integrity()


@pytest.mark.slow
def test_alora_multi_turn_trace_prefills_the_conversation_once(alora, engine_alora):
    """A three-turn conversation; after each base answer both aLoRAs check it. Every check's prompt is the
    conversation so far, the answer and its invocation: served as aLoRAs, a check prefills only what follows the
    base model's full blocks of it (hand-computed below); served as plain LoRAs of the same weights, each check
    prefills its adapter's own copy of the conversation. Prints both totals (the figure the docs quote)."""
    engine = engine_alora
    _, invocations, _ = alora
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    checks, base = {"alora": 0, "plain": 0}, {"alora": 0, "plain": 0}
    expected = 0
    for kind in checks:
        chat: list[dict[str, str]] = []
        for text in ["Name a large city.", "Why is it known?", "Say it in one word."]:
            chat.append({"role": "user", "content": text})
            conversation = engine.chat_prompt(chat)
            [answer] = engine.generate([conversation], params, cache_salt=f"trace-{kind}")
            base[kind] += len(conversation) - answer.num_cached_tokens
            offered = (len(conversation) + NEW_TOKENS - 1) // BLOCK  # the base model's full blocks of it
            for i, (name, ids) in enumerate(invocations.items()):
                prompt = conversation + answer.token_ids + ids
                adapter = name if kind == "alora" else f"plain{i}"
                [check] = engine.generate([prompt], params, adapters=adapter, cache_salt=f"trace-{kind}")
                checks[kind] += len(prompt) - check.num_cached_tokens
                if kind == "alora":
                    start = len(conversation) + NEW_TOKENS  # where its invocation starts
                    expected += len(prompt) - BLOCK * min(offered, (len(prompt) - 1) // BLOCK, start // BLOCK)
                    offered = max(offered, start // BLOCK)  # the check offers its base part's full blocks
            chat.append({"role": "assistant", "content": engine.tokenizer.decode(answer.token_ids)})
    assert base["alora"] == base["plain"]  # the same base conversation either way
    assert checks["alora"] == expected
    total = {kind: base[kind] + checks[kind] for kind in checks}
    saved = total["plain"] - total["alora"]
    print(
        f"\naLoRA trace: {total['alora']} prompt tokens prefilled with the checks as aLoRAs, {total['plain']} as "
        f"plain LoRAs of the same weights ({saved} saved, {saved / total['plain']:.0%})"
    )
    assert saved > 0
    engine.check_integrity()


@pytest.mark.slow
def test_alora_through_the_http_server_streamed_and_not(alora, tmp_path):
    """The real server with an aLoRA and its plain twin, the openai client: streamed and not, each completion's
    text is HF + PEFT's greedy tokens' (the prompt given as token ids, so both see the same tokens)."""
    from tests.servers import Server

    root, invocations, peft = alora
    adapters = ["--adapter", f"check0={root / 'check0'}", "--adapter", f"plain0={root / 'plain0'}"]
    server = Server(tmp_path, [root], [*adapters, "--served-model-name", "base"])
    try:
        tokenizer = _engine(kv_cache_bytes=8 << 20).tokenizer
        assert tokenizer is not None
        conversation = tokenizer.encode("<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\nBlue.")
        prompt = conversation + tokenizer.encode("<|im_end|>\n", add_special_tokens=False) + invocations["check0"]
        client = server.client()
        for adapter in ("check0", "plain0", "base"):
            tokens, _ = _peft_generate(peft, None if adapter == "base" else adapter, prompt)
            want = tokenizer.decode(tokens, skip_special_tokens=True)
            body = {"ignore_eos": True}
            whole = client.completions.create(
                model=adapter, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body=body
            )
            assert whole.choices[0].text == want, adapter
            parts = client.completions.create(
                model=adapter, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body=body, stream=True
            )
            assert "".join(c.choices[0].text for c in parts if c.choices) == want, adapter
    finally:
        server.stop()
