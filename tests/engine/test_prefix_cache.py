"""The prefix cache across a ring, on real daemons, the bundled model in float32, and the
official ``openai`` client.

Expected values: a turn that hits the cache must give the tokens the same request gives
with nothing cached (a cold scope, a cold store, or no store at all), and report as
cached at least the previous prompt's length minus one (the issue's rule: the previous
turn's prompt and answer are in the store, but for the answer's last token, which no
stage computed). KV bytes per cached token are written by hand from the model's shape
(SmolLM2-135M: 3 KV heads of 64, float32): 2 x 3 x 64 x 4 = 1,536 bytes per layer.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from ringlet.daemon.ops.demo import LocalCluster

KV_BYTES_PER_TOKEN_PER_LAYER = 2 * 3 * 64 * 4
#: API keys (each a scope of its own). The tests that share a cluster (:func:`keyed`) use
#: keys of their own: a test's "cold" key has cached nothing, whatever ran before.
KEYS = tuple(f"test-key-{i}-" + "k" * 24 for i in range(12))
#: The system prompt of the equality tests (~150 tokens: a cold prefill of it costs a
#: third of the issue's 500-token one; the sharing test uses a 500-token prompt of its own).
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely about topic number {i}." for i in range(10))
QUESTIONS = ("What is the capital of France?", "And of Italy?", "And of Spain?", "And of Germany?", "And of Japan?")


def _keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text("\n".join(KEYS) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """``keyed(stages)``: a static cluster of that many float32 stages with API keys
    (:data:`KEYS`), started on first use and shared by this module's tests (a cluster
    start costs more than most of these tests)."""
    keys = _keys_file(tmp_path_factory.mktemp("keys"))
    started: dict[int, LocalCluster] = {}

    def get(stages: int) -> LocalCluster:
        if stages not in started:
            c = LocalCluster(stages, dtype="float32", extra_args=["--api-key-file", str(keys)])
            started[stages] = c.start()
        return started[stages]

    try:
        yield get
    finally:
        for c in started.values():
            c.stop()


def _client(cluster: LocalCluster, key: str = "none", node: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.api_urls[node] + "/v1", api_key=key, max_retries=0, timeout=300)


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int = 10) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of one greedy chat turn."""
    r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=max_tokens, temperature=0)
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content, r.usage.prompt_tokens, (details.cached_tokens if details else 0)


