# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""modelswap.vllm.template: ansible.builtin.template's lookup without its deep copy of every variable."""
from __future__ import annotations

DOCUMENTATION = r"""
name: template
author: modelswap engineers (@modelswap)
version_added: 0.1.0
short_description: Render a template like ansible.builtin.template's lookup, without copying every variable
description:
  - Renders each template exactly as the lookup C(ansible.builtin.template) does (it is that lookup,
    with the same search path, options and variables such as C(ansible_managed)).
  - That lookup first makes a deep copy of all the task's variables, to add its own to them. On a
    host whose variables hold large results (a migration's read, the target's listing) that copy
    costs tens of milliseconds of controller CPU per call, per host. This lookup gives it a copy of
    the top level only - a template only reads the variables, and the lookup only adds its own at
    the top level of its copy.
  - The vllm_service role renders the slot's unit, environment and API key files with it, in its
    preview (what the slot should be) and when it writes them, so both render alike.
options:
  _terms:
    description: The templates to render (found like ansible.builtin.template's).
    required: true
  template_vars:
    description: A dictionary, the keys become additional variables available for templating.
    type: dict
    default: {}
  variable_start_string:
    description: The string marking the beginning of a print statement.
    type: str
    default: '{{'
  variable_end_string:
    description: The string marking the end of a print statement.
    type: str
    default: '}}'
  comment_start_string:
    description: The string marking the beginning of a comment statement.
    type: str
    default: '{#'
  comment_end_string:
    description: The string marking the end of a comment statement.
    type: str
    default: '#}'
  trim_blocks:
    description: Whether the first newline after a block is removed.
    type: bool
    default: true
seealso:
  - plugin: ansible.builtin.template
    plugin_type: lookup
"""

EXAMPLES = r"""
- name: What the unit would be
  ansible.builtin.debug:
    msg: "{{ lookup('modelswap.vllm.template', 'vllm.service.j2', template_vars={'__vllm_service': settings}) }}"
"""

RETURN = r"""
_raw:
  description: Each template's rendering.
  type: list
  elements: raw
"""

from ansible.plugins.lookup.template import LookupModule as BuiltinTemplate


class TopLevelCopy(dict):
    """The task's variables, whose deep copy copies the top level alone (the values are shared)."""

    def __deepcopy__(self, memo):
        return dict(self)


class LookupModule(BuiltinTemplate):
    def run(self, terms, variables=None, **kwargs):
        return super().run(terms, variables=TopLevelCopy(variables or {}), **kwargs)
