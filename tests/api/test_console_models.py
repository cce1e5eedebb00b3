"""The web console of a node serving several models (#45), in a real headless Chromium: the
page lists each model in priority order with its state and ring (the stages named after the
machine), and the chat's model picker offers every id and alias of ``/v1/models``; a chat
with an alias gets the reply of the model it names (the OpenAI API's greedy answer for it).
Needs Debian's chromium and chromium-driver (`make system-deps`)."""

from __future__ import annotations

import time

import openai
import test_console
from test_console import MODEL, last_reply, pytestmark, wait_for  # noqa: F401 - pytestmark: skip without chromium
from tiny_models import CONFIGS, make_chat_model

from ringlet.daemon.ops.demo import LocalCluster

browser = test_console.browser  # the headless Chromium (a fixture)


def models_shown(driver) -> list[list[str]]:
    """[key, state, text] of each model the page lists, in its order."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#models .model')].map(e => [e.dataset.key, e.dataset.state,"
        " e.innerText])")


def test_console_lists_each_models_ring_and_chats_with_the_picked_one(tmp_path, browser):
    driver = browser
    tiny = make_chat_model("llama", tmp_path / "tiny-llama", {**CONFIGS["llama"], "vocab_size": 98})
    started = time.monotonic()
    with LocalCluster(1, dynamic=True, dtype="float32", extra_args=[
            "--model", MODEL, "--model", str(tiny), "--model-alias", "haiku=tiny-llama"]) as c:
        url = c.api_urls[0]
        machine = c.cluster_info(0)["members"][0]["name"]
        driver.get(url + "/")
        shown = wait_for("both models serving on the page", lambda: (m := models_shown(driver)) and len(m) == 2
                         and all(state == "serving" for _, state, _ in m) and m, 60)
        print(f"\nboth models listed {time.monotonic() - started:.1f} s after the start")
        assert [key for key, _, _ in shown] == [MODEL, "tiny-llama"]
        first, second = (text for _, _, text in shown)
        assert first.startswith(f"1 · {MODEL}") and "[0, 30)" in first and "offered all" in first
        # the second model's ring has its own node id: its stage is named after the machine
        assert second.startswith("2 · tiny-llama (haiku)") and f"ring: {machine} " in second and "[0, 4)" in second
        assert driver.execute_script("return document.getElementById('ring-model').textContent") == f"of {MODEL}"

        options = wait_for("the model picker", lambda: driver.execute_script(
            "const p = document.getElementById('model-pick');"
            "return p.hidden ? null : [...p.options].map(o => o.value)"))
        assert options == [MODEL, "tiny-llama", "haiku"]
        driver.execute_script(
            "for (const [id, v] of [['temperature', '0'], ['max-tokens', '8'], ['model-pick', 'haiku']]) {"
            "  const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event('change')); }")
        driver.find_element("id", "chat-input").send_keys("hi")
        driver.find_element("id", "send").click()
        reply = wait_for("the reply", lambda: (r := last_reply(driver)) and r.get("done") and r, 30)
        assert not reply.get("error"), reply
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        want = oa.chat.completions.create(model="haiku", messages=[{"role": "user", "content": "hi"}],
                                          temperature=0, max_tokens=8)
        assert reply["content"] == want.choices[0].message.content
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    print(f"test body {time.monotonic() - started:.1f} s")
