"""Every Triton kernel variant the engine can launch, compiled ahead of time for a GPU that is not here.

A variant is one compilation of one ``@triton.jit`` kernel: its argument types, constexprs, the specialization of
its integer and pointer arguments, and its launch options. Which variants an engine reaches is the engine's own
business, so they are found by running it: an engine is built on the meta stand-in for CUDA
(instrument.host_work.stand_in_cuda: the CUDA code path with tensors that hold no data) with a stand-in Triton driver
that reports the target (``GPUTarget("cuda", 90, 32)`` for an H100), and every launch on the way is caught where
Triton would compile it (``capture_variants``): its variant is kept and nothing is launched. Each variant is then
compiled for its target by ``triton.compile`` with the ptxas that ships inside the triton wheel
(``compile_variant``), whose report gives registers, spills and shared memory; occupancy follows from the target's
limits (``TARGETS``).

Needs a triton built for NVIDIA (the Linux wheels) and no TRITON_INTERPRET in the process (the interpreter replaces
the compiler): the tests run it in a child process. Triton internals used: ``JITFunction._do_compile`` (where a
launch meets a variant it has not compiled) and ``triton.runtime.driver.set_active``; the test extras pin triton's
minor version for that reason."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

if TYPE_CHECKING:
    from lora_server.engine import Engine


@dataclass(frozen=True, slots=True)
class Target:
    """A GPU's compile target and the per-SM limits that decide occupancy."""

    name: str
    capability: int  # 90: sm_90a (Hopper), 80: sm_80 (Ampere)
    sms: int  # multiprocessors: what the split-K and split-KV choices aim to fill
    max_shared_per_block: int  # bytes, the opt-in maximum of one block
    shared_per_sm: int  # bytes
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32


TARGETS = {
    "sm_90": Target("H100 SXM (sm_90a)", 90, 132, 232_448, 233_472),
    "sm_80": Target("A100 (sm_80)", 80, 108, 166_912, 167_936),
}


@dataclass(frozen=True, slots=True)
class Variant:
    """One compilation of a kernel, as Triton would ask for it (the arguments of ``JITFunction._do_compile``)."""

    kernel: Any  # the triton JITFunction
    key: str  # Triton's own cache key of the variant (its specialization and options)
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    launch: dict[str, Any]  # the launch's own compile options (warps, stages); the target fills in the rest

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def describe(self) -> str:
        """The variant in a line: its kernel, constexprs by name, the arguments specialized as 16-aligned, pointer
        dtypes, warps and stages."""
        names = self.kernel.arg_names
        consts = ", ".join(f"{names[path[0]]}={value}" for path, value in sorted(self.constexprs.items()))
        aligned = ",".join(names[path[0]] for path, value in sorted(self.attrs.items()) if value)
        ptrs = "/".join(sorted({t for t in self.signature.values() if t.startswith("*")}))
        return f"{self.name}({consts}; 16-aligned {aligned}; {ptrs}; {self.launch})"


