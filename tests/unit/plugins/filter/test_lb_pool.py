"""lb_pool's logic (plugins/module_utils/serving/lb_pool.py) through its filters: HAProxy's stats CSV as a
pool, a state hook's list, the floor (batch included), and the result each entry point publishes
with its one-line message. Table-driven; the CSV rows carry HAProxy 2.6's real header."""
from __future__ import annotations

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from ansible_collections.modelswap.vllm.plugins.filter.lb_pool import FilterModule
from ansible_collections.modelswap.vllm.plugins.module_utils.serving import lb_pool
from tests.support.modules import REPO

pytestmark = pytest.mark.unit

F = FilterModule().filters()

# HAProxy 2.6's `show stat` / stats page CSV header (as the lab's HAProxy prints it).
HEADER = ("# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,"
          "status,weight,act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttle,lbtot,tracked,"
          "type,rate,rate_lim,rate_max,check_status,check_code,check_duration,hrsp_1xx,hrsp_2xx,hrsp_3xx,"
          "hrsp_4xx,hrsp_5xx,hrsp_other,hanafail,req_rate,req_rate_max,req_tot,cli_abrt,srv_abrt,comp_in,"
          "comp_out,comp_byp,comp_rsp,lastsess,last_chk,last_agt,qtime,ctime,rtime,ttime,agent_status,"
          "agent_code,agent_duration,check_desc,agent_desc,check_rise,check_fall,check_health,agent_rise,"
          "agent_fall,agent_health,addr,cookie,mode,algo,conn_rate,conn_rate_max,conn_tot,intercepted,dcon,"
          "dses,wrew,connect,reuse,cache_lookups,cache_hits,srv_icur,src_ilim,qtime_max,ctime_max,rtime_max,"
          "ttime_max,eint,idle_conn_cur,safe_conn_cur,used_conn_cur,need_conn_est,uweight,agg_server_status,"
          "agg_server_check_status,agg_check_status,-,ssl_sess,ssl_reused_sess,ssl_failed_handshake,h2_headers_rcvd,"
          "h2_data_rcvd,h2_settings_rcvd,h2_rst_stream_rcvd,h2_goaway_rcvd,h2_detected_conn_protocol_errors,"
          "h2_detected_strm_protocol_errors,h2_rst_stream_resp,h2_goaway_resp,h2_open_connections,"
          "h2_backend_open_streams,h2_total_connections,h2_backend_total_streams,h1_open_connections,"
          "h1_open_streams,h1_total_connections,h1_total_streams,h1_bytes_in,h1_bytes_out,")
COLUMNS = HEADER.lstrip("# ").split(",")


def row(pxname, svname, status, scur=0, weight=1, check="L7OK", lastchg=12):
    values = dict.fromkeys(COLUMNS, "")
    values.update(pxname=pxname, svname=svname, status=status, scur=str(scur), weight=str(weight),
                  check_status=check, lastchg=str(lastchg))
    return ",".join(values[c] for c in COLUMNS)


def csv_text(*servers, backend="vllm"):
    lines = [HEADER, row("vllm-in", "FRONTEND", "OPEN", check="")]
    lines += [row(backend, *s) if isinstance(s, tuple) else row(backend, s, "UP") for s in servers]
    lines += [row(backend, "BACKEND", "UP", check=""), row("stats", "FRONTEND", "OPEN", check="")]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("status, weight, serving, healthy, admin", [
    ("UP", 1, True, True, "ready"),
    ("UP 1/2", 1, True, False, "ready"),          # up, one check failed (going down), or just out of maint
    ("no check", 1, True, True, "ready"),
    ("UP", 0, False, True, "ready"),              # weight 0: no new request
    ("DOWN", 1, False, False, "ready"),
    ("DOWN 1/2", 1, False, False, "ready"),       # down, one check passed (going up)
    ("NOLB", 1, False, False, "ready"),
    ("MAINT", 1, False, False, "maint"),
    ("MAINT (via vllm/gpu3)", 1, False, False, "maint"),
    ("DRAIN", 1, False, False, "drain"),
    ("DRAIN (agent)", 1, False, False, "drain"),
])
def test_haproxy_statuses(status, weight, serving, healthy, admin):
    [server] = F["lb_pool_haproxy_servers"](csv_text(("gpu1", status, 3, weight)), "vllm")
    assert (server["serving"], server["healthy"], server["admin"]) == (serving, healthy, admin)
    assert server["status"] == status and server["sessions"] == 3 and server["weight"] == weight


