"""Models by name from the Hugging Face Hub: ``--model ORG/NAME[@REVISION]``.

Resolution goes through ``huggingface_hub`` against the standard Hugging Face cache
(``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_ENDPOINT`` are honoured, as
``huggingface_hub`` reads them), so a Mac that has used mlx-lm finds its models there:

1. ``HfApi.model_info(files_metadata=True)``: the commit hash the revision (default
   ``main``) points at — what the cluster agrees on — and every file with its size and,
   for LFS files, sha256;
2. the small files (``config.json``, tokenizer files, chat template, the safetensors
   index) with ``hf_hub_download``;
3. every safetensors header with ``HfApi.get_safetensors_metadata`` (HTTP range reads of
   the first bytes of each file), kept in a *headers file* beside the cache entry
   (``<cache>/models--ORG--NAME/.ringlet/<commit>.json``), so the node sizes the model
   and plans before any weight arrives (:mod:`ringlet.daemon.engine.partial_model`).

The weights are downloaded later, only the files of the node's own layers
(:mod:`ringlet.daemon.shards.hub_fetch`). Without the Hub (offline, unreachable) a
model resolves from the cache alone (config, index and headers file); with nothing
cached, :class:`HubUnavailable` says what to do. The model's directory is the
snapshot in the cache: a :class:`~ringlet.daemon.engine.sources.ModelLocation` of kind
``"mlx"`` with the commit as ``revision``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from ringlet.daemon.engine.partial_model import (
    INDEX_FILE,
    read_headers_file,
    weight_map,
    write_headers_file,
)
from ringlet.daemon.engine.sources import ModelLocation
from ringlet.daemon.errors import ModelFormatError, ModelNotFound

log = logging.getLogger(__name__)

#: ``ORG/NAME`` with an optional ``@REVISION`` (a branch, a tag or a commit hash).
_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w.][\w./-]*))?$")
#: Top-level files fetched whole at resolution: config, tokenizer, chat template, index.
SMALL_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
#: A "small" file larger than this is not fetched at resolution (bytes).
SMALL_LIMIT = 64 * 1024 * 1024
#: Where ringlet keeps its own files inside a repository's cache folder.
RINGLET_DIR = ".ringlet"


class HubUnavailable(ModelNotFound):
    """The Hub cannot be reached and the cache lacks the model; the message names the
    repository, the cache path and how to download it by hand."""


@dataclass(frozen=True)
class HubRef:
    """``ORG/NAME[@REVISION]`` as given: ``revision`` ``None`` means ``main``."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


def parse_ref(text: str | None) -> HubRef | None:
    """``ORG/NAME[@REVISION]`` as a :class:`HubRef`; ``None`` when ``text`` is not of that
    form or names an existing file or directory (a path always wins)."""
    m = _REF.match(text.strip()) if text else None
    if m is None or text.startswith((".", "~", "/")):
        return None
    try:
        if Path(text).expanduser().exists():
            return None
    except OSError:  # not a usable path (too long, say): a name
        pass
    return HubRef(m.group("repo"), m.group("rev"))


def hub_cache_dir() -> Path:
    """The Hugging Face cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``), as ``huggingface_hub`` reads it."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_storage(repo: str, cache_dir: Path | None = None) -> Path:
    """A repository's folder in the cache (``models--ORG--NAME``)."""
    from huggingface_hub.file_download import repo_folder_name

    return (cache_dir or hub_cache_dir()) / repo_folder_name(repo_id=repo, repo_type="model")


@dataclass(frozen=True)
class HubFile:
    """One file of a commit: ``size`` bytes (``None``: unknown) and, for an LFS file, the
    ``sha256`` the Hub gives (its ETag)."""

    name: str
    size: int | None = None
    sha256: str | None = None


