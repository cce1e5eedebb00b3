"""Room for KV caches on a stage: a step that would fill more memory than the node has ends
its request instead of allocating (refuse, never overfill).

A node's memory beside its weights holds the KV caches of the requests in flight and the
prefix store (the boundary store and one step's activations are kept off its offer
already). Before a step adds ``n`` tokens to a request's cache, the stage checks that
``n x`` its bytes per token (this stage's layers) still fit; if not, it first evicts prefix
store entries (they are rebuilt by a later prefill), and if that is not enough the request
ends with :class:`KVRoomError`, whose message names the figures and what would help. The
other requests, and the node, go on. (Without the check the allocation would go ahead: on
Linux the kernel's OOM killer ends the whole daemon, and MLX's CPU backend does not check a
failed allocation.)
"""

from __future__ import annotations

from collections.abc import Callable

from ringlet.daemon.engine.request_errors import RequestError

__all__ = ["MARK", "KVRoom", "KVRoomError", "OutOfMemory", "allocation_failed"]

#: Words every :class:`KVRoomError` message starts with (they cross the wire as text; an
#: API node does not resume a request that failed for them).
MARK = "no memory for"
#: What MLX's allocators say when an allocation fails (``[metal::malloc] Unable to allocate
#: N bytes``; ``[malloc_or_wait] Unable to allocate ...``).
_ALLOCATION_FAILED = ("Unable to allocate", "[malloc")


def allocation_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed allocation (MLX's, or Python's :class:`MemoryError`)."""
    return isinstance(exc, MemoryError) or any(m in str(exc) for m in _ALLOCATION_FAILED)


class OutOfMemory(RequestError):
    """A step's allocation failed on this stage: the request ends (its API node resumes
    it once the node, having shed its caches and offered less, is re-planned)."""


class KVRoomError(RequestError):
    """A step found no memory for its tokens' KV on this stage (the request ends)."""


class KVRoom:
    """The KV room of one stage.

    Args:
        budget_bytes: the memory the stage's KV caches and prefix store may take together,
            bytes (the node's usable memory less its weights, boundary store and work space).
        bytes_per_token: KV bytes one token takes across this stage's layers (> 0).
        on_full: called (from the MLX thread) with the tokens a refused step needed in all,
            once per refusal.
        on_failed: called (from the MLX thread) with MLX's words when an allocation failed
            anyway (Metal says so; MLX's CPU backend does not check).
    """

    def __init__(self, budget_bytes: int, bytes_per_token: float, on_full: Callable[[int], None] | None = None,
                 on_failed: Callable[[str], None] | None = None):
        self.budget_bytes = max(0, int(budget_bytes))
        self.bytes_per_token = float(bytes_per_token)
        self.on_full = on_full
        self.on_failed = on_failed
        self.refused = 0

    def out_of_memory(self, exc: Exception) -> Exception:
        """``exc`` as a step's result: a failed allocation becomes :class:`OutOfMemory` and
        ``on_failed`` hears of it (from the MLX thread); any other error stays itself."""
        if not allocation_failed(exc):
            return exc
        what = str(exc).strip() or type(exc).__name__
        if self.on_failed is not None:
            self.on_failed(what)
        return OutOfMemory(f"this node ran out of memory for the step ({what}); it sheds its caches and offers "
                           f"the planner less")

    def left(self, kv_bytes: int, prefix_bytes: int) -> int:
        """Bytes still free for KV growth when the caches in flight hold ``kv_bytes`` and the
        prefix store ``prefix_bytes`` (negative: already over)."""
        return self.budget_bytes - kv_bytes - prefix_bytes

    def take(self, left: int, tokens: int, held_tokens: int, prefix, kv_bytes: int) -> int:
        """Reserve room for ``tokens`` more tokens; returns the bytes left after them.

        Args:
            left: bytes free now (:meth:`left`, less what earlier steps of the round took).
            tokens: the step's new tokens.
            held_tokens: tokens the caches in flight hold (for the message).
            prefix: the stage's prefix store (entries are evicted for room).
            kv_bytes: bytes the caches in flight hold (for the message).

        Raises:
            KVRoomError: no room, even with the prefix store emptied.
        """
        need = int(tokens * self.bytes_per_token)
        if need <= left:
            return left - need
        before = prefix.nbytes
        prefix.make_room(need - left)
        left += before - prefix.nbytes
        if need <= left:
            return left - need
        self.refused += 1
        if self.on_full is not None:
            self.on_full(held_tokens + tokens)
        mb = 1e6
        raise KVRoomError(
            f"{MARK} {tokens} more token(s) of KV on this node: the requests in flight hold {held_tokens} tokens "
            f"({kv_bytes / mb:.1f} MB) of the {self.budget_bytes / mb:.1f} MB it has beside its weights, room for "
            f"about {int(self.budget_bytes / self.bytes_per_token)} tokens in all; retry when fewer requests run, "
            f"shorten the request, or add a node or memory")