def test_haproxy_servers_keep_the_backends_order_and_fields():
    text = csv_text(("gpu2", "UP", 2, 1, "L7OK", 40), ("gpu1", "MAINT", 0, 1, "", 7))
    text += row("other", "x1", "UP") + "\n" + row("other", "BACKEND", "UP") + "\n"
    assert F["lb_pool_haproxy_servers"](text, "vllm") == [
        {"name": "gpu2", "status": "UP", "serving": True, "healthy": True, "admin": "ready", "sessions": 2,
         "weight": 1, "check": "L7OK", "lastchg": 40},
        {"name": "gpu1", "status": "MAINT", "serving": False, "healthy": False, "admin": "maint", "sessions": 0,
         "weight": 1, "check": None, "lastchg": 7},
    ]


@pytest.mark.parametrize("text, backend, message", [
    (csv_text("gpu1"), "vllm-pool", "backend 'vllm-pool' is not in http://lb:8404/stats;csv (backends there: vllm): "
                                    "set lb_pool_haproxy_backend"),
    ("", "vllm", "http://lb:8404/stats;csv answered nothing: is it HAProxy's stats page (its URL ends in ;csv)?"),
    ("<html><body>Statistics Report</body></html>\n", "vllm",
     "http://lb:8404/stats;csv is not HAProxy's stats CSV (no pxname and status columns): <html>"),
])
def test_haproxy_servers_errors_name_the_source_and_the_fix(text, backend, message):
    with pytest.raises(AnsibleFilterError) as err:
        F["lb_pool_haproxy_servers"](text, backend, "http://lb:8404/stats;csv")
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("value, expected", [
    ([{"name": "gpu1", "serving": True}, {"name": "gpu2", "serving": False, "status": "down", "sessions": 4}],
     [("gpu1", "serving", True, None), ("gpu2", "down", False, 4)]),
    ({"gpu1": True, "gpu2": False}, [("gpu1", "serving", True, None), ("gpu2", "out", False, None)]),
    ([], []),
])
def test_hook_servers(value, expected):
    servers = F["lb_pool_hook_servers"](value)
    assert [(s["name"], s["status"], s["serving"], s["sessions"]) for s in servers] == expected


@pytest.mark.parametrize("value, told", [
    (None, "it set nothing"),
    ("gpu1", "it set str"),
    ([{"name": "gpu1"}], "one item is {'name': 'gpu1'}"),
    ([{"name": "gpu1", "serving": "yes"}], "one item is"),
    ({"gpu1": "up"}, "one item is {'name': 'gpu1', 'serving': 'up'}"),
])
def test_hook_servers_that_break_the_contract(value, told):
    with pytest.raises(AnsibleFilterError) as err:
        F["lb_pool_hook_servers"](value)
    assert str(err.value).startswith("the state hook (lb_pool_state_tasks) must set lb_pool_hook_servers")
    assert told in str(err.value)


