"""Tensor-parallel groups of real rank processes on 127.0.0.1 (MLX ring backend over loopback TCP).

- the default model (SmolLM2-135M, 9 heads / 3 kv heads) on 3 ranks, float32: greedy output equals
  the independent reference (first 20 tokens); on 2 ranks it is refused with the reason;
- tiny random llama / qwen3 models on 2 and 3 ranks: logits equal mlx-lm's single-process forward
  to 1e-4 relative error;
- failures: kill -9 a rank mid-stream (default model: falls back to one process; tiny 6-head
  model: re-planned on the 2 survivors), a rank that stops answering (SIGSTOP: heartbeat lost),
  a ring collective that never returns (step timeout, mlx issue #3862), the supervisor itself
  dying -- each request still completes with the undisturbed greedy output, and no rank process
  is left behind.

More ranks than cores use the poll shim (tests/tp_support.py): MLX's ring busy-waits otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from smollm2 import KV_DIM, LAYERS
from tp_support import alive, make_model, mlx_greedy, rank_env, wait_dead, worker_pids

from ringlet.daemon.engine.sampling import SamplingParams
from ringlet.daemon.tensor.group import TPGroup
from ringlet.daemon.tensor.planning.decision import TPRefused

pytestmark = pytest.mark.timeout(240)

FIRST = 20


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float = 180):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def collect(gen, on_token=None) -> list[int]:
    out = []
    async for tok in gen:
        out.append(tok)
        if on_token is not None:
            on_token(len(out))
    return out


def killer(group: TPGroup, rank: int, after: int, sig=signal.SIGKILL, record=None):
    """on_token callback: send ``sig`` to ``rank``'s process once ``after`` tokens arrived."""
    state = {"done": False}

    def on_token(n: int) -> None:
        if n == after and not state["done"]:
            state["done"] = True
            pid = group.rank_pids()[rank]
            if record is not None:
                record.append(pid)
            os.kill(pid, sig)

    return on_token


def assert_no_new_ranks(before: list[int]) -> None:
    """No rank process started by this test process is still running, except ``before``."""
    left = [p for p in worker_pids() if p not in before]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"rank processes left running: {left}"


# ------------------------------------------------------------------ the default model, 3 ranks


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def smol3(loop):
    group = TPGroup.local(None, 3, dtype="float32", extra_env=rank_env(3), step_timeout=60)
    run(loop, group.start(), 240)
    try:
        yield group
    finally:
        pids = list(group.rank_pids().values())
        run(loop, group.close())
        assert wait_dead(pids) == []
        assert_no_new_ranks([])


@pytest.fixture(scope="module")
def eos_ids(default_location):
    from ringlet.daemon.engine.model_info import load_tokenizer

    return sorted(load_tokenizer(default_location).eos_token_ids)


def test_default_model_on_three_ranks_matches_the_reference(smol3, loop, reference, eos_ids):
    info = smol3.info()
    assert (info["mode"], info["backend"], info["ranks"], info["size"], info["state"]) == (
        "tensor",
        "ring",
        ["rank0", "rank1", "rank2"],
        3,
        "ready",
    )
    assert (
        info["reason"]
        == "--mode tensor: 3 ranks over ring: loopback links form a ring rank0 -> rank1 -> rank2 -> rank0"
    )
    for case in reference:
        want = case["completion_ids"][:FIRST]
        got = run(loop, collect(smol3.generate(case["prompt_ids"], FIRST, stop_ids=eos_ids)))
        assert got == want, case["name"]


