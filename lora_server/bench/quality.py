"""``lora-server bench-quality``: what each quantization mode costs in accuracy, per adapter, measured as llama.cpp's
perplexity tool measures it (``llama-perplexity --kl-divergence``).

The text (``quality_text.txt`` beside this module: about 3,900 words of English prose written for this benchmark and
given to the public domain; ``--text`` another) is tokenized once by the reference's tokenizer and cut into chunks
of ``ctx`` tokens, the tail that fills no chunk dropped; where the model adds a BOS token it replaces each chunk's
first token (as llama.cpp does). Each chunk is one prompt, run through every engine by
``Engine.full_prompt_logprobs`` (the serving path itself, the whole vocabulary). As in llama.cpp, only the chunk's
second half is scored, so that every scored token has at least ctx / 2 tokens of context: position j (0-based,
ctx / 2 <= j <= ctx - 2) predicts token j + 1, ctx / 2 - 1 positions a chunk.

Per mode and adapter, against the reference with the same adapter (the same checkpoint held unquantized in float32,
float32 KV cache), over the scored positions:

- perplexity: exp(mean negative log-likelihood of the text's next token), the mode's own;
- mean KL divergence: KL(ref || mode) = sum over the vocabulary of p_ref * (log p_ref - log p_mode), averaged over
  positions (llama.cpp drops the terms its 16-bit copy of the reference cannot hold, log p_ref < -16; here nothing
  is dropped);
- top-1 agreement: the share of positions whose most likely token is the reference's.

A mode is a ``--quantization`` value, optionally followed by modifiers: ``none+fp8kv`` is the float weights with the
fp8 KV cache (MODIFIERS). ``--compare PATH`` scores other checkpoints of the same model (a GGUF of another block
type, a pre-quantized directory), each read in its own format (``--quantization auto``)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lora_server.config import QUANTIZATIONS, EngineConfig
from lora_server.engine import Engine
from lora_server.errors import ConfigError

TEXT_PATH = Path(__file__).with_name("quality_text.txt")
BASE = "base"  # the adapter column's name for the base model (no adapter)
REFERENCE = "reference"  # the mode column's name for the reference
# what "+NAME" after a mode's quantization changes in its engine's config
MODIFIERS: dict[str, dict[str, Any]] = {"fp8kv": {"kv_cache_dtype": "fp8"}}


@dataclass
class Mode:
    """One engine to score: its label and the fields of the engine config it changes."""

    label: str
    overrides: dict[str, Any]


def parse_mode(spec: str) -> Mode:
    """``QUANTIZATION[+MODIFIER...]`` (e.g. ``int8``, ``none+fp8kv``) -> its Mode; ConfigError naming what is
    unknown."""
    quantization, *modifiers = spec.split("+")
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"mode {spec!r}: the quantization must be one of {', '.join(QUANTIZATIONS)}")
    overrides: dict[str, Any] = {"quantization": quantization}
    for name in modifiers:
        if name not in MODIFIERS:
            raise ConfigError(f"mode {spec!r}: unknown modifier {name!r} (known: {', '.join(MODIFIERS)})")
        overrides.update(MODIFIERS[name])
    return Mode(spec, overrides)


def checkpoint_mode(path: str) -> Mode:
    """Another checkpoint of the reference's model, read in its own format."""
    return Mode(Path(path).name, {"model": path, "load_format": "auto", "quantization": "auto"})


def reference_config(base: EngineConfig) -> EngineConfig:
    """The reference: the same checkpoint and engine settings, weights unquantized in float32 (a GGUF's blocks
    dequantized exactly), the KV cache in float32."""
    return dataclasses.replace(base, quantization="none", dtype="float32", kv_cache_dtype="auto")


