"""Hub models in one process: resolution to a commit with the config, tokenizer and
headers only; downloads of a stage's files only, resumed from a partial file, verified
against the Hub's sha256, refused when the disk is short; offline resolution from the
cache, and one clear error when the cache lacks the model.

The real ``huggingface_hub`` client talks to a Hub served on this machine
(:mod:`hub_server`); what was requested is read from that server's log. Which files a
stage needs is known from how the test wrote the repository (:func:`tiny_models.
stage_file_names`), not from the code under test.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest
from hub_server import FakeHub, point_hub_client
from tiny_models import NUM_LAYERS, sharded_model_files, stage_file_names

from ringlet.daemon.engine.hub import HubUnavailable, parse_ref, resolve_hub
from ringlet.daemon.errors import ModelNotFound, RingletError
from ringlet.daemon.shards import hub_fetch
from ringlet.daemon.shards.hub_fetch import download, stage_weight_files
from ringlet.daemon.shards.layout import ShardError

REPO = "test-org/tiny"
SMALL = {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"}


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return sharded_model_files()


@pytest.fixture
def hub(files, monkeypatch, tmp_path):
    with FakeHub() as server:
        server.old = server.add_commit(REPO, sharded_model_files(seed=1), ref="v1")
        server.sha = server.add_commit(REPO, files)
        point_hub_client(monkeypatch, server.endpoint("t"), str(tmp_path / "hf"))
        yield server


def weights(names) -> set[str]:
    return {n for n in names if n.endswith(".safetensors")}


def test_resolution_reads_config_tokenizer_and_headers_but_no_weights(hub, files):
    model = resolve_hub(parse_ref(REPO))
    assert model.revision == hub.sha and model.requested is None and not model.offline
    assert model.num_layers == NUM_LAYERS
    assert {p.name for p in model.snapshot.iterdir()} == SMALL
    assert model.weight_files == sorted(weights(files))
    # whole-file GETs: the small files only; the weights were read as headers (ranges from 0)
    assert {e.file for e in hub.downloads("t")} == SMALL
    header_reads = [e for e in hub.requests("t", "GET") if e.range]
    assert {e.file for e in header_reads} == weights(files)
    assert all(e.range.startswith("bytes=0-") for e in header_reads)
    # an explicit revision: a tag and a commit both give that commit
    assert resolve_hub(parse_ref(f"{REPO}@v1")).revision == hub.old
    assert resolve_hub(parse_ref(f"{REPO}@{hub.old}")).revision == hub.old


def test_unknown_repository_or_revision_is_one_clear_error(hub):
    with pytest.raises(ModelNotFound, match="no model repository 'test-org/nope'"):
        resolve_hub(parse_ref("test-org/nope"))
    with pytest.raises(ModelNotFound, match="has no revision 'v9'"):
        resolve_hub(parse_ref(f"{REPO}@v9"))


def test_a_path_is_never_taken_for_a_hub_name(tmp_path, monkeypatch):
    (tmp_path / "test-org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_ref("test-org/tiny") is None
    assert parse_ref("test-org/other@main").revision == "main"
    assert parse_ref("./x/y") is None and parse_ref("a/b/c") is None and parse_ref("smollm2-135m") is None


@pytest.mark.parametrize("start,end", [(a, b) for a, b in itertools.combinations(range(NUM_LAYERS + 1), 2)])
def test_a_stage_needs_exactly_its_files(hub, start, end):
    model = resolve_hub(parse_ref(REPO))
    assert set(stage_weight_files(model, start, end)) == stage_file_names(start, end)


def test_a_stage_downloads_only_its_files_and_a_reshard_only_the_new_ones(hub, files):
    model = resolve_hub(parse_ref(REPO))
    before = len(hub.downloads("t"))
    download(model, stage_weight_files(model, 1, 3))
    got = [e.file for e in hub.downloads("t")[before:]]
    assert sorted(got) == sorted(stage_file_names(1, 3))
    for name in stage_file_names(1, 3):  # the cache holds the Hub's bytes
        assert (model.snapshot / name).read_bytes() == files[name]
    before = len(hub.downloads("t"))
    download(model, stage_weight_files(model, 1, 4))  # the stage grows by the last layer
    new = stage_file_names(1, 4) - stage_file_names(1, 3)
    assert sorted(e.file for e in hub.downloads("t")[before:]) == sorted(new)


def test_a_partial_download_resumes_from_its_last_byte(hub, files):
    model = resolve_hub(parse_ref(REPO))
    name = sorted(stage_file_names(2, 3))[0]
    data = files[name]
    partial = model.storage / ".ringlet" / "partial" / hashlib.sha256(data).hexdigest()
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:50_000])  # a download stopped there
    download(model, [name])
    (get,) = [e for e in hub.downloads("t") if e.file == name]
    assert get.range == "bytes=50000-" and get.sent == len(data) - 50_000
    assert (model.snapshot / name).read_bytes() == data
    assert not partial.exists()


def test_a_corrupt_partial_download_is_caught_and_deleted(hub, files):
    model = resolve_hub(parse_ref(REPO))
    name = sorted(stage_file_names(2, 3))[0]
    partial = model.storage / ".ringlet" / "partial" / hashlib.sha256(files[name]).hexdigest()
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\0" * 1000)  # not the file's first bytes
    with pytest.raises(ShardError, match=f"{name}: the download does not match the Hub.*sha256.*deleted"):
        download(model, [name])
    assert not partial.exists() and not model.cached(name)
    download(model, [name])  # and the next try fetches it whole
    assert (model.snapshot / name).read_bytes() == files[name]


def test_a_short_disk_is_refused_before_any_byte(hub, files, monkeypatch):
    model = resolve_hub(parse_ref(REPO))
    names = stage_weight_files(model, 0, NUM_LAYERS)
    need = sum(len(files[n]) for n in names)

    class Usage:
        free = need - 1000

    monkeypatch.setattr(hub_fetch.shutil, "disk_usage", lambda path: Usage)
    before = len(hub.downloads("t"))
    assert 100_000 < need < 1_000_000  # so, in kB:
    with pytest.raises(RingletError, match=rf"{need / 1000:.1f} kB to download .*short by 1\.0 kB"):
        download(model, names)
    assert len(hub.downloads("t")) == before


def test_offline_resolves_from_the_cache_or_says_how_to_download(hub, monkeypatch, tmp_path):
    online = resolve_hub(parse_ref(REPO))
    point_hub_client(monkeypatch, hub.endpoint("off"), str(tmp_path / "hf"), offline=True)
    offline = resolve_hub(parse_ref(REPO))
    assert (offline.revision, offline.offline, offline.weight_map) == (online.revision, True, online.weight_map)
    assert offline.files == online.files  # sizes and sha256 kept from the Hub's listing
    assert hub.requests("off") == []
    point_hub_client(monkeypatch, hub.endpoint("off"), str(tmp_path / "empty"), offline=True)
    with pytest.raises(HubUnavailable) as err:
        resolve_hub(parse_ref(REPO))
    message = str(err.value)
    assert "\n" not in message
    for part in (REPO, str(tmp_path / "empty" / "models--test-org--tiny"), "HF_HUB_OFFLINE",
                 f"ringlet models pull {REPO}", f"hf download {REPO}"):
        assert part in message, part
