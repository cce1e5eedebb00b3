"""``ringlet doctor``'s versions check: this install's release and wire protocol, the running
daemon's, and every member's, with what to upgrade when they differ (a rolling upgrade under
way) or cannot work together (another protocol version: kept out of the cluster)."""

from __future__ import annotations

from ringlet.daemon.ops.doctor.base import FAIL, OK, WARN, Check, Context
from ringlet.daemon.ops.doctor.network import _ringlet_on, read_cluster
from ringlet.daemon.wire import versions


def check_versions(ctx: Context) -> Check:
    """The versions check against the daemon on ``ctx.api_port`` (if one runs)."""
    if _ringlet_on(ctx.api_port) is None:
        return versions_verdict(None)
    return versions_verdict(read_cluster(ctx.api_port))


def versions_verdict(cluster: dict | str | None, installed: str = versions.RELEASE,
                     protocol: int = versions.PROTOCOL_VERSION) -> Check:
    """The verdict (pure) on the running daemon's ``/v1/cluster`` answer (``None``: no daemon;
    a string: why it could not be read): FAIL when a member was kept out for its protocol
    version, WARN when the daemon runs another release than the one installed (restart it) or
    the members run several releases (finish the rolling upgrade), else OK."""
    mine = f"installed: ringlet {installed}, wire protocol {protocol}"
    if cluster is None:
        return Check("versions", OK, f"{mine}; no daemon running")
    if isinstance(cluster, str):
        return Check("versions", WARN, f"{mine}; {cluster}")
    running = cluster.get("release") or "0.1.0"  # a daemon of 0.1.0 reports none
    members = [m for m in cluster.get("members") or [] if isinstance(m, dict)]
    by_release: dict[str, list[str]] = {}
    for m in members:
        by_release.setdefault(str(m.get("release") or "0.1.0"), []).append(str(m.get("name") or m.get("node_id")))
    parts = [mine, f"the daemon runs {running} (protocol {cluster.get('protocol_version', 1)})"]
    if by_release:
        parts.append("members: " + "; ".join(f"{r} on {', '.join(sorted(names))}"
                                              for r, names in sorted(by_release.items(), reverse=True)))
    out = [i for i in cluster.get("incompatible") or [] if isinstance(i, dict)]
    if out:
        reasons = "; ".join(str(i.get("reason") or i.get("node_id")) for i in out)
        return Check("versions", FAIL, "; ".join(parts) + f"; kept out: {reasons}",
                     "upgrade the node each reason names (ringlet service upgrade), one at a time",
                     details={"incompatible": out})
    if running != installed:
        return Check("versions", WARN, "; ".join(parts),
                     f"restart the daemon to run the installed {installed} (ringlet service restart)")
    if len(by_release) > 1:
        newest = max(by_release, key=versions.release_key)
        behind = sorted(n for r, names in by_release.items() if r != newest for n in names)
        return Check("versions", WARN, "; ".join(parts) + " (a rolling upgrade under way: each plan uses only "
                     "what every node taking part speaks)",
                     f"upgrade {', '.join(behind)} to {newest}, one node at a time (ringlet service upgrade)")
    return Check("versions", OK, "; ".join(parts))

