"""Tenants share the engine fairly: the waiting line (engine.fair_queue) against orderings computed by hand
(weights 1:1 and 2:1, priorities, caps, preemption back to the front, idle tenants earn no credit, FIFO when fair
sharing is off), the scheduler with several tenants (caps, token shares by weight, integrity after every step),
the real engine on the embedded model (a tenant that floods the queue does not hold back one that comes later,
counted in engine steps, against the same run without fair sharing), and the real server through the openai
client: weight and cap round-trip through the admin API, a cap set there holds, priority is validated, and the
flood over HTTP."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import openai
import pytest

from lora_server.config import EngineConfig
from lora_server.engine import Engine, TenantShare
from lora_server.engine.fair_queue import FairQueue
from lora_server.engine.request import FinishReason, Request
from lora_server.engine.scheduler import Scheduler
from lora_server.errors import InvalidRequestError
from lora_server.kv_pool.unified_pool import PoolConfig, UnifiedPool
from lora_server.sampling_params import SamplingParams
from tests.scheduler_setup import scheduler_config
from tests.servers import BASE, Server

EOS = 2


def req(rid: str, tenant: TenantShare, prompt_len: int = 4, priority: int = 0, **params) -> Request:
    """A request whose arrival time is its number in ``rid`` order of creation (ties never depend on the clock)."""
    params.setdefault("max_tokens", 4)
    params.setdefault("ignore_eos", True)
    r = Request(
        rid,
        [10 + i for i in range(prompt_len)],
        SamplingParams(**params),
        eos_token_ids=(EOS,),
        tenant=tenant,
        priority=priority,
    )
    r.arrival_time = float(next(_clock))
    return r


_clock = iter(range(10**9))
A, B = TenantShare("a"), TenantShare("b")


def drain(queue: FairQueue, tokens: int = 4, running: dict[str, int] | None = None) -> list[str]:
    """Admit everything the queue lets through, one request at a time, each charged ``tokens``."""
    order = []
    while (r := queue.next(running or {})) is not None:
        queue.admit(r)
        queue.charge(r, tokens)
        order.append(r.request_id)
    return order


# ---- the waiting line, by hand ------------------------------------------------------------------------------------


def test_equal_weights_alternate():
    q = FairQueue()
    for i in range(4):
        q.push(req(f"a{i}", A))
    for i in range(4):
        q.push(req(f"b{i}", B))
    # counters (a, b): 0,0 -> a (earlier) 4,0 -> b 4,4 -> a (its head arrived first) 8,4 -> b ...
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    assert q.counters == {"a": 16.0, "b": 16.0} and not q


def test_weights_two_to_one():
    heavy = TenantShare("a", weight=2)
    q = FairQueue()
    for i in range(6):
        q.push(req(f"a{i}", heavy))
    for i in range(6):
        q.push(req(f"b{i}", B))
    # a pays 4/2 = 2 per admission, b pays 4: (a, b) 0,0 a 2,0 b 2,4 a 4,4 a 6,4 b 6,8 a 8,8 a 10,8 b 10,12 a
    # 12,12: a's line is empty, b takes the rest
    assert drain(q) == ["a0", "b0", "a1", "a2", "b1", "a3", "a4", "b2", "a5", "b3", "b4", "b5"]


def test_tokens_not_requests_are_shared():
    """A tenant of long prompts gets fewer admissions than one of short prompts, for the same tokens."""
    q = FairQueue()
    for i in range(3):
        q.push(req(f"long{i}", A, prompt_len=12))
    for i in range(6):
        q.push(req(f"short{i}", B, prompt_len=4))
    order = []
    while (r := q.next({})) is not None:
        q.admit(r)
        q.charge(r, r.num_prompt_tokens)
        order.append(r.request_id)
    # (a, b): 0,0 long0 12,0 short0 12,4 short1 12,8 short2 12,12 long1 (earlier) 24,12 short3 .. short5 24,24 long2
    assert order == ["long0", "short0", "short1", "short2", "long1", "short3", "short4", "short5", "long2"]


def test_priority_orders_within_a_tenant_only():
    q = FairQueue()
    q.push(req("a-p0", A, priority=0))
    q.push(req("a-p-1", A, priority=-1))
    q.push(req("b-p5", B, priority=5))
    q.push(req("a-p1", A, priority=1))
    q.push(req("a-p-1-later", A, priority=-1))
    # a's line: -1, -1 (by arrival), 0, 1; b's priority does not put it behind a's requests
    assert drain(q) == ["a-p-1", "b-p5", "a-p-1-later", "a-p0", "a-p1"]


def test_cap_of_running_requests():
    capped = TenantShare("a", max_running=2)
    q = FairQueue()
    for i in range(4):
        q.push(req(f"a{i}", capped))
    q.push(req("b0", B))
    running: Counter[str] = Counter({"a": 1})
    order = []
    while (r := q.next(running)) is not None:
        q.admit(r)
        q.charge(r, 4)
        running[r.tenant.name] += 1
        order.append(r.request_id)
    assert order == ["a0", "b0"] and running == {"a": 2, "b": 1}
    assert [r.request_id for r in q] == ["a1", "a2", "a3"]  # they wait for a's running ones to end
    running["a"] -= 1
    assert q.next(running).request_id == "a1"


def test_preempted_requests_go_back_to_the_front_of_their_tenants_line():
    q = FairQueue()
    reqs = {rid: req(rid, A) for rid in ("a0", "a1", "a2", "a3")}
    for r in reqs.values():
        q.push(r)
    b0 = req("b0", B, priority=-5)
    q.push(b0)
    q.admit(reqs["a0"])
    q.admit(reqs["a1"])
    q.charge(reqs["a0"], 4)
    q.charge(reqs["a1"], 4)
    # running [a0, a1]: the scheduler preempts the latest first, so a1 then a0 go back
    q.push_front(reqs["a1"])
    q.push_front(reqs["a0"])
    assert [r.request_id for r in q] == ["b0", "a0", "a1", "a2", "a3"]  # b's counter (0) is lower than a's (8)
    assert drain(q) == ["b0", "a0", "a1", "a2", "a3"]


def test_an_idle_tenant_earns_no_credit():
    q = FairQueue()
    for i in range(3):
        q.push(req(f"a{i}", A))
    assert drain(q, tokens=10) == ["a0", "a1", "a2"]
    # a computed 30 tokens alone; b, idle meanwhile, does not start at 0 but at the lowest waiting counter
    q.push(req("a3", A))
    q.push(req("b0", B))
    assert q.counters["b"] == 30.0  # a3 waits: b is lifted to the lowest waiting counter, a's 30
    q.remove(next(r for r in q if r.request_id == "a3"))
    q.push(req("b1", B))
    assert q.counters["b"] == 30.0
    q2 = FairQueue()
    for i in range(2):
        q2.push(req(f"a{i}", A))
    drain(q2, tokens=10)
    q2.push(req("b0", B))  # nobody waits: b starts where the last admission was (a1 admitted at counter 10)
    assert q2.counters == {"a": 20.0, "b": 10.0}


def test_fifo_when_fair_sharing_is_off():
    q = FairQueue(fair=False)
    ids = []
    for i, (tenant, prio) in enumerate([(A, 0), (A, 0), (B, -3), (A, -9), (TenantShare("c", max_running=1), 0)]):
        q.push(req(f"r{i}", tenant, priority=prio))
        ids.append(f"r{i}")
    assert drain(q, running={"c": 5}) == ids  # arrival order: no tenants, priorities or caps
    assert all(c == 0 for c in q.counters.values())  # nothing charged


def test_tenant_share_and_priority_are_validated():
    for bad in (0, -1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="weight"):
            TenantShare("a", weight=bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_running"):
            TenantShare("a", max_running=bad)


# ---- the scheduler with several tenants ---------------------------------------------------------------------------


def make_scheduler(fair: bool = True, max_num_seqs: int = 8, budget: int = 256, num_blocks: int = 256) -> Scheduler:
    pool = UnifiedPool(PoolConfig(num_blocks, 0, 4, block_bytes=1, policy="lru-unified"))
    config = scheduler_config(max_num_seqs, budget, 256, fair_sharing=fair)
    return Scheduler(config, pool)


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[Request, int]]:
    work = sched.schedule()
    sampled = {r.request_id: [token] for r, n in work.items if r.num_computed_tokens + n == r.num_tokens}
    sched.update(work, sampled)
    sched.check_integrity()
    return work.items


def test_scheduler_admits_in_fair_order_and_honours_caps():
    sched = make_scheduler(max_num_seqs=8)
    capped = TenantShare("a", max_running=3)
    for i in range(6):
        sched.add(req(f"a{i}", capped, prompt_len=4, max_tokens=3))
    for i in range(2):
        sched.add(req(f"b{i}", B, prompt_len=4, max_tokens=3))
    items = run_step(sched)
    # a0 (tie, earlier), b0, a1, b1, a2; then a is at its cap of 3 and b has nothing left
    assert [r.request_id for r, _ in items] == ["a0", "b0", "a1", "b1", "a2"]
    assert Counter(r.tenant.name for r in sched.running) == {"a": 3, "b": 2}
    run_step(sched)
    assert len(sched.running) == 5 and len(sched.waiting) == 3  # still capped while a's three decode
    run_step(sched)  # max_tokens 3: all five finish in this step
    assert not sched.running
    items = run_step(sched)
    assert [r.request_id for r, _ in items] == ["a3", "a4", "a5"]


def test_preempted_request_comes_back_first_in_its_tenants_line():
    # 6 blocks of 4 tokens: three requests of 8-token prompts fill 6 blocks; growing past them preempts
    sched = make_scheduler(max_num_seqs=3, num_blocks=6)
    for i in range(3):
        sched.add(req(f"a{i}", A, prompt_len=8, max_tokens=4))
    sched.add(req("b0", B, prompt_len=8, max_tokens=4))
    first = run_step(sched)
    assert [r.request_id for r, _ in first] == ["a0", "b0", "a1"]
    run_step(sched)  # the decodes need a third block each: a1, the latest admitted, is preempted
    waiting = [r.request_id for r in sched.waiting]
    assert waiting[0] == "a1" and waiting.index("a1") < waiting.index("a2")
    assert sched.num_preemptions >= 1


def test_backlogged_tenants_get_tokens_in_proportion_to_their_weights():
    """Two tenants that always have requests waiting: while both wait, the tokens computed for each follow their
    weights 2:1 (the reference is the weights themselves)."""
    sched = make_scheduler(max_num_seqs=6, budget=64)
    heavy = TenantShare("a", weight=2)
    rng = random.Random(0)
    n = 0
    served: Counter[str] = Counter()
    for _ in range(400):
        for tenant in (heavy, B):
            while sum(r.tenant.name == tenant.name for r in sched.waiting) < 4:
                n += 1
                sched.add(req(f"{tenant.name}{n}", tenant, prompt_len=rng.randint(2, 12), max_tokens=rng.randint(1, 6)))
        for r, tokens in run_step(sched):
            served[r.tenant.name] += tokens
    assert served["a"] / served["b"] == pytest.approx(2.0, rel=0.1)


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_tenants_keep_caps_and_integrity(seed):
    rng = random.Random(seed)
    sched = make_scheduler(max_num_seqs=5, budget=24, num_blocks=24)
    tenants = [TenantShare("a", weight=3), TenantShare("b", max_running=2), TenantShare("c", weight=0.5)]
    made: list[Request] = []
    for step_no in range(2000):
        if step_no < 200:
            for _ in range(rng.choice((0, 1, 2))):
                r = req(
                    f"q{len(made)}",
                    rng.choice(tenants),
                    prompt_len=rng.randint(1, 30),
                    priority=rng.randint(-2, 2),
                    max_tokens=rng.randint(1, 20),
                )
                sched.add(r)
                made.append(r)
        if sched.requests and rng.random() < 0.02:
            assert sched.abort(rng.choice(sorted(sched.requests))).finish_reason is FinishReason.ABORT
        if not sched.has_work():
            if step_no >= 200:
                break
            continue
        run_step(sched)
        assert sum(r.tenant.name == "b" for r in sched.running) <= 2  # admission never takes b past its cap
        assert len(sched.running) <= 5
    else:
        pytest.fail("the run did not drain")
    assert all(r.finished for r in made) and sched.num_preemptions > 0
    assert sched.pool.gpu.num_free == 24


# ---- the engine on the embedded model ----------------------------------------------------------------------------

A_REQUESTS, B_REQUESTS = 50, 5


def flood(fair: bool, max_steps: int) -> tuple[Engine, dict[str, int | None]]:
    """Tenant a queues 50 requests; after one step tenant b queues 5. Steps until each of b's has its first token
    (at most ``max_steps``); returns the engine and, for each of b's requests, the steps from its arrival to its
    first token (None: not yet)."""
    engine = Engine(
        EngineConfig(
            quantization="none",
            max_num_seqs=4,
            kv_cache_bytes=32 << 20,
            host_kv_bytes=0,
            fair_sharing=fair,
            show_progress=False,
        )
    )
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)  # each of a's runs 2 steps
    prompt = [1, 504, 3458, 282, 4195, 314]
    for _ in range(A_REQUESTS):
        engine.add(engine.make_request(prompt, params, tenant=TenantShare("a")))
    engine.step()
    b_ids = []
    for _ in range(B_REQUESTS):
        r = engine.make_request(prompt, params, tenant=TenantShare("b"))
        engine.add(r)
        b_ids.append(r.request_id)
    waits: dict[str, int | None] = dict.fromkeys(b_ids)
    for step in range(1, max_steps + 1):
        for out in engine.step():
            if out.request_id in waits and waits[out.request_id] is None and out.token_ids:
                waits[out.request_id] = step
        engine.check_integrity()
        if all(w is not None for w in waits.values()):
            break
    return engine, waits


@pytest.mark.slow
def test_a_flooding_tenant_does_not_hold_back_another():
    """4 run at once and each of a's requests takes 2 steps. With fair sharing b's five take half of the places
    freed by a's next rounds (b's counter starts at a's): by hand, b0 and b1 start in the 2nd step after arriving,
    b2 and b3 in the 4th, b4 in the 6th. Without it they wait for all 50 of a's: 25 rounds of 2 steps."""
    engine, fair_waits = flood(fair=True, max_steps=12)
    assert sorted(fair_waits.values()) == [2, 2, 4, 4, 6], fair_waits
    params = SamplingParams(max_tokens=2)
    for bad in (2**31, -(2**31) - 1, True, 1.5):  # the priority of a request is validated on the engine
        with pytest.raises(InvalidRequestError, match="priority"):
            engine.make_request([1, 2, 3], params, priority=bad)
    assert engine.make_request([1, 2, 3], params, priority=-(2**31)).priority == -(2**31)
    _, fifo_waits = flood(fair=False, max_steps=12)
    assert all(w is None for w in fifo_waits.values()), fifo_waits  # same run, arrival order: b still waits


