# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""The host's commands as logic sees them: find a binary, run an argv under the C locale.

Logic in module_utils takes a ``HostCommands`` instead of the AnsibleModule, so it can be called
with plain values: a module passes ``HostCommands.of(module)`` (Ansible's run_command and
get_bin_path), a test or a script ``HostCommands.local()`` (subprocess and shutil.which).
"""
from __future__ import annotations

import os
import shutil
import subprocess

# systemctl and journalctl print translated words in other locales; the parsers read English.
C_LOCALE = {"LANG": "C", "LC_ALL": "C"}


class HostCommands:
    def __init__(self, run, which):
        self._run = run        # (argv, env overrides) -> (rc, stdout, stderr)
        self._which = which    # name -> absolute path, or None

    @classmethod
    def of(cls, module):
        """The module's own runner: its logging, its PATH and its no_log rules apply."""
        return cls(lambda argv, env: module.run_command(argv, environ_update=env),
                   module.get_bin_path)

    @classmethod
    def local(cls):
        """subprocess on this machine (tests, scripts run outside Ansible)."""
        def run(argv, env):
            proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                                  env=dict(os.environ, **env))
            return proc.returncode, proc.stdout, proc.stderr
        return cls(run, shutil.which)

    def which(self, name: str):
        """The absolute path of ``name`` on the host, or None when it is not installed."""
        return self._which(name)

    def run(self, argv) -> tuple:
        """(rc, stdout, stderr) of ``argv`` under the C locale; never raises for a non-zero rc."""
        return self._run(list(argv), dict(C_LOCALE))
