"""One migration at a time per host (issue 27 item 2): the host's lease. Its rules as a table, the
refusal an operator reads, the file under its lock (two processes racing for it)
(plugins/module_utils/common/host_lease.py); the host_lease module as Ansible runs it is tested in
tests/unit/plugins/modules/test_host_lease.py."""
from __future__ import annotations

import json
import multiprocessing
import os
import stat

import pytest

from ansible_collections.modelswap.vllm.plugins.module_utils.common import host_lease

pytestmark = pytest.mark.unit

NOW = 1_796_487_120.0                      # 2026-12-05 16:12:00 UTC
A = {"schema": 1, "run_id": "run-a", "controller": "ctl01", "user": "alice", "pid": 4242,
     "started": NOW - 7200, "renewed": NOW - 600, "expires": NOW + 7200, "purpose": "migrate"}
EXPIRED = dict(A, expires=NOW - 300)       # expired five minutes ago
JUST_EXPIRED = dict(A, expires=NOW)        # expires <= now counts as expired


def req(state="held", run_id="run-b", **extra):
    return dict({"state": state, "run_id": run_id, "controller": "ctl02", "user": "bob", "pid": 7,
                 "ttl": 600, "break_lease": "", "purpose": "migrate"}, **extra)


# (id, current, request, action, taken_over, words in the reason)
RULES = [
    ("held-free", None, req(), "take", False, "taken by run run-b"),
    ("held-free-break-names-nobody", None, req(break_lease="run-x"), "take", False, "taken by run run-b"),
    ("held-mine", A, req(run_id="run-a"), "renew", False, "renewed by run run-a"),
    ("held-mine-expired", EXPIRED, req(run_id="run-a"), "renew", False, "renewed by run run-a"),
    ("held-other-expired", EXPIRED, req(), "take", True, "took over the expired lease of run run-a"),
    ("held-other-expired-when", EXPIRED, req(), "take", True, "expired 16:07:00 UTC (5m ago)"),
    ("held-other-expires-now", JUST_EXPIRED, req(), "take", True, "expired lease of run run-a"),
    ("held-other-expired-break", EXPIRED, req(break_lease="run-a"), "take", True, "expired lease"),
    ("held-other-break", A, req(break_lease="run-a"), "take", True,
     "taken over from run run-a as asked (modelswap_break_lease)"),
    ("held-other-live", A, req(), "refuse", False, "held by run run-a (controller ctl01, user alice, PID 4242"),
    ("held-other-wrong-break", A, req(break_lease="run-x"), "refuse", False,
     "modelswap_break_lease=run-x does not name the holder: the lease is held by run run-a"),
    ("held-other-expired-wrong-break", EXPIRED, req(break_lease="run-x"), "refuse", False,
     "never broken"),
    ("released-mine", A, req(state="released", run_id="run-a"), "release", False, "released by run run-a"),
    ("released-other", A, req(state="released"), "none", False, "held by another run, run run-a"),
    ("released-other-says-so", A, req(state="released"), "none", False, "only gives back its own lease"),
    ("released-none", None, req(state="released"), "none", False, "not held"),
    ("read-held", A, req(state="read"), "none", False, "held by run run-a"),
    ("read-free", None, req(state="read", run_id=""), "none", False, "not held"),
]


@pytest.mark.parametrize("current, request_, action, taken_over, words", [r[1:] for r in RULES],
                         ids=[r[0] for r in RULES])
def test_the_rules(current, request_, action, taken_over, words):
    out = host_lease.decide(current, request_, NOW)
    assert (out["action"], out["taken_over"]) == (action, taken_over)
    assert words in out["reason"], out["reason"]
    assert out["previous"] == current
    if action in ("take", "renew"):
        lease = out["lease"]
        assert set(lease) == set(host_lease.FIELDS) and lease["schema"] == 1
        assert (lease["run_id"], lease["controller"], lease["user"], lease["pid"], lease["purpose"]) == (
            request_["run_id"], "ctl02", "bob", 7, "migrate")
        assert lease["expires"] == NOW + 600 and lease["renewed"] == NOW
        assert lease["started"] == (A["started"] if action == "renew" else NOW)
    else:
        assert out["lease"] is None


def test_every_action_is_covered_by_the_table():
    assert {r[3] for r in RULES} == set(host_lease.ACTIONS)


@pytest.mark.parametrize("request_, error", [
    (req(state="locked"), "state must be one of held, released, read"),
    (req(run_id=""), "needs the run's run_id"),
    (req(ttl=0), "ttl must be a number of seconds above 0"),
])
def test_bad_requests_are_refused(request_, error):
    with pytest.raises(ValueError, match=error):
        host_lease.decide(None, request_, NOW)


def test_the_refusal_names_the_holder_and_the_takeover():
    msg = host_lease.refusal_message(A, "gpu1", NOW)
    assert msg == ("host_lease: gpu1 is held by run run-a (controller ctl01, user alice, PID 4242, "
                   "since 14:12:00 UTC, expires 18:12:00 UTC (in 2h00m), for migrate): another migration is "
                   "changing this host; wait for it to finish, or if that run is dead, run again with "
                   "-e modelswap_break_lease=run-a; nothing was changed")


