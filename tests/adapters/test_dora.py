"""DoRA (PEFT's use_dora) served beside plain LoRA adapters and the base model.

Below the model: DoRA's magnitudes read from PEFT's files (a fused module's split like B's rows) and refused when
malformed; its scale and shift laid out beside A and B^T and found through the table; the LoRA expand's epilogue
on every path (the CPU's segments, the twins, the Triton kernel under the interpreter) against a float64 product.
End to end: the engine's greedy tokens and log-probabilities against HF transformers + PEFT at fp32, each request
alone in PEFT (PEFT does not batch DoRA adapters): a DoRA adapter alone, a batch mixing DoRA adapters, plain LoRA
adapters and the base on a tiny Llama, and on Qwen2 (q, k, v biases) and Phi-3 (fused qkv and gate_up); the same
through the real HTTP server with the openai client, streamed and not. Each DoRA adapter has its lora_B and its
magnitudes moved after PEFT made them, so that its scales are far from 1, and each end-to-end test checks that
the adapter read as a plain LoRA (no scale) would compute something else."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_server.adapters.dora import dora_epilogues
from lora_server.adapters.page_layout import PageGeometry, PageLayout
from lora_server.adapters.peft_format import AdapterError, BaseShapes, LoraAdapter, content_hash, load_peft_adapter
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.kernels import ops
from lora_server.kernels.lora_table import GROUPS, MODULE_INDEX, MODULES, dora_column, max_tiles, row_len, tile_map
from lora_server.model.arena import Arena, ResidentAdapters
from lora_server.model.lora import BaseRowNorms, workspace_shape
from lora_server.sampling_params import SamplingParams
from tests.adapters import test_adapter_keys
from tests.adapters.test_adapter_keys import BASE
from tests.kernel_env import DEVICE, TOL_VS_TWIN, force_path
from tests.kernels.test_lora_ops import ARCH, BLOCK_SIZE, MAX_RANK, SHAPES, WIDTHS
from tests.model.test_architectures import _build, _peft_greedy, _peft_log_softmax, assert_mixed_batch_matches_peft
from tests.model.test_model_vs_hf import LOGPROB_TOL

tiny = test_adapter_keys.tiny  # the keys tests' fixture: a random tiny Llama in HF's format and the model (fp32)
TINY_BASE = BASE  # its shapes: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 128
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(model, path: Path, seed: int, dora: bool = True, **config) -> Path:
    """A PEFT adapter on ``model`` (a copy), saved to ``path``: random A and B (init_lora_weights=False), then B
    and, for DoRA, the magnitudes moved (PEFT sets them to the norms of W + B A, where DoRA's scale is 1)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, use_dora=dora, **config))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5).add_(torch.randn_like(p) * 0.2)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.6 * (torch.rand_like(p) - 0.5))
    peft.save_pretrained(path)
    return path


def as_plain_lora(path: Path, out: Path) -> Path:
    """The DoRA adapter at ``path`` read as a plain LoRA (its magnitudes dropped): what serving it without the scale
    would compute."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k}, str(out / "adapter_model.safetensors"))
    config = json.loads((path / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    return out


def peft_model(base, adapters: dict[str, Path]):
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(copy.deepcopy(base), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def tiny_engine(path: Path, **kw) -> Engine:
    config = dict(quantization="none", kv_cache_bytes=16 << 20, block_size=64, max_loras=8, show_progress=False)
    return Engine(EngineConfig(model=str(path), **{**config, **kw}))


def _prompts(lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


def assert_matches_peft(engine: Engine, model, plan: list[str | None], prompts, new_tokens: int = 8) -> None:
    """One batch of ``plan``'s adapters (None: the base): each request's greedy tokens are HF + PEFT's with only its
    adapter active, and its log-probabilities within LOGPROB_TOL of PEFT's."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=1)
    outs = engine.generate(prompts, params, adapters=plan)
    for prompt, adapter, out in zip(prompts, plan, outs, strict=True):
        assert out.token_ids == _peft_greedy(model, adapter, prompt, new_tokens), adapter
        ref = _peft_log_softmax(model, adapter, prompt + out.token_ids)
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - ref[len(prompt) - 1 + step, lp.token_id].item()) <= LOGPROB_TOL, (adapter, step)


