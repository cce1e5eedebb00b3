"""The data dir per platform (daemon/paths.py), expected paths from each platform's convention."""

from pathlib import Path

import pytest

from ringlet.daemon import paths
from ringlet.daemon.paths import default_data_dir


def test_default_data_dir_per_platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(paths.Path, "home", classmethod(lambda cls: tmp_path))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setattr(paths.sys, "platform", "linux")
    assert default_data_dir() == tmp_path / ".local/share/ringlet"
    monkeypatch.setenv("XDG_DATA_HOME", "/xdg")
    assert default_data_dir() == Path("/xdg/ringlet")
    monkeypatch.setattr(paths.sys, "platform", "darwin")
    assert default_data_dir() == tmp_path / "Library/Application Support/ringlet"
