"""``lora-server serve --model FILE.gguf`` on a Gemma 2 GGUF as llama.cpp's converter writes one: its weights
(tests/model/test_gguf_architectures.py's writer), a SentencePiece vocabulary (tests/engine/test_spm_vocab.py's) and the
chat template in the file. The real server renders a chat token for token as transformers renders it from the same file
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, template included), its greedy tokens are HF eager's on the
original model, and the file's end-of-turn token stops a completion."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.engine.test_spm_vocab import write_spm_gguf
from tests.model.test_architectures import FAMILIES, _build
from tests.model.test_gguf_architectures import GGUF_FAMILIES, _gemma2_metadata, _tensors
from tests.servers import Server

# Gemma's turn format; the file's BOS comes from the template, as in Gemma's own
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHAT = [{"role": "user", "content": "Where does the river go?"}]
END_OF_TURN = 4  # write_spm_gguf's <end_of_turn>


def _gemma2_file(tmp_path, monkeypatch):
    """(the HF model, the GGUF written from it with a SentencePiece vocabulary of the model's size)."""
    import gguf

    vocab = gguf.GGUFReader(str(write_spm_gguf(tmp_path / "vocab.gguf", "gemma2"))).fields
    tokens = [str(bytes(vocab["tokenizer.ggml.tokens"].parts[i]), "utf-8") for i in vocab["tokenizer.ggml.tokens"].data]
    monkeypatch.setitem(FAMILIES, "gguf-serve-gemma2", {**GGUF_FAMILIES["gemma2"][0], "vocab_size": len(tokens)})
    hf = _build(tmp_path / "hf", "gguf-serve-gemma2")
    path = tmp_path / "gemma2.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        field = vocab[key]
        writer.add_array(key, [field.contents(i) for i in range(len(field.data))])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(END_OF_TURN)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(TEMPLATE)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _gemma2_metadata(writer, hf.config)
    for name, array in _tensors(tmp_path / "hf", hf.config, "gemma2"):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf, path


@pytest.mark.slow
def test_gemma2_gguf_serves_with_its_tokenizer_and_template(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    hf, path = _gemma2_file(tmp_path, monkeypatch)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    expected = list(reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert expected[0] == 1 and expected.count(1) == 1  # one BOS, the template's
    server = Server(tmp_path, [], ["--model", str(path), "--served-model-name", "g"])
    try:
        rendered = httpx.post(f"{server.url}/tokenize", json={"model": "g", "messages": CHAT}, timeout=60)
        assert rendered.status_code == 200, rendered.text
        assert rendered.json()["tokens"] == expected
        reply = server.client().chat.completions.create(model="g", messages=CHAT, max_tokens=8, temperature=0)
        with torch.no_grad():
            greedy = hf.generate(torch.tensor([expected]), max_new_tokens=8, do_sample=False)[0, len(expected) :]
        ends = [i for i, t in enumerate(greedy.tolist()) if t in (2, END_OF_TURN)]  # the file's EOS and EOT
        answer = greedy.tolist()[: ends[0] if ends else None]
        assert answer and reply.choices[0].message.content == reference.decode(answer, skip_special_tokens=True)
        assert reply.choices[0].finish_reason == ("stop" if ends else "length")
        forced = server.client().completions.create(
            model="g", prompt=expected, max_tokens=8, temperature=0, logit_bias={str(END_OF_TURN): 100}
        )
        assert forced.choices[0].finish_reason == "stop" and forced.usage.completion_tokens == 1
    finally:
        server.stop()