def assert_scale_matters(base, dora: Path, tmp: Path, prompt: list[int]) -> None:
    """PEFT's DoRA adapter and the same weights as a plain LoRA differ clearly: dropping the scale would fail the
    comparisons with PEFT."""
    model = peft_model(base, {"dora": dora, "plain": as_plain_lora(dora, tmp / f"{dora.name}-plain")})
    diff = _peft_log_softmax(model, "dora", prompt) - _peft_log_softmax(model, "plain", prompt)
    assert diff.abs().max() > 0.05


# ---- reading PEFT's files ----------------------------------------------------------------------------------------


def test_magnitudes_are_read_per_module_and_hashed(tiny, tmp_path):
    path = save_adapter(tiny[1], tmp_path / "d", seed=1, r=4, target_modules=["q_proj", "down_proj"])
    saved = load_file(str(path / "adapter_model.safetensors"))
    adapter = load_peft_adapter("d", path, TINY_BASE, max_rank=16)
    assert set(adapter.magnitudes) == set(adapter.weights) == {(i, m) for i in range(2) for m in ("q", "down")}
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector"  # PEFT's name: no ".weight"
    assert torch.equal(adapter.magnitudes[(1, "down")], saved[key])
    # the same A and B with other magnitudes are other weights
    saved[key] = saved[key] * 2
    save_file(saved, str(path / "adapter_model.safetensors"))
    assert content_hash(load_peft_adapter("d", path, TINY_BASE, max_rank=16)) != content_hash(adapter)
    plain = as_plain_lora(path, tmp_path / "plain")
    assert load_peft_adapter("p", plain, TINY_BASE, max_rank=16).magnitudes == {}


def test_a_fused_modules_magnitude_splits_like_its_b(tmp_path):
    """Phi-3's qkv_proj: one magnitude [q + k + v], split by the parts' widths."""
    base = BaseShapes.llama(1, 8, 16, 8, 4, fused=True)
    key = "base_model.model.model.layers.0.self_attn.qkv_proj"
    magnitude = torch.arange(16, dtype=torch.float32) + 1
    save_file(
        {
            f"{key}.lora_A.weight": torch.randn(2, 8),
            f"{key}.lora_B.weight": torch.randn(16, 2),
            f"{key}.lora_magnitude_vector": magnitude,
        },
        str(tmp_path / "adapter_model.safetensors"),
    )
    config = dict(peft_type="LORA", r=2, lora_alpha=2, target_modules=["qkv_proj"], use_dora=True)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    adapter = load_peft_adapter("f", tmp_path, base, max_rank=16)
    parts = {m: adapter.magnitudes[(0, m)].tolist() for m in ("q", "k", "v")}
    assert parts == {"q": magnitude[:8].tolist(), "k": magnitude[8:12].tolist(), "v": magnitude[12:].tolist()}


def _edit(path: Path, change) -> None:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


