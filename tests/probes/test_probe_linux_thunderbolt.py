"""Linux Thunderbolt probe on the chrisbergeron captures (tests/fixtures/linux, SOURCES.md §5).

The sysfs test builds a fake ``/sys`` in tmp_path from the published ``tree`` listings: the same
symlinks (``bus/thunderbolt/devices/0-3 -> ../../../devices/.../domain0/0-0/0-3``), the same
driver bindings (``drivers/thunderbolt-net/0-3.0``), and attribute values taken from the other
captures:
- DEVTYPE: ``0-3`` is the host ("thunderbolt 0-3: new host found" in dmesg) -> thunderbolt_xdomain;
  ``0-3.0`` is bound to thunderbolt-net (tree) -> thunderbolt_service; ``0-0`` -> thunderbolt_device
  (router); ``domain0`` -> thunderbolt_domain. (DEVTYPE names: drivers/thunderbolt, SOURCES.md §5.)
- vendor 0xa27 / device 0xa / "Apple Inc." / "Macmini9,1": the dmesg lines.
- tx_speed / rx_speed "20.0 Gb/s": the speed capture. No ``*_lanes`` files (the 5.13 kernel of
  the capture predates them) -> 1 lane assumed; a second case adds ``rx_lanes``/``tx_lanes`` = 2.
- net/thunderbolt0 under 0-3.0: dmesg "thunderbolt-net 0-3.0 thunderbolt0: ...".
- ``unique_id`` values are NOT in any capture: the two below are invented (lower case, as %pUb).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ringlet.daemon.probes.common import ProbeParseError, ThunderboltPort
from ringlet.daemon.probes.links import match_links
from ringlet.daemon.probes.linux_thunderbolt import (
    DmesgEvent,
    parse_dmesg_thunderbolt,
    parse_ifconfig_linux,
    parse_lane_speed,
    parse_uevent,
    read_linux_thunderbolt,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "linux"
TREE_AFTER = "linux_sys_bus_thunderbolt_tree_AFTER_cable_mac_peer__chrisbergeron.txt"
TREE_BEFORE = "linux_sys_bus_thunderbolt_tree_BEFORE_cable__chrisbergeron.txt"
DMESG = "linux_dmesg_thunderbolt_new_host_found_macmini9_1__chrisbergeron.txt"
IFCONFIG = "linux_ifconfig_thunderbolt0_to_macmini_m1__chrisbergeron.txt"
SPEED = "linux_sys_bus_thunderbolt_tx_rx_speed_macmini_peer__chrisbergeron.txt"

INVENTED_PEER_UUID = "cccccccc-0000-4000-8000-0000000000a1"  # not from a capture
INVENTED_ROOT_UUID = "dddddddd-0000-4000-8000-0000000000b0"  # not from a capture


def fx(name: str) -> str:
    return (FIX / name).read_text(encoding="utf-8")


_TREE_LINE = re.compile(r"^((?:│   |    )*)(?:├── |└── )(.+?)(?: -> (.+))?$")


def parse_tree_listing(text: str) -> list[tuple[tuple[str, ...], str | None]]:
    """`tree` output -> [(path components below the listed dir, symlink target or None)]."""
    out, stack = [], []
    for line in text.splitlines():
        m = _TREE_LINE.match(line.rstrip())
        if not m:
            continue
        depth = len(m.group(1)) // 4
        stack[depth:] = [m.group(2)]
        out.append((tuple(stack), m.group(3)))
    return out


def build_fake_sysfs(tmp_path: Path, listing: str, dmesg: str, lanes: int | None = None) -> Path:
    sys_root = tmp_path / "sys"
    bus = sys_root / "bus" / "thunderbolt"
    entries = parse_tree_listing(listing)
    devices: dict[str, Path] = {}
    for parts, target in entries:
        link = bus.joinpath(*parts)
        link.parent.mkdir(parents=True, exist_ok=True)
        if target is None:
            if parts[-1] in ("uevent", "bind", "unbind", "drivers_probe", "drivers_autoprobe"):
                link.touch()
            else:
                link.mkdir(exist_ok=True)
            continue
        real = Path(os.path.normpath(link.parent / target))
        real.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
        if parts[0] == "devices":
            devices[parts[1]] = real
        elif parts[0] == "drivers" and len(parts) == 3:  # drivers/<driver>/<device>: a binding
            (real / "driver").symlink_to(os.path.relpath(link.parent, real))

    events = parse_dmesg_thunderbolt(dmesg).events
    hosts = {e.device for e in events if e.kind == "host_found"}
    netdevs = {e.device: e.netdev for e in events if e.netdev and e.device}

    def write(dev: str, name: str, value: str) -> None:
        (devices[dev] / name).write_text(value + "\n")

    for name, real in devices.items():
        if name.startswith("domain"):
            devtype = "thunderbolt_domain"
        elif name in hosts:
            devtype = "thunderbolt_xdomain"
        elif "." in name:
            devtype = "thunderbolt_service"
        else:
            devtype = "thunderbolt_device"
        extra = "DRIVER=thunderbolt-net\n" if (real / "driver").exists() else ""
        (real / "uevent").write_text(f"DEVTYPE={devtype}\n{extra}")
        if name in netdevs:
            (real / "net" / netdevs[name]).mkdir(parents=True)
    write("0-0", "unique_id", INVENTED_ROOT_UUID)
    found = next(e for e in events if e.kind == "host_found")
    named = next(e for e in events if e.kind == "host_name")
    write("0-3", "vendor", hex(found.vendor_id))  # kernel prints %#x
    write("0-3", "device", hex(found.device_id))
    vendor_name, device_name = named.text.rsplit(" ", 1)  # "Apple Inc." "Macmini9,1"
    write("0-3", "vendor_name", vendor_name)
    write("0-3", "device_name", device_name)
    write("0-3", "unique_id", INVENTED_PEER_UUID)
    tx, rx = fx(SPEED).splitlines()[1:3]  # after the "$ cat .../tx_speed .../rx_speed" line
    write("0-3", "tx_speed", tx)
    write("0-3", "rx_speed", rx)
    if lanes is not None:
        write("0-3", "tx_lanes", str(lanes))
        write("0-3", "rx_lanes", str(lanes))
    return bus / "devices"


def test_tree_listing_parser_reads_the_capture():
    entries = dict(parse_tree_listing(fx(TREE_AFTER)))
    assert set(k[1] for k in entries if k[0] == "devices" and len(k) == 2) == {"0-0", "0-3", "0-3.0", "domain0"}
    assert entries[("drivers", "thunderbolt-net", "0-3.0")].endswith("domain0/0-0/0-3/0-3.0")


def test_sysfs_after_cable_one_mac_peer(tmp_path):
    root = build_fake_sysfs(tmp_path, fx(TREE_AFTER), fx(DMESG))
    tb = read_linux_thunderbolt(root)
    assert tb.present and tb.routers == ("0-0",)
    (peer,) = tb.peers
    assert peer.name == "0-3"
    assert peer.unique_id == INVENTED_PEER_UUID.upper()
    assert peer.local_uuid == INVENTED_ROOT_UUID.upper()
    assert (peer.vendor_id, peer.device_id) == (0xA27, 0xA)
    assert (peer.vendor_name, peer.device_name) == ("Apple Inc.", "Macmini9,1")
    assert (peer.rx_gbps_per_lane, peer.tx_gbps_per_lane) == (20, 20)
    assert (peer.rx_lanes, peer.tx_lanes) == (None, None)
    assert peer.rx_bytes_per_s == peer.tx_bytes_per_s == 2_500_000_000  # 20 Gb/s x 1 lane (assumed)
    assert peer.services == ("0-3.0",) and peer.netdevs == ("thunderbolt0",)
    (port,) = tb.ports()
    assert port == ThunderboltPort(
        port_id="0-3",
        interface="thunderbolt0",
        own_domain_uuid=INVENTED_ROOT_UUID.upper(),
        peer_domain_uuid=INVENTED_PEER_UUID.upper(),
        link_speed_bytes_per_s=2_500_000_000,
        speed_text="20.0 Gb/s x 1",
        peer_name="Apple Inc.",
        peer_model="Macmini9,1",
        devices=("0-3",),
        bus_name="0",
        source="linux_sysfs",
    )


def test_sysfs_two_lanes(tmp_path):
    root = build_fake_sysfs(tmp_path, fx(TREE_AFTER), fx(DMESG), lanes=2)
    (peer,) = read_linux_thunderbolt(root).peers
    assert (peer.rx_lanes, peer.tx_lanes) == (2, 2)
    assert peer.rx_bytes_per_s == 5_000_000_000  # 20 Gb/s per lane x 2 = 40 Gb/s


def test_sysfs_before_cable_no_netdev(tmp_path):
    # BEFORE (cut off in the blog): 0-3 present, nothing bound to thunderbolt-net, no 0-3.0.
    root = build_fake_sysfs(tmp_path, fx(TREE_BEFORE), fx(DMESG))
    (peer,) = read_linux_thunderbolt(root).peers
    assert peer.services == () and peer.netdevs == ()
    assert peer.to_port().interface is None


def test_sysfs_missing_or_broken(tmp_path):
    assert read_linux_thunderbolt(tmp_path / "nope").present is False
    root = build_fake_sysfs(tmp_path, fx(TREE_AFTER), fx(DMESG))
    real_03 = (root / "0-3").resolve()
    (real_03 / "rx_speed").write_text("garbage\n")
    (real_03 / "vendor").write_text("\x00\xff")
    (real_03 / "unique_id").unlink()
    ((root / "0-0").resolve() / "uevent").write_text("")
    (peer,) = read_linux_thunderbolt(root).peers
    assert peer.rx_gbps_per_lane is None and peer.vendor_id is None and peer.unique_id is None
    assert peer.tx_bytes_per_s == 2_500_000_000


def test_linux_port_links_with_a_mac_port(tmp_path):
    # Synthetic: a Mac whose bus UUID equals the (invented) Linux unique_id of its XDomain and whose
    # peer is the Linux root router UUID -- the cross-OS assumption noted in SOURCES.md §5.
    (port,) = read_linux_thunderbolt(build_fake_sysfs(tmp_path, fx(TREE_AFTER), fx(DMESG))).ports()
    mac = ThunderboltPort(
        port_id="3", interface="en3", own_domain_uuid=INVENTED_PEER_UUID.upper(),
        peer_domain_uuid=INVENTED_ROOT_UUID.upper(), link_speed_bytes_per_s=2_500_000_000,
    )  # fmt: skip
    (link,) = match_links({"linux-a": [port], "macmini": [mac]})
    assert (link.node_a, link.iface_a, link.node_b, link.iface_b) == ("linux-a", "thunderbolt0", "macmini", "en3")
    assert link.speed_bytes_per_s == 2_500_000_000 and link.rdma_both is False


# --------------------------------------------------------------------------- text parsers


def test_lane_speed_capture():
    lines = fx(SPEED).splitlines()
    assert lines[0].startswith("$ cat ")
    assert [parse_lane_speed(x) for x in lines[1:]] == [20, 20]
    for bad in ("", "20 Mb/s", "fast", "Up to 40 Gb/s", "99999999 Gb/s"):
        with pytest.raises(ProbeParseError):
            parse_lane_speed(bad)


def test_uevent():
    assert parse_uevent("DEVTYPE=thunderbolt_xdomain\nDRIVER=x\n") == {"DEVTYPE": "thunderbolt_xdomain", "DRIVER": "x"}
    with pytest.raises(ProbeParseError):
        parse_uevent("no equals here")


def test_dmesg_capture():
    events = parse_dmesg_thunderbolt(fx(DMESG)).events
    assert events == (
        DmesgEvent("login_timeout", "Sun Jul 25 16:24:56 2021", "0-3.0", netdev="thunderbolt0",
                   text="ThunderboltIP login timed out"),
        DmesgEvent("host_disconnected", "Sun Jul 25 16:50:04 2021", "0-3", text="host disconnected"),
        DmesgEvent("host_found", "Sun Jul 25 16:50:16 2021", "0-3", vendor_id=0xA27, device_id=0xA),
        DmesgEvent("host_name", "Sun Jul 25 16:50:16 2021", "0-3", text="Apple Inc. Macmini9,1"),
        DmesgEvent("link_ready", "Sun Jul 25 16:50:22 2021", None, netdev="thunderbolt0",
                   text="ADDRCONF(NETDEV_CHANGE): thunderbolt0: link becomes ready"),
    )  # fmt: skip
    assert parse_dmesg_thunderbolt(fx(DMESG)).hosts() == {"0-3": "Apple Inc. Macmini9,1"}
    with pytest.raises(ProbeParseError):
        parse_dmesg_thunderbolt("[    0.000000] Linux version 6.1\n[    1.0] usb 1-1: new device\n")


def test_ifconfig_thunderbolt0_capture():
    i = parse_ifconfig_linux(fx(IFCONFIG))
    assert i.name == "thunderbolt0" and i.up
    assert i.flags == ("UP", "BROADCAST", "RUNNING", "MULTICAST") and i.mtu == 1500
    assert (i.ipv4, i.netmask, i.broadcast) == ("10.10.10.2", "255.0.0.0", "10.255.255.255")
    assert i.ipv6 == ("fe80::1234:5678:9abc:def0",)
    assert i.mac == "12:00:00:00:0a:01"
    assert (i.rx_packets, i.rx_bytes, i.tx_packets, i.tx_bytes) == (103, 55297, 31, 8602)
    for bad in ("", "thunderbolt0: error fetching interface information: Device not found", "x"):
        with pytest.raises(ProbeParseError):
            parse_ifconfig_linux(bad)