def test_haproxy_servers_from_the_uri_result():
    """The role hands the filter uri's registered result: its status is checked, its content read."""
    ok = {"status": 200, "content": csv_text("gpu1"), "msg": "OK (unknown bytes)"}
    assert [s["name"] for s in F["lb_pool_haproxy_servers"](ok, "vllm", "http://lb:8404/stats;csv")] == ["gpu1"]
    assert F["lb_pool_haproxy_sessions"](dict(ok, content=csv_text(("gpu1", "MAINT", 2))), "vllm", "gpu1") == 2
    refused = {"status": -1, "msg": "Status code was -1 and not [200]: Request failed: <urlopen error [Errno 111] "
                                    "Connection refused>"}
    with pytest.raises(AnsibleFilterError) as err:
        F["lb_pool_haproxy_servers"](refused, "vllm", "http://lb:8404/stats;csv")
    assert str(err.value) == ("cannot read http://lb:8404/stats;csv: Status code was -1 and not [200]: Request "
                              "failed: <urlopen error [Errno 111] Connection refused>")
    with pytest.raises(AnsibleFilterError, match=r"^cannot read the stats: HTTP 503$"):
        F["lb_pool_haproxy_servers"]({"status": 503}, "vllm")


def servers(**statuses):
    return F["lb_pool_haproxy_servers"](csv_text(*statuses.items()), "vllm")


# (statuses, server, min_serving, leaving) -> (floor_ok, serving, would_stay)
FLOOR = {
    "two up, one leaves": (dict(gpu1="UP", gpu2="UP"), "gpu1", 1, [], True, 2, 1),
    "two up, floor 2": (dict(gpu1="UP", gpu2="UP"), "gpu1", 2, [], False, 2, 1),
    "the other in maintenance": (dict(gpu1="UP", gpu2="MAINT"), "gpu1", 1, [], False, 1, 0),
    "the other down": (dict(gpu1="UP", gpu2="DOWN"), "gpu1", 1, [], False, 1, 0),
    "this one not serving can always leave": (dict(gpu1="DOWN", gpu2="MAINT"), "gpu1", 1, [], True, 0, 0),
    "this one already out": (dict(gpu1="MAINT", gpu2="UP"), "gpu1", 1, [], True, 1, 1),
    "floor 0 lets the last one go": (dict(gpu1="UP", gpu2="MAINT"), "gpu1", 0, [], True, 1, 0),
    "a batch of two of three leaves": (dict(gpu1="UP", gpu2="UP", gpu3="UP"), "gpu1", 2, ["gpu1", "gpu2"],
                                       False, 3, 1),
    "a batch of two of four leaves": (dict(gpu1="UP", gpu2="UP", gpu3="UP", gpu4="UP"), "gpu2", 2,
                                      ["gpu1", "gpu2"], True, 4, 2),
    "the whole fleet at once (no serial)": (dict(gpu1="UP", gpu2="UP"), "gpu2", 1, ["gpu1", "gpu2"], False, 2, 0),
    "batch members that do not serve lower nothing": (dict(gpu1="UP", gpu2="DOWN", gpu3="UP"), "gpu1", 1,
                                                      ["gpu1", "gpu2"], True, 2, 1),
    "unknown batch names are ignored": (dict(gpu1="UP", gpu2="UP"), "gpu1", 1, ["gpu1", "lb-host"], True, 2, 1),
}


@pytest.mark.parametrize("statuses, server, floor, leaving, ok, serving, stay", list(FLOOR.values()), ids=list(FLOOR))
def test_floor(statuses, server, floor, leaving, ok, serving, stay):
    view = F["lb_pool_view"](servers(**statuses), server, floor, leaving, "vllm")
    assert (view["floor_ok"], view["serving"], view["would_stay"]) == (ok, serving, stay)
    assert view["total"] == len(statuses) and view["found"] and view["this"]["name"] == server
    assert (view["problem"] is None) is ok


def test_floor_refusal_names_the_pool_the_counts_and_the_fix():
    view = F["lb_pool_view"](servers(gpu1="UP", gpu2="MAINT"), "gpu1", 1, ["gpu1"], "vllm")
    assert view["problem"] == (
        "lb_pool: refusing to take gpu1 out of pool vllm: 1 of 2 servers serve now (gpu1 UP, gpu2 MAINT) and 0 "
        "would stay serving, fewer than the floor of 1 (lb_pool_min_serving, modelswap_min_serving). Nothing was "
        "changed. Bring another server back into service first, roll fewer hosts at a time (serial), or lower "
        "modelswap_min_serving, and run again.")
    batch = F["lb_pool_view"](servers(gpu1="UP", gpu2="UP", gpu3="UP"), "gpu1", 2, ["gpu1", "gpu2"], "vllm")
    assert "and 1 would stay serving (leaving with it: gpu2), fewer than the floor of 2" in batch["problem"]