MAG = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
MALFORMED = {
    "a module without its magnitude": (lambda t: t.pop(MAG), "lacks its DoRA magnitude"),
    "a magnitude of another shape": (lambda t: t.update({MAG: torch.ones(32)}), r"lora_magnitude_vector \(32,\)"),
    "a NaN magnitude": (lambda t: t[MAG].__setitem__(3, float("nan")), "NaN or Inf DoRA magnitude"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_magnitudes_are_refused(tiny, tmp_path, case):
    path = save_adapter(tiny[1], tmp_path / "d", seed=2, r=2, target_modules=["q_proj", "v_proj"])
    change, reason = MALFORMED[case]
    _edit(path, change)
    with pytest.raises(AdapterError, match=reason):
        load_peft_adapter("d", path, TINY_BASE, max_rank=16)


def test_magnitudes_without_use_dora_are_refused(tiny, tmp_path):
    path = save_adapter(tiny[1], tmp_path / "d", seed=3, r=2, target_modules=["q_proj"])
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    with pytest.raises(AdapterError, match="DoRA magnitude, but adapter_config.json does not set use_dora"):
        load_peft_adapter("d", path, TINY_BASE, max_rank=16)


def test_the_scale_and_shift_from_the_base(tmp_path):
    """s = m / ||W + B A||_row, rounded to the arena's dtype; shift (1 - s) * bias; a zero row is refused."""
    a, b = torch.randn(2, 3), torch.randn(4, 2)
    w, bias = torch.randn(4, 3), torch.randn(4)
    adapter = LoraAdapter("d", tmp_path, 2, {(0, "q"): (a, b)}, magnitudes={(0, "q"): torch.rand(4) + 0.5})

    def row_norms(layer, module, a_, b_):
        assert (layer, module) == (0, "q") and a_ is a and b_ is b
        return torch.linalg.vector_norm(w + b @ a, dim=1), bias

    rows = dora_epilogues(adapter, row_norms, torch.bfloat16)[(0, "q")]
    scale = (adapter.magnitudes[(0, "q")] / (w + b @ a).norm(dim=1)).to(torch.bfloat16).float()
    torch.testing.assert_close(rows, torch.stack([scale, (1 - scale) * bias]), rtol=0, atol=0)
    with pytest.raises(AdapterError, match="not finite"):
        dora_epilogues(adapter, lambda *args: (torch.tensor([1.0, 0.0, 1.0, 1.0]), None), torch.float32)


def test_the_models_row_norms_read_the_served_weights(tmp_path):
    """model.lora.BaseRowNorms on a Qwen2 engine (q, k, v fused, with biases), in chunks of a few rows: HF's own
    weight and bias of the module (k: the middle slice of the fused qkv; up: the second of gate_up)."""
    hf = _build(tmp_path, "qwen2-bias")
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=16, num_kv_blocks=64, show_progress=False))
    row_norms = BaseRowNorms(engine.model.lora_wrappers(), torch.float32, engine.describe().device, chunk_elems=200)
    layer = hf.model.layers[1]
    for module, linear in (("k", layer.self_attn.k_proj), ("up", layer.mlp.up_proj)):
        a, b = torch.randn(3, linear.in_features), torch.randn(linear.out_features, 3)
        norms, bias = row_norms(1, module, a, b)
        torch.testing.assert_close(norms, torch.linalg.vector_norm(linear.weight + b @ a, dim=1))
        assert (bias is None) == (linear.bias is None) and (bias is None or torch.equal(bias, linear.bias))


# ---- the page layout and the LoRA ops ----------------------------------------------------------------------------


def _dora_adapter(ranks: dict[tuple[int, str], int], dora: set, seed: int, shift: bool):
    """Random A, B and, for the modules in ``dora``, epilogue rows [2, out] (scale near 1, a shift or zeros)."""
    gen = torch.Generator().manual_seed(seed)
    weights, epilogues = {}, {}
    for (layer, module), r in ranks.items():
        in_f, out_f = SHAPES.features[module]
        a = torch.randn(r, in_f, generator=gen) / in_f**0.5
        weights[(layer, module)] = (a, torch.randn(out_f, r, generator=gen) / r**0.5)
        if (layer, module) in dora:
            scale = 0.5 + torch.rand(out_f, generator=gen)
            epilogues[(layer, module)] = torch.stack([scale, torch.randn(out_f, generator=gen) * shift])
    magnitudes = {key: torch.ones(1) for key in epilogues}  # the layout reads only which modules are DoRA's
    return LoraAdapter(f"a{seed}", None, max(ranks.values()), weights, magnitudes=magnitudes), epilogues  # type: ignore[arg-type]