@dataclass
class HubModel:
    """A Hub model resolved to one commit.

    Attributes:
        repo: ``ORG/NAME``.
        revision: the commit hash (40 hex digits).
        requested: the revision asked for (``None``: ``main``).
        cache_dir: the Hugging Face cache.
        endpoint: the Hub's URL (``HF_ENDPOINT``).
        files: every file of the commit.
        weight_map: tensor name -> safetensors file (a single ``model.safetensors``: every
            tensor maps to it; empty when its header is unknown).
        num_layers: decoder layers (``num_hidden_layers`` of the config).
        offline: resolved from the cache without the Hub; ``why`` says why.
    """

    repo: str
    revision: str
    requested: str | None
    cache_dir: Path
    endpoint: str
    files: dict[str, HubFile]
    weight_map: dict[str, str]
    num_layers: int
    offline: bool = False
    why: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def storage(self) -> Path:
        """The repository's folder in the cache."""
        return repo_storage(self.repo, self.cache_dir)

    @property
    def snapshot(self) -> Path:
        """The commit's snapshot directory (what the stage loader reads)."""
        return self.storage / "snapshots" / self.revision

    @property
    def headers_path(self) -> Path:
        """The headers file of this commit."""
        return self.storage / RINGLET_DIR / f"{self.revision}.json"

    @property
    def weight_files(self) -> list[str]:
        """The commit's top-level ``*.safetensors`` files, sorted."""
        return sorted(f for f in self.files if f.endswith(".safetensors") and "/" not in f)

    @property
    def ident(self) -> str:
        """``ORG/NAME@COMMIT``."""
        return f"{self.repo}@{self.revision}"

    def cached(self, name: str) -> bool:
        """The file is in the snapshot."""
        return (self.snapshot / name).is_file()

    def location(self) -> ModelLocation:
        """The snapshot as a model location (``name`` = the repository)."""
        return ModelLocation(name=self.repo, kind="mlx", path=self.snapshot, revision=self.revision,
                             headers=self.headers_path)


def locate(model: str | None) -> ModelLocation:
    """``--model`` as a location: a Hub name (``ORG/NAME[@REVISION]``) resolved to its
    snapshot in the cache (config, tokenizer, headers; the weights only as far as they
    are cached: enough to size and plan it), else
    :func:`ringlet.daemon.engine.sources.resolve` (a path or a short name).

    Raises:
        ModelNotFound, HubUnavailable, ModelFormatError: as :func:`resolve_hub` and
            ``resolve`` say.
    """
    from ringlet.daemon.engine.sources import resolve

    ref = parse_ref(model)
    return resolve(model) if ref is None else resolve_hub(ref).location()


def unavailable_message(ref: HubRef, why: str, cache_dir: Path | None = None) -> str:
    """The one line said when the Hub cannot be reached and the cache lacks ``ref``."""
    storage = repo_storage(ref.repo, cache_dir)
    rev = f" --revision {ref.revision}" if ref.revision else ""
    return (f"model {ref} is not in the Hugging Face cache ({storage}) and the Hub cannot be reached ({why}); "
            f"download it by hand where the Hub is reachable with `ringlet models pull {ref}` (or "
            f"`hf download {ref.repo}{rev}`) and copy {storage} to this machine, or start this node with "
            f"--peers HOST:PORT of a member that has it")


def _small(f: HubFile) -> bool:
    return "/" not in f.name and f.name.endswith(SMALL_SUFFIXES) and (f.size or 0) <= SMALL_LIMIT


class SilentBar:
    """A progress bar for ``huggingface_hub`` that shows nothing (ringlet draws its own)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def resolve_hub(ref: HubRef) -> HubModel:
    """Resolve ``ref`` to a commit and fetch what planning needs (config, tokenizer, index,
    safetensors headers); without the Hub, from the cache.

    Raises:
        ModelNotFound: no such repository or revision on the Hub.
        HubUnavailable: the Hub cannot be reached and the cache lacks the model.
        ModelFormatError: not a safetensors model (no ``config.json`` or no weights).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # its tqdm bars on stderr; ringlet shows its own progress
    cache_dir, endpoint = hub_cache_dir(), constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        return _resolve_cached(ref, "HF_HUB_OFFLINE is set", cache_dir, endpoint)
    try:
        return _resolve_online(ref, cache_dir, endpoint)
    except GatedRepoError:
        raise ModelNotFound(f"model {ref.repo} is gated on {endpoint}: accept its terms on the Hub and log in "
                            "(`hf auth login`)") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"model {ref.repo} has no revision {ref.revision!r} on {endpoint}") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"no model repository {ref.repo!r} on {endpoint} (or it is private: log in with "
                            "`hf auth login`)") from None
    except (ModelNotFound, ModelFormatError):
        raise
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS, timeouts, 5xx: fall back to the cache
        why = f"{endpoint}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        log.warning("the Hub cannot be reached (%s); looking in the cache", why)
        return _resolve_cached(ref, why, cache_dir, endpoint)


