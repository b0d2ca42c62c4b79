"""Registering many adapters at once. ``POST /admin/adapters/batch`` on a real server process (its registry a SQLite
file in its data directory, which the tests read beside it), through httpx and the openai client: a batch is
registered in one store write and served; a batch with any refused item answers one error naming each refused
item, and changes nothing, in the engine or in the store. And ``RegistrySync.catch_up`` on a real engine, bringing
many store records in at once.

Slow: a server start and an engine's model load."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_server.admin.store import AdapterRecord, RegistryStore, open_store
from tests.servers import BASE, Server, write_adapter

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Server]:
    s = Server(root, [root])
    yield s
    s.stop()


@pytest.fixture
def store(server: Server) -> Iterator[RegistryStore]:
    """Another process's view of the server's registry (the same SQLite file)."""
    with open_store(server.data_dir) as opened:
        yield opened


def batch(server: Server, items: list[dict]) -> tuple[int, dict]:
    r = server.admin("POST", "/admin/adapters/batch", json={"adapters": items})
    return r.status_code, r.json()


def state(server: Server, store: RegistryStore) -> tuple[list[tuple], list[AdapterRecord], int]:
    """What a refused batch must leave as it was: the adapters the admin API lists (without where they are now,
    which the pool changes by itself), the store's records and its revision."""
    fields = ("name", "path", "source", "version", "pinned")
    listed = [tuple(a[f] for f in fields) for a in server.admin("GET", "/admin/adapters").json()["data"]]
    return listed, store.list_adapters(), store.revision()


def refusal(answer: dict) -> str:
    """The message of an error in OpenAI's shape (and the shape checked)."""
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == "adapters"
    return answer["error"]["message"]


def test_a_batch_is_registered_in_one_store_write_and_served(server: Server, store: RegistryStore, root: Path):
    paths = [write_adapter(root / f"many{i}", seed=i, r=1) for i in range(50)]
    items = [{"name": f"many{i}", "path": str(p), "pinned": i in (3, 30)} for i, p in enumerate(paths)]
    revision = store.revision()
    status, answer = batch(server, items)
    assert status == 200, answer
    assert [a["name"] for a in answer["data"]] == [f"many{i}" for i in range(50)]  # in the order sent
    assert {a["version"] for a in answer["data"]} == {1}
    assert [a["pinned"] for a in answer["data"]] == [i in (3, 30) for i in range(50)]
    assert [a["path"] for a in answer["data"]] == [str(p) for p in paths]
    assert {a["source"] for a in answer["data"]} == {"api"}
    assert store.revision() == revision + 1  # one transaction for the fifty
    recorded = {r.name: r for r in store.list_adapters()}
    for i, p in enumerate(paths):
        assert (recorded[f"many{i}"].path, recorded[f"many{i}"].version) == (str(p), 1)
        assert recorded[f"many{i}"].pinned == (i in (3, 30))
    single = server.admin("POST", "/admin/adapters", json={"name": "one", "path": str(paths[0])}).json()
    assert set(single) == set(answer["data"][0])  # each item answered as the single endpoint answers
    listed = {m.id for m in server.client().models.list().data}
    assert {f"many{i}" for i in range(50)} <= listed
    reply = server.client().chat.completions.create(model="many7", messages=QUESTION, max_tokens=4, temperature=0)
    assert reply.model == "many7" and reply.usage.completion_tokens == 4