def prefix_info(cluster: LocalCluster, i: int, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{cluster.api_urls[i]}/v1/cluster", timeout=10, headers=headers).json()["prefix_cache"]


def settled_info(cluster: LocalCluster, i: int, key: str, done, timeout_s: float = 15.0) -> dict:
    """Stage ``i``'s prefix-cache figures once ``done(info)`` holds: a request's KV enters
    the store (and evicts, writing to the disk tier) just after its reply is sent, so
    figures read at once may show that work half done. The last figures if it never does."""
    deadline = time.monotonic() + timeout_s
    while not done(info := prefix_info(cluster, i, key)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return info


@pytest.mark.parametrize("stages", [1, 3])  # a first, middle and last stage; 2 stages: the tests below
def test_hits_equal_cold_answers_and_scopes_keep_keys_apart(stages, keyed):
    """Three turns of one conversation (key A) against the same requests, each under a key
    that has cached nothing: equal answers; A's turns after the first are hits; a cold
    key's request sees none of A's entries (per-key scope)."""
    c = keyed(stages)
    a = _client(c, KEYS[0])
    messages = [{"role": "system", "content": SYSTEM}]
    previous = 0
    for turn, question in enumerate(QUESTIONS[:3]):
        messages.append({"role": "user", "content": question})
        warm, prompt_tokens, cached = ask(a, messages)
        cold, _, cold_cached = ask(_client(c, KEYS[1 + turn]), messages)
        assert warm == cold, f"turn {turn}: {warm!r} != {cold!r}"
        assert cold_cached == 0  # A's entries are not another key's
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= previous - 1, (turn, cached, previous)
        previous = prompt_tokens
        messages.append({"role": "assistant", "content": warm})
    for i in range(stages):
        info = prefix_info(c, i, KEYS[0])
        assert info["entries"] >= 1 and info["hits"] >= 1
        layers = info["layer_range"][1] - info["layer_range"][0]
        assert info["bytes"] == info["tokens"] * layers * KV_BYTES_PER_TOKEN_PER_LAYER  # compact: no padding


def test_two_conversations_sharing_a_system_prompt_keep_their_own_entries(keyed):
    """5 turns of two conversations, interleaved, sharing a ~500-token system prompt: every
    turn after each conversation's first reports at least its previous prompt length - 1
    as cached, and the streamed usage chunk says the same as the non-streamed answer."""
    system = " ".join(f"Guideline {i}: be concise and exact when asked about subject {i}." for i in range(36))
    c = keyed(3)
    before = [prefix_info(c, i, KEYS[4])["entries"] for i in range(3)]
    client = _client(c, KEYS[4], node=1)  # any node takes the API calls
    convs = {name: [{"role": "system", "content": system}] for name in ("x", "y")}
    previous = {"x": 0, "y": 0}
    for turn in range(5):
        for name, messages in convs.items():
            topic = "France Italy Spain Germany Japan".split()[turn] if name == "x" else f"{turn + 2} + {turn}"
            messages.append({"role": "user", "content": f"Tell me about {topic}."})
            answer, prompt_tokens, cached = ask(client, messages, max_tokens=8)
            assert prompt_tokens > 480 or turn > 0
            if turn > 0:
                assert cached >= previous[name] - 1, (name, turn, cached, previous[name])
            previous[name] = prompt_tokens
            messages.append({"role": "assistant", "content": answer})
    # the streamed usage chunk reports the cached tokens too (a repeat of the last turn)
    stream = client.chat.completions.create(model="smollm2-135m", messages=convs["x"][:-1], max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= previous["x"] - 1
    added = [prefix_info(c, i, KEYS[4])["entries"] - before[i] for i in range(3)]
    assert all(n >= 2 for n in added), added  # one per conversation (and the repeat's), not one overwritten


def test_the_store_keeps_to_its_budget_and_zero_holds_nothing():
    """Distinct prompts through a store of 5 MB per stage (an entry of 100-200 tokens x 15
    layers x 1,536 bytes is 2.3-4.6 MB): never more than that is held (LRU evictions
    instead); a budget of 0 holds nothing and reports no cached tokens."""
    budget = 5_000_000
    words = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot")
    prompts = [f"{w} request: " + " ".join(f"item {n}-{k}" for k in range(20 + 5 * n)) for n, w in enumerate(words)]
    with LocalCluster(2, dtype="float32", extra_args=["--prefix-cache-bytes", str(budget)]) as small, \
            LocalCluster(2, dtype="float32", extra_args=["--prefix-cache-bytes", "0"]) as off:
        for prompt in prompts:  # no two share a first token: nothing to reuse
            r = _client(small).completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, temperature=0)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
            for i in range(2):
                info = prefix_info(small, i)
                assert info["budget_bytes"] == budget and info["bytes"] <= budget, info
        for i in range(2):
            info = prefix_info(small, i)
            assert info["evictions"] > 0 and info["entries"] >= 1, info
        for prompt in (prompts[0], prompts[0] + " and more"):  # the same conversation twice: still nothing
            r = _client(off).completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, temperature=0)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        for i in range(2):
            info = prefix_info(off, i)
            assert info["entries"] == 0 and info["bytes"] == 0 and info["budget_bytes"] == 0


def test_a_restarted_stage_falls_back_then_hits_again(keyed):
    """kill -9 of the middle stage of 3, restarted empty, while a conversation goes on:
    stage 0 still offers its cached prefix, the restarted stage lacks it, and the request
    is prefilled again from what every stage holds (nothing): the answer equals the cold
    one. The turn after is a hit again. (The last test on the shared 3-stage cluster.)"""
    c = keyed(3)
    a, b = _client(c, KEYS[5]), _client(c, KEYS[6])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    answer, previous, _ = ask(a, messages)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]
    os.killpg(c.procs[1].pid, signal.SIGKILL)
    c.procs[1].wait(timeout=30)
    c.restart(1)
    warm, prompt_tokens, cached = ask(a, messages)
    cold, _, _ = ask(b, messages)
    assert warm == cold
    assert cached == 0  # the restarted stage held nothing: the ring fell back to no prefix
    assert prefix_info(c, 1, KEYS[5])["misses"] >= 1
    messages += [{"role": "assistant", "content": warm}, {"role": "user", "content": QUESTIONS[2]}]
    _, _, cached = ask(a, messages)
    assert cached >= prompt_tokens - 1


