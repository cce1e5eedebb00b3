"""The dashboard's frame (pure rendering at 80x24 and wide), its event tracking, and the
live loop (in-place redraws at 2 Hz+, log lines routed above the display)."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import sys

import pytest
from rich.console import Console
from test_status import FakeNode, batched_infos, batching_of, studio_infos, today_info

from ringlet.daemon.ops.dashboard import live
from ringlet.daemon.ops.dashboard.events import EventTracker
from ringlet.daemon.ops.dashboard.frame import render
from ringlet.daemon.ops.dashboard.live import DEFAULT_INTERVAL_S, live_dashboard, run_live
from ringlet.daemon.ops.dashboard.widgets import layer_bar
from ringlet.daemon.ops.format import fmt_bandwidth, fmt_bytes, fmt_pair, fmt_seconds, fmt_ts
from ringlet.daemon.ops.status.snapshot import build_snapshot

GIB = 1 << 30


def frame(snap: dict, width: int, height: int | None = None, **kw) -> list[str]:
    console = Console(record=True, width=width, height=height or 200, file=io.StringIO())
    console.print(render(snap, height=height, **kw))
    return console.export_text().splitlines()


def studios(n_events: int = 3, recent: int = 2) -> dict:
    infos = studio_infos()
    base = infos["http://10.0.0.1:8000"]
    base["members"][3].update(state="loading", loading_progress=0.45)
    base["members"][2]["state"] = "suspect"
    base["events"] = [{"ts": 1_700_000_000 + k, "kind": "join", "message": f"event {k}"} for k in range(n_events)]
    base["recent_requests"] = [{"request_id": f"req{k:05d}", "prompt_tokens": 10 + k, "completion_tokens": 100,
                                "ttft_s": 0.4, "tokens_per_s": 30.0 + k} for k in range(recent)]
    return build_snapshot("http://10.0.0.1:8000", infos, {}, now=1_700_000_100)


def node_line(lines: list[str], name: str) -> str:
    found = [ln for ln in lines if re.search(rf"(^|\s){re.escape(name)}(\s|$)", ln) and not ln.startswith("ring:")]
    assert found, f"{name} not drawn"
    return found[0]


def test_four_studios_at_80x24_fit_and_say_everything():
    snap = studios(n_events=12, recent=6)
    lines = frame(snap, 80, 24)
    assert len(lines) <= 24, "\n".join(lines)
    assert all(len(ln) <= 80 for ln in lines)
    text = "\n".join(lines)
    assert "epoch 7" in text and "80 layers" in text and "Llama-3.3-70B" in text
    for n in snap["nodes"]:
        line = node_line(lines, n["name"])
        assert f"[{n['layer_range'][0]}, {n['layer_range'][1]})" in line  # range on the node's own line
    assert "loading 45%" in text and "suspect" in text
    assert "▼ TB 40 Gb/s 210 µs" in text and "↩ studio-1" in text  # hops, and the return to stage 0
    assert "90/512 GiB" in text and "Apple M3 Ultra" in text
    assert "policy balanced" in text and "mode pipeline" in text and "31.5 tok/s" in text
    assert "req00005" in text  # newest request first
    assert "event 11" in text  # the latest events fit
    assert "total 2.0 TiB" in text and "usable 1.9 TiB" in text


def test_wide_one_line_per_node_with_every_column():
    snap = studios()
    for width in (120, 160, 220):
        lines = frame(snap, width)
        assert all(len(ln) <= width for ln in lines)
        for n in snap["nodes"]:
            line = node_line(lines, n["name"])
            assert "Apple M3 Ultra" in line and f"{n['memory_used_bytes'] // GIB}/512 GiB" in line
            assert f"[{n['layer_range'][0]}, {n['layer_range'][1]})" in line and "31.5" in line
    lines = frame(snap, 160)
    assert "▼ thunderbolt · 40 Gb/s · RTT 210 µs" in node_line(lines, "studio-1")
    assert "↩ studio-1 · thunderbolt" in node_line(lines, "studio-4")
    assert "loading 45% ██" in node_line(lines, "studio-4")
    assert "negotiation idle" in lines[0] and "2/4 ready" in lines[0]


def test_many_nodes_at_80x24_switch_to_one_line_per_node():
    infos = {f"http://a{i}": today_info(i, n=8, layers=64) for i in range(8)}
    snap = build_snapshot("http://a0", infos, {})
    lines = frame(snap, 80, 24)
    assert len(lines) <= 24
    for n in snap["nodes"]:
        assert f"[{n['layer_range'][0]}, {n['layer_range'][1]})" in node_line(lines, n["name"])


def test_batch_per_stage_at_80x24_under_the_tokens_per_s():
    snap = build_snapshot("http://a0", batched_infos(), {}, now=1_700_000_100)
    lines = frame(snap, 80, 24)
    assert len(lines) <= 24 and all(len(ln) <= 80 for ln in lines)
    assert lines[1].endswith("3/3 ready · in flight 3 · 7.5 tok/s")
    second = [ln for ln in lines if ln.startswith("   — ")]  # a stage's second line (no chip reported)
    assert [ln.split("  ")[-1].strip() for ln in second] == ["batch 2.4/8", "batch 12/16", "batch —"]
    assert second[0].endswith("▼ hop 410 µs                   batch 2.4/8")
    assert second[2].endswith("↩ 127.0.0.1:7100 · hop 400 µs      batch —")  # the older node


def test_batch_column_in_the_wide_layout():
    snap = build_snapshot("http://a0", batched_infos(), {}, now=1_700_000_100)
    for width in (120, 160, 220):
        lines = frame(snap, width)
        assert all(len(ln) <= width for ln in lines)
        header = next(ln for ln in lines if ln.lstrip().startswith("# node"))
        assert re.search(r" tok/s batch hop to next stage", header), header
        assert re.search(r" 7\.5 2\.4/8 ▼ hop 410 µs", node_line(lines, "127.0.0.1:7100"))
        assert re.search(r" 7\.5 12/16 ▼ hop 420 µs", node_line(lines, "127.0.0.1:7101"))
        assert re.search(r" 7\.5     — ↩ 127\.0\.0\.1:7100", node_line(lines, "127.0.0.1:7102"))
        assert "in flight 3 · 7.5 tok/s" in lines[0]


def test_batch_column_when_many_nodes_take_one_line_each_at_80x24():
    infos = {f"http://a{i}": today_info(i, n=8, layers=64, batching=batching_of(1.0 + i if i < 7 else None, 1))
             for i in range(8)}
    del infos["http://a3"]["batching"]  # an older daemon
    snap = build_snapshot("http://a0", infos, {})
    lines = frame(snap, 80, 24)
    assert len(lines) <= 24 and all(len(ln) <= 80 for ln in lines)
    for n in snap["nodes"]:
        line = node_line(lines, n["name"])
        assert f"[{n['layer_range'][0]}, {n['layer_range'][1]})" in line
        want = "batch —" if n["stage"] in (3, 7) else f"batch {1.0 + n['stage']:.1f}/8"
        assert re.search(rf"0\.0 tok/s +{re.escape(want)}$", line), line


def test_layer_bars_tile_the_depth():
    for depth in (1, 7, 30, 80, 126):
        for width in (5, 17, 40):
            for n in range(1, min(depth, width) + 1):
                cuts = [round(i * depth / n) for i in range(n + 1)]
                if any(cuts[i + 1] - cuts[i] < depth / width for i in range(n)):
                    continue  # a range thinner than a cell is drawn as one cell (below)
                filled = [0] * width
                for i in range(n):
                    bar = layer_bar([cuts[i], cuts[i + 1]], depth, width, "cyan").plain
                    assert len(bar) == width
                    for k, ch in enumerate(bar):
                        filled[k] += ch == "━"
                assert filled == [1] * width, (depth, width, n)
    assert layer_bar([3, 4], 126, 10, "cyan").plain.count("━") == 1
    assert layer_bar(None, 30, 8, "cyan").plain == "········"


def test_missing_fields_are_dashes():
    snap = build_snapshot("http://a", {"http://a": {"plan": [{"address": "h:1", "start": 0, "end": 4}]}}, {})
    text = "\n".join(frame(snap, 80))
    assert "h:1" in text and "[0, 4)" in text and "epoch —" in text and "— tok/s" in text and "batch —" in text
    assert re.search(r" — +— +$", node_line(frame(snap, 160), "h:1"))  # tok/s and batch, no hop


def test_unreachable_with_and_without_the_last_good_frame():
    down = build_snapshot(None, {}, {"http://10.0.0.1:8000": "connection refused"})
    text = "\n".join(frame(down, 80))
    assert "cannot reach the cluster" in text and "connection refused" in text
    text = "\n".join(frame(down, 80, last_good=studios()))
    assert "cannot reach the cluster" in text and "studio-3" in text and "[40, 60)" in text


def test_formatters():
    assert fmt_bytes(192 * GIB) == "192 GiB" and fmt_bytes(287 << 20) == "287 MiB" and fmt_bytes(None) == "—"
    assert fmt_pair(62 * GIB, 192 * GIB) == "62/192 GiB" and fmt_pair(1.5 * GIB, 8 * GIB) == "1.5/8.0 GiB"
    assert fmt_bandwidth(5e9) == "40 Gb/s" and fmt_bandwidth(1.25e8) == "1.0 Gb/s"
    assert fmt_seconds(0.00021) == "210 µs" and fmt_seconds(0.418) == "418 ms" and fmt_seconds(2.5) == "2.50 s"
    assert re.fullmatch(r"\d\d:\d\d:\d\d", fmt_ts(1_700_000_000))
    assert re.fullmatch(r"\d\d:\d\d:\d\d", fmt_ts("2026-01-02T03:04:05Z"))
    assert fmt_ts(None) == "—" and fmt_ts("soon") == "soon"


def test_event_tracker_sees_joins_leaves_replans_and_contact():
    tracker = EventTracker()
    two = {f"http://a{i}": today_info(i, n=2) for i in range(2)}
    tracker.observe(build_snapshot("http://a0", two, {}, now=10))
    # ready <-> serving is not news
    busy = {u: dict(i, state="serving") for u, i in two.items()}
    tracker.observe(build_snapshot("http://a0", busy, {}, now=11))
    three = {f"http://a{i}": today_info(i, n=3, epoch=2) for i in range(3)}
    tracker.observe(build_snapshot("http://a0", three, {}, now=12))
    tracker.observe(build_snapshot(None, {}, {"http://a0": "connection refused"}, now=13))
    snap = tracker.observe(build_snapshot("http://a0", three, {}, now=14))
    kinds = [e["kind"] for e in snap["events"]]
    assert kinds == ["connected", "replan", "join", "lost", "back"], snap["events"]
    assert "epoch 1 → 2" in snap["events"][1]["message"]


def test_event_tracker_defers_to_the_daemons_own_event_log():
    tracker = EventTracker()
    own = [{"ts": 5, "kind": "replan", "message": "epoch 2: moved 1.2 GB"}]
    tracker.observe(build_snapshot("http://a0", {"http://a0": today_info(0, n=1, events=own)}, {}, now=6))
    snap = tracker.observe(build_snapshot("http://a0", {"http://a0": today_info(0, n=1, epoch=2, events=own)},
                                          {}, now=7))
    assert [e["kind"] for e in snap["events"]] == ["replan", "connected"]


class _CountingCollector:
    def __init__(self):
        self.calls = 0

    async def snapshot(self):
        self.calls += 1
        infos = {"http://a": today_info(0, n=1, tokens_generated_total=10 * self.calls, requests_in_flight=1)}
        return build_snapshot("http://a", infos, {}, rates={}, cluster_rate=float(self.calls))


def test_live_loop_redraws_in_place_at_2hz_or_more():
    assert DEFAULT_INTERVAL_S <= 0.5
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, height=30, color_system=None)
    collector = _CountingCollector()

    async def go():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(1.6, stop.set)
        await run_live(collector, stop, console=console, interval_s=DEFAULT_INTERVAL_S)

    asyncio.run(go())
    assert collector.calls >= 3  # 0 s, 0.5 s, 1.0 s, 1.5 s: one may be late on a loaded machine
    raw = out.getvalue()
    assert "\x1b[2J" not in raw  # never clears the screen: no flicker
    assert "\x1b[1A" in raw or "\x1b[2K" in raw  # moves the cursor up and overwrites
    assert "3.0 tok/s" in raw  # each redraw shows the new data


def test_log_lines_scroll_above_the_live_display_and_are_restored():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100, height=30, color_system=None)
    handler = logging.StreamHandler(sys.__stderr__)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        async def go():
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, lambda: logging.getLogger("ringlet.test").warning("a peer went quiet"))
            loop.call_later(0.8, stop.set)
            await run_live(_CountingCollector(), stop, console=console, interval_s=0.2)

        asyncio.run(go())
        assert "a peer went quiet" in out.getvalue()
        assert handler.stream is sys.__stderr__
    finally:
        root.removeHandler(handler)


def test_live_dashboard_for_ringlet_run_stops_and_shows_warnings(capsys):
    with FakeNode(today_info(0, n=1)) as node:
        async def go():
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.call_later(0.4, lambda: logging.getLogger("ringlet.test").error("stage 1 failed request x"))
            loop.call_later(1.2, stop.set)
            await asyncio.wait_for(live_dashboard(node.url, stop), timeout=10)

        asyncio.run(go())
    text = capsys.readouterr().out
    assert "127.0.0.1:7100" in text and "[0, 30)" in text
    assert "stage 1 failed request x" in text  # the error reached the event log
    assert not [h for h in logging.getLogger().handlers if isinstance(h, live._LogToEvents)]


@pytest.mark.parametrize("args", [["--interval", "0"], ["--interval", "fast"], ["--api", "nope://x"]])
def test_dashboard_bad_input_is_one_error_line(args):
    from conftest import ringlet

    r = ringlet("dashboard", *args, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("ringlet").level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.getLogger("ringlet").setLevel(saved[2])


def test_log_lines_concise_text_and_json_with_extras(capsys, restore_logging):
    import json

    from ringlet.daemon.ops import logs

    logs.setup(0)
    logging.getLogger("ringlet.daemon.node").info("stage 0 ready")
    logging.getLogger("ringlet.daemon.node").debug("hidden at the default level")
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r"\d\d:\d\d:\d\d I node: stage 0 ready", line), line
    logs.setup(0, json_format=True)
    try:
        raise ValueError("bad tensor")
    except ValueError:
        logging.getLogger("ringlet.daemon.wire.hop").exception("request failed",
                                                          extra={"request_id": "r1", "obj": object()})
    entry = json.loads(capsys.readouterr().err)
    assert entry["level"] == "error" and entry["logger"] == "ringlet.daemon.wire.hop"
    assert entry["msg"] == "request failed"
    assert entry["request_id"] == "r1" and entry["obj"].startswith("<object")
    assert "ValueError: bad tensor" in entry["exc"] and entry["ts"].endswith("Z")
    logs.setup(2)
    assert logging.getLogger().level == logging.DEBUG and logging.getLogger("ringlet").level == logging.DEBUG
    logs.setup(0, quiet=True)
    assert logging.getLogger("ringlet").level == logging.WARNING


@pytest.mark.parametrize("width, height", [(80, 24), (80, 18), (100, 12), (120, 16), (160, 20), (160, 40)])
def test_live_frames_never_overflow_the_terminal(width, height):
    lines = frame(studios(n_events=30, recent=9), width, height)
    assert len(lines) <= height and max(len(ln) for ln in lines) <= width
    assert "epoch 7" in lines[0]
    infos = batched_infos()
    infos["http://a0"]["batching"].update(mean_batch_recent=100.0, max_batch=128)  # the widest batch figure
    lines = frame(build_snapshot("http://a0", infos, {}), width, height)
    assert len(lines) <= height and max(len(ln) for ln in lines) <= width
    assert "100/128" in "\n".join(lines)


def test_tensor_mode_backend_and_ranks_are_drawn():
    from test_status import tensor_infos

    snap = build_snapshot("http://10.0.0.1:8000", tensor_infos(), {}, now=1_700_000_100)
    lines = frame(snap, 80, 24)
    assert len(lines) <= 24 and all(len(ln) <= 80 for ln in lines)
    text = "\n".join(lines)
    assert "policy balanced · mode tensor/jaccl" in text
    assert "tensor group (jaccl, ready): 0:studio-1 ↔ 1:studio-2 ↔ 2:studio-3 ↔ 3:studio-4" in text


def test_hybrid_groups_are_drawn_as_a_chain():
    from test_status import hybrid_infos

    snap = build_snapshot("http://10.0.0.1:8000", hybrid_infos(), {}, now=1_700_000_100)
    for width in (80, 140):
        lines = frame(snap, width, 30)
        assert len(lines) <= 30 and all(len(ln) <= width for ln in lines)
    text = "\n".join(frame(snap, 140, 30))
    assert "mode hybrid/jaccl" in text
    assert "hybrid (ready): [0, 40) studio-1 ↔ studio-2 → [40, 80) studio-3 ↔ studio-4" in text


def test_a_node_fetching_its_files_shows_the_download_fraction():
    infos = {f"http://a{i}": today_info(i) for i in range(3)}
    infos["http://a1"].update(state="fetching", layer_range=None, download={"bytes_done": 300, "bytes_total": 1000})
    line = node_line(frame(build_snapshot("http://a0", infos, {}), 80, 24), "127.0.0.1:7101")
    assert "fetching 30%" in line, line


def test_prefilling_request_in_the_requests_title():
    snap = studios()
    snap["prefilling"] = [{"request_id": "r", "prompt_tokens": 3000, "cached_tokens": 0, "processed_tokens": 1280,
                           "elapsed_s": 10.0, "eta_s": 13.5}]
    text = "\n".join(frame(snap, 160))
    assert "prefilling 1280/3000 ETA 13.50 s" in text


def test_speculative_decoding_on_the_cluster_line():
    """Tokens per trip and the acceptance of drafts, from the summed counters
    ((30 + 10) / (12 + 4) = 2.50 tokens per trip, (18 + 6) / (40 + 20) = 40 %)."""
    infos = batched_infos()
    urls = list(infos)
    infos[urls[0]]["speculation"] = {"trips": 12, "tokens": 30, "drafted": 40, "accepted": 18}
    infos[urls[1]]["speculation"] = {"trips": 4, "tokens": 10, "drafted": 20, "accepted": 6}
    lines = frame(build_snapshot("http://a0", infos, {}, now=1_700_000_100), 200)
    assert any("drafts 2.50 tok/trip 40% accepted" in ln for ln in lines), lines
    plain = frame(build_snapshot("http://a0", batched_infos(), {}, now=1_700_000_100), 200)
    assert not any("tok/trip" in ln for ln in plain)


def test_each_stage_shows_its_release_wide_and_narrow():
    """The release each node reports stands beside its chip (a rolling upgrade shows which
    nodes are done); a node that reports none (an older daemon) shows the chip alone."""
    snap = build_snapshot("http://a0", batched_infos(), {}, now=1_700_000_100)
    for width in (80, 140):
        text = "\n".join(frame(snap, width, 30))
        assert text.count("— · 0.2.0") == 2, text
