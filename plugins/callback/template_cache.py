# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0
"""Compile each Jinja template once per ansible-playbook run instead of once per task and host
(plugins/plugin_utils/template_cache.py does the work)."""
from __future__ import annotations

DOCUMENTATION = r"""
name: template_cache
type: aggregate
short_description: Compile each Jinja template once per run, not once per task and host
version_added: 0.1.0
description:
  - ansible-playbook forks a worker process for every task and host, and ansible-core compiles
    every template a worker renders again from source. On a fleet that is most of the
    controller's CPU per host (on the lab's migration preview about 250 compiles and 0.2 s per host).
  - This callback makes a private folder for the run (mode 0700) and has ansible's Jinja
    environment keep each compiled template there, so that the first process that compiles a
    template compiles it and every other process, for every other host, loads it. The folder is
    removed when the run ends, and one that a killed run left behind by the next run (a compiled
    template holds its source's constants).
  - The cache key is everything the compiled code depends on (the source, the lexer's and code
    generator's settings, ansible's compile-time switches, the versions of Python, Jinja and
    ansible-core). A result can only come sooner, never differ; what the cache cannot judge is
    compiled as before, and an ansible-core whose templating it does not know is left alone.
  - Enable it with C(ANSIBLE_CALLBACKS_ENABLED=modelswap.vllm.template_cache) or
    C(callbacks_enabled) in C(ansible.cfg); the collection's own ansible.cfg does.
notes:
  - With C(-vvv) it prints how many compiles the run saved.
"""

import atexit
import os

from ansible.plugins.callback import CallbackBase
from ansible_collections.modelswap.vllm.plugins.plugin_utils import template_cache


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "modelswap.vllm.template_cache"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # loaded in ansible-playbook's own process before the first play: every worker inherits it
        self.owner = os.getpid()
        for stale in template_cache.stale_folders():
            template_cache.remove_folder(stale)
        try:
            self.folder = template_cache.new_folder()
        except OSError as exc:
            # no usable temporary folder: the run goes on, compiling as ansible-core does
            self._display.vvv(f"template_cache: not used, no folder for it ({exc})")
            self.folder = self.cache = None
            return
        self.cache = template_cache.install(self.folder)
        if self.cache is None or self.cache.directory != self.folder:
            # this ansible-core's templating is not the one the cache knows, or another run's
            # cache is installed in this process already (ansible-runner in one interpreter)
            template_cache.remove_folder(self.folder)
            self.folder = None
        else:
            atexit.register(self._remove)

    def _remove(self):
        # only the process that made the folder removes it (a forked worker exits without atexit,
        # but a process forked by a plugin might not)
        if self.folder and os.getpid() == self.owner:
            template_cache.uninstall()
            template_cache.remove_folder(self.folder)
            self.folder = None

    def v2_playbook_on_stats(self, stats):
        if self.cache is not None:
            self._display.vvv(f"template_cache: {self.cache.hits} compiles loaded in this process, "
                              f"{self.cache.misses} compiled here, {self.cache.errors} cache errors")
        self._remove()