def test_dora_rows_read_back_through_the_table():
    """Small pages: every block (DoRA's rows a unit each) within one page, off the table; the table's DoRA entries
    point at the scale and the shift, -1 for the other modules."""
    shapes = BaseShapes.llama(2, 8, 16, 8, 4)
    geometry = PageGeometry(2048, torch.float32, 16, shapes)
    ranks = {(0, "q"): 4, (0, "v"): 4, (1, "down"): 16, (1, "up"): 2}
    dora = {(0, "v"), (1, "down")}
    layout = PageLayout(geometry, ranks, dora)
    epilogues = {key: torch.randn(2, shapes.features[key[1]][1]) for key in dora}
    weights = {
        key: (torch.randn(r, shapes.features[key[1]][0]), torch.randn(shapes.features[key[1]][1], r))
        for key, r in ranks.items()
    }
    adapter = LoraAdapter("t", None, 16, weights, magnitudes={k: torch.ones(1) for k in dora})  # type: ignore[arg-type]
    for block in layout.blocks:
        size = (block.row1 - block.row0) * block.width
        assert block.offset + size <= geometry.page_elems and (block.page > 0 or block.offset >= geometry.table_elems)
    pages = [6, 1, 4, 2][: layout.num_pages]
    arena = torch.full((8, geometry.page_bytes), 0xFF, dtype=torch.uint8)
    for i, page in enumerate(pages):
        arena[page] = layout.image(adapter, dora=epilogues)[i]
    values = arena.view(-1).view(torch.float32)
    table = layout.table(pages).reshape(2, len(MODULES), row_len(16))
    column = dora_column(16)
    for layer in range(2):
        for module in MODULES:
            entries = table[layer, MODULE_INDEX[module], column:].tolist()
            if (layer, module) not in dora:
                assert entries == [-1, -1]
                continue
            width = shapes.features[module][1]
            got = torch.stack([values[e : e + width] for e in entries])
            assert torch.equal(got, epilogues[(layer, module)])


# DoRA on every module with a shift (a base with biases); plain LoRA; DoRA on q and v at rank 20 (two row groups:
# the epilogue after both) without a shift; DoRA on the MLP of layer 1
DORA_RANKS = [
    ({(i, m): 8 for i in range(2) for m in SHAPES.features}, "all", True),
    ({(i, m): 4 for i in range(2) for m in ("k", "o", "down")}, "none", False),
    ({(0, "q"): 20, (0, "v"): 20, (1, "q"): 20, (1, "v"): 20}, "all", False),
    ({(1, m): 3 for m in ("gate", "up", "down")}, "all", True),
]


def _load_arena(dtype: torch.dtype):
    """DORA_RANKS' adapters in an arena of ``dtype`` at scattered pages, NaN everywhere no table points."""
    page = ARCH.num_layers * 2 * BLOCK_SIZE * ARCH.kv_size * 4
    geometry = PageGeometry(page, dtype, MAX_RANK, SHAPES)
    arena = Arena(40, ARCH, BLOCK_SIZE, torch.float32, dtype, torch.device(DEVICE))
    arena.pages.fill_(0xFF)
    starts = {g: [0, *torch.tensor(w).cumsum(0).tolist()] for g, w in WIDTHS.items()}
    residents = ResidentAdapters(arena, geometry, starts)
    loaded, free = [], [33, 3, 21, 8, 30, 14, 0, 26, 11, 37, 5, 18, 39, 1, 24, 9, 35, 16, 28, 6]
    for seed, (ranks, which, shift) in enumerate(DORA_RANKS):
        adapter, epilogues = _dora_adapter(ranks, set(ranks) if which == "all" else set(), seed, shift)
        layout = PageLayout(geometry, ranks, epilogues.keys())
        pages = [free.pop(0) for _ in range(layout.num_pages)]
        residents.load(pages, layout, layout.image(adapter, dora=epilogues).to(DEVICE))
        loaded.append((adapter, epilogues, pages[0]))
    return arena, residents, loaded


@pytest.fixture(scope="module")
def dora_arena():
    return _load_arena(torch.float32)


RUNS = [(0, 5, 0), (5, 7, None), (7, 12, 1), (12, 23, 2), (23, 29, 3)]  # (first, end, adapter index) of row runs
LAYER = 1


