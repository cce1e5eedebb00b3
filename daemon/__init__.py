"""ringlet's daemon: every part of a node that touches the world (see docs/architecture.md).

Importing this package defers the body of ``mlx_lm/__init__.py`` until one of its names
is used (:func:`_defer_mlx_lm_init`). That body imports ``mlx_lm.convert`` and through it
``transformers``, whose own ``__init__`` reads every file under ``transformers/models``
to build its lazy import table: about 1 s of CPU at every process start. Most ringlet
processes never tokenize (a tensor rank; a stage that serves no API call; ``ringlet
status``), and the submodules they use (``mlx_lm.models.*``, ``mlx_lm.sample_utils``)
do not need the package body. The first use of a package-level name
(``mlx_lm.load``, ``from mlx_lm import generate``) runs the body as usual.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading


def _defer_mlx_lm_init() -> None:
    """Register ``mlx_lm`` in ``sys.modules`` as its package (``__path__``, ``__spec__``
    set, so submodules import as usual) whose ``__init__`` body runs on the first lookup
    of a name it does not have yet. Nothing happens when mlx_lm is already imported or
    not installed."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    module = importlib.util.module_from_spec(spec)
    lock = threading.RLock()
    state = {"ran": False}

    def __getattr__(name: str):  # noqa: N807 - PEP 562 module __getattr__
        with lock:  # another thread's first lookup waits for the body to finish
            if not state["ran"]:
                state["ran"] = True
                try:
                    spec.loader.exec_module(module)
                finally:
                    module.__dict__.pop("__getattr__", None)
        try:
            return module.__dict__[name]
        except KeyError:  # also a lookup from within the body itself, before it set the name
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

    module.__getattr__ = __getattr__
    # what the package body sets before it imports transformers (mlx-lm's own choice)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    sys.modules["mlx_lm"] = module


_defer_mlx_lm_init()
