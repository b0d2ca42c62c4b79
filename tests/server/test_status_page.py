"""/admin/ui in a real headless Chromium (Debian's package, driven by Playwright): the browser presents the admin
key by HTTP Basic, the page draws the pool, and what it shows equals what /admin/pool and /admin/tenants say."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from tests.servers import ADMIN, BASE, Server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# flags for a sandbox without a network or a display (the machine notes' probe used these)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("ui"), [], ["--allow-anonymous"])
    yield s
    s.stop()


def test_the_page_needs_the_admin_key(server):
    r = httpx.get(server.url + "/admin/ui")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    assert httpx.get(server.url + "/admin/ui", auth=("anyone", "wrong")).status_code == 401
    ok = httpx.get(server.url + "/admin/ui", auth=("anyone", ADMIN))
    assert ok.status_code == 200 and "lora-server status" in ok.text


@pytest.mark.slow
def test_the_page_shows_what_the_admin_api_says(server):
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), "chromium is missing: the test set-up installs it (.ci/setup --tests)"
    key = server.admin("POST", "/admin/tenants", json={"name": "acme", "adapters": ["upper"]}).json()["api_key"]
    for model, headers in ((BASE, {}), ("upper", {}), ("upper", {"Authorization": f"Bearer {key}"}), ("pirate", {})):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            headers=headers,
            timeout=120,
            json={"model": model, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 4},
        )
        assert r.status_code == 200
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(http_credentials={"username": "admin", "password": ADMIN}).new_page()
            page.goto(server.url + "/admin/ui")
            page.wait_for_function("document.getElementById('updated').textContent !== 'never'", timeout=30_000)
            assert page.text_content("#error") == ""
            shown = {
                "policy": page.text_content("#policy"),
                "gpu_free": int(page.text_content("#gpu_free")),
                "gpu_cached": int(page.text_content("#gpu_cached")),
                "kv_hit": page.text_content("#kv_token_hit_rate"),
                "device": [
                    [td.text_content() for td in tr.query_selector_all("td")]
                    for tr in page.query_selector_all("#device tbody tr")
                ],
                "tenants": [
                    [td.text_content() for td in tr.query_selector_all("td")]
                    for tr in page.query_selector_all("#tenants tbody tr")
                ],
            }
        finally:
            browser.close()
    pool = server.admin("GET", "/admin/pool").json()  # idle: the same figures the page read
    assert shown["policy"] == pool["policy"] == "tree-cost"
    assert (shown["gpu_free"], shown["gpu_cached"]) == (pool["gpu_free"], pool["gpu_cached"])
    assert shown["kv_hit"] == f"{100 * pool['kv_token_hit_rate']:.1f}%"
    on_device = {", ".join(a["names"]): a for a in pool["adapters"] if a["tier"] == "gpu"}
    assert {row[0] for row in shown["device"]} == set(on_device) >= {"<base>", "upper", "pirate"}
    for names, page, _, weights, kv_gpu, kv_host in shown["device"]:
        a = on_device[names]
        assert (-1 if page == "-" else int(page), int(weights), int(kv_gpu), int(kv_host)) == (
            a["table_page"],
            a["weight_blocks"],
            a["kv_blocks_gpu"],
            a["kv_blocks_host"],
        )
    assert on_device["upper"]["kv_blocks_gpu"] > 0  # its requests' prompts stayed cached under it
    usage = server.admin("GET", "/admin/tenants/acme").json()["usage"]["upper"]
    assert shown["tenants"] == [
        ["acme", "upper", str(usage["requests"]), str(usage["prompt_tokens"]), str(usage["completion_tokens"])]
    ]


@pytest.mark.slow
def test_the_page_works_opened_with_the_key_in_its_url(server):
    """http://user:KEY@host/admin/ui: Chromium refuses a fetch of a relative URL from a page whose URL carries
    credentials, and the page stayed empty; it fetches from its origin (no credentials in it), and the browser
    sends the ones it was given for /admin."""
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), "chromium is missing: the test set-up installs it (.ci/setup --tests)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(server.url.replace("http://", f"http://admin:{ADMIN}@") + "/admin/ui")
            page.wait_for_function(
                "document.getElementById('updated').textContent !== 'never' || "
                "document.getElementById('error').textContent !== ''",
                timeout=30_000,
            )
            error, policy = page.text_content("#error"), page.text_content("#policy")
        finally:
            browser.close()
    assert error == "" and policy == server.admin("GET", "/admin/pool").json()["policy"]
