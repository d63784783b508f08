"""vllm_ready's logic without the module: the options, the unit reader over a HostCommands built
from plain functions shaped like systemctl's and journalctl's output, the wait for stopped with
fake process/listener sequences and a fake clock, the wait for ready's result and message."""
from __future__ import annotations

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_ready
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import vllm_unit_state

pytestmark = pytest.mark.unit

SHOW_OUTPUT = """Id=vllm.service
LoadState=loaded
ActiveState=activating
SubState=start
Result=success
MainPID=812
NRestarts=0
ExecMainStatus=0
ExecMainCode=0
ControlGroup=/system.slice/vllm.service
InvocationID=0f1e2d3c4b5a69788796a5b4c3d2e1f0
ExecMainStartTimestampMonotonic=1000000000
ActiveEnterTimestampMonotonic=0
ActiveExitTimestampMonotonic=0
InactiveEnterTimestampMonotonic=0
"""

JOURNAL_NEWEST_FIRST = """2026-01-02T10:00:03+0000 host vllm[812]: RuntimeError: CUDA out of memory
2026-01-02T10:00:02+0000 host vllm[812]: Traceback (most recent call last):
2026-01-02T10:00:01+0000 host vllm[812]: INFO starting
"""


def params(**overrides):
    base = dict(state="ready", host="127.0.0.1", port=8000, scheme="http", served_model_name="tiny-a",
                api_key=None, api_key_file=None, timeout=None, model_path=None, parallel_size=1,
                enforce_eager=False, poll_interval=2.0, request_timeout=10.0, completion=True, api=True,
                prompt="Hello", unit="vllm.service", check_port_owner=True, journal_lines=40,
                fail_when_not_ready=True)
    base.update(overrides)
    return base


class FakeSystemd:
    """systemctl and journalctl as a HostCommands sees them; records every argv and env."""

    def __init__(self, show=SHOW_OUTPUT, show_rc=0, journal=JOURNAL_NEWEST_FIRST, journal_rc=0,
                 installed=("systemctl", "journalctl")):
        self.show, self.show_rc = show, show_rc
        self.journal, self.journal_rc = journal, journal_rc
        self.installed = installed
        self.calls = []

    def which(self, name):
        return "/usr/bin/" + name if name in self.installed else None

    def run(self, argv, env):
        self.calls.append((argv, env))
        if argv[0].endswith("systemctl"):
            if self.show_rc:
                return self.show_rc, "", "Failed to connect to bus: No such file or directory\n"
            return 0, self.show, ""
        return self.journal_rc, self.journal, ""

    def commands(self):
        return HostCommands(self.run, self.which)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_unit_reader_show_asks_for_the_properties_under_the_c_locale():
    systemd = FakeSystemd()
    state = vllm_unit_state.UnitReader(systemd.commands(), "vllm.service").show()
    assert state["Id"] == "vllm.service" and state["MainPID"] == "812"
    assert state["ControlGroup"] == "/system.slice/vllm.service"
    argv, env = systemd.calls[0]
    assert argv == ["/usr/bin/systemctl", "show", "--property=Id," + ",".join(vllm_unit_state.UNIT_PROPERTIES),
                    "--", "vllm.service"]
    assert env == {"LANG": "C", "LC_ALL": "C"}


def test_unit_reader_show_failure_has_todays_message():
    reader = vllm_unit_state.UnitReader(FakeSystemd(show_rc=1).commands(), "vllm.service")
    with pytest.raises(vllm_unit_state.ReadyError) as err:
        reader.show()
    assert str(err.value) == ("reading the state of vllm.service failed: systemctl show exited 1: "
                              "Failed to connect to bus: No such file or directory")


def test_unit_reader_without_systemctl_fails_as_get_bin_path_did():
    with pytest.raises(vllm_unit_state.ReadyError, match='Failed to find required executable "systemctl" in paths: '):
        vllm_unit_state.UnitReader(FakeSystemd(installed=()).commands(), "vllm.service")


