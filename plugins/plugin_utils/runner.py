# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Drive modelswap's playbooks from Python through ansible-runner (controller side only).

For CI jobs, AWX-style platforms and chat-ops bots that want structured results instead of
console text::

    from ansible_collections.modelswap.vllm.plugins.plugin_utils.runner import preview, migrate
    plan = preview("inventory/prod", serve="kimi-k2.5-int4")      # the --check --diff plan
    run = migrate("inventory/prod", serve="kimi-k2.5-int4")        # records, benchmark summary

or from a shell::

    python -m ansible_collections.modelswap.vllm.plugins.plugin_utils.runner \\
        preview --inventory inventory/prod --serve kimi-k2.5-int4

Roles hand their structured results to this interface through ``ansible.builtin.set_stats``
(keys starting with ``modelswap_``), which ansible-runner carries in the ``playbook_on_stats``
event. Host key checking stays as ansible.cfg says (ansible-runner would turn it off).
This file is never sent to hosts: no module imports it, and ansible_runner is imported lazily.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

# The repository or installed collection root: this file is <root>/plugins/plugin_utils/runner.py.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


@dataclass
class RunResult:
    """What one playbook run produced, as data."""
    rc: int
    status: str
    stats: dict
    events: list = field(repr=False)
    stdout: str = field(repr=False)
    custom_stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def hosts(self) -> list[str]:
        names = set()
        for counts in self.stats.values():
            if isinstance(counts, dict):
                names.update(counts)
        return sorted(names)

    def count(self, kind: str, host: str) -> int:
        """kind: ok, changed, failures, dark (unreachable), skipped, rescued, ignored."""
        return int(self.stats.get(kind, {}).get(host, 0))

    def changed(self, host: str) -> int:
        return self.count("changed", host)

    def failed(self, host: str) -> int:
        return self.count("failures", host)

    def task_results(self, task_name: str, host: str | None = None) -> list[dict]:
        """Module results of a task (by name), optionally for one host."""
        found = []
        for ev in self.events:
            data = ev.get("event_data", {})
            if ev.get("event") in ("runner_on_ok", "runner_on_failed", "runner_on_skipped",
                                   "runner_on_unreachable") \
                    and data.get("task") == task_name and (host is None or data.get("host") == host):
                found.append(dict(data.get("res", {}), _event=ev["event"], _host=data.get("host")))
        return found

    def failures(self) -> dict[str, list[str]]:
        """Per host, the messages of the tasks that failed or were unreachable."""
        out: dict[str, list[str]] = {}
        for ev in self.events:
            if ev.get("event") in ("runner_on_failed", "runner_on_unreachable"):
                data = ev.get("event_data", {})
                if data.get("ignore_errors"):
                    continue
                res = data.get("res", {})
                out.setdefault(data.get("host", "?"), []).append(
                    f"{data.get('task')}: {res.get('msg', '')}".strip())
        return out

    def tasks_per_host(self) -> dict[str, int]:
        """Per host, how many tasks ran (ok, changed, failed, skipped or unreachable; a loop counts
        once). Each costs the controller a worker round trip, skipped ones included: the figure
        the fleet-scale bound of the preview watches."""
        out: dict[str, int] = {}
        for ev in self.events:
            if ev.get("event") in _TASK_RESULT_EVENTS:
                host = ev.get("event_data", {}).get("host", "?")
                out[host] = out.get(host, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"rc": self.rc, "status": self.status, "stats": self.stats,
                "custom_stats": self.custom_stats, "failures": self.failures(),
                "tasks_per_host": self.tasks_per_host()}


_TASK_RESULT_EVENTS = ("runner_on_ok", "runner_on_failed", "runner_on_skipped", "runner_on_unreachable")


def _custom_stats(events: list) -> dict:
    for ev in reversed(events):
        if ev.get("event") == "playbook_on_stats":
            return ev.get("event_data", {}).get("artifact_data", {}) or {}
    return {}