def test_a_batch_with_refused_items_names_each_and_changes_nothing(
    server: Server, store: RegistryStore, root: Path, tmp_path: Path
):
    good = [write_adapter(root / f"good{i}", seed=100 + i, r=1) for i in range(3)]
    broken = write_adapter(root / "broken", seed=110, r=1)
    (broken / "adapter_model.safetensors").unlink()
    outside = write_adapter(tmp_path / "outside", seed=111, r=1)
    items = [
        {"name": "good0", "path": str(good[0])},
        {"name": "broken", "path": str(broken)},
        {"name": "good1", "path": str(good[1])},
        {"name": "outside", "path": str(outside)},
        {"name": "bad name", "path": str(good[2])},
        {"name": BASE, "path": str(good[2])},
        {"name": "good2", "path": str(good[2])},
        {"name": "tilde", "path": "~no-such-user-here/adapter"},
        {"name": "nul", "path": f"{root}/a\x00b"},
    ]
    before = state(server, store)
    status, answer = batch(server, items)
    assert status == 400
    message = refusal(answer)
    assert message.startswith("6 of 9 adapters refused, nothing changed: ")
    assert "adapters[1] 'broken': " in message and "no adapter_model.safetensors" in message
    assert "adapters[3] 'outside': adapter path" in message and "outside the allowed adapter roots" in message
    assert "adapters[4] 'bad name': invalid adapter name" in message
    assert f"adapters[5] {BASE!r}: {BASE!r} is the base model's id" in message
    assert "adapters[7] 'tilde': adapter path '~no-such-user-here/adapter' cannot be resolved" in message
    assert "adapters[8] 'nul': adapter path" in message and "null byte" in message
    assert "good" not in message
    assert state(server, store) == before
    # the single endpoint checks a path the same way (a path that cannot be resolved was a 500)
    r = server.admin("POST", "/admin/adapters", json={"name": "nul", "path": f"{root}/a\x00b"})
    assert r.status_code == 400 and "cannot be resolved" in r.json()["error"]["message"]


def test_duplicate_names_in_a_batch_are_refused(server: Server, store: RegistryStore, root: Path):
    first, second = write_adapter(root / "dup-a", seed=120, r=1), write_adapter(root / "dup-b", seed=121, r=1)
    items = [
        {"name": "dup", "path": str(first)},
        {"name": "other", "path": str(first)},
        {"name": "dup", "path": str(second)},
    ]
    before = state(server, store)
    status, answer = batch(server, items)
    assert status == 400
    expected = "1 of 3 adapters refused, nothing changed: adapters[2] 'dup': the same name as adapters[0]"
    assert refusal(answer) == expected
    assert state(server, store) == before


def test_names_already_served_are_a_409_unless_replaced(server: Server, store: RegistryStore, root: Path):
    path = write_adapter(root / "taken", seed=130, r=1)
    assert server.admin("POST", "/admin/adapters", json={"name": "taken", "path": str(path)}).status_code == 200
    items = [
        {"name": "fresh", "path": str(path)},
        {"name": "taken", "path": str(path)},
        {"name": "emoji", "path": str(path)},  # a demo adapter: served, but not through the API
    ]
    before = state(server, store)
    status, answer = batch(server, items)
    assert status == 409 and answer["error"]["code"] == "adapter_exists"
    message = refusal(answer)
    assert message.startswith("2 of 3 adapters refused, nothing changed: adapters[1] 'taken': already served")
    assert "adapters[2] 'emoji': already served" in message and '"replace": true' in message
    assert state(server, store) == before

    for item in items[1:]:
        item["replace"] = True
    status, answer = batch(server, items)
    assert status == 200, answer
    assert [(a["name"], a["version"]) for a in answer["data"]] == [("fresh", 1), ("taken", 2), ("emoji", 2)]
    assert store.get_adapter("taken").version == 2 and store.get_adapter("emoji").version == 2


def test_a_batch_above_the_limit_is_refused_and_long_refusals_are_cut(server: Server, store: RegistryStore):
    before = state(server, store)
    status, answer = batch(server, [{"name": f"x{i}", "path": "/nowhere"} for i in range(10_001)])
    assert status == 400
    assert refusal(answer) == "a batch holds at most 10000 adapters, got 10001; send it in several"

    status, answer = batch(server, [{"name": f"x{i}", "path": "/nowhere"} for i in range(10_000)])
    assert status == 400
    message = refusal(answer)
    assert message.startswith("10000 of 10000 adapters refused, nothing changed: adapters[0] 'x0': adapter path")
    assert message.count("outside the allowed adapter roots") == 20 and "adapters[19] 'x19'" in message
    assert "adapters[20]" not in message and message.endswith("; and 9980 more")
    assert state(server, store) == before


