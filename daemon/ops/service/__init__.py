"""``ringlet service install | uninstall | status | upgrade``: run ringlet as a login service.

- **macOS**: a launchd agent ``~/Library/LaunchAgents/io.ringlet.ringlet.plist``
  (``RunAtLoad``, ``KeepAlive``), loaded with ``launchctl bootstrap gui/<uid>``;
  logs in ``~/Library/Logs/ringlet/`` (``ringlet.log`` is the daemon's log, stderr).
- **Linux**: a systemd user unit ``~/.config/systemd/user/ringlet.service``
  (``Restart=on-failure``), enabled with ``systemctl --user enable --now``; logs
  in the journal (``journalctl --user -u ringlet``). To start at boot without a
  login: ``sudo loginctl enable-linger $USER``.

Both run ``ringlet run`` with the arguments of the service configuration,
``~/.config/ringlet/service.toml`` (``$XDG_CONFIG_HOME`` respected): cluster name,
secret file, model, interfaces, ports, ... ``install`` merges its options into the
existing configuration, checks that ``ringlet run`` accepts the result, writes
the configuration and the service file, and records what it created in
``service-manifest.json`` next to the configuration, so that ``uninstall``
removes exactly that. ``--dry-run`` prints the files and commands instead.

``upgrade`` moves the service to another release, one node at a time: fetch it, drain
and stop the service (its members re-plan without it), install, start, wait until it
serves again (:mod:`~ringlet.daemon.ops.service.upgrade`).

Exit status of ``service status``: 0 running, 3 installed but not running, 4 not
installed (as ``systemctl status``); 2 bad input everywhere.

Modules: :mod:`~ringlet.daemon.ops.service.config` (the configuration and the
``ringlet run`` arguments it stands for), :mod:`~ringlet.daemon.ops.service.paths`,
:mod:`~ringlet.daemon.ops.service.units` (the plist and the unit),
:mod:`~ringlet.daemon.ops.service.install_plan` (what ``install`` will do),
:mod:`~ringlet.daemon.ops.service.manager` (launchctl / systemctl),
:mod:`~ringlet.daemon.ops.service.install` (install, uninstall),
:mod:`~ringlet.daemon.ops.service.status`, :mod:`~ringlet.daemon.ops.service.upgrade` and
:mod:`~ringlet.daemon.ops.service.command`
(the parser).
"""