def run_playbook(playbook: str, inventory: str, extra_vars: dict | None = None, *,
                 check: bool = False, diff: bool = False, limit: str | None = None,
                 tags: str | None = None, skip_tags: str | None = None,
                 envvars: dict | None = None, timeout: int | None = None,
                 quiet: bool = True, cwd: str | None = None) -> RunResult:
    """Run one of modelswap's playbooks (a name in playbooks/ or a path) with ansible-runner.

    ansible-playbook runs in `cwd` (default: the caller's working directory), as it would from
    the caller's shell: the roles' default results folder is results/ there
    (modelswap_results_dir), not inside the collection.
    """
    import ansible_runner  # controller-only dependency

    path = playbook if os.path.isabs(playbook) else os.path.join(ROOT, "playbooks", playbook)
    if not os.path.exists(path) and os.path.exists(os.path.abspath(playbook)):
        path = os.path.abspath(playbook)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no playbook {playbook!r} (looked for {path})")
    if not os.path.exists(inventory):
        raise FileNotFoundError(f"no inventory at {inventory!r}")
    cmdline = " ".join(flag for flag, on in (("--check", check), ("--diff", diff)) if on)
    env = {"ANSIBLE_HOST_KEY_CHECKING": os.environ.get("ANSIBLE_HOST_KEY_CHECKING", "True"),
           "ANSIBLE_NOCOLOR": "1"}
    cfg = os.path.join(ROOT, "ansible.cfg")
    if "ANSIBLE_CONFIG" not in os.environ and os.path.isfile(cfg):
        env["ANSIBLE_CONFIG"] = cfg
    env.update(envvars or {})
    # ansible-runner starts ansible-playbook by name: prefer the one beside this interpreter.
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    private = tempfile.mkdtemp(prefix="modelswap-runner-")
    try:
        # ansible-runner starts ansible-playbook in project_dir: the caller's directory, not ROOT
        run = ansible_runner.run(
            private_data_dir=private, project_dir=os.path.abspath(cwd or os.getcwd()), playbook=path,
            inventory=os.path.abspath(inventory), extravars=extra_vars or {}, limit=limit,
            tags=tags, skip_tags=skip_tags, cmdline=cmdline or None, quiet=quiet,
            envvars=env, timeout=timeout)
        # The artifacts live in the temporary folder: read everything before it goes.
        events = list(run.events)
        return RunResult(rc=run.rc, status=run.status, stats=run.stats or {}, events=events,
                         stdout=run.stdout.read(), custom_stats=_custom_stats(events))
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _serve_vars(serve: str | None, extra_vars: dict | None) -> dict:
    merged = dict(extra_vars or {})
    if serve:
        merged["modelswap_serve"] = serve
    return merged


def preview(inventory: str, serve: str | None = None, extra_vars: dict | None = None,
            **kwargs) -> dict:
    """The migration's plan per host (a --check --diff run of migrate.yml); changes nothing."""
    result = run_playbook("migrate.yml", inventory, _serve_vars(serve, extra_vars),
                          check=True, diff=True, **kwargs)
    return {"ok": result.ok, "plan": result.custom_stats.get("modelswap_plan", {}),
            "fleet": result.custom_stats.get("modelswap_fleet", {}), "run": result.to_dict()}


def migrate(inventory: str, serve: str | None = None, extra_vars: dict | None = None,
            **kwargs) -> dict:
    """Run the migration; returns each host's run record and where the records were written."""
    result = run_playbook("migrate.yml", inventory, _serve_vars(serve, extra_vars), **kwargs)
    run_dir = result.custom_stats.get("modelswap_run_dir")
    return {"ok": result.ok, "records": result.custom_stats.get("modelswap_record", {}),
            "run_dir": os.path.normpath(run_dir) if run_dir else run_dir, "run": result.to_dict()}


def status(inventory: str, **kwargs) -> dict:
    """The fleet table of playbooks/status.yml as data."""
    result = run_playbook("status.yml", inventory, **kwargs)
    return {"ok": result.ok, "hosts": result.custom_stats.get("modelswap_status", {}),
            "run": result.to_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelswap-runner", description=__doc__.split("\n\n", maxsplit=1)[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("preview", "migrate", "status"):
        p = sub.add_parser(name)
        p.add_argument("--inventory", "-i", required=True)
        p.add_argument("--limit", "-l")
        p.add_argument("--extra-vars", "-e", default="{}", help="JSON object")
        if name != "status":
            p.add_argument("--serve", help="catalog name to serve (modelswap_serve)")
    args = parser.parse_args(argv)
    try:
        extra = json.loads(args.extra_vars)
    except json.JSONDecodeError as exc:
        parser.error(f"--extra-vars must be a JSON object: {exc}")
    if args.cmd == "status":
        out = status(args.inventory, extra_vars=extra, limit=args.limit)
    else:
        out = globals()[args.cmd](args.inventory, serve=args.serve, extra_vars=extra, limit=args.limit)
    json.dump(out, sys.stdout, indent=2, sort_keys=True, default=str)
    print()
    return 0 if out["ok"] else 2


if __name__ == "__main__":
    sys.exit(main())