def test_a_server_the_pool_does_not_list_is_refused():
    view = F["lb_pool_view"](servers(gpu1="UP"), "gpu9", 1, [], "vllm")
    assert not view["found"] and not view["floor_ok"] and view["status"] is None
    assert view["problem"] == ("lb_pool: gpu9 is not a server of pool vllm (servers: gpu1): set lb_pool_server "
                               "to its name there. Nothing was changed.")


def test_labels():
    assert lb_pool.pool_label("vllm") == "pool vllm" and lb_pool.pool_label("the pool") == "the pool"
    assert F["lb_pool_view"](servers(gpu1="UP", gpu2="DOWN"), "gpu1", 1, [], "vllm")["line"] == (
        "pool vllm: gpu1 UP, gpu2 DOWN (1 of 2 serving)")


NOW = 1_800_000_000.0
IDLE = {"ready": True, "elapsed": 3.24, "in_flight": {"running": 2, "waiting": 1},
        "in_flight_last": {"running": 0, "waiting": 0}, "server_absent": False}


def view_of(server="gpu1", **statuses):
    return F["lb_pool_view"](servers(**statuses), server, 1, [server], "vllm")


RESULTS = {
    "pool": (dict(action="pool"), view_of(gpu1="UP", gpu2="UP"), {
        "changed": False, "status_before": "UP", "status_after": "UP",
        "message": "pool vllm: gpu1 UP, gpu2 UP (2 of 2 serving)"}),
    "pool that a drain would refuse": (dict(action="pool"), view_of(gpu1="UP", gpu2="MAINT"), {
        "floor_ok": False,
        "message": "pool vllm: gpu1 UP, gpu2 MAINT (1 of 2 serving); a drain of gpu1 would be refused: lb_pool: "
                   "refusing to take gpu1 out of pool vllm: 1 of 2 servers serve now..."}),
    "drain, check mode": (dict(action="drain", check_mode=True, timeout=300, idle=dict(IDLE, elapsed=0.0)),
                          view_of(gpu1="UP", gpu2="UP"), {
        "changed": False, "check_mode": True, "status_after": "UP", "out_since": None, "serving_after": 1,
        "drain_seconds": None, "sessions_at_start": 0,
        "message": "would take gpu1 out of pool vllm (UP now; 2 of 2 serving, 1 would stay, floor 1) and wait up "
                   "to 300 s for its requests in flight (0 on the load balancer, 2 running, 1 waiting now)"}),
    "drain, check mode, nothing listens": (dict(action="drain", check_mode=True, timeout=300,
                                                idle={"ready": True, "elapsed": 0, "in_flight": None,
                                                      "server_absent": True}),
                                           view_of(gpu1="DOWN", gpu2="UP"), {
        "message": "would take gpu1 out of pool vllm (DOWN now; 1 of 2 serving, 1 would stay, floor 1) and wait up "
                   "to 300 s for its requests in flight (0 on the load balancer, nothing answers on its vLLM port "
                   "now)"}),
    "drain": (dict(action="drain", changed=True, after={"status": "MAINT"}, idle=IDLE, timeout=300,
                   out_at=NOW - 3.24, sessions_left=0),
              F["lb_pool_view"](F["lb_pool_haproxy_servers"](csv_text(("gpu1", "UP", 3), "gpu2"), "vllm"),
                                "gpu1", 1, ["gpu1"], "vllm"), {
        "changed": True, "status_before": "UP", "status_after": "MAINT", "drain_seconds": 3.2,
        "sessions_at_start": 3, "sessions_left": 0,
        "in_flight_at_start": {"running": 2, "waiting": 1}, "idle": True, "out_since": NOW - 3.24,
        "message": "gpu1 out of pool vllm (UP -> MAINT; 1 of 2 still serving); its requests in flight "
                   "(3 on the load balancer; 2 running, 1 waiting) ended in 3.2 s"}),
    "drain that proceeds with requests in flight on vLLM": (
        dict(action="drain", changed=True, after={"status": "MAINT"}, out_at=NOW - 300.0, sessions_left=0,
             idle=dict(IDLE, ready=False, elapsed=290.0, in_flight_last={"running": 1, "waiting": 0})),
        view_of(gpu1="UP", gpu2="UP"), {
            "idle": False,
            "message": "gpu1 out of pool vllm (UP -> MAINT; 1 of 2 still serving); requests still in flight after "
                       "300 s (1 running, 0 waiting): they end when the server stops"}),
    "drain that proceeds with sessions left on the load balancer": (
        dict(action="drain", changed=True, after={"status": "MAINT"}, out_at=NOW - 300.0, sessions_left=2,
             idle=None),
        view_of(gpu1="UP", gpu2="UP"), {
            "idle": False, "sessions_left": 2, "in_flight_at_start": None,
            "message": "gpu1 out of pool vllm (UP -> MAINT; 1 of 2 still serving); 2 request(s) still in flight on "
                       "the load balancer after 300 s: they end when the server stops"}),
    "drain of a host where nothing listens": (
        dict(action="drain", changed=True, after={"status": "MAINT"}, out_at=NOW - 1.0, sessions_left=0,
             idle={"ready": True, "elapsed": 0.0, "in_flight": None, "server_absent": True}),
        view_of(gpu1="DOWN", gpu2="UP"), {
            "idle": True,
            "message": "gpu1 out of pool vllm (DOWN -> MAINT; 1 of 2 still serving); nothing answered on its vLLM "
                       "port: nothing was in flight"}),
    "rejoin, check mode after a drain": (dict(action="rejoin", check_mode=True, timeout=120,
                                              drain={"status_after": "UP", "out_since": None}),
                                         view_of(gpu1="UP", gpu2="UP"), {
        "changed": False, "seconds_out": None,
        "message": "would put gpu1 back into pool vllm (out of it after the drain) and wait up to 120 s until "
                   "the load balancer says it serves"}),
    "rejoin": (dict(action="rejoin", changed=True, before={"status": "MAINT"}, timeout=120,
                    drain={"status_after": "MAINT", "out_since": NOW - 61.26}),
               F["lb_pool_view"](F["lb_pool_haproxy_servers"](csv_text(("gpu1", "UP", 0, 1, "L7OK", 2), "gpu2"), "vllm"),
                                 "gpu1", 1, [], "vllm"), {
        "changed": True, "status_before": "MAINT", "status_after": "UP", "seconds_out": 61.3, "rejoin_seconds": 2,
        "message": "gpu1 back in pool vllm (MAINT -> UP, UP after 2 s, out of the pool for 61.3 s; 2 of 2 serving)"}),
    "rejoin confirmed within a second": (
        dict(action="rejoin", changed=True, before={"status": "MAINT"}, timeout=120,
             drain={"status_after": "MAINT", "out_since": NOW - 24.0}),
        F["lb_pool_view"](F["lb_pool_haproxy_servers"](csv_text(("gpu1", "UP", 0, 1, "L7OK", 0), "gpu2"), "vllm"),
                          "gpu1", 1, [], "vllm"), {
            "rejoin_seconds": 0, "seconds_out": 24.0,
            "message": "gpu1 back in pool vllm (MAINT -> UP, UP within 1 s, out of the pool for 24 s; 2 of 2 serving)"}),
}


