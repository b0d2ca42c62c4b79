"""Staging adapters, files to host pages (engine.adapter_loader). The pages staged straight from a PEFT directory's
stored weights equal, byte for byte, those laid out from its float32 LoraAdapter (the way every adapter was staged
before, which the engine tests check against HF + PEFT), for every stored dtype and page dtype, fused modules,
rank and alpha patterns, rsLoRA and changes to the embedding and head; the loader's host budget and its order, by
hand; files that change, or are replaced by a copy, or were registered while still being written; the file stamps'
rule by hand."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_server.adapters.page_layout import PageGeometry, PageLayout, vocab_shapes
from lora_server.adapters.peft_adapter import PeftAdapter
from lora_server.adapters.peft_files import SETTLE_NS, FilesIdentity, FileStamp
from lora_server.adapters.peft_format import BaseShapes, load_peft_adapter, read_peft_adapter
from lora_server.engine.adapter_loader import AdapterLoader, LoaderEvents
from lora_server.engine.adapter_registry import AdapterRegistry, AdapterSpec
from lora_server.kv_pool import PolicyParams, PoolConfig
from lora_server.model.arena import AdapterForm

VOCAB = 96
SHAPES = BaseShapes.llama(2, 64, 96, 64, 32, vocab_size=VOCAB, vocab_refusal="")
FUSED = BaseShapes.llama(2, 64, 96, 64, 32, fused=True, vocab_size=VOCAB, vocab_refusal="")
PAGE_BYTES = 4096 * 4
MODULES = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "down_proj": "mlp"}
FUSED_MODULES = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}


def _write(path, shapes: BaseShapes, dtype: torch.dtype, seed: int = 0, r: int = 8, vocab: bool = False, **config):
    """A PEFT directory: rank ``r`` on the base's q/v/o/down (or its fused qkv and gate_up), stored in ``dtype``;
    with ``vocab``, LoRA on the embedding and trainable tokens on the head too."""
    gen = torch.Generator().manual_seed(seed)
    modules = FUSED_MODULES if shapes is FUSED else MODULES
    tensors = {}
    for layer in range(shapes.num_layers):
        for name, kind in modules.items():
            in_f, out_f = shapes.module_features(f"{kind}.{name}")
            key = f"base_model.model.model.layers.{layer}.{kind}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, in_f, generator=gen).to(dtype)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, r, generator=gen).to(dtype)
    targets = list(modules)
    if vocab:
        hidden = shapes.hidden
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(r, VOCAB, generator=gen)
        tensors["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.randn(hidden, r, generator=gen)
        tensors["base_model.model.lm_head.token_adapter.trainable_tokens_delta"] = torch.randn(3, hidden, generator=gen)
        targets.append("embed_tokens")
        config["trainable_token_indices"] = {"lm_head": [1, 5, 7]}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": targets, **config}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


CONFIGS = {
    "plain": {},
    "odd alpha": {"lora_alpha": 13.7},
    "patterns, rslora": {
        "use_rslora": True,
        "rank_pattern": {"v_proj": 4},
        "alpha_pattern": {"down_proj": 3},
    },
}


@pytest.mark.parametrize("stored", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("pages", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_pages_from_the_stored_weights_equal_the_float32_adapters(tmp_path, stored, pages, config):
    geometry = PageGeometry(PAGE_BYTES, pages, 16, SHAPES)
    path = _write(tmp_path / "a", SHAPES, stored, r=8, **CONFIGS[config])
    if "rank_pattern" in CONFIGS[config]:  # v's tensors at the pattern's rank 4
        tensors = load_file(str(path / "adapter_model.safetensors"))
        for key in [k for k in tensors if "v_proj" in k]:
            tensors[key] = (tensors[key][:4] if "lora_A" in key else tensors[key][:, :4]).contiguous()
        save_file(tensors, str(path / "adapter_model.safetensors"))
    stored_adapter = read_peft_adapter("a", path, SHAPES, 16)
    stored_adapter.check_weights()
    lora = load_peft_adapter("a", path, SHAPES, 16)
    layout = PageLayout(geometry, lora.ranks)
    assert stored_adapter.ranks == lora.ranks and stored_adapter.nbytes == lora.nbytes
    assert torch.equal(layout.image(stored_adapter), layout.image(lora))


@pytest.mark.parametrize("pages", [torch.float32, torch.bfloat16], ids=str)
def test_fused_modules_and_vocabulary_pieces_stage_alike(tmp_path, pages):
    for shapes, vocab in ((FUSED, False), (SHAPES, True)):
        geometry = PageGeometry(PAGE_BYTES, pages, 16, shapes)
        path = _write(tmp_path / f"{vocab}", shapes, torch.bfloat16, vocab=vocab, lora_alpha=24)
        stored, lora = read_peft_adapter("a", path, shapes, 16), load_peft_adapter("a", path, shapes, 16)
        layout = PageLayout(geometry, lora.ranks, (), vocab_shapes(lora.vocab))
        assert (layout.vocab != {}) == vocab
        assert torch.equal(layout.image(stored), layout.image(lora))


def _registry(tmp_path, dtype: torch.dtype = torch.bfloat16) -> AdapterRegistry:
    geometry = PageGeometry(PAGE_BYTES, dtype, 16, SHAPES)
    pool = PoolConfig.for_budget(
        num_gpu_blocks=4096,
        num_host_blocks=0,
        block_size=16,
        block_bytes=PAGE_BYTES,
        policy="tree-cost",
        params=PolicyParams(),
        max_loras=16,
        adapter_slot_bytes=0,
    )
    return AdapterRegistry(AdapterForm(SHAPES, geometry), [tmp_path], pool)


def _staged(
    loader: AdapterLoader, ids: list[int], priorities: list[float] | None = None, keep: list[int] | None = None
) -> LoaderEvents:
    """Request ``ids``, wait until none is on its way, then take the events (evicting beyond the budget, but not
    ``keep``): the contents staged in the order they landed, and those evicted."""
    for i, adapter_id in enumerate(ids):
        loader.request(adapter_id, *(() if priorities is None else (priorities[i],)))
    while loader.busy():
        loader.wait(1.0)
    events = loader.take_events(keep or ())
    assert not events.failed, events.failed
    return events


def test_the_loader_stages_the_float32_adapters_pages_on_several_workers(tmp_path):
    registry = _registry(tmp_path)
    paths = [_write(tmp_path / f"a{i}", SHAPES, torch.bfloat16, seed=i) for i in range(6)]
    results = registry.check_many([AdapterSpec(p.name, p) for p in paths], threads=2)
    handles = [registry.install(checked) for checked in results]  # type: ignore[arg-type]
    loader = AdapterLoader(registry, torch.device("cpu"), 1 << 30, workers=2)
    assert sorted(_staged(loader, [h.adapter_id for h in handles]).staged) == sorted(h.adapter_id for h in handles)
    for handle, path in zip(handles, paths, strict=True):
        staged = loader.staged(handle.adapter_id)
        assert staged is not None
        lora = load_peft_adapter("a", path, SHAPES, 16)
        assert torch.equal(staged.image, PageLayout(registry.geometry, lora.ranks).image(lora))
    loader.close()


def test_the_host_budget_by_hand(tmp_path):
    """Images of 2 pages each, by hand: per layer, bf16 A and B^T of rank 8 on q, v (A side by side), o and down:
    8 x (64 + 64) + 8 x 64 + 8 x 32 + 8 x 64 + 8 x 64 + 8 x 96 + 8 x 64 = 4,096 values (every block a multiple of
    128 bytes); 2 layers and the table (2 x 7 x 5 int64, 560 bytes, 640 aligned: 320 values) are 8,512 values, over
    one 8,192-value page. A budget of two and a half images keeps two; --max-cpu-loras 1 keeps one; images that
    just landed, and pinned ones, are kept beyond it."""
    registry = _registry(tmp_path)
    handles = [registry.register(f"a{i}", _write(tmp_path / f"a{i}", SHAPES, torch.bfloat16, seed=i)) for i in range(4)]
    assert handles[0].device_nbytes == 2 * PAGE_BYTES
    image = 2 * PAGE_BYTES
    ids = [h.adapter_id for h in handles]
    loader = AdapterLoader(registry, torch.device("cpu"), budget_bytes=int(2.5 * image), workers=1)
    assert _staged(loader, ids[:2]).evicted == []
    assert loader.staged_bytes() == 2 * image and loader.staged_ids() == ids[:2]
    loader.staged(ids[0])  # a use: ids[1] is now the least recently used
    events = _staged(loader, ids[2:3])  # 3 images: over the budget; the one that just landed stays
    assert (events.staged, events.evicted) == ([ids[2]], [ids[1]])
    assert loader.staged_bytes() == 2 * image and loader.staged_ids() == [ids[0], ids[2]]
    events = _staged(loader, ids[3:4], keep=[ids[0], ids[2]])  # pinned, and just landed: all kept, over budget
    assert (events.staged, events.evicted) == ([ids[3]], [])
    assert loader.staged_bytes() == 3 * image
    assert loader.take_events(keep=[ids[3]]).evicted == [ids[0]]  # used less recently than ids[2]
    assert loader.staged_bytes() == 2 * image
    counted = AdapterLoader(registry, torch.device("cpu"), budget_bytes=1 << 30, max_images=1, workers=1)
    _staged(counted, ids[:1])
    assert _staged(counted, ids[1:2]).evicted == [ids[0]] and counted.staged_ids() == [ids[1]]
    loader.close()
    counted.close()


def test_waiting_adapters_are_staged_earliest_first(tmp_path):
    """One worker, busy with a large adapter while four others are asked for: they land in the order of their
    priorities (the arrival of the earliest request waiting for each), those no request waits for last."""
    registry = _registry(tmp_path)
    big = registry.register("big", _write(tmp_path / "big", SHAPES, torch.float32, r=16))
    small = [registry.register(f"s{i}", _write(tmp_path / f"s{i}", SHAPES, torch.bfloat16, seed=i)) for i in range(4)]
    loader = AdapterLoader(registry, torch.device("cpu"), 1 << 30, workers=1)
    ids = [big.adapter_id, *(h.adapter_id for h in small)]
    landed = _staged(loader, ids, [0.0, float("inf"), 3.0, 1.0, 2.0]).staged
    assert landed == [ids[0], ids[3], ids[4], ids[2], ids[1]]
    loader.close()


def test_the_stamps_rule_by_hand():
    settled_ns = 10 * SETTLE_NS
    config, weights = FileStamp(1, 10, 100, 5, 5), FileStamp(1, 11, 5000, 5, 5)
    registered = FilesIdentity((config, weights), settled_ns)
    assert registered.same_bytes(FilesIdentity((config, weights), settled_ns + 99))
    moved = FileStamp(1, 12, 5000, 5, 5)  # another file (a copy moved into place): new inode
    assert not registered.same_bytes(FilesIdentity((config, moved), settled_ns + 99))
    changed = FileStamp(1, 11, 5000, 5, 6)  # written in place: a new change time
    assert not registered.same_bytes(FilesIdentity((config, changed), settled_ns + 99))
    # read less than SETTLE_NS after the last change: a write in the same tick could leave the same stamps
    racy = FilesIdentity((config, weights), 5 + SETTLE_NS)
    assert not racy.same_bytes(FilesIdentity((config, weights), settled_ns))
    assert FilesIdentity((config, weights), 6 + SETTLE_NS).same_bytes(FilesIdentity((config, weights), settled_ns))


@pytest.mark.slow
def test_weights_are_hashed_again_only_when_the_files_may_have_changed(tmp_path, monkeypatch):
    """Files at rest when registered: staging reads them without hashing. Stamped anew (their change time moves,
    their bytes do not): hashed, and served. Other weights: refused as changed. A copy of the registered files moved
    into place: hashed, and served."""
    registry = _registry(tmp_path)
    path = _write(tmp_path / "a", SHAPES, torch.bfloat16)
    original = {f.name: f.read_bytes() for f in path.iterdir()}
    time.sleep(SETTLE_NS / 1e9 + 0.1)
    handle = registry.register("a", path)
    hashed = []
    digest = PeftAdapter.digest
    monkeypatch.setattr(PeftAdapter, "digest", lambda self: hashed.append(self.path) or digest(self))
    filler = registry.register("filler", _write(tmp_path / "filler", SHAPES, torch.bfloat16, seed=1))
    loader = AdapterLoader(registry, torch.device("cpu"), 1 << 30, max_images=1, workers=1)

    def stage_again() -> None:
        """Stage the filler (evicting a's image: one image at most), then a."""
        for adapter_id in (filler.adapter_id, handle.adapter_id):
            loader.request(adapter_id)
            while loader.busy():
                loader.wait(1.0)
            loader.take_events(keep=[adapter_id])

    stage_again()
    mine = path.resolve()
    assert loader.staged(handle.adapter_id) is not None and hashed.count(mine) == 0
    weights = path / "adapter_model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns))  # same bytes, new ctime
    stage_again()
    assert loader.staged(handle.adapter_id) is not None and hashed.count(mine) == 1
    _write(path, SHAPES, torch.bfloat16, seed=7)  # other weights
    stage_again()
    assert loader.staged(handle.adapter_id) is None
    assert "changed since it was registered" in (loader.failed([handle.adapter_id]) or "")
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in original.items():
        (copy / name).write_bytes(data)
    for name in original:
        shutil.move(copy / name, path / name)
    stage_again()
    assert loader.staged(handle.adapter_id) is not None and hashed.count(mine) == 3
    loader.close()


def test_what_a_staged_adapter_keeps_is_its_own_memory(tmp_path):
    """A worker reads every file into the same buffer: the embedding's and head's changes a staged adapter keeps
    (float32 files, which a view would share) are still its own after the worker read other files."""
    registry = _registry(tmp_path, torch.float32)
    first = registry.register("v", _write(tmp_path / "v", SHAPES, torch.float32, vocab=True, lora_alpha=24))
    others = [
        registry.register(f"o{i}", _write(tmp_path / f"o{i}", SHAPES, torch.float32, seed=9 + i)) for i in range(3)
    ]
    loader = AdapterLoader(registry, torch.device("cpu"), 1 << 30, workers=1)
    _staged(loader, [first.adapter_id, *(h.adapter_id for h in others)])
    staged = loader.staged(first.adapter_id)
    expected = load_peft_adapter("v", tmp_path / "v", SHAPES, 16).vocab
    assert staged is not None and staged.vocab is not None and expected is not None
    for name, tensor in expected.tensors().items():
        assert torch.equal(staged.vocab.tensors()[name], tensor), name
    loader.close()