def _apply(monkeypatch, loaded_arena, group: str, path: str, dtype: torch.dtype = torch.float32):
    """x, out and out after kernels.ops.apply_lora of layer LAYER's ``group`` down ``path`` for the runs RUNS."""
    arena, residents, loaded = loaded_arena
    gen = torch.Generator().manual_seed(len(group))
    x = torch.randn(29, SHAPES.features[GROUPS[group][0]][0], generator=gen).to(DEVICE, dtype)
    out = torch.randn(29, sum(WIDTHS[group]), generator=gen).to(DEVICE, dtype)
    segments = [(s, e, loaded[i][2]) for s, e, i in RUNS if i is not None]
    starts = [0, *torch.tensor(WIDTHS[group]).cumsum(0).tolist()]
    tiles = torch.tensor(tile_map(segments, 16, max_tiles(29, 16, 4)), dtype=torch.int32, device=DEVICE).view(-1, 3)
    kernels = path == "kernels"
    force_path(monkeypatch, "kernels" if kernels else "twins")
    result = out.clone()
    ops.apply_lora(
        x,
        result,
        ops.LoraArena(arena.weights, arena.table, arena.table_stride, MAX_RANK),
        tiles,
        layer=LAYER,
        module_base=MODULE_INDEX[GROUPS[group][0]],
        slice_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE) if kernels else starts,
        max_width=max(WIDTHS[group]),
        y=torch.full(workspace_shape(29, MAX_RANK), float("nan"), device=DEVICE) if kernels else None,
        block_t=16,
        host_segments=(
            (lambda: [(s, e, residents.terms(p, LAYER, group)) for s, e, p in segments]) if path == "segments" else None
        ),
    )
    return x, out, result


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("path", ["segments", "twins", "kernels"])
def test_the_epilogue_on_every_path_against_float64(dora_arena, monkeypatch, group, path):
    x, out, result = _apply(monkeypatch, dora_arena, group, path)
    starts = [0, *torch.tensor(WIDTHS[group]).cumsum(0).tolist()]
    expected = out.double().cpu()
    for start, end, i in RUNS:
        if i is None:
            continue
        adapter, epilogues, _ = dora_arena[2][i]
        for k, module in enumerate(GROUPS[group]):
            if (LAYER, module) not in adapter.weights:
                continue
            a, b = adapter.weights[(LAYER, module)]
            c0, c1 = starts[k], starts[k + 1]
            value = expected[start:end, c0:c1] + x[start:end].double().cpu() @ a.double().T @ b.double().T
            if (LAYER, module) in epilogues:
                scale, shift = epilogues[(LAYER, module)].double()
                value = value * scale + shift
            expected[start:end, c0:c1] = value
    torch.testing.assert_close(result.double().cpu(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(result[5:7], out[5:7])  # no adapter: not touched


@pytest.mark.parametrize("group", ["qkv", "down"])
def test_the_kernels_epilogue_in_bfloat16_matches_its_twin(monkeypatch, group):
    loaded = _load_arena(torch.bfloat16)
    _, out, kernel = _apply(monkeypatch, loaded, group, "kernels", torch.bfloat16)
    _, _, twin = _apply(monkeypatch, loaded, group, "twins", torch.bfloat16)
    torch.testing.assert_close(kernel.float(), twin.float(), **TOL_VS_TWIN[torch.bfloat16])
    assert torch.equal(kernel[5:7], out[5:7])


# ---- end to end against HF + PEFT --------------------------------------------------------------------------------


def test_a_dora_adapter_alone_matches_peft(tiny, tmp_path):
    path, model = tiny
    dora = save_adapter(model, tmp_path / "d", seed=10, r=8, lora_alpha=16, target_modules="all-linear")
    prompts = _prompts((3, 17))
    assert_scale_matters(model, dora, tmp_path, prompts[1])
    engine = tiny_engine(path)
    engine.adapters.add("d", dora)
    assert_matches_peft(engine, peft_model(model, {"d": dora}), ["d", "d"], prompts)


def test_a_batch_of_dora_lora_and_the_base_matches_peft(tiny, tmp_path):
    path, model = tiny
    adapters = {
        "d0": save_adapter(model, tmp_path / "d0", seed=20, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "l0": save_adapter(model, tmp_path / "l0", seed=21, dora=False, r=4, target_modules="all-linear"),
        "d1": save_adapter(
            model,
            tmp_path / "d1",
            seed=22,
            r=4,
            use_rslora=True,
            target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"],
        ),
        "l1": save_adapter(model, tmp_path / "l1", seed=23, dora=False, r=8, target_modules=["q_proj", "up_proj"]),
    }
    plan = [None, "d0", "l0", "d1", "l1", "d0", None, "d1"]
    prompts = _prompts((5, 12, 1, 20, 9, 3, 14, 7))
    assert_scale_matters(model, adapters["d1"], tmp_path, prompts[3])
    engine = tiny_engine(path)
    for name, adapter in adapters.items():
        engine.adapters.add(name, adapter)
    assert_matches_peft(engine, peft_model(model, adapters), plan, prompts)
    engine.check_integrity()


def test_a_dora_adapter_larger_than_a_slot_is_refused(tiny, tmp_path):
    """lru-separate's slots hold an adapter of every module at the largest rank: a DoRA adapter of that size takes
    a page more (its scales) and is refused at registration, with the sizes; a smaller one is served."""
    path, model = tiny
    engine = tiny_engine(path, block_size=32, max_lora_rank=16, pool_policy="lru-separate", max_loras=2)
    full = save_adapter(model, tmp_path / "full", seed=50, r=16, target_modules="all-linear")
    with pytest.raises(AdapterError, match="takes 10 pages; the lru-separate policy's adapter slots hold 9"):
        engine.adapters.add("full", full)
    engine.adapters.add("small", save_adapter(model, tmp_path / "small", seed=51, r=8, target_modules="all-linear"))
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), adapters=["small"])) == 1


