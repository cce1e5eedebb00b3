"""Probe timings on this machine: speed benchmark, probe_local cold (measures) and warm (cached),
and parser cost on the captured outputs. Usage: .venv/bin/python bench/bench_probes.py"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from ringlet.daemon.probes import probe_local
from ringlet.daemon.probes.links import match_links
from ringlet.daemon.probes.macos_networksetup import parse_hardware_ports
from ringlet.daemon.probes.macos_spthunderbolt import parse_spthunderbolt_json
from ringlet.daemon.probes.macos_thunderbolt import join_interfaces
from ringlet.daemon.probes.speed import measure_speed

FIX = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "macos"


def timed(fn, n: int = 5) -> tuple[float, object]:
    times, out = [], None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    t, r = timed(measure_speed, 3)
    print(
        f"measure_speed: median {t:.2f} s; bandwidth {r.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
        f"matmul {r.matmul_flops / 1e9:.2f} GFLOP/s ({r.device}, {r.matmul_dtype}, n={r.matmul_n})"
    )
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        probe_local(d)
        cold = time.perf_counter() - t0
        warm, _ = timed(lambda: probe_local(d), 5)
    print(f"probe_local: cold {cold:.2f} s (measures), warm median {warm * 1e3:.1f} ms (cached speed)")
    studio = (FIX / "spthunderbolt_json_macstudio_m3ultra_cabled_to_macbookpro_m5max__studio-a_side.json").read_text()
    mbp = (FIX / "spthunderbolt_json_macbookpro_m5max_cabled_to_macstudio_m3ultra__mbp-a_side.json").read_text()
    ns_studio = (FIX / "networksetup_listallhardwareports_macstudio_m3ultra__knurlogic_trimmed.txt").read_text()
    ns_mbp = (FIX / "networksetup_listallhardwareports_macbookpro_3tb_with_bridge0__d-inference_macB.txt").read_text()

    def pair():
        return match_links(
            {
                "s": join_interfaces(parse_spthunderbolt_json(studio), parse_hardware_ports(ns_studio)),
                "m": join_interfaces(parse_spthunderbolt_json(mbp), parse_hardware_ports(ns_mbp)),
            }
        )

    t, links = timed(pair, 200)
    print(f"parse 2 SP JSON + 2 networksetup + match: median {t * 1e6:.0f} us -> {len(links)} link(s)")


if __name__ == "__main__":
    main()