@dataclass(frozen=True, slots=True)
class Resources:
    """What ptxas made of one variant for one target."""

    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of local memory per thread (spills live there)
    shared: int  # bytes of shared memory per block (Triton's own count: what the launch asks for)
    num_warps: int
    ld_global_b16: int  # 16-bit global loads in the PTX (a load that could not be vectorized)
    ptx: str

    def occupancy(self, target: Target) -> int:
        """Resident warps per SM (of target.max_warps_per_sm) that registers, shared memory and the block limit
        allow: registers are allocated per warp in units of 256, shared memory per block."""
        per_warp = -(-max(self.registers, 1) * 32 // 256) * 256
        by_regs = target.registers_per_sm // per_warp // self.num_warps
        by_shared = target.shared_per_sm // self.shared if self.shared else target.max_blocks_per_sm
        blocks = min(by_regs, by_shared, target.max_blocks_per_sm, target.max_warps_per_sm // self.num_warps)
        return blocks * self.num_warps


class StandInDriver:
    """Triton's active driver on a machine without the target GPU: reports the target, device 0 and stream 0."""

    def __init__(self, capability: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")


LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")  # what the kernels' launches set


@contextlib.contextmanager
def capture_variants(capability: int) -> Iterator[dict[str, Variant]]:
    """Within the block, Triton compiles for ``capability`` (the stand-in driver) and every launch that meets a
    variant Triton has not compiled adds it to the yielded dict (by its key) instead of compiling and
    launching."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    found: dict[str, Variant] = {}

    def capture(self, key, signature, device, constexprs, options, attrs, warmup):  # type: ignore[no-untyped-def]
        full_key = f"{self.fn.__module__}.{self.fn.__qualname__}:{key}"
        launch = {k: getattr(options, k) for k in LAUNCH_OPTIONS}
        found.setdefault(full_key, Variant(self, full_key, dict(signature), dict(constexprs), attrs, launch))
        return None  # nothing compiled: run() returns without launching

    before = driver._active
    driver.set_active(StandInDriver(capability))  # type: ignore[arg-type]
    try:
        with _patched(JITFunction, "_do_compile", capture):
            yield found
    finally:
        driver._active = before


@contextlib.contextmanager
def _patched(cls: type, name: str, value: Any) -> Iterator[None]:
    original = getattr(cls, name)
    setattr(cls, name, value)
    try:
        yield
    finally:
        setattr(cls, name, original)


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_LD_B16 = re.compile(r"\bld\.global(?:\.[a-z0-9]+)*\.[bfu]16\b")


def compile_variant(variant: Variant, capability: int) -> Resources:
    """Compile ``variant`` for ``capability`` with triton.compile (and the wheel's ptxas); raises what the compiler
    raises. Triton's kernel cache is used as usual (set TRITON_CACHE_DIR for a fresh one): ptxas's report is read
    from its own run on the variant's PTX, so a cached compile reports the same."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    from triton.compiler import ASTSource

    source = ASTSource(variant.kernel, variant.signature, variant.constexprs, variant.attrs)
    with contextlib.redirect_stdout(io.StringIO()):
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=variant.launch)
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        arch = sm_arch_from_capability(capability)
        report = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={arch}", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    used = _PTXAS_USED.search(report)
    frame = _PTXAS_FRAME.search(report)
    assert used is not None and frame is not None, report
    stack, stores, loads = (int(x) for x in frame.groups())
    return Resources(
        registers=int(used.group(1)),
        spill_stores=stores,
        spill_loads=loads,
        stack=stack,
        shared=int(compiled.metadata.shared),
        num_warps=int(compiled.metadata.num_warps),
        ld_global_b16=len(_LD_B16.findall(ptx)),
        ptx=ptx,
    )


# ---- the engines whose variants are compiled -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineShape:
    """One engine configuration, built on the meta stand-in: ``model`` a preset (with ``layers``) or "smollm2" (the
    embedded GGUF, its own blocks kept)."""

    label: str
    model: str
    dtype: str
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    max_lora_rank: int = 16
    enforce_eager: bool = False
    speculative_ngram: int = 0
    layers: int | None = None
    min_capability: int = 0  # targets below it are skipped (fp8 needs 8.9)


LLAMA = "llama-3-8b"
LLAMA_LAYERS = 16  # of 32: every kernel sees the same shapes (the page then holds 16 layers' KV: still enough for the
# rank-64 rows of the widest module); half the host work of building and stepping the stand-in
SMOLLM2 = "smollm2"
SHAPES = (
    EngineShape("llama3-8b bf16", LLAMA, "bfloat16", layers=LLAMA_LAYERS),
    EngineShape("llama3-8b fp16", LLAMA, "float16", layers=LLAMA_LAYERS),
    EngineShape("llama3-8b bf16 int8", LLAMA, "bfloat16", "int8", layers=LLAMA_LAYERS),
    EngineShape("llama3-8b bf16 int4 rank 64", LLAMA, "bfloat16", "int4", max_lora_rank=64, layers=LLAMA_LAYERS),
    EngineShape("llama3-8b fp16 int4 eager", LLAMA, "float16", "int4", enforce_eager=True, layers=LLAMA_LAYERS),
    EngineShape("llama3-8b bf16 fp8", LLAMA, "bfloat16", "fp8", min_capability=89, layers=LLAMA_LAYERS),
    EngineShape(
        "llama3-8b bf16 fp8 KV", LLAMA, "bfloat16", kv_cache_dtype="fp8", min_capability=89, layers=LLAMA_LAYERS
    ),
    EngineShape("llama3-8b bf16 int8 speculative", LLAMA, "bfloat16", "int8", speculative_ngram=3, layers=LLAMA_LAYERS),
    # the other families' kernel variants: soft-capped and sliding-window attention at head_dim 256, GELU (Gemma 2);
    # per-head q/k norms (Qwen3); partial rotary (Phi-4-mini); 8 layers: a page then holds 16 rows of the widest module
    EngineShape("gemma-2-2b bf16", "gemma-2-2b", "bfloat16", layers=8),
    EngineShape("qwen3-8b bf16", "qwen3-8b", "bfloat16", layers=8),
    EngineShape("phi-4-mini bf16 int4", "phi-4-mini", "bfloat16", "int4", layers=8),
    EngineShape("smollm2 fp32 gguf", SMOLLM2, "float32", "auto"),
    EngineShape("smollm2 bf16 gguf", SMOLLM2, "bfloat16", "auto"),
    EngineShape("smollm2 fp32", SMOLLM2, "float32"),
    EngineShape("smollm2 bf16 eager", SMOLLM2, "bfloat16", enforce_eager=True),
)


@contextlib.contextmanager
def stand_in_engine(shape: EngineShape, workdir: Path, sms: int) -> Iterator[Engine]:
    """The engine of ``shape`` on the meta stand-in for CUDA, as on a GPU of ``sms`` multiprocessors (built inside
    the caller's capture_variants, so its warm-up's launches are caught), with two random adapters of ranks 8 and
    the shape's largest registered."""
    from lora_server.bench.engine import write_random_adapters
    from lora_server.engine import Engine
    from lora_server.instrument.host_work import HostWorkCounter, StandInConfig, stand_in_cuda
    from lora_server.model.arch import PRESETS
    from lora_server.model.loader import default_model_path

    if shape.model == SMOLLM2:
        model, load_format = str(default_model_path()), "gguf"
    else:
        config_path = workdir / f"{shape.model}.json"
        layers = {"num_hidden_layers": shape.layers} if shape.layers else {}
        config_path.write_text(json.dumps({**PRESETS[shape.model], **layers}))
        model, load_format = str(config_path), "dummy"
    config = StandInConfig(
        model=model,
        load_format=load_format,
        quantization=shape.quantization,
        dtype=shape.dtype,
        kv_cache_dtype=shape.kv_cache_dtype,
        device="cpu",
        kv_cache_bytes=1 << 30,
        gpu_memory_utilization=None,
        host_kv_bytes=0,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        max_model_len=4096,
        max_loras=4,
        max_lora_rank=shape.max_lora_rank,
        enforce_eager=shape.enforce_eager,
        speculative_ngram=shape.speculative_ngram,
        show_progress=False,
    )
    with (
        stand_in_cuda(triton_runs=True),
        HostWorkCounter("meta", emulate=True),
        mock.patch("lora_server.kernels.ops._num_sms", lambda device: sms),
        mock.patch("lora_server.kernels.decode_attention.DEFAULT_SMS", sms),
    ):
        engine = Engine(config)
        names = write_random_adapters(workdir / shape.label.replace(" ", "-"), 2, [8, shape.max_lora_rank], engine)
        for name in names:
            engine.adapters.add(name, workdir / shape.label.replace(" ", "-") / name)
        engine.adapters.stage(names)
        yield engine


def serve_random(engine: Engine, requests: int, seed: int = 0) -> None:
    """A random workload on a stand-in engine: prompts of 1 to 1,000 tokens, 1 to 40 new tokens, some with prompt
    logprobs, with either adapter or none, added a few at a time between steps, then stepped until done."""
    import random

    from lora_server.sampling_params import SamplingParams

    rng = random.Random(seed)
    names = engine.adapters.names()
    vocab = engine.vocab_size
    for _ in range(requests):
        length = rng.choice([1, 2, 3, 5, 9, 16, 17, 33, 64, 65, 100, 129, 200, 255, 256, 300, 511, 700, 1000])
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        prompt_logprobs = rng.choice([None, None, None, 0, 3])  # scoring sends prompt rows through the head
        params = SamplingParams(
            max_tokens=rng.choice([1, 2, 7, 40]), temperature=rng.choice([0.0, 1.0]), prompt_logprobs=prompt_logprobs
        )
        engine.add(engine.make_request(prompt, params, rng.choice([*names, None])))
        for _ in range(rng.randrange(4)):
            engine.step()
    while engine.has_work():
        engine.step()


# ---- collecting, compiling, reporting -------------------------------------------------------------------------


def collect(target: Target, shapes: tuple[EngineShape, ...], requests: int) -> tuple[dict[str, Variant], dict]:
    """Every variant the shapes' engines launch on ``target``: those of each engine's warm-up (its start) and those
    a random workload of ``requests`` launches after it. Returns the variants by key and, per shape, the keys its
    warm-up compiled and the variants the workload met that warm-up had not."""
    variants: dict[str, Variant] = {}
    coverage: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, capture_variants(target.capability) as found:
        for shape in shapes:
            if target.capability < shape.min_capability:
                continue
            found.clear()
            start = time.perf_counter()
            with stand_in_engine(shape, Path(tmp), target.sms) as engine:
                warm = set(found)
                serve_random(engine, requests)
            missed = sorted(set(found) - warm)
            coverage[shape.label] = dict(
                warmup=sorted(warm), missed=[found[k].describe() for k in missed], seconds=time.perf_counter() - start
            )
            variants.update(found)
    return variants, coverage


def _compile_one(args: tuple[str, str, dict, dict, dict, dict, int]) -> dict[str, Any]:
    """In a worker: compile one variant (given as plain data), its resources or its error as a dict."""
    import importlib

    module, name, signature, constexprs, attrs, launch, capability = args
    kernel = getattr(importlib.import_module(module), name)
    variant = Variant(kernel, "", signature, constexprs, attrs, launch)
    try:
        resources = compile_variant(variant, capability)
    except Exception as exc:  # noqa: BLE001 (the report says which variant failed and why)
        return dict(error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
    return {k: v for k, v in asdict(resources).items() if k != "ptx"}


def compile_all(variants: dict[str, Variant], capability: int, workers: int) -> dict[str, dict[str, Any]]:
    """Compile every variant for ``capability`` in ``workers`` processes; by key, its resources or error."""
    jobs = [
        (v.kernel.fn.__module__, v.kernel.fn.__name__, v.signature, v.constexprs, v.attrs, v.launch, capability)
        for v in variants.values()
    ]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_compile_one, jobs))
    return dict(zip(variants, results, strict=True))


ACTIVATIONS = ("x_ptr", "q_ptr", "qk_ptr", "k_ptr", "out_ptr")  # the argument that holds a kernel's activations


def float_kind(variant: Variant) -> str:
    """The precision of the variant's activations ("fp32", "bf16", "fp16"): its tl.dot precision where it has one
    (IEEE fp32, or tensor cores on 16-bit values), else the type of its activation argument."""
    names = variant.kernel.arg_names
    precision = next((v for path, v in variant.constexprs.items() if names[path[0]] == "PRECISION"), None)
    if precision is not None and precision == "ieee":
        return "fp32"
    pointers = [variant.signature[n] for n in ACTIVATIONS if variant.signature.get(n, "").startswith("*")]
    pointers += sorted(t for t in variant.signature.values() if t in ("*bf16", "*fp16"))
    kind = next((t[1:] for t in pointers if t in ("*bf16", "*fp16", "*fp32")), "fp32")
    return "bf16" if precision is not None and kind == "fp32" else kind


def report(target_name: str, shapes: tuple[EngineShape, ...], requests: int, workers: int) -> dict[str, Any]:
    """Collect and compile for one target: every variant with its resources and verdicts, and the warm-up's
    coverage per shape."""
    target = TARGETS[target_name]
    start = time.perf_counter()
    variants, coverage = collect(target, shapes, requests)
    collected = time.perf_counter() - start
    compiled = compile_all(variants, target.capability, workers)
    rows = []
    for key, variant in variants.items():
        result = compiled[key]
        row: dict[str, Any] = dict(kernel=variant.name, variant=variant.describe(), kind=float_kind(variant), **result)
        row["shapes"] = sorted(label for label, c in coverage.items() if key in c["warmup"])
        if "error" not in result:
            resources = Resources(**{**result, "ptx": ""})
            row["occupancy_warps"] = resources.occupancy(target)
            row["over_shared"] = result["shared"] > target.max_shared_per_block
        rows.append(row)
    return dict(
        target=target_name,
        device=target.name,
        max_shared_per_block=target.max_shared_per_block,
        seconds=dict(collect=round(collected, 1), compile=round(time.perf_counter() - start - collected, 1)),
        variants=sorted(rows, key=lambda r: (r["kernel"], r["variant"])),
        coverage={label: dict(warmup=len(c["warmup"]), missed=c["missed"]) for label, c in coverage.items()},
    )


def verdicts(part: dict[str, Any]) -> dict[str, list[str]]:
    """What fails the check, per reason (an empty list each when all is well): compile errors, shared memory over
    the target's per-block limit, spills in 16-bit variants, 16-bit scalar loads in the LoRA kernels, and variants
    a workload met that warm-up had not compiled."""
    rows = part["variants"]
    return dict(
        errors=[f"{r['variant']}: {r['error']}" for r in rows if "error" in r],
        over_shared=[f"{r['variant']}: {r['shared']} B" for r in rows if r.get("over_shared")],
        spills_16bit=[
            f"{r['variant']}: {r['spill_stores']} B stored"
            for r in rows
            if r["kind"] != "fp32" and r.get("spill_stores", 0) + r.get("spill_loads", 0) > 0
        ],
        lora_b16_loads=[
            f"{r['variant']}: {r['ld_global_b16']}"
            for r in rows
            if r["kernel"] in ("_lora_shrink_kernel", "_lora_expand_kernel")
            and r["kind"] != "fp32"
            and r.get("ld_global_b16", 0) > 0
        ],
        warmup_missed=[f"{label}: {m}" for label, c in part["coverage"].items() for m in c["missed"]],
    )


def table(part: dict[str, Any]) -> str:
    """The report of one target as a text table: a row per variant."""
    lines = [
        f"{part['device']}: {len(part['variants'])} variants (collected in {part['seconds']['collect']} s, compiled "
        f"in {part['seconds']['compile']} s); shared memory per block at most {part['max_shared_per_block']} B",
        f"{'kernel':32} {'kind':5} {'regs':>4} {'spill':>6} {'smem':>7} {'warps/SM':>8} {'b16 ld':>6}  variant",
    ]
    for r in part["variants"]:
        if "error" in r:
            lines.append(f"{r['kernel']:32} {r['kind']:5} ERROR {r['error'][:200]}  {r['variant']}")
            continue
        spill = r["spill_stores"] + r["spill_loads"]
        lines.append(
            f"{r['kernel']:32} {r['kind']:5} {r['registers']:>4} {spill:>6} {r['shared']:>7} "
            f"{r['occupancy_warps']:>8} {r['ld_global_b16']:>6}  {r['variant']}"
        )
    return "\n".join(lines)


def run_side_by_side(
    targets: list[str], shapes: tuple[EngineShape, ...], requests: int, workers: int
) -> list[dict[str, Any]]:
    """Each target in processes of its own (Triton binds a kernel to the first target it meets), all at once: the
    first target, whose shapes also serve ``requests``, in two processes of half its shapes each; the others
    whole. Their parts, in target order (the first target's two halves one after the other)."""
    jobs = [(targets[0], half, requests) for half in (shapes[0::2], shapes[1::2]) if half]
    jobs += [(name, shapes, 0) for name in targets[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        outs, runs = [Path(tmp) / f"{i}.json" for i in range(len(jobs))], []
        for (name, subset, n), out in zip(jobs, outs, strict=True):
            cmd = [sys.executable, "-m", "lora_server.bench.kernel_aot", "--target", name, "--json", str(out)]
            cmd += [f"--shape={s.label}" for s in subset] + ["--requests", str(n), "--workers", str(workers)]
            with out.with_suffix(".txt").open("w") as log:
                runs.append(subprocess.Popen(cmd, stdout=log))
        parts = []
        for run, out in zip(runs, outs, strict=True):
            run.wait()  # its failures are in its JSON
            print(out.with_suffix(".txt").read_text(), end="", flush=True)  # one table after the other
            parts += json.loads(out.read_text())["parts"]
    return parts


def merge_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One part per target from parts of some of its shapes each: the variants of all (one row for a variant two
    parts met, with both parts' shapes), every shape's coverage, the longest part's seconds (they ran side by
    side)."""
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        into = merged.get(part["target"])
        if into is None:
            copied = [dict(r) for r in part["variants"]]
            merged[part["target"]] = {**part, "variants": copied, "coverage": dict(part["coverage"])}
            continue
        rows = {r["variant"]: r for r in into["variants"]}
        for row in part["variants"]:
            if row["variant"] in rows:
                rows[row["variant"]]["shapes"] = sorted({*rows[row["variant"]]["shapes"], *row["shapes"]})
            else:
                into["variants"].append(dict(row))
        into["variants"].sort(key=lambda r: (r["kernel"], r["variant"]))
        into["coverage"].update(part["coverage"])
        into["seconds"] = {k: max(v, part["seconds"][k]) for k, v in into["seconds"].items()}
    return list(merged.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lora_server.bench.kernel_aot",
        description="Compile every Triton kernel variant the engine reaches for GPUs that are not here.",
    )
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: every target")
    parser.add_argument("--shape", action="append", help="engine shapes by label (default: all)")
    parser.add_argument(
        "--requests",
        type=int,
        default=24,
        help="random requests served after each warm-up on the first target (the others run warm-up alone: which "
        "variants a workload meets does not depend on the target)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        parser.error("TRITON_INTERPRET is set: the interpreter replaces the compiler; unset it")
    shapes = tuple(s for s in SHAPES if args.shape is None or s.label in args.shape)
    targets = args.target or sorted(TARGETS, reverse=True)  # sm_90 first
    if len(targets) > 1:
        parts = merge_parts(run_side_by_side(targets, shapes, args.requests, args.workers))
    else:
        parts = [report(targets[0], shapes, args.requests, args.workers)]
        print(table(parts[0]), flush=True)
    failed = {p["target"]: {k: v for k, v in verdicts(p).items() if v} for p in parts}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(parts=parts, failed=failed), indent=1))
    for name, reasons in failed.items():
        for reason, items in reasons.items():
            print(f"{name}: {reason}: {len(items)}", *items[:20], sep="\n  ")
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
