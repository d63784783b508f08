"""What a task of a playbook sees: the variables Ansible would give one task for one host.

    python -m tests.support.task_vars INVENTORY PLAYBOOK HOST TASK_NAME VAR[,VAR...]

loads the playbook as ansible-playbook does (roles, import_role, role defaults and parameters;
include_tasks and include_role are followed as a run that reaches them would load them),
finds the first task whose name ends with TASK_NAME, and prints, as JSON, each VAR templated
with the variables of that task for HOST (inventory, role defaults, the import's vars, ...).
Nothing runs and no host is contacted. Run it with ANSIBLE_CONFIG set to the repository's
ansible.cfg (the collection resolves through .collections/).
"""
from __future__ import annotations

import json
import os
import sys


def task_vars(inventory, playbook, host, task_name, names):
    import ansible.constants as C
    from ansible import context
    from ansible.inventory.manager import InventoryManager
    from ansible.module_utils.common.collections import ImmutableDict
    from ansible.parsing.dataloader import DataLoader
    from ansible.playbook import Playbook
    from ansible.playbook.block import Block
    from ansible.plugins.loader import init_plugin_loader
    from ansible.template import Templar, trust_as_template
    from ansible.vars.manager import VariableManager

    context.CLIARGS = ImmutableDict(tags=["all"], skip_tags=[], check=False, diff=False)
    init_plugin_loader(C.COLLECTIONS_PATHS)
    loader = DataLoader()
    inv = InventoryManager(loader=loader, sources=[inventory])
    manager = VariableManager(loader=loader, inventory=inv)
    book = Playbook.load(playbook, variable_manager=manager, loader=loader)

    from ansible.playbook.helpers import load_list_of_blocks
    from ansible.playbook.role_include import IncludeRole
    from ansible.playbook.task_include import TaskInclude

    def included(play, task):
        """The blocks a dynamic include loads (as the strategy would, without running anything)."""
        if isinstance(task, IncludeRole):
            return task.get_block_list(play=play, variable_manager=manager, loader=loader)[0]
        name = task.args.get("file") or task.args.get("_raw_params")
        if "{{" in name:        # a file chosen by a variable (lb_pool's type): as the host would choose it
            variables = manager.get_vars(play=play, host=inv.get_host(host), task=task)
            name = Templar(loader=loader, variables=variables).template(trust_as_template(name))
        base = task._role._role_path + "/tasks" if task._role else loader.get_basedir()
        path = os.path.join(base, name)
        if not os.path.isfile(path):    # an operator's file that is not set (vllm_service_quality_hook: '')
            return []
        copy = task.copy(exclude_parent=True)
        copy._parent = task._parent
        return load_list_of_blocks(loader.load_from_file(path, trusted_as_template=True), play=play,
                                   task_include=copy,
                                   role=task._role, variable_manager=manager, loader=loader)

    def walk(play, items):
        for item in items:
            if isinstance(item, Block):
                yield from walk(play, item.block)
                yield from walk(play, item.rescue)
                yield from walk(play, item.always)
            elif isinstance(item, (IncludeRole, TaskInclude)) and item.action in (
                    "ansible.builtin.include_role", "ansible.builtin.include_tasks", "include_role", "include_tasks"):
                yield item
                yield from walk(play, included(play, item))
            else:
                yield item

    for play in book.get_plays():
        for task in walk(play, play.compile()):
            if task.get_name().endswith(task_name):
                variables = manager.get_vars(play=play, host=inv.get_host(host), task=task)
                templar = Templar(loader=loader, variables=variables)
                return {name: templar.template(trust_as_template("{{ %s }}" % name)) for name in names}
    raise SystemExit(f"no task named ...{task_name!r} in {playbook}")


if __name__ == "__main__":
    inventory_, playbook_, host_, task_, names_ = sys.argv[1:6]
    print(json.dumps(task_vars(inventory_, playbook_, host_, task_, names_.split(",")), default=str))