def _resolve_online(ref: HubRef, cache_dir: Path, endpoint: str) -> HubModel:
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=endpoint)
    info = api.model_info(ref.repo, revision=ref.revision, files_metadata=True)
    sha = str(info.sha)
    files = {s.rfilename: HubFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None) for s in info.siblings or ()}
    if "config.json" not in files:
        raise ModelFormatError(f"model {ref.repo}@{sha[:12]} has no config.json: not an MLX / transformers "
                               "model repository")
    if not any(f.endswith(".safetensors") and "/" not in f for f in files):
        raise ModelFormatError(f"model {ref.repo}@{sha[:12]} has no safetensors weights; ringlet runs MLX / "
                               "safetensors models from the Hub (for a GGUF, download the file and pass its path)")
    # config.json by the revision asked for: the cache records the ref (refs/main -> commit),
    # so the same name resolves offline later
    hf_hub_download(ref.repo, "config.json", revision=ref.revision or "main", cache_dir=cache_dir,
                    endpoint=endpoint, tqdm_class=SilentBar)
    for f in sorted(files.values(), key=lambda f: f.name):
        if _small(f) and f.name != "config.json":
            hf_hub_download(ref.repo, f.name, revision=sha, cache_dir=cache_dir, endpoint=endpoint,
                            tqdm_class=SilentBar)
    model = _model(ref, sha, cache_dir, endpoint, files)
    sidecar = read_headers_file(model.headers_path)
    if sidecar is None or sidecar.get("revision") != sha:
        if all(model.cached(f) for f in model.weight_files):
            headers = _local_headers(model)  # every weight is here already: no network
        else:
            meta = api.get_safetensors_metadata(ref.repo, revision=sha)
            headers = {name: {"tensors": {t: {"dtype": i.dtype, "shape": list(i.shape),
                                              "data_offsets": list(i.data_offsets)}
                                          for t, i in fm.tensors.items()}}
                       for name, fm in meta.files_metadata.items()}
        for name, h in headers.items():
            f = files.get(name, HubFile(name))
            h.update(size=f.size, sha256=f.sha256)
        write_headers_file(model.headers_path, headers, repo=ref.repo, revision=sha,
                           all_files={n: {"size": f.size, "sha256": f.sha256} for n, f in files.items()})
    if not model.weight_map:
        model.weight_map = _weight_map(model)
    return model


def _local_headers(model: HubModel) -> dict[str, dict]:
    from ringlet.daemon.engine.sources import read_safetensors_header

    out = {}
    for name in model.weight_files:
        _, header = read_safetensors_header(model.snapshot / name)
        out[name] = {"tensors": {k: v for k, v in header.items() if k != "__metadata__"}}
    return out


def _weight_map(model: HubModel) -> dict[str, str]:
    mapping = weight_map(model.snapshot)
    if mapping is not None:
        return mapping
    sidecar = read_headers_file(model.headers_path) or {"files": {}}
    return {t: name for name, info in sidecar["files"].items() for t in (info.get("tensors") or {})}


def _num_layers(snapshot: Path) -> int:
    try:
        config = json.loads((snapshot / "config.json").read_text())
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        return int(text["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelFormatError(f"{snapshot / 'config.json'}: no num_hidden_layers") from None


def _model(ref: HubRef, sha: str, cache_dir: Path, endpoint: str, files: dict[str, HubFile],
           offline: bool = False, why: str = "") -> HubModel:
    snapshot = repo_storage(ref.repo, cache_dir) / "snapshots" / sha
    model = HubModel(repo=ref.repo, revision=sha, requested=ref.revision, cache_dir=cache_dir, endpoint=endpoint,
                     files=files, weight_map={}, num_layers=_num_layers(snapshot), offline=offline, why=why)
    if (snapshot / INDEX_FILE).is_file() or read_headers_file(model.headers_path) is not None:
        model.weight_map = _weight_map(model)
    return model


def _resolve_cached(ref: HubRef, why: str, cache_dir: Path, endpoint: str) -> HubModel:
    """The model from the cache alone: the snapshot the revision points at (``refs/``),
    its files from the headers file (else from the snapshot itself)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref.repo, "config.json", cache_dir=cache_dir, revision=ref.revision)
    if not isinstance(found, str):
        raise HubUnavailable(unavailable_message(ref, why, cache_dir))
    snapshot = Path(found).parent
    sha = snapshot.name
    storage = repo_storage(ref.repo, cache_dir)
    sidecar = read_headers_file(storage / RINGLET_DIR / f"{sha}.json")
    if sidecar is not None and isinstance(sidecar.get("all_files"), dict):
        files = {n: HubFile(n, v.get("size"), v.get("sha256")) for n, v in sidecar["all_files"].items()}
    else:
        files = {p.name: HubFile(p.name, p.stat().st_size) for p in snapshot.iterdir() if p.is_file()}
        for name in (weight_map(snapshot) or {}).values():
            files.setdefault(name, HubFile(name))
    model = _model(ref, sha, cache_dir, endpoint, files, offline=True, why=why)
    missing = [f for f in model.weight_files if not model.cached(f)]
    if missing and sidecar is None:
        model.notes.append(f"the cache has {len(model.weight_files) - len(missing)} of {len(model.weight_files)} "
                           "weight files and no headers of the others: the plan sizes them from the config")
    log.info("model %s: commit %s from the cache (%s)", ref, sha, why)
    return model
