"""Facts about a model needed before loading it: layer count, context length, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ringlet.daemon.engine import gguf as gguf_source
from ringlet.daemon.engine.sources import ModelLocation, read_config
from ringlet.daemon.errors import ModelFormatError


@dataclass(frozen=True)
class ModelInfo:
    """Model facts: ``num_layers`` decoder layers, ``context_tokens`` maximum positions,
    ``config`` the mlx-lm config dict."""

    name: str
    num_layers: int
    context_tokens: int
    config: dict

    @property
    def vocab_size(self) -> int | None:
        """Entries of the embedding table (token ids are in ``[0, vocab_size)``), if the config says."""
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else {}
        value = self.config.get("vocab_size") or text.get("vocab_size")
        return int(value) if value else None


def model_info(location: ModelLocation) -> ModelInfo:
    """Read the layer count and context length without loading weights.

    Raises:
        ModelFormatError: the config or GGUF metadata is unreadable or lacks the fields.
    """
    if location.kind == "gguf":
        config = gguf_source.open_gguf(location.path).config
    else:
        config = read_config(location)
        from mlx_lm.utils import _get_classes

        try:
            _get_classes(config)
        except (ValueError, KeyError):
            raise ModelFormatError(
                f"{location.path}: unsupported architecture {config.get('model_type')!r} "
                "(mlx-lm has no model class for it)"
            ) from None
    text = config.get("text_config", config)
    try:
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise ModelFormatError(f"{location.path}: the config has no num_hidden_layers") from None
    context = int(text.get("max_position_embeddings") or 4096)
    return ModelInfo(name=location.name, num_layers=layers, context_tokens=context, config=config)


def load_tokenizer(location: ModelLocation):
    """The model's tokenizer and chat template as an mlx-lm ``TokenizerWrapper``.

    Raises:
        ModelFormatError: no usable tokenizer files.
    """
    if location.kind == "gguf":
        return gguf_source.load_tokenizer(gguf_source.open_gguf(location.path))
    from mlx_lm.tokenizer_utils import load

    try:
        return load(Path(location.path))
    except Exception as exc:  # transformers raises OSError/ValueError/... for bad dirs
        raise ModelFormatError(f"{location.path}: cannot load the tokenizer: {exc}") from None
