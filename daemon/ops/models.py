"""``ringlet models list | pull | rm``: the Hugging Face cache, as ringlet uses it
(``load`` and ``unload``, the models a running cluster serves: :mod:`.models_serve`).

A ``ringlet`` CLI extension (see :mod:`ringlet.daemon.ops.cli`). The cache is the
standard one (``HF_HUB_CACHE``, ``HF_HOME``), read with ``huggingface_hub``'s
``scan_cache_dir``; ``pull`` resolves and downloads as ``ringlet run`` does
(:mod:`ringlet.daemon.engine.hub`, :mod:`ringlet.daemon.shards.hub_fetch`), so a pull
interrupted by any means resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

from ringlet.daemon.errors import RingletError

COMMANDS = frozenset({"models"})


def add_parsers(subparsers) -> None:
    """Register ``ringlet models`` on ``ringlet``'s subparsers."""
    p = subparsers.add_parser("models", help="the Hugging Face cache (list, pull, rm); a running cluster's models "
                                             "(load, unload)",
                              description="Models in the Hugging Face cache (HF_HUB_CACHE / HF_HOME), by name: list, "
                                          "pull, rm; and the models a running cluster serves: load, unload.")
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    ls = sub.add_parser("list", help="what the cache holds: revisions, sizes, layers present")
    ls.add_argument("--json", action="store_true", help="print JSON")
    pull = sub.add_parser("pull", help="download a model (or the files of some layers) into the cache")
    pull.add_argument("model", metavar="ORG/NAME[@REVISION]")
    pull.add_argument("--layers", default=None, metavar="START:END",
                      help="only the files holding layers [START, END) (half-open), plus config and tokenizer")
    rm = sub.add_parser("rm", help="delete a model (every revision, or the one named) from the cache")
    rm.add_argument("model", metavar="ORG/NAME[@REVISION]")
    from ringlet.daemon.ops.models_serve import add_serve_parsers

    add_serve_parsers(sub)  # load, unload: the models a running cluster serves


def run(args: argparse.Namespace) -> int:
    """Run ``ringlet models ACTION``."""
    import logging

    if not getattr(args, "verbose", 0):
        logging.getLogger("ringlet").setLevel(logging.WARNING)
    action = getattr(args, "models_command", None)
    if action == "list":
        return _list(args.json)
    if action == "pull":
        return _pull(args.model, args.layers)
    if action == "rm":
        return _rm(args.model)
    if action in ("load", "unload"):
        from ringlet.daemon.ops.models_serve import run_serve

        return run_serve(args)
    raise RingletError("ringlet models: give list, pull ORG/NAME, rm ORG/NAME, load MODEL or unload MODEL")


def _ref(text: str):
    from ringlet.daemon.engine.hub import parse_ref

    ref = parse_ref(text)
    if ref is None:
        raise RingletError(f"{text!r} is not a Hub model name: give ORG/NAME or ORG/NAME@REVISION")
    return ref


def _layer_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise RingletError(f"--layers {text!r}: give START:END, e.g. 0:20") from None
    return a, b


def _ranges(layers: list[int]) -> str:
    """``[0, 4)`` style runs of consecutive layers."""
    runs, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            runs.append(f"[{start}, {n + 1})")
            start = None
    return ", ".join(runs) or "none"


