"""``ringlet doctor`` checks of this node's own set-up: the cluster secret (loads, is
private) and the login service (installed; on Linux, lingering)."""

from __future__ import annotations

import os
from pathlib import Path

from ringlet.daemon.ops.doctor.base import FAIL, OK, WARN, Check, Context, run_command


def check_secret(ctx: Context) -> Check:
    if not ctx.secret_file:
        return Check("secret", WARN, "no cluster secret: the node runs open (anyone on the network can join and "
                     "read prompts)", "ringlet secret new FILE, copy FILE to every node, run with --secret-file FILE")
    path = Path(ctx.secret_file).expanduser()
    if not path.is_file():
        return Check("secret", FAIL, f"{path} does not exist", f"ringlet secret new {path}")
    try:
        from ringlet.daemon.wire.auth import fingerprint, load_secret
    except ImportError:
        fingerprint = load_secret = None
    if load_secret is not None:
        try:
            fp = fingerprint(load_secret(path))
        except Exception as exc:  # SecretError: malformed or wrong mode -- its message says which
            return Check("secret", FAIL, f"{path}: {exc}", f"ringlet secret new {path} --force (then copy it to "
                         "every node)")
        return Check("secret", OK, f"{path} (fingerprint {fp}; equal on every node of the cluster)")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        return Check("secret", WARN, f"{path} has mode {mode:o}", f"chmod 600 {path}")
    return Check("secret", OK, str(path))


def check_service(ctx: Context) -> Check:
    from ringlet.daemon.ops.service.paths import host_target, service_file

    target = host_target()
    spath = service_file(target)
    if not spath.exists():
        return Check("service", OK, "not installed as a service (optional: ringlet service install)")
    summary = f"installed: {spath}"
    if target == "linux":
        user = os.environ.get("USER") or str(os.getuid())
        rc, out = run_command(["loginctl", "show-user", user, "--property=Linger"], timeout=5)
        if rc == 0 and out.strip() == "Linger=no":
            return Check("service", WARN, summary + "; it starts only when you log in",
                         f"sudo loginctl enable-linger {user}")
    return Check("service", OK, summary)
