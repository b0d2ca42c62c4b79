"""A bare CUDA machine has torch, triton, transformers and peft, and none of the server's packages: the engine,
``lora-server bench-gpu`` and the GPU test tier must import there. Checked here by hiding those packages from a
child interpreter (a sitecustomize that refuses to find them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# what a bare CUDA machine lacks of what this project installs (the engine may use them only for the feature that
# needs them: a GGUF model, the HTTP server, structured output, Redis, bench serve)
HIDDEN = ("gguf", "fastapi", "starlette", "uvicorn", "xgrammar", "redis", "jsonschema", "openai", "playwright")
HIDER = f"""
import sys
HIDDEN = {HIDDEN!r}
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: a bare CUDA machine)", name=name)
        return None
sys.meta_path.insert(0, _Hide())
"""


def _run(args: list[str], tmp_path: Path, hide: bool) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if hide:
        (tmp_path / "sitecustomize.py").write_text(HIDER)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _collected(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if "::" in line)


def test_the_hider_hides(tmp_path):
    run = _run(["-c", "import gguf"], tmp_path, hide=True)
    assert run.returncode != 0 and "hidden: a bare CUDA machine" in run.stderr


def test_engine_and_bench_gpu_import_and_run_without_the_server_packages(tmp_path):
    """The engine builds and generates on a dummy tiny Llama, bench-gpu's module imports and its CLI parses, with
    every package above hidden."""
    script = """
import json, sys, tempfile
from pathlib import Path
import lora_server.bench.gpu_suite, lora_server.bench.engine, lora_server.bench.peer
from lora_server.cli import main_parser
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.model.arch import PRESETS
from lora_server.sampling_params import SamplingParams
main_parser().parse_args(["bench-gpu", "--quick"])
with tempfile.TemporaryDirectory() as tmp:
    cfg = Path(tmp) / "config.json"
    cfg.write_text(json.dumps(PRESETS["tiny-llama"]))
    engine = Engine(EngineConfig(model=str(cfg), load_format="dummy", quantization="none", kv_cache_bytes=8 << 20,
                                 show_progress=False))
    [out] = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 4
hidden = sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN_NAMES)
assert not hidden, hidden
print("ok")
"""
    run = _run(["-c", f"HIDDEN_NAMES = {HIDDEN!r}\n{script}"], tmp_path, hide=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.slow
def test_gpu_tier_collects_without_the_server_packages(tmp_path):
    """``pytest -m gpu --collect-only`` collects every GPU test with the packages hidden: the same tests as with
    everything installed and every test module imported (``-m "not not gpu"`` selects the same tests but is not
    the plain ``-m gpu`` for which conftest.py imports only the modules that mark a test gpu)."""
    bare = _run(["-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"], tmp_path, hide=True)
    assert bare.returncode == 0, bare.stdout[-3000:]
    full = _run(
        ["-m", "pytest", "-m", "not not gpu", "--collect-only", "-q", "-p", "no:cacheprovider"], tmp_path, False
    )
    assert full.returncode == 0, full.stdout[-3000:]
    assert _collected(bare.stdout) == _collected(full.stdout)
    assert len(_collected(bare.stdout)) >= 40
