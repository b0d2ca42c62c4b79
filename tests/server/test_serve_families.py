"""``lora-server serve --model DIR`` on a local HF directory of each family beyond Llama (Qwen3, Gemma 2, Gemma 3,
Phi-3): the real server starts on it and renders chats with the directory's own chat template and special tokens,
token for token as transformers' ``apply_chat_template`` renders them from the same directory, and answers through
the ``openai`` client, stopping at the family's end-of-turn token.

Each directory is a tiny random checkpoint of the family (tests/model/test_architectures.py builds it) with a tokenizer
trained here on the shipped quality text and a chat template in the family's turn format (its own role markers,
Gemma's BOS written by the template, its "model" role)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from lora_server.bench.quality import TEXT_PATH
from tests.model.test_architectures import _build
from tests.servers import Server

# family -> (its special tokens, the end-of-turn token, a chat template in its turn format)
TURNS = {
    "qwen3": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|im_end|>",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ),
    "gemma2": (
        ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        "<end_of_turn>",
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    ),
    "phi3": (
        ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
        "<|end|>",
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    ),
}
TURNS["gemma3"] = TURNS["gemma2"]
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def write_family_dir(root: Path, family: str) -> Path:
    """The family's tiny checkpoint (vocabulary 256) with a tokenizer of 256 ids trained on the quality text, its
    special tokens first, BOS added by the template (not by the tokenizer), and its end-of-turn token as EOS."""
    from transformers import PreTrainedTokenizerFast

    specials, end_of_turn, template = TURNS[family]
    path = root / family
    _build(path, family)
    backend = Backend(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=specials, show_progress=False)
    backend.train_from_iterator([TEXT_PATH.read_text()], trainer)
    assert backend.get_vocab_size() <= 256
    bos = "<bos>" if "<bos>" in specials else None
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=end_of_turn, chat_template=template
    )
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(eos_token_id=backend.token_to_id(end_of_turn), bos_token_id=backend.token_to_id(bos or specials[0]))
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)  # the end of turn, from config.json alone
    return path


def _serve_and_check(tmp_path: Path, family: str) -> None:
    from transformers import AutoTokenizer

    path = write_family_dir(tmp_path, family)
    reference = AutoTokenizer.from_pretrained(path)
    expected = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    server = Server(tmp_path, [], ["--model", str(path), "--served-model-name", family])
    try:
        rendered = httpx.post(f"{server.url}/tokenize", json={"model": family, "messages": CHAT}, timeout=60)
        assert rendered.status_code == 200, rendered.text
        assert rendered.json()["tokens"] == list(expected)
        reply = server.client().chat.completions.create(model=family, messages=CHAT, max_tokens=24, temperature=0)
        choice = reply.choices[0]
        assert reply.model == family and choice.finish_reason in ("stop", "length")
        assert reply.usage.prompt_tokens == len(expected)
        end_id = reference.convert_tokens_to_ids(TURNS[family][1])
        forced = server.client().completions.create(
            model=family,
            prompt=reference.decode(expected),
            max_tokens=8,
            temperature=0,
            logit_bias={str(end_id): 100},  # the end of turn first: the family's EOS must stop it
        )
        assert forced.choices[0].finish_reason == "stop" and forced.usage.completion_tokens == 1
    finally:
        server.stop()


def test_gemma3_serves_with_its_chat_template(tmp_path):
    _serve_and_check(tmp_path, "gemma3")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3"])
def test_family_serves_with_its_chat_template(tmp_path, family):
    _serve_and_check(tmp_path, family)