@pytest.mark.parametrize("kwargs, view, expected", list(RESULTS.values()), ids=list(RESULTS))
def test_results(kwargs, view, expected):
    kwargs = dict(kwargs)
    action = kwargs.pop("action")
    result = F["lb_pool_result"](view, action, now=NOW, **kwargs)
    for key, value in expected.items():
        if isinstance(value, str) and value.endswith("..."):       # a prefix
            assert result[key].startswith(value[:-3]), result[key]
        else:
            assert result[key] == value, (key, result[key])
    assert result["action"] == action and result["type"] == "haproxy" and result["pool"] == "vllm"
    assert result["server"] == "gpu1" and result["at"] == NOW
    assert [s["name"] for s in result["servers"]] == [s["name"] for s in view["servers"]]


@pytest.mark.parametrize("action, says", [("pool", "is not in a pool that modelswap knows"),
                                          ("drain", "is not taken out of a pool before its server stops"),
                                          ("rejoin", "is not put back into a pool")])
def test_type_none_says_so_and_changes_nothing(action, says):
    view = F["lb_pool_view"]([], "gpu1", 1, [], "the pool", "none")
    result = F["lb_pool_result"](view, action, changed=True, now=NOW)
    assert result["message"] == "no load balancer (lb_pool_type: none): gpu1 " + says
    assert result["changed"] is False and result["type"] == "none" and result["servers"] == []