def test_a_join_keeps_answers_equal_and_hits_resume(tmp_path):
    """A conversation on 2 negotiated daemons; a third joins (a new plan moves layer
    ranges: each stage keeps the layers it still holds and fetches the ones it gained
    from their old holders, the new member included). The next turn equals the cold
    answer and already reuses the first turn; the one after is a hit again."""
    keys = _keys_file(tmp_path)
    c = LocalCluster(2, dtype="float32", dynamic=True, extra_args=["--api-key-file", str(keys)])
    c.api_headers = {"Authorization": f"Bearer {KEYS[0]}"}
    with c:
        a, b = _client(c, KEYS[0]), _client(c, KEYS[1])
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        answer, first_tokens, _ = ask(a, messages)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]
        c.add_node()
        c.wait_plan(stages=3, timeout_s=90)
        warm, prompt_tokens, cached = ask(a, messages)
        assert warm == ask(b, messages)[0]
        # the first turn's entry moved with its layers: the new member got its share
        assert cached >= first_tokens, (cached, first_tokens)
        messages += [{"role": "assistant", "content": warm}, {"role": "user", "content": QUESTIONS[2]}]
        _, _, cached = ask(a, messages)
        assert cached >= prompt_tokens - 1


def test_concurrent_requests_extending_one_prefix_equal_their_solo_answers(keyed):
    """Two requests at once extend the same cached conversation with different questions
    (their decode steps batch on every stage): each equals the same request alone under a
    cold key, and neither changes the shared entry (a third, later, still hits it)."""
    c = keyed(2)
    a, b = _client(c, KEYS[7]), _client(c, KEYS[8])
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    answer, prompt_tokens, _ = ask(a, base)
    base.append({"role": "assistant", "content": answer})
    branches = [base + [{"role": "user", "content": q}] for q in (QUESTIONS[1], QUESTIONS[3])]
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        results[i] = ask(a, branches[i], max_tokens=12)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i in range(2):
        warm, _, cached = results[i]
        assert cached >= prompt_tokens - 1
        assert warm == ask(b, branches[i], max_tokens=12)[0]
    time.sleep(0.2)
    assert ask(a, branches[0], max_tokens=12)[2] >= prompt_tokens - 1


def test_an_entry_spilled_to_disk_serves_hits_also_after_every_daemon_restarts(tmp_path):
    """2 stages whose memory holds one conversation's entry, with a disk tier. B's first
    turn evicts A's entry to disk; A's next turn is a hit served from the files (equal to
    the cold answer); both daemons stop (SIGTERM: the entries in memory are written out
    too) and start again, empty in memory: A's third turn is a hit again, from disk."""
    keys = _keys_file(tmp_path)
    per_token = 15 * KV_BYTES_PER_TOKEN_PER_LAYER  # one stage's 15 layers
    args = ["--api-key-file", str(keys), "--prefix-cache-bytes", str(300 * per_token),  # one ~190-token entry
            "--prefix-cache-disk-bytes", "200MB"]
    with LocalCluster(2, dtype="float32", extra_args=args) as c:
        a, b = _client(c, KEYS[0]), _client(c, KEYS[1])
        conv_a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        conv_b = [{"role": "system", "content": SYSTEM + " Be terse."}, {"role": "user", "content": QUESTIONS[3]}]
        answer, first_a, _ = ask(a, conv_a)
        ask(b, conv_b)  # A's entry is evicted from memory for B's: it goes to disk
        for i in range(2):
            info = settled_info(c, i, KEYS[0], lambda f: f["entries"] == 1 and f["disk"]["entries"] >= 1)
            assert info["entries"] == 1 and info["disk"]["entries"] >= 1, info
        conv_a += [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[1]}]
        warm, second_a, cached = ask(a, conv_a)
        assert cached >= first_a - 1
        assert all(prefix_info(c, i, KEYS[0])["disk"]["hits"] >= 1 for i in range(2))
        assert warm == ask(_client(c, KEYS[2]), conv_a)[0]

        for i in range(2):
            c.kill(i, signal.SIGTERM)
        for i in range(2):
            c.restart(i)
        for i in range(2):
            info = prefix_info(c, i, KEYS[0])
            assert info["entries"] == 0 and info["disk"]["entries"] >= 2, info
        conv_a += [{"role": "assistant", "content": warm}, {"role": "user", "content": QUESTIONS[2]}]
        warm, _, cached = ask(a, conv_a)
        assert cached >= second_a - 1
        assert warm == ask(_client(c, KEYS[3]), conv_a)[0]