def test_three_ranks_keep_their_shards_of_a_turn_and_the_next_turn_prefills_only_its_new_tokens(
        smol3, loop, reference, eos_ids):
    """The group's prefix cache (rank 0 keeps the index, every rank its KV shards): a turn
    that extends the previous one reuses the KV of all but its last token and still equals
    the reference, which continues the same greedy sequence; another scope reuses nothing."""
    case = reference[0]  # raw_once: 4 prompt tokens, 40 reference completion tokens
    prompt, want = case["prompt_ids"], case["completion_ids"]
    mine = {"scope": "alice", "budget": 1 << 30}
    first: dict = {}
    assert run(loop, collect(smol3.generate(prompt, 10, stop_ids=eos_ids, prefix=mine, info=first))) == want[:10]
    assert first.get("cached_tokens") == 0
    # the first turn's cache holds its prompt and 9 generated tokens (the 10th was never fed)
    second: dict = {}
    got = run(loop, collect(smol3.generate(prompt + want[:10], 10, stop_ids=eos_ids, prefix=mine, info=second)))
    assert got == want[10:20]
    assert second.get("cached_tokens") == len(prompt) + 9
    other: dict = {}
    got = run(loop, collect(smol3.generate(prompt + want[:10], 10, stop_ids=eos_ids,
                                           prefix={"scope": "bob", "budget": 1 << 30}, info=other)))
    assert got == want[10:20] and other.get("cached_tokens") == 0
    stats = smol3.prefix_info
    assert (stats["hits"], stats["misses"], stats["ranks"]) == (1, 2, 3)
    # the second turn's entry replaced the first's (it extends it); bob's is its own
    assert stats["entries"] == 2 and stats["tokens"] == (len(prompt) + 19) * 2, stats
    # each rank keeps 1 of the 3 kv heads: keys and values, 30 layers, float32
    assert stats["bytes"] == stats["tokens"] * 2 * LAYERS * (KV_DIM // 3) * 4


def test_three_ranks_decode_speculatively_and_give_the_reference(smol3, loop, reference, eos_ids):
    """Speculative decoding in a tensor group: rank 0 feeds the latest token and the drafts
    of the caller's prediction, verifies them on every position's logits, and every rank
    drops the rejected ones. The prediction is the reference's own completion with three
    tokens changed at 12-14, so drafts are accepted, then rejected there (each rank's cache
    trimmed), then found again; the output is still the reference (transformers, fp32),
    token for token, with logprobs for every token, and the counts add up."""
    case = reference[0]  # raw_once: 40 reference completion tokens
    want = case["completion_ids"]
    prediction = [*want[:12], *(t + 1 for t in want[12:15]), *want[15:]]
    info: dict = {}
    spec = {"k": 6, "prediction": prediction, "measured": False}
    scope = {"scope": "spec", "budget": 1 << 30}
    tokens = run(loop, collect(smol3.generate(case["prompt_ids"], 30, SamplingParams(logprobs=2),
                                              stop_ids=eos_ids, prefix=scope, info=info, spec=spec)))
    assert [int(t) for t in tokens] == want[:30]
    assert all(t.logprob is not None and len(t.top) == 2 and t.logprob <= 0 for t in tokens)
    accepted, rejected, trips = info["drafts"]
    assert accepted >= 20 and rejected >= 1 and trips <= 9, info  # several tokens a step; the changed ones rejected
    # every rank's cache held exactly the accepted tokens: the turn it kept serves the next one
    second: dict = {}
    got = run(loop, collect(smol3.generate(case["prompt_ids"] + want[:30], 10, stop_ids=eos_ids, prefix=scope,
                                           info=second)))
    assert got == want[30:40] and second["cached_tokens"] == len(case["prompt_ids"]) + 29


def test_kill_a_rank_mid_stream_falls_back_to_one_process(smol3, loop, reference, eos_ids):
    """9 heads do not divide by the 2 survivors: the request resumes on one process."""
    case = reference[0]
    old = list(smol3.rank_pids().values())
    killed: list[int] = []
    got = run(
        loop,
        collect(smol3.generate(case["prompt_ids"], FIRST, stop_ids=eos_ids), killer(smol3, 1, after=6, record=killed)),
    )
    assert got == case["completion_ids"][:FIRST]
    info = smol3.info()
    assert (info["mode"], info["backend"], info["ranks"], info["size"], info["epoch"]) == (
        "pipeline",
        "none",
        ["rank0"],
        1,
        2,
    )
    assert "9 attention heads and 3 key/value heads do not divide by 2 ranks" in info["reason"]
    # first signal: rank 1's exit, its closed socket, or a survivor's "[ring] connection to a peer was lost"
    assert info["history"][-1]["lost"] == ["rank1"]
    assert wait_dead(old) == []  # the two survivors of the old group were killed, nothing hangs


def test_two_ranks_of_the_default_model_are_refused():
    before = worker_pids()
    group = TPGroup.local(None, 2, dtype="float32")
    with pytest.raises(TPRefused) as err:
        asyncio.run(group.start())
    assert str(err.value) == (
        "tensor mode refused: smollm2-135m: 9 attention heads and 3 key/value heads do not divide by 2 ranks; "
        "group sizes that work: 3"
    )
    assert group.state == "new" and group.rank_pids() == {} and worker_pids() == before
    asyncio.run(group.close())  # its work dir goes


# ------------------------------------------------------------------ tiny models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_tiny")
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = make_model(arch, root / arch)
        return cache[arch]

    return get


def mlx_forward(path: Path, ids: list[int]) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    out = model(mx.array([ids]))
    return np.array(out[0].astype(mx.float32))


PROMPT = [1, 40, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.mark.parametrize(("arch", "ranks"), [("llama", 2), ("qwen3", 2), ("llama6", 3), ("qwen3_gqa3", 3)])
def test_tiny_logits_match_single_process(tiny_dir, arch, ranks):
    before = worker_pids()
    path = tiny_dir(arch)
    want = mlx_forward(path, PROMPT)

    async def go():
        async with TPGroup.local(str(path), ranks, extra_env=rank_env(ranks)) as group:
            assert (group.info()["mode"], group.info()["size"]) == ("tensor", ranks)
            logits = await group.logits(PROMPT)
            sec = await group.allreduce_seconds(iters=20)
            assert 0 < sec < 0.5 and group.info()["epoch"] == 1  # the all-reduce probe runs in the live group
            return logits

    got = asyncio.run(asyncio.wait_for(go(), 120))
    assert_no_new_ranks(before)
    assert got.shape == want.shape == (len(PROMPT), 160)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-4, f"{arch} on {ranks} ranks: relative error {rel:.2e}"
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


def test_tiny_group_survives_kill_and_hang(tiny_dir):
    """3 ranks -> kill -9 rank 1 -> 2 ranks (rank0, rank2) -> SIGSTOP one -> 1 process; streams complete."""
    before = worker_pids()
    path = tiny_dir("llama6")
    prompts = [PROMPT, [1, 84, 104, 101, 32, 113, 117, 105, 99, 107]]
    # 48, not 24: after a stop at the 5th token rank 0 must still need the stopped rank (with 24
    # it once finished every token before the client took its 5th, and nothing was dropped)
    n = 48
    want = []
    for p in prompts:
        ids, margin = mlx_greedy(path, p, n)
        assert margin > 1e-3  # no near-ties: any correct split gives the same greedy ids
        want.append(ids)
    gone: list[int] = []

    async def go():
        group = TPGroup.local(str(path), 3, extra_env=rank_env(3), hb_timeout=2.0, step_timeout=20)
        await group.start()
        try:
            # two requests interleave step by step and each equals its single-process output
            both = await asyncio.gather(*(collect(group.generate(p, n)) for p in prompts))
            assert both == want
            first = list(group.rank_pids().values())
            got = await collect(group.generate(prompts[0], n), killer(group, 1, after=5, record=gone))
            assert got == want[0]
            info = group.info()
            assert (info["mode"], info["ranks"], info["size"], info["members"]) == (
                "tensor",
                ["rank0", "rank2"],
                2,
                ["rank0", "rank2"],
            )
            assert info["history"][-1]["lost"] == ["rank1"]
            assert wait_dead(first) == []
            # a rank that stops answering: its heartbeats stop, it is dropped
            second = list(group.rank_pids().values())
            got = await collect(group.generate(prompts[1], n), killer(group, 1, after=5, sig=signal.SIGSTOP))
            assert got == want[1]
            info = group.info()
            assert (info["mode"], info["ranks"], info["size"]) == ("pipeline", ["rank0"], 1)
            assert (
                info["history"][-1]["lost"] == ["rank2"]
                and "no heartbeat from rank(s) 1" in info["history"][-1]["failed"]
            )
            assert wait_dead(second) == []
            last = list(group.rank_pids().values())
        finally:
            await group.close()
        assert wait_dead(last) == []

    asyncio.run(asyncio.wait_for(go(), 180))
    assert_no_new_ranks(before)


def test_stalled_collective_restarts_the_group(tiny_dir):
    """A rank frozen inside the ring while heartbeats are still expected to arrive: the other ranks
    sit in one all_sum forever (mlx #3862); the step timeout tears the group down, the same members
    restart, and the request resumes."""
    before = worker_pids()
    path = tiny_dir("llama6")
    # 48 tokens, stopped after the 4th arrives: with 16, rank 0 (a tiny model, ms a token) once
    # produced them all before the client took its 4th from the stream, and nothing stalled
    want, _ = mlx_greedy(path, PROMPT, 48)

    async def go():
        # 3 s, not 1.5: the restarted group's first step (three fresh ranks warming up on two
        # cores) once took longer than 1.5 s and failed the group a second time
        group = TPGroup.local(str(path), 3, extra_env=rank_env(3), hb_timeout=60, step_timeout=3.0)
        await group.start()
        try:
            got = await collect(group.generate(PROMPT, 48), killer(group, 2, after=4, sig=signal.SIGSTOP))
            info = group.info()
            assert got == want
            assert (info["mode"], info["size"], info["epoch"], info["restarts"]) == ("tensor", 3, 2, 1)
            assert "stuck in one step for more than 3.0 s" in info["history"][-1]["failed"]
        finally:
            await group.close()

    asyncio.run(asyncio.wait_for(go(), 120))
    assert_no_new_ranks(before)


def test_losing_the_leader_rank_restarts_on_the_same_members(tiny_dir):
    """Rank 0 runs on this node: its process dying is a crash, not a lost member."""
    before = worker_pids()
    path = tiny_dir("llama")
    want, _ = mlx_greedy(path, PROMPT, 16)

    async def go():
        async with TPGroup.local(str(path), 2) as group:
            got = await collect(group.generate(PROMPT, 16), killer(group, 0, after=3))
            assert got == want
            # a tiny model may have finished the request before the kill landed: wait for the restart
            for _ in range(300):
                info = group.info()
                if info["epoch"] == 2 and info["state"] == "ready":
                    break
                await asyncio.sleep(0.1)
            assert (info["mode"], info["ranks"], info["epoch"], info["restarts"]) == (
                "tensor",
                ["rank0", "rank1"],
                2,
                1,
            )
            assert info["history"][-1]["lost"] == ["rank0"]

    asyncio.run(asyncio.wait_for(go(), 120))
    assert_no_new_ranks(before)


def test_a_model_the_ranks_cannot_load_fails_fast(tmp_path):
    from ringlet.daemon.tensor.group_errors import TPGroupError
    from ringlet.daemon.tensor.planning.inputs import TPModelSpec

    before = worker_pids()
    spec = TPModelSpec(num_heads=4, num_kv_heads=2, num_layers=4, total_bytes=10**6, name="missing")
    group = TPGroup.local(str(tmp_path / "no-such-model"), 2, spec=spec)
    t0 = time.monotonic()
    with pytest.raises(TPGroupError, match="rank could not load the model: ModelNotFound"):
        asyncio.run(asyncio.wait_for(group.start(), 60))
    asyncio.run(group.close())  # its work dir (the ranks' logs) goes
    assert time.monotonic() - t0 < 30 and group.info()["epoch"] == 1  # no restart loop
    assert_no_new_ranks(before)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_idle_ranks_use_no_cpu(tiny_dir):
    """MLX's ring busy-waits inside a collective; an idle group must not sit in one."""
    before = worker_pids()
    path = tiny_dir("llama")

    async def go():
        async with TPGroup.local(str(path), 2) as group:
            await collect(group.generate(PROMPT, 4))
            pids = list(group.rank_pids().values())
            await asyncio.sleep(0.3)
            start = {p: cpu_seconds(p) for p in pids}
            await asyncio.sleep(1.5)
            return {p: cpu_seconds(p) - start[p] for p in pids}

    used = asyncio.run(asyncio.wait_for(go(), 60))
    assert all(v < 0.25 for v in used.values()), used  # heartbeats only; a spinning rank would use ~1.5 s
    assert_no_new_ranks(before)


class CrashingLauncher:
    """Starts a process that exits at once instead of a rank."""

    async def start(self, node_id, argv, env, log_path):
        from ringlet.daemon.tensor.launch import LocalLauncher

        return await LocalLauncher().start(node_id, [sys.executable, "-c", "raise SystemExit(3)"], env, log_path)


def test_a_crash_loop_gives_up():
    from ringlet.daemon.tensor.group_errors import TPGroupError
    from ringlet.daemon.tensor.planning.inputs import TPModelSpec

    spec = TPModelSpec(num_heads=4, num_kv_heads=2, num_layers=4, total_bytes=10**6, name="crash")
    group = TPGroup.local("unused", 2, spec=spec, launcher=CrashingLauncher(), max_restarts=2)
    with pytest.raises(TPGroupError, match="single process failed 3 times: rank 0 \\(rank0\\) exited with code 3"):
        asyncio.run(asyncio.wait_for(group.start(), 60))
    asyncio.run(group.close())  # its work dir (the processes' logs) goes
    # 2 ranks: rank1's process died too, so member rank1 is lost -> 1 process, started 3 times in all
    assert [(h["size"], h["lost"]) for h in group.history] == [
        (2, ["rank0", "rank1"]),
        (1, ["rank0"]),
        (1, ["rank0"]),
        (1, ["rank0"]),
    ]


SUPERVISOR = """
import asyncio, json, sys
from ringlet.daemon.tensor.group import TPGroup
async def main():
    group = TPGroup.local(sys.argv[1], 2)
    await group.start()
    print(json.dumps(list(group.rank_pids().values())), flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_ranks_exit_when_the_supervisor_dies(tiny_dir):
    path = tiny_dir("llama")
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(path)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    pids: list[int] = []
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 2 and all(alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_dead(pids, 10) == []  # control socket closed -> each rank leaves at once
    finally:
        with_leftovers = [p for p in pids if alive(p)]
        for p in with_leftovers:
            os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