@pytest.mark.parametrize("systemd, lines, expected", [
    (FakeSystemd(), 2000, ["2026-01-02T10:00:01+0000 host vllm[812]: INFO starting",
                           "2026-01-02T10:00:02+0000 host vllm[812]: Traceback (most recent call last):",
                           "2026-01-02T10:00:03+0000 host vllm[812]: RuntimeError: CUDA out of memory"]),
    (FakeSystemd(journal_rc=1), 2000, []),
    (FakeSystemd(installed=("systemctl",)), 2000, []),
    (FakeSystemd(), 0, []),
])
def test_unit_reader_journal_is_oldest_first(systemd, lines, expected):
    reader = vllm_unit_state.UnitReader(systemd.commands(), "vllm.service")
    assert reader.journal(1767348000.7, lines) == expected
    if expected:
        assert systemd.calls[0][0] == ["/usr/bin/journalctl", "--unit", "vllm.service", "--since", "@1767348000",
                                       "--reverse", "--lines", "2000", "--no-pager", "--output", "short-iso",
                                       "--quiet"]


@pytest.mark.parametrize("overrides, message", [
    ({}, None),
    ({"port": 0}, "vllm_ready: port 0 is not a TCP port (1..65535)"),
    ({"port": 65536}, "vllm_ready: port 65536 is not a TCP port (1..65535)"),
    ({"timeout": -1.0}, "vllm_ready: timeout must be >= 0 seconds"),
    ({"timeout": 0.0}, None),
    ({"poll_interval": 0.0}, "vllm_ready: poll_interval and request_timeout must be > 0"),
    ({"request_timeout": -1.0}, "vllm_ready: poll_interval and request_timeout must be > 0"),
])
def test_options_problem(overrides, message):
    assert vllm_ready.options_problem(params(**overrides)) == message


def test_api_key_from_file(tmp_path):
    env = tmp_path / "vllm.env"
    env.write_text('VLLM_API_KEY="k-1"\n')
    assert vllm_ready.api_key_from_file(str(env)) == "k-1"
    assert vllm_ready.api_key_from_file(str(tmp_path / "missing.env")) is None

    def unreadable(path):
        raise PermissionError(13, "Permission denied")
    with pytest.raises(vllm_unit_state.ReadyError) as err:
        vllm_ready.api_key_from_file("/etc/modelswap/vllm.env", read_text=unreadable)
    assert str(err.value) == ("vllm_ready: cannot read the API key file /etc/modelswap/vllm.env: "
                              "Permission denied; run with become")


@pytest.mark.parametrize("overrides, expected", [
    ({"timeout": 5.0}, {"seconds": 5.0, "derived": False, "model_bytes": None}),
    ({"state": "stopped"}, {"seconds": 120.0, "derived": False, "model_bytes": None}),
    ({}, {"seconds": 360.0, "derived": True, "model_bytes": 0}),
    ({"model_path": "/snap", "parallel_size": 3, "enforce_eager": True},
     {"seconds": 180.0 + 8 + 60, "derived": True, "model_bytes": 2 << 30}),
])
def test_budget_for(overrides, expected):
    assert vllm_ready.budget_for(params(**overrides), size_of=lambda path: 2 << 30) == expected


@pytest.mark.parametrize("host, probed", [("0.0.0.0", "127.0.0.1"), ("::", "::1"), ("", "127.0.0.1"),
                                          ("10.0.0.5", "10.0.0.5")])
def test_probe_host(host, probed):
    assert vllm_ready.probe_host(host) == probed


@pytest.mark.parametrize("value, text", [(0.04, "0.0"), (9.94, "9.9"), (10.0, "10"), (123.6, "124")])
def test_format_seconds(value, text):
    assert vllm_ready.format_seconds(value) == text


PROC = {"pid": 812, "cmdline": "/opt/venv/bin/python3 -m vllm.entrypoints.openai.api_server", "user": "vllm"}
LISTENER = {"pid": 812, "user": "vllm", "unit": "vllm.service", "address": "0.0.0.0", "name": "vllm",
            "cmdline": "/opt/venv/bin/vllm serve"}


