"""Helpers for the tensor-parallel tests and bench: tiny models whose heads divide by 2 and 3,
process checks, and a poll shim for running more MLX ring ranks than this machine has cores.

Why the shim: MLX's ring backend (mlx/distributed/ring/ring.cpp, ``SocketThread::worker``)
waits for a peer by calling non-blocking ``recv``/``send`` in a loop. With more ranks than
cores (3 ranks on this 2-core box) the spinning threads take the CPU from the very rank
they wait for and one all-reduce takes ~15-25 ms instead of ~0.35 ms. The shim, preloaded
into rank processes (``LD_PRELOAD``), makes a ``recv``/``send`` that returned EAGAIN first
``poll()`` the socket for up to 1 ms, then returns the same EAGAIN: MLX sees identical
results, only the waiting no longer burns CPU. Used only when ranks > cores, on Linux, when a
C compiler is present; the product never loads it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tiny_models

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

static ssize_t (*real_recv)(int, void*, size_t, int);
static ssize_t (*real_send)(int, const void*, size_t, int);

static void wait_ready(int fd, short events) {
  int saved = errno;
  struct pollfd p = {fd, events, 0};
  poll(&p, 1, 1);
  errno = saved;
}

ssize_t recv(int fd, void* buf, size_t n, int flags) {
  if (!real_recv) real_recv = (ssize_t (*)(int, void*, size_t, int))dlsym(RTLD_NEXT, "recv");
  ssize_t r = real_recv(fd, buf, n, flags);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) wait_ready(fd, POLLIN);
  return r;
}

ssize_t send(int fd, const void* buf, size_t n, int flags) {
  if (!real_send) real_send = (ssize_t (*)(int, const void*, size_t, int))dlsym(RTLD_NEXT, "send");
  ssize_t r = real_send(fd, buf, n, flags);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) wait_ready(fd, POLLOUT);
  return r;
}
"""

#: Tiny configs whose heads divide by 2 and 3 (tiny_models.CONFIGS has 4/2 heads: 2 ranks only).
TP_CONFIGS: dict[str, dict] = {
    # 6 query heads, 6 kv heads, MLP 192: 1, 2, 3 and 6 ranks
    "llama6": {
        **tiny_models.CONFIGS["llama"],
        "hidden_size": 96,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
    },
    # grouped-query attention with q/k norms: 6 heads, 3 kv heads -> 3 ranks (not 2)
    "qwen3_gqa3": {
        **tiny_models.CONFIGS["qwen3"],
        "hidden_size": 96,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 16,
    },
}


def make_model(arch: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random model: ``tiny_models.CONFIGS`` or :data:`TP_CONFIGS`."""
    if arch in TP_CONFIGS:
        tiny_models.CONFIGS.setdefault(arch, TP_CONFIGS[arch])
    return tiny_models.make_tiny_model(arch, directory, seed=seed)


def mlx_greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Single-process greedy ids with mlx-lm (the independent reference for tiny models) and
    the smallest top-1/top-2 logit margin seen (a near-tie could flip under another order of
    float32 sums)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    cache = make_prompt_cache(model)
    x, out, margin = mx.array([prompt]), [], float("inf")
    for _ in range(n):
        logits = np.array(model(x, cache=cache)[0, -1])
        top = np.sort(logits)[-2:]
        margin = min(margin, float(top[1] - top[0]))
        out.append(int(np.argmax(logits)))
        x = mx.array([[out[-1]]])
    return out, margin


def poll_shim() -> str | None:
    """Path of the compiled shim (cached by source hash), or ``None`` off Linux / without cc."""
    if not sys.platform.startswith("linux"):
        return None
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha256(SHIM_C.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"ringlet-tp-pollshim-{os.getuid()}-{digest}.so"
    if out.exists():
        return str(out)
    src = out.with_suffix(".c")
    src.write_text(SHIM_C)
    tmp = out.with_suffix(f".{os.getpid()}.so")
    proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src), "-ldl"], capture_output=True)
    if proc.returncode != 0:
        return None
    tmp.replace(out)
    return str(out)


def rank_env(ranks: int) -> dict[str, str]:
    """Extra environment for rank processes: the poll shim when ranks outnumber cores."""
    if ranks <= (os.cpu_count() or 1):
        return {}
    shim = poll_shim()
    return {"LD_PRELOAD": shim} if shim else {}


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not sys.platform.startswith("linux")


def wait_dead(pids, timeout: float = 10.0) -> list[int]:
    """Wait up to ``timeout`` seconds for the processes ``pids`` to be gone; returns those alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def worker_pids() -> list[int]:
    """Every running ``ringlet.daemon.tensor.worker`` process started by this test process."""
    me = os.getpid()
    found = []
    if not Path("/proc/self/stat").exists():  # macOS: ask ps
        out = subprocess.run(["ps", "-axo", "pid=,ppid=,command="], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split(None, 2)
            if len(parts) == 3 and int(parts[1]) == me and "ringlet.daemon.tensor.worker" in parts[2]:
                found.append(int(parts[0]))
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if (
            b"ringlet.daemon.tensor.worker" in cmd
            and int(stat.rsplit(")", 1)[1].split()[1]) == me
            and alive(int(entry.name))
        ):
            found.append(int(entry.name))
    return found
