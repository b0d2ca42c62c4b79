"""The registry and the pool each own their facts: versions count a name's registrations, a request keeps the
version it resolved while the name is replaced or unloaded, a pinned adapter goes to the device before anyone asks
for it and stays there while others churn through the rest of the arena, and pins beyond half the arena are
refused."""

from __future__ import annotations

import pytest

from lora_server.adapters.peft_format import AdapterError
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.errors import UnknownAdapterError
from lora_server.sampling_params import SamplingParams
from tests.conftest import pool_counters
from tests.servers import write_adapter

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    # 8 pages of the arena; write_adapter's rank-4 q/v adapters take 2 each (its table and 23 layers, then 7)
    return Engine(EngineConfig(quantization="none", num_kv_blocks=8, max_loras=2, show_progress=False))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    names = ("pin", "a", "b", "c", "d", "x1", "x2")
    return {name: write_adapter(root / name, seed=i) for i, name in enumerate(names)}


def _resident(engine: Engine) -> set[str]:
    return {n for n in engine.adapters.names() if engine.adapters.info(n).state == "resident"}


def test_pinned_adapter_loads_first_and_stays_while_others_churn(engine, paths):
    engine.adapters.add("pin", paths["pin"], pinned=True)
    for name in ("a", "b", "c", "d"):
        engine.adapters.add(name, paths[name])
    with pytest.raises(AdapterError, match="pinned adapters may take 4 of the 8 device pages and 4 are taken"):
        for name in ("a", "b"):  # a pin of 2 more pages fits the half of the arena pins may take; a third does not
            engine.adapters.add(name, paths[name], pinned=True)
    engine.adapters.add("a", paths["a"])  # unpinned again
    prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    engine.generate([prompt], GREEDY)  # a base-model request: the pool loads the pinned adapter meanwhile
    assert _resident(engine) == {"pin"}
    for name in ("a", "b", "c", "d", "a", "c"):  # 8 pages cannot hold them all: they churn, the pin stays
        engine.generate([prompt], GREEDY, adapters=name)
        assert {"pin", name} <= _resident(engine)
        engine.check_integrity()
    assert pool_counters(engine)["adapter_unload"] > 0
    assert engine.adapters.info("pin").pinned is True and engine.adapters.info("pin").table_page >= 0


def test_versions_count_registrations_and_a_request_keeps_its_version(engine, paths):
    first = engine.adapters.add("x", paths["x1"])
    prompt = engine.chat_prompt([{"role": "user", "content": "Tell me a fun fact."}])
    v1_alone = engine.generate([prompt], GREEDY, adapters="x")[0].token_ids
    held = engine.make_request(prompt, GREEDY, adapter="x")  # resolves version 1 now
    second = engine.adapters.add("x", paths["x2"])
    assert (first.version, second.version) == (1, 2) and engine.adapters.info("x").version == 2
    assert engine.adapters.add("x", paths["x2"], version=7).version == 7  # the registry store's, when reloading
    engine.adapters.remove("x")
    with pytest.raises(UnknownAdapterError):
        engine.make_request(prompt, GREEDY, adapter="x")
    engine.add(held)  # made before the replacement and the unload: still served by version 1
    tokens = []
    while engine.has_work():
        tokens += [t for out in engine.step() for t in out.token_ids]
    assert tokens == v1_alone
    engine.check_integrity()
