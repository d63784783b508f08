"""A single-name Hub repo id (the Hub's `gpt2`, `bert-base-uncased`) from preview to serve on the
lab, and one sentence for a catalog entry that cannot be served, from the preview and the deploy.

The catalog's rules have one owner (plugins/module_utils/common/catalog.py): before it, a name without a
namespace passed preflight and the fetch and was refused at deploy, after the purge and the
download had run. Here tiny-a's files are published on the local Hub under a single-name id, and
that entry is previewed (migrate.yml --check), fetched and verified (model_fetch) and served
(vllm_service: one real vLLM start on one host). An entry with a flag the role owns in its
vllm_args is refused by the preview and by the deploy with the same sentence, before anything
changes.
"""
from __future__ import annotations

import re

import pytest

from ansible_collections.modelswap.vllm.plugins.plugin_utils import runner
from tests.integration import vllm_lab as V

pytestmark = [pytest.mark.lab, pytest.mark.vllm]

HOST = "gpu1"
REPO_ID = "modelswap-single"          # no namespace, like gpt2
FOLDER = "models--" + REPO_ID


def published_files(lab) -> dict:
    """tiny-a's files at its pinned commit, read from the lab Hub's own store."""
    tiny = lab.models["tiny-a"]
    store = lab.hub.store
    commit = store.commit(tiny["repo_id"], tiny["commit"])
    return {path: store.object_path(entry.sha256).read_bytes() for path, entry in commit.files.items()}


@pytest.fixture(scope="module")
def single(lab):
    commit = lab.hub.publish(REPO_ID, published_files(lab), gated=False)
    catalog = V.catalog(lab)
    catalog["single"] = dict(catalog["tiny-a"], repo_id=REPO_ID, revision=commit,
                             served_model_name="single")
    catalog["bad"] = dict(catalog["tiny-a"], vllm_args=dict(V.CPU_ARGS, port=9000))
    forget = V.FORGET_MODEL.format(repo_folder=FOLDER, name="single")
    V.reset_host(lab, HOST)
    lab.ssh(HOST, forget)
    yield {"commit": commit, "catalog": catalog, "key": V.new_api_key()}
    V.reset_host(lab, HOST)
    lab.ssh(HOST, forget)


def test_the_preview_plans_the_single_name_repo(lab, single):
    out = runner.preview(str(lab.inventory), serve="single", limit=HOST,
                         extra_vars={"modelswap_models": single["catalog"]})
    assert out["ok"], out["run"]["failures"]
    steps = {s["step"]: s for s in out["plan"][HOST]["steps"]}
    assert steps["preflight"]["verdict"] == "fits"
    assert steps["fetch"]["files"] == len(published_files(lab)) and steps["fetch"]["bytes"] > 0


def test_a_single_name_repo_is_fetched_verified_and_served(lab, single):
    V.prepare(lab, [HOST], single["key"])        # vLLM installed, the lab's models fetched (no-ops when done)
    fetch = lab.playbook(V.FETCH, dict(V.fetch_vars(lab), modelswap_models=single["catalog"],
                                       vllm_fetch_models=["single"]), limit=HOST)
    assert fetch.rc == 0, fetch.stdout[-6000:]
    deploy = lab.playbook(V.DEPLOY, V.role_vars(lab, single["key"], modelswap_models=single["catalog"],
                                                modelswap_serve="single"), limit=HOST)
    assert deploy.rc == 0, deploy.stdout[-6000:]
    assert V.served_names(lab, HOST, single["key"]) == ["single"]
    record = V.record(lab, HOST)
    assert record["model"] == "single" and record["commit"] == single["commit"]
    assert record["path"].endswith("/%s/snapshots/%s" % (FOLDER, single["commit"]))
    assert "single" in record["fetched"]


def refusal(messages: str) -> str:
    """The catalog sentence of a failed run, without the role's prefix."""
    found = re.search(r"catalog entry 'bad' is invalid: (.*?); nothing was changed", " ".join(messages.split()))
    assert found, messages[-4000:]
    return found.group(1)


def test_an_entry_the_deploy_refuses_is_refused_by_the_preview_with_the_same_sentence(lab, single):
    preview = runner.preview(str(lab.inventory), serve="bad", limit=HOST,
                             extra_vars={"modelswap_models": single["catalog"]})
    deploy = lab.playbook(V.DEPLOY, V.role_vars(lab, single["key"], modelswap_models=single["catalog"],
                                                modelswap_serve="bad"), limit=HOST, check=True)
    assert not preview["ok"] and deploy.rc != 0
    sentence = refusal(" ".join(preview["run"]["failures"][HOST]))
    assert "port" in sentence and "vllm_service_port" in sentence
    assert refusal(" ".join(deploy.failures()[HOST])) == sentence