# ---- the server, through the openai client -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fair")
    s = Server(root, [root], ["--max-num-seqs", "4", "--adapter", "", "--allow-anonymous"])
    yield s
    s.stop()


def make_tenant(server: Server, name: str, **share) -> str:
    r = server.admin("POST", "/admin/tenants", json={"name": name, "adapters": [], **share})
    assert r.status_code == 200, r.text
    return r.json()["api_key"]


@pytest.mark.slow
def test_weight_and_cap_round_trip_through_the_admin_api(server):
    r = server.admin("POST", "/admin/tenants", json={"name": "gold", "weight": 2.5, "max_running": 3})
    body = r.json()
    assert (body["weight"], body["max_running"]) == (2.5, 3)
    plain = server.admin("POST", "/admin/tenants", json={"name": "plain"}).json()
    assert (plain["weight"], plain["max_running"]) == (1.0, 0)  # defaults: equal shares, no cap
    r = server.admin("PATCH", "/admin/tenants/gold", json={"max_running": 0})
    assert r.status_code == 200 and (r.json()["weight"], r.json()["max_running"]) == (2.5, 0)
    got = server.admin("GET", "/admin/tenants/gold").json()
    assert (got["weight"], got["max_running"]) == (2.5, 0)
    listed = {t["name"]: (t["weight"], t["max_running"]) for t in server.admin("GET", "/admin/tenants").json()["data"]}
    assert listed["gold"] == (2.5, 0) and listed["plain"] == (1.0, 0)
    for bad in ({"weight": 0}, {"weight": -1}, {"weight": 1001}, {"weight": "2"}, {"max_running": -1}, {}, {"x": 1}):
        r = server.admin("PATCH", "/admin/tenants/gold", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = server.admin("POST", "/admin/tenants", json={"name": "bad", "weight": True})
    assert r.status_code == 400 and server.admin("GET", "/admin/tenants/bad").status_code == 404
    assert server.admin("PATCH", "/admin/tenants/nobody", json={"weight": 2}).status_code == 404
    got = server.admin("GET", "/admin/tenants/gold").json()
    assert (got["weight"], got["max_running"]) == (2.5, 0)  # the refused changes changed nothing


@pytest.mark.slow
def test_priority_is_validated(server):
    client = server.client()
    for bad in ("high", 1.5, 2**40, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=BASE, prompt="Hi", max_tokens=1, extra_body={"priority": bad})
        assert info.value.body["param"] == "priority"
    r = client.completions.create(model=BASE, prompt="Hi", max_tokens=1, extra_body={"priority": -3})
    assert r.usage.completion_tokens == 1


def spans(server: Server, tenant: str, key: str, n: int) -> list[tuple[float, float]]:
    """n streamed completions at once, read on one event loop: (first token's time, end's time) of each, sorted."""
    return asyncio.run(_spans(openai.AsyncOpenAI(base_url=f"{server.url}/t/{tenant}/v1", api_key=key), n))


async def _spans(client: openai.AsyncOpenAI, n: int) -> list[tuple[float, float]]:

    async def one() -> tuple[float, float]:
        first = None
        stream = await client.completions.create(
            model=BASE, prompt="Count: one, two,", max_tokens=6, temperature=0, stream=True
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.monotonic()
        assert first is not None
        return first, time.monotonic()

    async with client:
        return sorted(await asyncio.gather(*(one() for _ in range(n))))


@pytest.mark.slow
def test_a_cap_set_through_the_admin_api_holds(server):
    """Cap 1: a tenant's concurrent requests run one at a time (each starts after the one before ended: 5 steps
    later, against a slack of 0.05 s for reading two sockets); once the cap is lifted they run together."""
    key = make_tenant(server, "capped", max_running=1)
    capped = spans(server, "capped", key, 3)
    assert all(later[0] > earlier[1] - 0.05 for earlier, later in zip(capped, capped[1:], strict=False)), capped
    assert server.admin("PATCH", "/admin/tenants/capped", json={"max_running": 0}).status_code == 200
    free = spans(server, "capped", key, 3)
    assert free[-1][0] < free[0][1], free  # the last started before the first ended


@pytest.mark.slow
def test_a_flooding_tenant_does_not_hold_back_another_over_http(server):
    """Tenant heavy streams 50 requests at once, tenant light 5 a moment later (4 run at once): every one of
    light's requests has its first token while most of heavy's have not started; then heavy's are dropped."""
    keys = {name: make_tenant(server, name) for name in ("heavy", "light")}

    async def main() -> tuple[list[float], list[float | None]]:
        clients = {n: openai.AsyncOpenAI(base_url=f"{server.url}/t/{n}/v1", api_key=k) for n, k in keys.items()}
        async with clients["heavy"], clients["light"]:
            return await flood(clients)

    async def flood(clients: dict[str, openai.AsyncOpenAI]) -> tuple[list[float], list[float | None]]:
        async def first_token(name: str) -> float:
            """The time of the request's first token; it is read to its end."""
            first = None
            stream = await clients[name].completions.create(
                model=BASE, prompt="Count: one, two,", max_tokens=8, temperature=0, stream=True
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.monotonic()
            assert first is not None
            return first

        heavy = [asyncio.create_task(first_token("heavy")) for _ in range(50)]
        await asyncio.wait(heavy, return_when=asyncio.FIRST_COMPLETED)  # heavy's first round has ended
        light = await asyncio.gather(*(first_token("light") for _ in range(5)))
        started = [t.result() if t.done() else None for t in heavy]  # None: still running or waiting
        for t in heavy:
            t.cancel()
        await asyncio.gather(*heavy, return_exceptions=True)
        return light, started

    light, heavy_done = asyncio.run(main())
    # light's five ended (each ran 8 steps) while at least 30 of heavy's had not: arrival order would have served
    # all 50 of heavy's first
    assert sum(t is None for t in heavy_done) >= 30, heavy_done
    assert httpx.get(f"{server.url}/health").status_code == 200