@pytest.mark.parametrize(
    ("family", "dora_targets", "lora_targets"),
    [
        ("qwen2-bias", ALL, ["k_proj", "down_proj"]),  # q, k, v with biases: the shift (1 - s) * b
        ("phi3", ["qkv_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "o_proj"]),  # fused: magnitudes split
    ],
)
def test_dora_on_other_families_matches_peft(tmp_path, family, dora_targets, lora_targets):
    hf = _build(tmp_path / "base", family)
    with torch.no_grad():  # HF's init leaves biases zero, where DoRA's shift would be zero too
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path / "base")
    dora = save_adapter(hf, tmp_path / "a0", seed=30, r=8, lora_alpha=16, target_modules=dora_targets)
    save_adapter(hf, tmp_path / "a1", seed=31, dora=False, r=4, lora_alpha=8, target_modules=lora_targets)
    assert_scale_matters(hf, dora, tmp_path, list(range(3, 20)))
    engine = Engine(
        EngineConfig(
            model=str(tmp_path / "base"), block_size=16, num_kv_blocks=128, max_lora_rank=8, show_progress=False
        )
    )
    for name in ("a0", "a1"):
        engine.adapters.add(name, tmp_path / name)
    assert_mixed_batch_matches_peft(engine, peft_model(hf, {"a0": tmp_path / "a0", "a1": tmp_path / "a1"}))


@pytest.mark.gpu
def test_dora_on_cuda_matches_peft(tiny, tmp_path):
    """The GPU path (GPU tier): the Triton expand kernel's epilogue, read through tables that decode steps' CUDA
    graphs captured before the adapters were loaded, and the scales computed on the loader's own stream; fp32."""
    path, model = tiny
    adapters = {
        "d0": save_adapter(model, tmp_path / "d0", seed=60, r=8, lora_alpha=16, target_modules="all-linear"),
        "l0": save_adapter(model, tmp_path / "l0", seed=61, dora=False, r=4, target_modules=["q_proj", "down_proj"]),
    }
    engine = tiny_engine(path, device="cuda", dtype="float32")
    for name, adapter in adapters.items():
        engine.adapters.add(name, adapter)
    plan = [None, "d0", "l0", "d0", None, "l0", "d0"]
    assert_matches_peft(engine, peft_model(model, adapters), plan, _prompts((5, 12, 1, 20, 9, 3, 14)))


# ---- through the HTTP server -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_server_serves_dora_streamed_and_not(tmp_path_factory, hf_smollm2):
    """``lora-server serve`` on the embedded model: a DoRA adapter registered through the admin API answers the
    openai client's completions with HF + PEFT's greedy tokens, streamed and not, beside the base model."""
    from tests.servers import BASE, assert_serves_greedy

    root = tmp_path_factory.mktemp("dora-server")
    dora = save_adapter(hf_smollm2, root / "dora", seed=40, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    prompt = [1, 9690, 314, 253, 2914, 1005, 28, 2]  # token ids: no tokenizer between the two sides
    model = peft_model(hf_smollm2, {"dora": dora})
    expected = {"dora": _peft_greedy(model, "dora", prompt, 8), BASE: _peft_greedy(model, None, prompt, 8)}
    assert expected["dora"] != expected[BASE]
    assert_serves_greedy(root, {"dora": dora}, prompt, expected)