def cache_rows() -> list[dict]:
    """One row per cached model revision: ``repo``, ``revision``, ``refs``, ``bytes`` on
    disk, ``files``, ``layers`` present / ``num_layers`` (``None`` for a model that is
    not a safetensors checkpoint) and the snapshot ``path``."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from ringlet.daemon.engine.hub import hub_cache_dir
    from ringlet.daemon.engine.partial_model import weight_map
    from ringlet.daemon.engine.stage_tensors import layers_present

    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return []
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified):
            snapshot = Path(rev.snapshot_path)
            present = {f.file_name for f in rev.files}
            layers = num_layers = None
            try:
                config = json.loads((snapshot / "config.json").read_text())
                num_layers = int((config.get("text_config") or config)["num_hidden_layers"])
                mapping = weight_map(snapshot)
                if mapping is None and "model.safetensors" in present:
                    layers = list(range(num_layers))
                elif mapping is not None:
                    layers = layers_present(mapping, num_layers, present)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RingletError):
                pass
            rows.append({"repo": repo.repo_id, "revision": rev.commit_hash, "refs": sorted(rev.refs),
                         "bytes": rev.size_on_disk, "files": len(rev.files), "layers": layers,
                         "num_layers": num_layers, "path": str(snapshot)})
    return rows


def _list(as_json: bool) -> int:
    from ringlet.daemon.engine.hub import hub_cache_dir

    rows = cache_rows()
    if as_json:
        print(json.dumps({"cache": str(hub_cache_dir()), "models": rows}, indent=2))
        return 0
    if not rows:
        print(f"the Hugging Face cache ({hub_cache_dir()}) holds no models")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"models in {hub_cache_dir()}")
    for col in ("model", "revision", "refs", "size", "files", "layers present"):
        table.add_column(col)
    for r in rows:
        if r["layers"] is None:
            layers = "—"
        elif len(r["layers"]) == r["num_layers"]:
            layers = f"all {r['num_layers']}"
        else:
            layers = f"{_ranges(r['layers'])} of {r['num_layers']}"
        table.add_row(r["repo"], r["revision"][:12], ",".join(r["refs"]) or "—", f"{r['bytes'] / 1e6:.1f} MB",
                      str(r["files"]), layers)
    Console().print(table)
    return 0


def _pull(text: str, layers: str | None) -> int:
    from ringlet.daemon.engine.hub import resolve_hub
    from ringlet.daemon.shards.hub_fetch import stage_weight_files

    ref, span = _ref(text), _layer_range(layers)
    hub = resolve_hub(ref)
    if span is not None:
        from ringlet.daemon.engine.stage_tensors import validate_range

        validate_range(span[0], span[1], hub.num_layers)
    names = stage_weight_files(hub, *span) if span else hub.weight_files
    todo = [n for n in names if not hub.cached(n)]
    what = f"{hub.repo}" + (f" layers [{span[0]}, {span[1]})" if span else "")
    t0 = time.monotonic()
    got = _download_showing(hub, todo, what).to_dict()
    have = [n for n in hub.weight_files if hub.cached(n)]
    print(f"{hub.repo}@{hub.revision[:12]}: {len(todo)} file(s), {got['bytes_done'] / 1e6:.1f} MB downloaded in "
          f"{time.monotonic() - t0:.1f} s; {len(have)} of {len(hub.weight_files)} weight files in {hub.snapshot}")
    return 0


def _show(progress, done: threading.Event) -> None:
    """A rich progress bar (bytes, rate, ETA) on stderr until ``done``; silent unless a terminal."""
    if not sys.stderr.isatty():
        done.wait()
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(progress.what, total=progress.total_bytes)
        while not done.wait(0.2):
            d = progress.to_dict()
            bar.update(task, completed=d["bytes_done"], description=f"{progress.what} {d['file']}")


def whole_model(model: str | None):
    """``--model`` of a one-process command (``generate``): a Hub name resolved, with every
    weight file downloaded into the cache (a progress bar on a terminal); else the path or
    short name resolved.

    Raises:
        ModelNotFound, HubUnavailable, ModelFormatError, RingletError: see
            :func:`ringlet.daemon.engine.hub.resolve_hub` and
            :func:`ringlet.daemon.shards.hub_fetch.download`.
    """
    from ringlet.daemon.engine.hub import parse_ref, resolve_hub
    from ringlet.daemon.engine.sources import resolve

    ref = parse_ref(model)
    if ref is None:
        return resolve(model)
    hub = resolve_hub(ref)
    _download_showing(hub, [n for n in hub.weight_files if not hub.cached(n)], hub.repo)
    return hub.location()


def _download_showing(hub, todo: list[str], what: str):
    """Download ``todo`` of ``hub`` with a progress bar on a terminal; returns the progress."""
    from ringlet.daemon.shards.hub_fetch import DownloadProgress, download, total_bytes

    progress = DownloadProgress(what, total_bytes(hub, todo), len(todo))
    done = threading.Event()
    failure: list[BaseException] = []

    def work() -> None:
        try:
            download(hub, todo, progress)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=work, name="pull", daemon=True).start()
    _show(progress, done)
    if failure:
        raise failure[0]
    return progress


def _rm(text: str) -> int:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from ringlet.daemon.engine.hub import RINGLET_DIR, hub_cache_dir, repo_storage

    ref = _ref(text)
    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        info = None
    repo = next((r for r in (info.repos if info else ()) if r.repo_id == ref.repo and r.repo_type == "model"), None)
    revisions = [] if repo is None else [
        r for r in repo.revisions
        if ref.revision is None or r.commit_hash.startswith(ref.revision) or ref.revision in r.refs]
    if not revisions:
        raise RingletError(f"{ref} is not in the Hugging Face cache ({repo_storage(ref.repo)})")
    hashes = [r.commit_hash for r in revisions]
    strategy = info.delete_revisions(*hashes)
    strategy.execute()
    storage = repo_storage(ref.repo)
    for sha in hashes:
        (storage / RINGLET_DIR / f"{sha}.json").unlink(missing_ok=True)
    if ref.revision is None or not any((storage / "snapshots").glob("*")):
        shutil.rmtree(storage / RINGLET_DIR, ignore_errors=True)  # partial downloads too
    print(f"deleted {ref.repo}: {len(hashes)} revision(s) ({', '.join(h[:12] for h in hashes)}), "
          f"{strategy.expected_freed_size / 1e6:.1f} MB freed")
    return 0