def test_a_pin_that_does_not_fit_undoes_the_whole_batch(server: Server, store: RegistryStore, root: Path):
    """Each adapter's pin fits alone (what the files' check sees), the sixteen together do not (the device's pinned
    share is 72 of 145 pages; a rank-16 adapter takes several): serving stops at the first that does not fit, and
    the batch is undone, in the engine and in the store."""
    paths = [write_adapter(root / f"pin{i}", seed=140 + i, r=16) for i in range(16)]
    listed, records, _ = state(server, store)
    status, answer = batch(server, [{"name": f"pin{i}", "path": str(p), "pinned": True} for i, p in enumerate(paths)])
    assert status == 400
    message = refusal(answer)
    assert message.startswith("1 of 16 adapters refused, nothing changed: adapters[")
    assert "pinned adapters may take" in message
    after, records_after, _ = state(server, store)
    assert after == listed and records_after == records
    status, answer = batch(server, [{"name": "pin0", "path": str(paths[0]), "pinned": True}])
    assert status == 200 and answer["data"][0]["pinned"]  # the pins the undone batch took are free again


# -- RegistrySync.catch_up ---------------------------------------------------------------------------------------------


def test_catch_up_brings_in_many_records_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """Forty records written by another replica: catch_up serves each at the store's version, path and pin, skips
    (and logs) the ones whose files cannot be served, leaves the process's own adapters alone, unloads API adapters
    the store no longer has, and reloads one recorded again with other files."""
    from lora_server.config import EngineConfig
    from lora_server.engine import Engine
    from lora_server.server.registry_sync import RegistrySync

    paths = [write_adapter(tmp_path / f"rec{i}", seed=200 + i, r=1) for i in range(40)]
    (paths[5] / "adapter_model.safetensors").unlink()
    records = [AdapterRecord(f"rec{i}", str(p), 1 + i % 3, i % 10 == 0, 1000.0 + i) for i, p in enumerate(paths)]
    records.append(AdapterRecord("gone", str(tmp_path / "nowhere"), 1, False, 1000.0))
    engine = Engine(EngineConfig(quantization="none", kv_cache_bytes=64 << 20, show_progress=False))
    engine.adapters.add("own", paths[0], source="command line")
    with open_store(tmp_path / "data") as store:
        store.put_adapters(records)
        sync = RegistrySync(store, engine, threading.Lock(), lambda: None)
        try:
            with caplog.at_level(logging.WARNING, logger="lora_server"):
                assert sync.catch_up() == 1
            refused = {r.getMessage().split()[2] for r in caplog.records if "could not be loaded" in r.getMessage()}
            assert refused == {"rec5", "gone"}
            expected = {r.name: r for r in records if r.name not in refused}
            assert set(engine.adapters.names()) == {*expected, "own"}
            for name, record in expected.items():
                info = engine.adapters.info(name)
                assert (info.path, info.version, info.pinned, info.source) == (
                    record.path,
                    record.version,
                    record.pinned,
                    "api",
                ), name
            assert engine.adapters.info("own").source == "command line"

            for name in ("rec1", "rec2", "rec3"):
                store.delete_adapter(name)
            store.put_adapter(AdapterRecord("rec4", str(paths[6]), 1, False, 2000.0))  # version 3 now
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="lora_server"):
                assert sync.catch_up() == 5
            assert set(engine.adapters.names()) == {*expected, "own"} - {"rec1", "rec2", "rec3"}
            info = engine.adapters.info("rec4")
            assert (info.path, info.version) == (str(paths[6]), 3)
            assert {r.getMessage().split()[2] for r in caplog.records} == {"rec5", "gone"}  # tried again, refused
        finally:
            sync.feed.close()
            engine.shutdown()