@pytest.mark.parametrize("procs, listeners, fail, ready, error, message", [
    # gone at once
    ([[]], [[]], True, True, None, None),
    # the process exits, then the port is released
    ([[PROC], [], []], [[LISTENER], [LISTENER], []], True, True, None, None),
    # still there when the budget ends
    ([[PROC]], [[LISTENER]], True, False,
     "1 process(es) of vllm.service remain: pid 812 /opt/venv/bin/python3 -m vllm.entrypoints.openai.api_server; "
     "port 8000 is still held by pid 812, user vllm, unit vllm.service: /opt/venv/bin/vllm serve",
     "vllm_ready: waiting for the old vLLM service to be gone failed after 2.0 s: 1 process(es) of vllm.service "
     "remain: pid 812 /opt/venv/bin/python3 -m vllm.entrypoints.openai.api_server; port 8000 is still held by "
     "pid 812, user vllm, unit vllm.service: /opt/venv/bin/vllm serve. Stop the listed processes (or raise the "
     "timeout) and run again."),
    # only the port, and no failure asked for
    ([[]], [[LISTENER]], False, False,
     "port 8000 is still held by pid 812, user vllm, unit vllm.service: /opt/venv/bin/vllm serve", None),
])
def test_wait_until_stopped(procs, listeners, fail, ready, error, message):
    clock = FakeClock()
    procs_seq, listeners_seq = iter(procs), iter(listeners)
    last = {"procs": procs[-1], "listeners": listeners[-1]}

    def processes_of(unit):
        assert unit == "vllm.service"
        last["procs"] = next(procs_seq, last["procs"])
        return last["procs"]

    def listeners_on(port):
        assert port == 8000
        last["listeners"] = next(listeners_seq, last["listeners"])
        return last["listeners"]

    reader = vllm_unit_state.UnitReader(FakeSystemd().commands(), "vllm.service")
    result, failure = vllm_ready.wait_until_stopped(
        params(state="stopped", fail_when_not_ready=fail), reader, {"seconds": 2.0},
        clock=clock, sleep=clock.sleep, processes_of=processes_of, listeners_on=listeners_on)
    assert result["ready"] is ready and failure == message
    assert result.get("last_error") == error
    assert result["changed"] is False and result["budget"] == {"seconds": 2.0}
    assert result["unit_state"]["Id"] == "vllm.service"
    assert result["monotonic"] == clock.now
    assert set(result) >= {"elapsed", "processes", "port_listeners"}
    if not ready:
        assert result["elapsed"] == 2.0     # four polls of 0.5 s (poll_interval 2 is capped)


def test_wait_until_stopped_without_a_unit_checks_the_port_only():
    clock = FakeClock()
    result, failure = vllm_ready.wait_until_stopped(
        params(state="stopped", unit=None), None, {"seconds": 1.0}, clock=clock, sleep=clock.sleep,
        processes_of=lambda unit: pytest.fail("no unit, no processes to read"), listeners_on=lambda port: [])
    assert result["ready"] is True and failure is None and "unit_state" not in result


def outcome(ready, failed_gate=None, last_error=None, stopped_by=None, elapsed=3.2):
    return {"ready": ready, "gates": {"port": 1.0}, "elapsed": elapsed, "failed_gate": failed_gate,
            "last_error": last_error, "models": None, "completion": None, "stopped_by": stopped_by}


def test_wait_until_ready_refuses_a_unit_that_is_not_loaded():
    systemd = FakeSystemd(show="Id=vllm.service\nLoadState=not-found\n")
    reader = vllm_unit_state.UnitReader(systemd.commands(), "vllm.service")
    with pytest.raises(vllm_unit_state.ReadyError) as err:
        vllm_ready.wait_until_ready(params(), reader, {"seconds": 5.0},
                                    walk_gates=lambda **kw: pytest.fail("no gate before the unit is loaded"))
    assert str(err.value) == ("vllm_ready: the unit vllm.service is not loaded (LoadState=not-found); "
                              "deploy it before waiting for it")


