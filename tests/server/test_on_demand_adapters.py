"""--load-adapters-on-demand on a real server, through the openai client: a request naming an adapter that is not
registered but lies in an adapter root as ROOT/NAME is registered on first use and answered; an unknown name stays
a 404, a name with a path separator is a 400, a tenant's allow-list is checked before anything is read, and
without the flag nothing is looked up."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from tests.servers import Server, free_port, write_adapter


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("on-demand")
    (root / "data").mkdir()
    (root / "adapters").mkdir()
    write_adapter(root / "adapters" / "fresh", seed=31)
    write_adapter(root / "adapters" / "secret", seed=32)
    write_adapter(root / "adapters" / "later", seed=33)
    return root


@pytest.fixture(scope="module")
def server(roots):
    s = Server(roots / "data", [roots / "adapters"], ["--allow-anonymous", "--load-adapters-on-demand"])
    yield s
    s.stop()


def _ask(client: openai.OpenAI, model: str):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )


def _served(server: Server) -> set[str]:
    return {a["name"] for a in server.admin("GET", "/admin/adapters").json()["data"]}


def test_a_name_in_a_root_is_registered_on_first_use(server):
    assert "fresh" not in _served(server)
    reply = _ask(server.client(), "fresh")
    assert reply.model == "fresh" and reply.usage.completion_tokens == 3
    info = server.admin("GET", "/admin/adapters/fresh").json()
    assert info["source"] == "on-demand" and info["version"] == 1
    assert _ask(server.client(), "fresh").usage.completion_tokens == 3  # now simply registered
    assert server.admin("GET", "/admin/adapters/fresh").json()["version"] == 1


def test_unknown_and_path_like_names_are_refused(server):
    with pytest.raises(openai.NotFoundError) as missing:
        _ask(server.client(), "nowhere")
    assert missing.value.body["code"] == "model_not_found"
    for name in ("../adapters/fresh", "sub/fresh", "..", "~root", "x" * 300, "é", "fresh\n", ".hidden", "a..b"):
        with pytest.raises(openai.BadRequestError) as bad:
            _ask(server.client(), name)  # 300 characters and non-ASCII names were 500s that showed the root's path
        assert bad.value.body["param"] == "model" and "invalid adapter name" in bad.value.body["message"], name
    assert "nowhere" not in _served(server)
    assert server.admin("GET", "/health").status_code == 200


def test_files_that_cannot_be_served_are_a_400_without_paths(server, roots):
    """An anonymous caller learns what is wrong with the files, never where they lie (the message named the
    adapter root's path)."""
    broken = write_adapter(roots / "adapters" / "broken", seed=34)
    (broken / "adapter_model.safetensors").unlink()
    cut = write_adapter(roots / "adapters" / "cut", seed=35)
    (cut / "adapter_model.safetensors").write_bytes((cut / "adapter_model.safetensors").read_bytes()[:100])
    for name, reason in (
        ("broken", "no adapter_model.safetensors"),
        ("cut", "adapter_model.safetensors cannot be read"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            _ask(server.client(), name)
        message = bad.value.body["message"]
        assert reason in message and f"`{name}`" in message and str(roots) not in message, message
    assert not {"broken", "cut"} & _served(server)


def test_a_tenant_allow_list_is_checked_first(server):
    created = server.admin("POST", "/admin/tenants", json={"name": "acme", "adapters": ["fresh"]}).json()
    client = server.client("acme", created["api_key"])
    with pytest.raises(openai.PermissionDeniedError):
        _ask(client, "secret")
    assert "secret" not in _served(server)  # refused before anything was read
    assert _ask(client, "fresh").usage.completion_tokens == 3


@pytest.mark.slow
def test_without_the_flag_nothing_is_looked_up(roots, tmp_path):
    (tmp_path / "data").mkdir()
    s = Server(tmp_path / "data", [roots / "adapters"], ["--allow-anonymous"])
    try:
        with pytest.raises(openai.NotFoundError):
            _ask(s.client(), "later")
        assert "later" not in {a["name"] for a in s.admin("GET", "/admin/adapters").json()["data"]}
    finally:
        s.stop()


@pytest.fixture(scope="module")
def biased(roots, hf_smollm2):
    """An adapter made with PEFT for the served model, in the adapter root, with a bias on lora_B (lora_bias), which
    PEFT adds and this server does not implement."""
    from peft import LoraConfig

    from tests.adapters.test_adapter_keys import save_peft

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_bias=True, task_type="CAUSAL_LM")
    save_peft(hf_smollm2, config, roots / "adapters" / "biased", scale=0.01)
    return roots / "adapters" / "biased"


def test_an_adapter_peft_computes_otherwise_is_refused_on_every_path(server, biased):
    """On demand, through the admin API and through vLLM's /v1/load_lora_adapter: a 400 naming the key, and nothing
    registered."""
    with pytest.raises(openai.BadRequestError) as on_demand:
        _ask(server.client(), "biased")
    assert "lora_bias" in on_demand.value.body["message"] and on_demand.value.body["param"] == "model"
    assert str(biased.parent) not in on_demand.value.body["message"]  # an anonymous caller: no path
    for path, body in (
        ("/admin/adapters", {"name": "biased2", "path": str(biased)}),
        ("/v1/load_lora_adapter", {"lora_name": "biased2", "lora_path": str(biased)}),
    ):
        r = server.admin("POST", path, json=body)
        assert r.status_code == 400, r.text
        assert "lora_bias" in r.json()["error"]["message"]
    assert not {"biased", "biased2"} & _served(server)
    assert _ask(server.client(), "fresh").usage.completion_tokens == 3  # still serving


@pytest.mark.slow
def test_an_adapter_given_at_start_that_peft_computes_otherwise_stops_the_start(biased, tmp_path):
    cmd = [sys.executable, "-m", "lora_server.cli", "serve", "--adapter", f"biased={biased}"]
    cmd += ["--data-dir", str(tmp_path), "--port", str(free_port()), "--quantization", "none", "--kv-cache-gb", "0.1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: adapter_config.json sets lora_bias" in done.stderr
