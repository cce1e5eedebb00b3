"""What Ollama's model endpoints say about the one model a ringlet cluster serves:
``GET /api/tags`` and ``GET /api/ps`` entries, ``POST /api/show``'s answer.

Ollama names models ``name:tag``; the served model is ``<name>:latest`` there, and a
request may name it either way (:func:`served_name`). Facts come from the model's own
files, read once without its weights (a GGUF file's metadata and tensor shapes, an MLX
directory's ``config.json``): architecture, context length, sizes, quantization. The
``digest`` is the SHA-256 of the model's identity (name and, for a Hub model, the commit
the cluster agreed on), not of its files, which are never hashed whole.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ringlet.daemon.api.errors import ApiError
from ringlet.daemon.engine import gguf as gguf_source
from ringlet.daemon.engine.sources import ModelLocation, read_config

#: Ollama's ``quantization_level`` of a GGUF ``general.file_type``
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              30: "BF16"}
#: ``expires_at`` of the loaded model: a cluster keeps its model loaded for good
NEVER = "2318-01-01T00:00:00Z"


def served_name(requested: str | None, model_name: str) -> str:
    """The served model's id for a request's ``model`` (``name`` or ``name:latest``).

    Raises:
        ApiError: another model (404, Ollama's ``model '<name>' not found``).
    """
    if requested in (model_name, ollama_name(model_name)):
        return model_name
    raise ApiError(404, f"model '{requested}' not found: this cluster serves '{ollama_name(model_name)}'",
                   param="model", code="model_not_found")


def ollama_name(model_name: str) -> str:
    """The served model as Ollama names it: ``<name>:latest`` unless it has a tag."""
    return model_name if ":" in model_name.rsplit("/", 1)[-1] else f"{model_name}:latest"


def timestamp(when: float | None = None) -> str:
    """An RFC 3339 UTC time with microseconds (``2025-01-02T03:04:05.678901Z``), as
    Ollama's ``created_at`` and ``modified_at``; ``when`` in seconds since the epoch (now
    when ``None``)."""
    moment = datetime.now(UTC) if when is None else datetime.fromtimestamp(when, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class ModelFacts:
    """The served model as Ollama describes one.

    Attributes:
        name: Ollama's name (``<name>:latest``).
        size: bytes of its weight files on this node's disk.
        modified: their last change, seconds since the epoch.
        digest: SHA-256 (hex) of its identity.
        format: ``gguf`` or ``safetensors``.
        family: the architecture (``llama``, ``qwen3``...), "" when unknown.
        parameters: its parameter count, 0 when unknown.
        quantization: ``Q4_1``, ``BF16``..., "" when unknown.
        info: Ollama's ``model_info`` (``general.architecture``, ``<arch>.context_length``...).
    """

    name: str
    size: int
    modified: float
    digest: str
    format: str
    family: str
    parameters: int
    quantization: str
    info: dict[str, Any]

    def details(self) -> dict[str, Any]:
        """Ollama's ``details`` object."""
        return {"parent_model": "", "format": self.format, "family": self.family,
                "families": [self.family] if self.family else None, "parameter_size": parameter_size(self.parameters),
                "quantization_level": self.quantization}

    def tag(self) -> dict[str, Any]:
        """One ``GET /api/tags`` entry."""
        return {"name": self.name, "model": self.name, "modified_at": timestamp(self.modified), "size": self.size,
                "digest": self.digest, "details": self.details()}

    def running(self, context_tokens: int) -> dict[str, Any]:
        """One ``GET /api/ps`` entry: ``size_vram`` is the whole size on a Mac (unified
        memory the GPU reads), 0 elsewhere (ringlet runs on the CPU there)."""
        return {"name": self.name, "model": self.name, "size": self.size, "digest": self.digest,
                "details": self.details(), "expires_at": NEVER,
                "size_vram": self.size if sys.platform == "darwin" else 0, "context_length": context_tokens}


def parameter_size(count: int) -> str:
    """Ollama's ``parameter_size``: ``134.52M``, ``7.6B``; "" for 0 (unknown)."""
    if count <= 0:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(count)


def model_facts(location: ModelLocation, context_tokens: int) -> ModelFacts:
    """The facts of the model at ``location`` (reads metadata only; call off the event loop).

    Raises:
        RingletError: the model's files are unreadable.
    """
    ident = f"{location.name}@{location.revision}" if location.revision else location.name
    digest = hashlib.sha256(ident.encode()).hexdigest()
    if location.kind == "gguf":
        model = gguf_source.open_gguf(location.path)
        meta = model.metadata
        family = str(meta.get("general.architecture") or "")
        params = sum(math.prod(t.shape) for t in model.tensors.values())
        quant = FILE_TYPES.get(int(meta.get("general.file_type", -1)), "")
        files = [location.path]
        config = model.config
        fmt = "gguf"
    else:
        config = read_config(location)
        family = str(config.get("model_type") or "")
        bits = (config.get("quantization") or {}).get("bits")
        quant = f"Q{bits}" if bits else str(config.get("torch_dtype") or config.get("dtype") or "").upper()
        params = 0
        files = sorted(location.path.glob("*.safetensors"))
        fmt = "safetensors"
    stats = [f.stat() for f in files if f.exists()]
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    arch = family or "ringlet"
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": location.name,
                            f"{arch}.context_length": context_tokens}
    if params:
        info["general.parameter_count"] = params
    for key, field in (("embedding_length", "hidden_size"), ("block_count", "num_hidden_layers"),
                       ("attention.head_count", "num_attention_heads"),
                       ("attention.head_count_kv", "num_key_value_heads"), ("vocab_size", "vocab_size")):
        if text.get(field) is not None:
            info[f"{arch}.{key}"] = text[field]
    return ModelFacts(ollama_name(location.name), sum(s.st_size for s in stats),
                      max((s.st_mtime for s in stats), default=0.0), digest, fmt, family, params, quant, info)


def show_json(facts: ModelFacts, capabilities: list[str], template: str) -> dict[str, Any]:
    """``POST /api/show``'s answer. ``modelfile`` and ``parameters`` say what ringlet
    does (it has no Modelfile); ``template`` is the model's own (Jinja) chat template."""
    return {"modelfile": f"# ringlet serves this model; it has no Modelfile\nFROM {facts.name}\n",
            "parameters": "", "template": template, "details": facts.details(), "model_info": facts.info,
            "capabilities": capabilities, "modified_at": timestamp(facts.modified)}
