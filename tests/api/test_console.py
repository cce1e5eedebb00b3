"""The web console (#44 must-have 1) in a real headless Chromium against a 2-daemon ring:
the page shows both nodes and the plan's two stages; a chat message streams a reply equal to
the OpenAI API's greedy answer for the same messages; the stop button ends a long reply and
the ring frees the request; a third daemon joining and one being killed show without a
reload; the browser's console logs no error. Prints the page's load time and bytes, and the
path of a screenshot. Needs Debian's chromium and chromium-driver (`make system-deps`)."""

from __future__ import annotations

import shutil
import signal
import time

import httpx
import openai
import pytest
from conftest import keyed_cluster

from ringlet.daemon.ops.demo import LocalCluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs chromium and chromium-driver (apt; `make system-deps` as root)")
MODEL = "smollm2-135m"


def wait_for(what, check, timeout_s: float = 20.0, every_s: float = 0.1):
    """Poll ``check`` until it returns a true value. The page re-renders its cards as events
    arrive, so an element found in one call may be replaced before the next: a stale element
    (or one not yet there) is another poll, not a failure."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except (StaleElementReferenceException, NoSuchElementException):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000",
                "--disable-gpu", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def cards(driver) -> dict[str, str]:
    """node id -> the state its card shows."""
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#nodes .node')]"
        ".map(n => [n.dataset.nodeId, n.dataset.state]))")


def last_reply(driver) -> dict | None:
    return driver.execute_script(
        "const c = JSON.parse(localStorage.getItem('ringlet.conversations') || '[]')[0];"
        "const m = c && c.messages[c.messages.length - 1];"
        "return m && m.role === 'assistant' ? m : null;")


def usage_text(driver) -> str:
    """The usage line under the last assistant message."""
    return driver.execute_script(
        "const u = document.querySelectorAll('#messages .msg.assistant .usage');"
        "return u.length ? u[u.length - 1].innerText : '';")


def chat(driver, text: str) -> None:
    box = driver.find_element("id", "chat-input")
    box.send_keys(text)
    driver.find_element("id", "send").click()


def test_console_shows_the_ring_chats_and_follows_members(tmp_path, browser):
    driver = browser
    with LocalCluster(2, dtype="float32", dynamic=True) as c:
        c.wait_plan(stages=2)
        url = c.api_urls[0]
        started = time.monotonic()
        driver.get(url + "/")
        ids = {m["node_id"] for m in c.cluster_info(0)["members"]}
        wait_for("both nodes on the page", lambda: set(cards(driver)) == ids)
        stages = wait_for("the plan's two stages", lambda: driver.execute_script(
            "return [...document.querySelectorAll('#ring .stage')].map(s => s.dataset.nodeId)"))
        assert set(stages) == ids and len(stages) == 2
        # each node's memory used, the other one's from its own /v1/cluster through the node serving the page
        wait_for("both nodes' memory used", lambda: all(
            "memory – used" not in t and " MB used of " in t for t in driver.execute_script(
                "return [...document.querySelectorAll('#nodes .node')].map(n => n.innerText)")))
        timing = driver.execute_script(
            "const nav = performance.getEntriesByType('navigation')[0];"
            "const res = performance.getEntriesByType('resource');"
            "return {load_ms: nav.loadEventEnd - nav.startTime,"
            "        bytes: nav.transferSize + res.reduce((a, r) => a + r.transferSize, 0),"
            "        decoded: nav.decodedBodySize + res.reduce((a, r) => a + r.decodedBodySize, 0)};")
        print(f"\nconsole page: loaded in {timing['load_ms']:.0f} ms, {timing['bytes']} bytes transferred "
              f"({timing['decoded']} bytes decoded); nodes and ring shown {time.monotonic() - started:.2f} s after get")

        # a greedy chat reply equals the OpenAI API's for the same messages
        driver.execute_script(
            "for (const [id, v] of [['temperature', '0'], ['max-tokens', '24']]) {"
            "  const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event('change')); }")
        question = "What is the capital of France?"
        chat(driver, question)
        reply = wait_for("the streamed reply", lambda: (r := last_reply(driver)) and r.get("done") and r, 30)
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        want = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          temperature=0, max_tokens=24)
        assert reply["content"] == want.choices[0].message.content
        assert reply["usage"]["completion_tokens"] == want.usage.completion_tokens
        assert "cached" in usage_text(driver)
        # a second turn: the conversation so far comes from the prefix cache, and the page says so
        chat(driver, "And of Italy?")
        second = wait_for("the second reply", lambda: (r := last_reply(driver)) and r.get("done") and r is not None
                          and r["content"] != reply["content"] and r, 30)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and f"({cached} cached)" in usage_text(driver)

        # the stop button ends a long reply, and the ring frees the request
        driver.execute_script("const e = document.getElementById('max-tokens'); e.value = '2000';"
                              "e.dispatchEvent(new Event('change'));")
        chat(driver, "Write a very long story about a lighthouse keeper.")
        wait_for("the long reply streaming", lambda: len(driver.execute_script(
            "const m = document.querySelectorAll('#messages .msg.assistant .content');"
            "return m.length === 3 ? m[2].textContent : '';")) > 20, 30)
        # the ring's head (stage 0, whichever node it is) holds the request
        wait_for("the request in flight", lambda: sum(c.cluster_info(i)["requests_in_flight"] for i in (0, 1)) == 1, 5)
        wait_for("the page showing it in flight", lambda: driver.execute_script(
            "return document.getElementById('in-flight').dataset.count") == "1", 5)
        driver.find_element("id", "stop").click()
        stopped = wait_for("the stopped reply", lambda: (r := last_reply(driver)) and r.get("done") and r, 10)
        assert stopped["usage"]["stopped"] and stopped["usage"]["chunks"] > 0 and not stopped.get("error")
        wait_for("the ring to free the request",
                 lambda: all(c.cluster_info(i)["requests_in_flight"] == 0 for i in (0, 1)), 10)
        assert driver.find_element("id", "send").is_displayed()

        # a third daemon joins, then one is killed: the page follows without a reload
        marker = driver.execute_script("return window.ringletConsoleMarker = Math.random();")
        third = c.add_node()
        third_id = httpx.get(f"{c.api_urls[third]}/healthz", timeout=5).json()["node_id"]
        wait_for("the third node's card", lambda: cards(driver).get(third_id) not in (None, "gone"), 30)
        killed_id = httpx.get(f"{c.api_urls[1]}/healthz", timeout=5).json()["node_id"]
        c.kill(1)
        killed_at = time.monotonic()
        wait_for("the killed node shown gone", lambda: cards(driver).get(killed_id) == "gone", 30)
        print(f"a killed node shows as gone {time.monotonic() - killed_at:.1f} s after the kill")
        assert driver.execute_script("return window.ringletConsoleMarker") == marker  # no reload
        shot = tmp_path / "console.png"
        driver.save_screenshot(str(shot))
        driver.set_window_size(390, 844)  # a phone's width: one column, nothing wider than the screen
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        phone = tmp_path / "console-phone.png"
        driver.save_screenshot(str(phone))
        print(f"screenshots: {shot} {phone}")
        # read before the cluster stops: the page's live view then fails to reconnect, as it should
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors


def test_console_with_api_keys_asks_once_and_keeps_the_key(tmp_path, browser):
    """With keys set the page and its assets load without one; the live view wants the key:
    the page asks, keeps it in localStorage and sends it as a Bearer header, also after a reload."""
    key = "console-test-key-" + "c" * 24
    with keyed_cluster(tmp_path, key, dynamic=True) as c:
        url = c.api_urls[0]
        for path in ("/", "/console/console.js", "/console/console.css", "/console/vendor/marked.min.js",
                     "/console/vendor/dompurify.min.js"):
            assert httpx.get(url + path, timeout=10).status_code == 200, path
        assert httpx.get(url + "/v1/console/events", timeout=10).status_code == 401
        with httpx.stream("GET", url + "/v1/console/events", headers=c.api_headers, timeout=10) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"node_id"' in first
        node_id = c.cluster_info(0)["node_id"]
        driver = browser
        driver.get(url + "/")
        wait_for("the key form", lambda: driver.find_element("id", "key-form").is_displayed())
        driver.find_element("id", "key-input").send_keys(key)
        driver.find_element("css selector", "#key-form button").click()
        wait_for("the node with the key", lambda: node_id in cards(driver))
        assert driver.execute_script("return localStorage.getItem('ringlet.key')") == key
        driver.refresh()
        wait_for("the node after a reload", lambda: node_id in cards(driver))
        assert not driver.find_element("id", "key-form").is_displayed()
        # the one 401 before the key was given is the browser's note of a failed fetch, not a script error
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
        assert not errors, errors
        # the page's open live view does not hold a stopping node's drain (20 s by default)
        stopping = time.monotonic()
        c.kill(0, signal.SIGTERM)
        assert time.monotonic() - stopping < 8, "the console's live view held the node's stop"