def text_chunks(tokens: Sequence[int], ctx: int, bos: int | None, limit: int | None = None) -> list[list[int]]:
    """The text's tokens cut into chunks of ``ctx`` (the tail dropped; at most ``limit``), each chunk's first token
    replaced by ``bos`` where the model adds one."""
    count = len(tokens) // ctx if limit is None else min(limit, len(tokens) // ctx)
    chunks = [list(tokens[i * ctx : (i + 1) * ctx]) for i in range(count)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


def position_figures(
    ref: torch.Tensor, mode: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ref, mode: [n, vocab] log-probabilities (log-softmax rows) of the reference and the mode at the same
    positions; targets: [n] int64, the token that follows each. Returns per position the mode's negative
    log-likelihood of its target [n], KL(ref || mode) = (exp(ref) * (ref - mode)).sum(-1) [n], and whether the two
    argmaxes agree [n] bool."""
    nll = -mode.gather(1, targets[:, None])[:, 0]
    kl = (ref.exp() * (ref - mode)).sum(-1)
    return nll, kl, ref.argmax(-1) == mode.argmax(-1)


@dataclass
class Tally:
    """Sums over the scored positions of one mode and adapter (KL and agreement against the reference)."""

    positions: int = 0
    nll: float = 0.0  # sum of -log p_mode(next token)
    kl: float = 0.0  # sum of KL(ref || mode)
    kl_sq: float = 0.0
    kl_max: float = 0.0
    same_top: int = 0
    score_s: float = 0.0  # seconds this engine spent scoring (full_prompt_logprobs)

    def add(self, ref: torch.Tensor, mode: torch.Tensor, targets: torch.Tensor) -> None:
        nll, kl, same = position_figures(ref, mode, targets)
        self.positions += len(targets)
        self.nll += nll.double().sum().item()
        self.kl += kl.double().sum().item()
        self.kl_sq += kl.double().square().sum().item()
        self.kl_max = max(self.kl_max, kl.max().item())
        self.same_top += int(same.sum().item())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.positions)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.positions

    @property
    def kl_stderr(self) -> float:
        """The standard error of the mean KL (positions taken as independent, as llama.cpp's ±)."""
        n = self.positions
        variance = max(0.0, self.kl_sq / n - self.mean_kl**2)
        return math.sqrt(variance / max(1, n - 1))

    @property
    def top1(self) -> float:
        return self.same_top / self.positions


def score(
    reference: Engine,
    engines: dict[str, Engine],
    chunks: Sequence[Sequence[int]],
    adapters: Sequence[str | None],
    progress: bool = False,
) -> dict[tuple[str, str], Tally]:
    """Every chunk under every adapter (None: the base model) through the reference and each engine; returns the
    tallies by (mode label, adapter name or BASE), the reference's under REFERENCE (its KL and agreement are with
    itself: 0 and 1). The engines must share the reference's vocabulary and hold the adapters by these names."""
    tallies: dict[tuple[str, str], Tally] = {}
    for adapter in adapters:
        name = adapter or BASE
        ref_tally = tallies.setdefault((REFERENCE, name), Tally())
        mode_tallies = {label: tallies.setdefault((label, name), Tally()) for label in engines}
        for chunk in chunks:
            first = len(chunk) // 2  # the first scored position
            targets = torch.tensor(chunk[first + 1 :], dtype=torch.int64)
            ref = _rows(reference, chunk, adapter, first, ref_tally)
            ref_tally.add(ref, ref, targets)
            for label, engine in engines.items():
                mode_tallies[label].add(ref, _rows(engine, chunk, adapter, first, mode_tallies[label]), targets)
        if progress:
            print(f"  scored {len(chunks)} chunks under {name}", flush=True)
    return tallies


def _rows(engine: Engine, chunk: Sequence[int], adapter: str | None, first: int, tally: Tally) -> torch.Tensor:
    """The chunk's scored rows [len(chunk) - 1 - first, vocab], timed into ``tally``."""
    start = time.perf_counter()
    rows = engine.full_prompt_logprobs(chunk, adapter)[first:]
    tally.score_s += time.perf_counter() - start
    return rows


@dataclass
class QualityRow:
    mode: str
    adapter: str
    positions: int
    perplexity: float
    ppl_ratio: float  # the mode's perplexity / the reference's (same adapter)
    mean_kl: float
    kl_stderr: float
    max_kl: float
    top1: float
    score_s: float


def rows_of(tallies: dict[tuple[str, str], Tally]) -> list[QualityRow]:
    """The table's rows in the tallies' order (score's: per adapter, the reference, then the modes)."""
    rows = []
    for (label, adapter), t in tallies.items():
        ref = tallies[REFERENCE, adapter]
        rows.append(
            QualityRow(
                label,
                adapter,
                t.positions,
                round(t.perplexity, 4),
                round(t.perplexity / ref.perplexity, 4),
                round(t.mean_kl, 6),
                round(t.kl_stderr, 6),
                round(t.kl_max, 4),
                round(t.top1, 4),
                round(t.score_s, 2),
            )
        )
    return rows


def table(rows: Sequence[QualityRow]) -> str:
    lines = [
        f"{'mode':<16} {'adapter':<10} {'PPL':>9} {'PPL/ref':>8} {'mean KL':>20} {'top-1':>7} {'max KL':>8}",
    ]
    for r in rows:
        if r.mode == REFERENCE:
            lines.append(f"{r.mode:<16} {r.adapter:<10} {r.perplexity:9.4f} {'':>8} {'':>20} {'':>7} {'':>8}")
            continue
        kl = f"{r.mean_kl:.5f} ± {r.kl_stderr:.5f}"
        lines.append(
            f"{r.mode:<16} {r.adapter:<10} {r.perplexity:9.4f} {r.ppl_ratio:8.4f} {kl:>20} {100 * r.top1:6.2f}% "
            f"{r.max_kl:8.3f}"
        )
    return "\n".join(lines)


@dataclass
class Plan:
    """What one run scores, resolved from the command's flags."""

    modes: list[Mode]
    adapters: dict[str, str]  # name -> PEFT directory
    ctx: int
    chunk_limit: int | None
    text_path: Path


def bench(plan: Plan, base: EngineConfig, out: Path) -> dict:
    """Build the reference and one engine per mode (all alive together: each chunk goes through all of them, so
    that nothing larger than one chunk's rows is kept), score, print the table, write the JSON to ``out``."""
    start = time.perf_counter()
    ref_config = reference_config(base)
    reference = Engine(ref_config)
    if reference.tokenizer is None:
        raise ConfigError("bench-quality tokenizes its text: the model needs a tokenizer")
    text = plan.text_path.read_text(encoding="utf-8")
    tokens = reference.tokenizer.encode(text)
    longest = min(len(tokens), reference.max_model_len)
    if not 4 <= plan.ctx <= longest or (plan.chunk_limit is not None and plan.chunk_limit < 1):
        raise ConfigError(
            f"--ctx {plan.ctx}, --chunks {plan.chunk_limit}: needs 4 <= ctx <= {longest} (the text's {len(tokens)} "
            f"tokens, the engine's longest sequence {reference.max_model_len}) and at least one chunk"
        )
    bos = reference.tokenizer.bos_token_id if reference.tokenizer.add_bos else None
    chunks = text_chunks(tokens, plan.ctx, bos, plan.chunk_limit)
    print(_header(plan, ref_config, len(text.split()), len(tokens), len(chunks)), flush=True)
    engines = {}
    for mode in plan.modes:
        engine = Engine(dataclasses.replace(base, **mode.overrides))
        if engine.vocab_size != reference.vocab_size:
            raise ConfigError(f"{mode.label}: vocabulary {engine.vocab_size}, the reference's {reference.vocab_size}")
        engines[mode.label] = engine
    for engine in (reference, *engines.values()):
        for name, path in plan.adapters.items():
            engine.adapters.add(name, path)
    built = time.perf_counter() - start
    tallies = score(reference, engines, chunks, [None, *plan.adapters], progress=True)
    rows = rows_of(tallies)
    wall = time.perf_counter() - start
    print(table(rows))
    print(f"wall time {wall:.1f} s ({built:.1f} s building {1 + len(engines)} engines)")
    result = dict(
        device=str(ref_config.torch_device),
        model=base.model or "the embedded SmolLM2-135M-Instruct (Q4_1 GGUF)",
        reference=dict(quantization="none", dtype="float32", kv_cache_dtype="auto"),
        dtype=base.dtype,
        modes={m.label: m.overrides for m in plan.modes},
        adapters=plan.adapters,
        text=dict(
            path=str(plan.text_path),
            words=len(text.split()),
            tokens=len(tokens),
            ctx=plan.ctx,
            chunks=len(chunks),
            scored_per_chunk=plan.ctx - 1 - plan.ctx // 2,
        ),
        rows=[asdict(r) for r in rows],
        wall_s=round(wall, 1),
        build_s=round(built, 1),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"figures written to {out}")
    return result


def _header(plan: Plan, ref: EngineConfig, words: int, tokens: int, chunks: int) -> str:
    scored = plan.ctx - 1 - plan.ctx // 2
    return (
        f"bench-quality: {ref.model or 'the embedded SmolLM2-135M-Instruct'} on {ref.torch_device}; reference: "
        f"quantization none, float32 weights and KV cache; modes: {', '.join(m.label for m in plan.modes)}; "
        f"adapters: {', '.join([BASE, *plan.adapters])}\n"
        f"text: {plan.text_path.name}, {words} words, {tokens} tokens -> {chunks} chunks of {plan.ctx}, the second "
        f"half of each scored ({scored} positions a chunk, {chunks * scored} in all)\n"
        "PPL: exp(mean NLL of the next token); PPL/ref: against the reference with the same adapter; mean KL: "
        "KL(ref || mode) over the whole vocabulary, mean ± its standard error; top-1: positions whose argmax is the "
        "reference's"
    )