def test_wait_until_ready_passes_the_options_to_the_gates_and_returns_the_result():
    seen = {}

    def walk_gates(**kwargs):
        seen.update(kwargs)
        assert kwargs["check"]() is None     # the unit is starting, the port is its own
        return outcome(True)

    clock = FakeClock()
    reader = vllm_unit_state.UnitReader(FakeSystemd().commands(), "vllm.service")
    result, failure = vllm_ready.wait_until_ready(
        params(host="0.0.0.0", api_key="k"), reader, {"seconds": 5.0, "derived": False},
        clock=clock, sleep=clock.sleep, epoch=lambda: 1767348000.0,
        listeners_on=lambda port: [LISTENER], walk_gates=walk_gates)
    assert failure is None and result["ready"] is True
    assert result["port_listeners"] == [LISTENER] and result["unit_state"]["MainPID"] == "812"
    assert result["budget"] == {"seconds": 5.0, "derived": False} and result["monotonic"] == clock.now
    assert "journal" not in result
    assert {k: seen[k] for k in ("host", "port", "served_name", "api_key", "budget", "poll")} == {
        "host": "127.0.0.1", "port": 8000, "served_name": "tiny-a", "api_key": "k", "budget": 5.0, "poll": 2.0}
    assert seen["clock"] is clock and seen["sleep"] == clock.sleep


def test_wait_until_ready_check_stops_on_a_foreign_port_owner():
    foreign = dict(LISTENER, pid=900, unit="session-1.scope", cmdline="python3 -m http.server 8000")
    stops = []

    def walk_gates(**kwargs):
        stops.append(kwargs["check"]())
        return outcome(False, "port", stops[0], "check")

    reader = vllm_unit_state.UnitReader(FakeSystemd().commands(), "vllm.service")
    result, failure = vllm_ready.wait_until_ready(params(), reader, {"seconds": 5.0},
                                                  listeners_on=lambda port: [LISTENER, foreign],
                                                  walk_gates=walk_gates)
    assert stops == ["port 8000 is held by a process outside vllm.service: pid 900, user vllm, "
                     "unit session-1.scope: python3 -m http.server 8000"]
    assert result["port_listeners"] == [LISTENER, foreign]
    assert failure.startswith("vllm_ready: tiny-a on 127.0.0.1:8000 is not ready - gate 'port' failed after 3.2 s "
                              "(budget 5.0 s): port 8000 is held by a process outside vllm.service")
    assert "Errors in the unit's journal: RuntimeError: CUDA out of memory" in failure


def test_wait_until_ready_failure_reads_the_journal_since_the_units_start():
    systemd = FakeSystemd()
    clock = FakeClock()
    clock.now = 1100.0        # the unit started at monotonic 1000 s (ExecMainStartTimestampMonotonic)
    epochs = iter([1767348000.0, 1767348200.0])     # the wait's start, its end 200 s later
    reader = vllm_unit_state.UnitReader(systemd.commands(), "vllm.service")
    result, failure = vllm_ready.wait_until_ready(
        params(journal_lines=2), reader, {"seconds": 5.0}, clock=clock, sleep=clock.sleep,
        epoch=lambda: next(epochs), listeners_on=lambda port: [],
        walk_gates=lambda **kw: outcome(False, "health", "/health answered 503", "timeout"))
    journal_argv = systemd.calls[-1][0]
    # the unit's start, 100 s before the end, is later than the wait's start: 200 s - 100 s - 1 s
    assert journal_argv[journal_argv.index("--since") + 1] == "@1767348099"
    assert result["journal"] == ["2026-01-02T10:00:02+0000 host vllm[812]: Traceback (most recent call last):",
                                 "2026-01-02T10:00:03+0000 host vllm[812]: RuntimeError: CUDA out of memory"]
    assert result["journal_errors"] == ["RuntimeError: CUDA out of memory"]
    assert failure == ("vllm_ready: tiny-a on 127.0.0.1:8000 is not ready - gate 'health' failed after 3.2 s "
                       "(budget 5.0 s): /health answered 503. The budget ran out: raise the timeout if the model "
                       "needs longer, or read the journal. Errors in the unit's journal: "
                       "RuntimeError: CUDA out of memory")