def test_haproxy_sessions():
    text = csv_text(("gpu1", "MAINT", 4), ("gpu2", "UP", 1))
    assert [F["lb_pool_haproxy_sessions"](text, "vllm", h) for h in ("gpu1", "gpu2", "gpu9")] == [4, 1, 0]


def test_rejoin_failure_message():
    view = F["lb_pool_view"](servers(gpu1="DOWN", gpu2="UP"), "gpu1", 1, [], "vllm")
    assert F["lb_pool_rejoin_failure"](view, 120) == (
        "lb_pool: gpu1 was put back into pool vllm but the load balancer did not say it serves within 120 s (now "
        "DOWN, check L7OK): its health check fails or it serves nothing. The host stays as it is: check its server, "
        "then rejoin it (tasks_from: rejoin) or take it out (tasks_from: drain).")


def test_unknown_action():
    with pytest.raises(AnsibleFilterError, match="unknown action 'swap'"):
        F["lb_pool_result"](view_of(gpu1="UP"), "swap")


# ---------------------------------------------------------------------------------- the role's files
ROLE = REPO / "roles" / "lb_pool"


def test_every_default_is_commented_and_every_entry_point_has_its_file():
    lines = (ROLE / "defaults" / "main.yml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line[0].isspace() and not line.startswith(("#", "---")):
            assert lines[i - 1].startswith("#"), line
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    assert set(specs) == {"main", "pool", "drain", "rejoin"}
    for entry in specs:
        assert (ROLE / "tasks" / f"{entry}.yml").is_file()
        # each entry point's options are the main entry's (one definition, mirrored)
        for name, option in specs[entry]["options"].items():
            assert option == specs["main"]["options"][name], (entry, name)
    for kind in ("haproxy", "hooks"):
        for action in ("pool", "drain", "rejoin"):
            assert (ROLE / "tasks" / f"{kind}_{action}.yml").is_file()
    assert specs["main"]["options"]["lb_pool_haproxy_stats_password"]["no_log"] is True


def test_a_failed_pool_read_is_kept_in_lb_pools_own_words():
    wrapped = ("Task failed: Finalization of task args for 'ansible.builtin.set_fact' failed: Error while resolving "
               "value for 'lb_pool_result': The filter plugin 'modelswap.vllm.lb_pool_haproxy_servers' failed: "
               "cannot read http://lb:8404/stats;csv: HTTP 503")
    assert F["lb_pool_read_failure"]({"msg": wrapped}) == {"failed": True, "msg": "cannot read http://lb:8404/stats;csv: HTTP 503"}
    assert F["lb_pool_read_failure"]({"msg": "unreachable"}) == {"failed": True, "msg": "unreachable"}
    assert F["lb_pool_read_failure"]({}) == {"failed": True, "msg": "the pool could not be read"}
