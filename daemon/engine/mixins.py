"""Classes of mlx-lm modules with one of ringlet's behaviours mixed in front.

A stage changes how some of a model's own modules run (a layer taking its mask from its
own cache, an inner model given stand-in caches or skipping what lies around its
layers) by giving that one instance a subclass of its class with a mixin in front of it
in the method resolution order: ``instance.__class__ = mixed(Mixin, type(instance))``.
The instance keeps its parameters and children; the mixin's ``__call__`` runs first and
calls ``super().__call__``.
"""

from __future__ import annotations

_MIXED: dict[tuple[type, type], type] = {}


def mixed(mixin: type, base: type, name: str | None = None) -> type:
    """``base`` with ``mixin`` in front of it, made once per pair and reused (``name``:
    the class's name, default ``base``'s; its module is ``base``'s); ``base`` itself when
    it already has ``mixin``."""
    if issubclass(base, mixin):
        return base
    key = (mixin, base)
    if key not in _MIXED:
        _MIXED[key] = type(name or base.__name__, (mixin, base), {"__module__": base.__module__})
    return _MIXED[key]
