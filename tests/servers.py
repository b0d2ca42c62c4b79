"""A real server process for the HTTP tests: ``lora-server serve`` on the embedded model (fp32, small budget),
reached with the official openai client and httpx, plus hand-made PEFT adapters to register."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import torch
from safetensors.torch import save_file

ADMIN = "test-admin-key"
BASE = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``lora-server serve`` in its own process, its log in ``data_dir``; started and healthy when built."""

    def __init__(
        self,
        data_dir: Path,
        roots: list[Path],
        extra: list[str] = (),
        module: str = "lora_server.cli",
        env: dict[str, str] | None = None,
        data_dir_flag: bool = True,
    ) -> None:
        """``data_dir`` holds the log, and the registry unless ``data_dir_flag`` is False (then the server picks its
        default place); ``env`` is added to the environment."""
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            module,
            "serve",
            "--port",
            str(self.port),
            "--admin-key",
            ADMIN,
            *(["--data-dir", str(data_dir)] if data_dir_flag else []),
            "--quantization",
            "none",
            "--kv-cache-gb",
            "0.1",
            "--max-loras",
            "4",
            *[a for r in roots for a in ("--adapter-root", str(r))],
            *extra,
        ]
        self.log = open(data_dir / f"server-{self.port}.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {(data_dir / f'server-{self.port}.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()  # a server that did not come up in time must not outlive the test
        raise RuntimeError("server did not start")

    def client(self, tenant: str | None = None, key: str = "none") -> openai.OpenAI:
        base = f"{self.url}/t/{tenant}/v1" if tenant else f"{self.url}/v1"
        return openai.OpenAI(base_url=base, api_key=key, max_retries=0)

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60, **kw)

    def log_text(self) -> str:
        return (self.data_dir / f"server-{self.port}.log").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def served(tmp_path_factory, name: str, extra: list[str] = ()) -> Iterator[Server]:
    """A module fixture's server: started in a fresh directory (its data, log and only adapter root), stopped
    after the module (``yield from served(...)``)."""
    root = tmp_path_factory.mktemp(name)
    server = Server(root, [root], extra)
    yield server
    server.stop()


def write_adapter(path: Path, seed: int, r: int = 4, scale: float = 0.05) -> Path:
    """A PEFT LoRA directory with random weights on q_proj and v_proj (strong enough to change answers)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(30):
        for proj, out in (("q_proj", 576), ("v_proj", 192)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, 576, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=gen) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(dict(peft_type="LORA", r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], bias="none"))
    )
    return path


GREEDY_EXTRA = {"ignore_eos": True, "skip_special_tokens": False}  # vLLM's: every token, as /detokenize writes it


def assert_serves_greedy(root: Path, adapters: dict[str, Path], prompt: list[int], expected: dict[str, list[int]]):
    """``lora-server serve`` in ``root`` (its only adapter root) with ``adapters`` registered through the admin API:
    the openai client's greedy completions of ``prompt`` (token ids), streamed and not, are ``expected``'s tokens
    for each model name (an adapter, or BASE)."""
    server = Server(root, [root])
    try:
        for name, path in adapters.items():
            assert server.admin("POST", "/admin/adapters", json={"name": name, "path": str(path)}).status_code == 200
        client = server.client()
        for name, tokens in expected.items():
            text = server.admin("POST", "/detokenize", json={"model": BASE, "tokens": tokens}).json()["prompt"]
            n = len(tokens)
            asked = dict(model=name, prompt=prompt, max_tokens=n, temperature=0, extra_body=GREEDY_EXTRA)
            whole = client.completions.create(**asked)
            assert whole.choices[0].text == text and whole.usage.completion_tokens == n, name
            stream = client.completions.create(**asked, stream=True)
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text, name
    finally:
        server.stop()