# a start's milestones, as journalctl --output short-unix gives them (newest first, --reverse)
STARTUP_NEWEST_FIRST = """1767348030.50 host vllm[812]: (APIServer pid=812) INFO [entry.py:140] Starting vLLM server on http://0.0.0.0:8000
1767348028.00 host vllm[830]: (EngineCore pid=830) INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 2.00 s
1767348026.00 host vllm[840]: (Worker pid=840) INFO [default_loader.py:501] Loading weights took 0.50 seconds
1767348025.00 host vllm[840]: (Worker pid=840) INFO [cpu_model_runner.py:68] Starting to load model /snap...
1767348015.00 host vllm[830]: (EngineCore pid=830) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: x
1767348000.00 host systemd[1]: Started vllm.service - vLLM serving m.
"""


@pytest.mark.parametrize("wait_began, reads", [
    (1767347990.0, True),      # the unit started 10 s after the wait began: the swap's own start
    (1767348100.0, False),     # it started 100 s before: a server already running is only probed
])
def test_a_ready_wait_after_a_start_says_where_the_start_went(wait_began, reads):
    systemd = FakeSystemd(journal=STARTUP_NEWEST_FIRST)
    clock = FakeClock()
    clock.now = 1031.0        # the unit started at monotonic 1000 s, 31 s ago
    epochs = iter([wait_began, 1767348031.0, 1767348031.0])
    reader = vllm_unit_state.UnitReader(systemd.commands(), "vllm.service")
    result, failure = vllm_ready.wait_until_ready(
        params(), reader, {"seconds": 60.0}, clock=clock, sleep=clock.sleep,
        epoch=lambda: next(epochs), listeners_on=lambda port: [LISTENER], walk_gates=lambda **kw: outcome(True))
    assert failure is None
    journal_calls = [argv for argv, _env in systemd.calls if argv[0].endswith("journalctl")]
    if not reads:
        assert journal_calls == [] and "startup" not in result
        return
    [argv] = journal_calls
    assert argv[argv.index("--since") + 1] == "@1767347999" and argv[argv.index("--output") + 1] == "short-unix"
    assert result["startup"]["phases"] == {"imports_and_config_s": 15.0, "engine_and_workers_s": 10.0,
                                           "weights_s": 1.0, "engine_init_s": 2.0, "api_server_s": 2.5,
                                           "first_token_s": 0.5}
    assert result["startup"]["total_s"] == 31.0 and result["startup"]["reported"]["weights_s"] == 0.5


def test_wait_until_ready_soft_failure_has_no_message():
    result, failure = vllm_ready.wait_until_ready(
        params(unit=None, fail_when_not_ready=False), None, {"seconds": 1.0}, listeners_on=lambda port: [],
        walk_gates=lambda **kw: outcome(False, "port", "refused", "timeout"))
    assert failure is None and result["ready"] is False and "journal" not in result


@pytest.mark.parametrize("started, state, now_epoch, now_mono, since", [
    (1000.0, {}, 2000.0, 50.0, 999.0),
    (1000.0, {"ExecMainStartTimestampMonotonic": "0"}, 2000.0, 50.0, 999.0),
    (1000.0, {"ExecMainStartTimestampMonotonic": "40000000"}, 2000.0, 50.0, 1989.0),   # later start wins
    (1995.0, {"ExecMainStartTimestampMonotonic": "40000000"}, 2000.0, 50.0, 1994.0),   # earlier start loses
])
def test_journal_since(started, state, now_epoch, now_mono, since):
    assert vllm_ready.journal_since(started, state, now_epoch, now_mono) == since


@pytest.mark.parametrize("overrides, result, tail", [
    ({"served_model_name": None}, {}, ": refused"),
    ({}, {"journal": ["a", "b", "c", "d", "e", "f"]}, ": refused. Last journal lines: b | c | d | e | f"),
    ({}, {"journal": ["x"], "journal_errors": ["E1", "E2"]}, ": refused. Errors in the unit's journal: E1 | E2"),
])
def test_not_ready_message(overrides, result, tail):
    msg = vllm_ready.not_ready_message(params(**overrides), outcome(False, "port", "refused", "final", 12.3),
                                       {"seconds": 360.0}, result)
    who = overrides.get("served_model_name", "tiny-a") or "the server"
    assert msg == ("vllm_ready: %s on 127.0.0.1:8000 is not ready - gate 'port' failed after 12 s (budget 360 s)"
                   % who) + tail
