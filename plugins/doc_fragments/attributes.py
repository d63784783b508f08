# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Attributes every modelswap module has (listed before ansible.builtin.action_common_attributes,
which describes them: the first fragment to set a value wins); a module states its own check
mode and diff support beside it, and its own values win."""
from __future__ import annotations


class ModuleDocFragment:
    # Every module runs on the POSIX host it manages (or the controller for the benchmark).
    DOCUMENTATION = r"""
attributes:
  platform:
    support: full
    platforms: posix
"""

    # A module that only reads: check mode runs it the same, and it has nothing to diff.
    READ_ONLY = r"""
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
  platform:
    support: full
    platforms: posix
"""