def test_the_refusal_of_a_wrong_break_names_the_real_holder():
    msg = host_lease.refusal_message(A, "gpu1", NOW, "run-x")
    for words in ("gpu1 is held by run run-a", "not by run run-x", "never broken",
                  "-e modelswap_break_lease=run-a", "nothing was changed"):
        assert words in msg, msg


def test_times_and_durations_read_well():
    assert host_lease.utc(NOW - 86400, NOW) == "2026-12-04 16:12:00 UTC"      # another day: the date too
    assert [host_lease.duration(s) for s in (42, 300, 14100, 2 * 86400 + 3 * 3600)] == ["42s", "5m", "3h55m", "2d3h"]
    unknown = host_lease.describe({"run_id": "r", "started": "x", "expires": NOW + 60}, NOW)
    assert unknown == "run r (since an unknown time, expires 16:13:00 UTC (in 1m))"


@pytest.mark.parametrize("text", ["", "   \n"])
def test_an_empty_file_is_no_lease(text):
    assert host_lease.parse(text, "/l.json") is None


@pytest.mark.parametrize("text, why", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"user": "alice"}', "no run_id"),
    ('{"run_id": "r", "expires": "soon"}', "no expires time"),
])
def test_a_corrupt_file_names_its_path_and_the_fix(tmp_path, text, why):
    path = tmp_path / "lease.json"
    path.write_text(text)
    with pytest.raises(host_lease.LeaseError) as err:
        host_lease.apply(str(path), req(), NOW)
    assert str(path) in str(err.value) and why in str(err.value)
    assert "inspect it, and remove it" in str(err.value)
    assert path.read_text() == text                                   # left as it was


def test_take_refuse_release_on_disk(tmp_path):
    path = str(tmp_path / "lib" / "lease.json")
    decision = host_lease.apply(path, req(), NOW)
    assert decision["action"] == "take"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "lib").st_mode) & 0o755 == 0o755
    assert json.loads(open(path).read()) == decision["lease"] == host_lease.read(path)
    assert sorted(os.listdir(tmp_path / "lib")) == ["lease.json", "lease.json.lock"]   # no temp file left

    before = open(path, "rb").read()
    refused = host_lease.apply(path, req(run_id="run-c"), NOW + 1)
    assert refused["action"] == "refuse" and refused["previous"]["run_id"] == "run-b"
    assert open(path, "rb").read() == before                          # byte for byte

    assert host_lease.apply(path, req(state="released", run_id="run-c"), NOW + 2)["action"] == "none"
    assert open(path, "rb").read() == before                          # another run's lease stays

    renewed = host_lease.apply(path, req(), NOW + 3)
    assert renewed["action"] == "renew" and host_lease.read(path)["started"] == NOW
    assert host_lease.read(path)["expires"] == NOW + 603

    assert host_lease.apply(path, req(state="released"), NOW + 4)["action"] == "release"
    assert not os.path.exists(path)
    assert host_lease.apply(path, req(state="released"), NOW + 5)["action"] == "none"


def test_an_expired_lease_is_taken_over_on_disk(tmp_path):
    path = str(tmp_path / "lease.json")
    host_lease.apply(path, req(run_id="run-a", ttl=60), NOW)
    decision = host_lease.apply(path, req(), NOW + 61)
    assert decision["action"] == "take" and decision["taken_over"]
    assert decision["previous"]["run_id"] == "run-a" and host_lease.read(path)["run_id"] == "run-b"


def test_plan_writes_nothing(tmp_path):
    folder = tmp_path / "missing"
    path = str(folder / "lease.json")
    assert host_lease.plan(path, req(), NOW)["action"] == "take"
    assert not folder.exists()                                        # not even the lock file
    host_lease.apply(path, req(run_id="run-a"), NOW)
    before = open(path, "rb").read()
    assert host_lease.plan(path, req(state="released", run_id="run-a"), NOW)["action"] == "release"
    assert host_lease.plan(path, req(break_lease="run-a"), NOW)["action"] == "take"
    assert open(path, "rb").read() == before


def _race(path, run_id, barrier, results):
    barrier.wait()
    results.put((run_id, host_lease.apply(path, req(run_id=run_id), NOW)["action"]))


def test_two_runs_at_once_exactly_one_takes_it(tmp_path):
    path = str(tmp_path / "lib" / "lease.json")
    ctx = multiprocessing.get_context("fork")
    for attempt in range(5):
        barrier, results = ctx.Barrier(2), ctx.Queue()
        runs = ("r%d-1" % attempt, "r%d-2" % attempt)
        procs = [ctx.Process(target=_race, args=(path, r, barrier, results)) for r in runs]
        for proc in procs:
            proc.start()
        outcome = dict(results.get(timeout=30) for proc in procs)
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0
        assert sorted(outcome.values()) == ["refuse", "take"], outcome
        winner = next(r for r, action in outcome.items() if action == "take")
        assert host_lease.read(path)["run_id"] == winner
        os.unlink(path)
