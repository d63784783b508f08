#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: hf_snapshot
short_description: Download a pinned Hugging Face model snapshot and verify every file's content
version_added: "0.1.0"
description:
  - Downloads the files of a Hugging Face repository at one commit with C(huggingface_hub)
    (its C(hf_hub_download), per file, on O(workers) threads) into a hub cache or a plain folder,
    and verifies every file against the Hub's metadata for that commit, C(sha256) for LFS files
    and the git blob C(sha1) for the others. huggingface_hub alone only checks sizes.
  - O(revision) is resolved to a commit once; every file is fetched at that commit, and the
    commit is returned. A pattern set (O(allow_patterns), O(ignore_patterns)) that selects no file
    is an error.
  - Takes a repository-wide lock for the whole download (C(<cache>/.locks/<repo folder>/modelswap.lock),
    or C(<local_dir>/.cache/huggingface/download/.modelswap-download.lock)), which
    M(modelswap.vllm.model_purge) also respects. Under it, partial files that killed runs left
    behind (C(*.incomplete)) are deleted, each only when no download holds its per-file lock.
  - Files are verified in parallel, each as soon as it has landed while others still download.
    A file whose content does not match is deleted and fetched once more; if it is wrong again the
    module deletes it and fails naming it. Transient failures (connection errors, HTTP 408, 429,
    5xx, short transfers) are retried per file with exponential backoff.
  - Writes a verified manifest next to the snapshot (C(<repo folder>/modelswap/<commit>.json) in a
    cache, C(<local_dir>/.cache/huggingface/modelswap/<commit>.json)). The next run with the same
    commit checks it with one C(stat) per file and, when nothing changed, returns C(changed=false)
    without any network request (with a pinned commit; a branch costs one request to resolve).
  - Long downloads report progress while they run through O(progress_file), which the
    M(modelswap.vllm.hf_snapshot_progress) module reads (the model_fetch role polls it).
  - Nothing the Hub or the disk says is used to build a path unchecked. Every file path of the commit's
    file list (from the Hub, huggingface_hub's tree cache, or a manifest) must be a normalized relative
    path (no C(..), C(.) or empty segment, not absolute, no control character) and every blob id 40 or
    64 lowercase hex digits; otherwise the module fails naming the entry before anything is written or
    deleted. Every deletion of a bad file is confined to the repository folder (or the O(local_dir)),
    symlinks resolved, and never removes a blob that another snapshot links to or that another commit's
    verified manifest lists.
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
options:
  repo_id:
    description: The repository, C(org/name).
    type: str
    required: true
  revision:
    description:
      - A commit hash (40 hex digits), a branch or a tag. Always resolved to and returned as the commit.
      - Pin commits in the catalog; a branch costs one Hub request on every run.
    type: str
    default: main
  resolved_commit:
    description:
      - The commit O(revision) was already resolved to (for example the C(target.commit) that
        M(modelswap.vllm.disk_plan) returns). The module then sends no request to
        resolve it again, and takes the commit's file list from huggingface_hub's tree cache when that
        holds it. The manifest and the result still name O(revision).
      - 40 lowercase hex digits, else the module fails before any request; when O(revision) is itself a
        commit it must be the same one. Unset or empty, the revision is resolved here.
    type: str
  listing:
    description:
      - The commit's file list as listed already, e.g. once on the controller for a whole fleet - the
        C(listing) another hf_snapshot returned with O(return_listing) (C(commit) and C(files)). The module
        then asks the Hub for no file list; every path and blob id in it is checked as a Hub listing is.
      - Used only when its commit is the one to fetch (O(resolved_commit) or a pinned O(revision)); a
        verified manifest still comes first.
    type: dict
  return_listing:
    description:
      - Return the selected files of the commit as C(listing), for another hf_snapshot's O(listing) or a
        plan (the migrate role lists each target once on the controller this way, in check mode).
    type: bool
    default: false
  cache_dir:
    description:
      - The Hugging Face hub cache to download into (the folder holding C(models--org--name)).
        Default C(HF_HUB_CACHE), else C(HF_HOME/hub), else C(~/.cache/huggingface/hub).
      - Mutually exclusive with O(local_dir).
    type: path
  local_dir:
    description:
      - A plain folder to download into instead of the cache (files in place, no symlinks).
        Note that a blob already in the default cache is copied, taking its space twice.
    type: path
  allow_patterns:
    description: Only files matching at least one of these globs (fnmatch, as huggingface_hub).
    type: list
    elements: str
  ignore_patterns:
    description: Leave out files matching any of these globs.
    type: list
    elements: str
  token:
    description:
      - Hub token for gated or private repositories. Never logged, returned or written to any file.
      - Only this token is ever sent. A token stored on the host (C(HF_TOKEN), C(hf auth login))
        is not used, so no token reaches an endpoint it was not meant for.
    type: str
  endpoint:
    description: The Hub's URL (a mirror, the lab's local Hub). Default C(HF_ENDPOINT) or huggingface.co.
    type: str
  http_endpoint_trusted:
    description:
      - With a O(token), a plain C(http://) endpoint is refused before any request, because the token
        would cross the network in clear text (and a man in the middle could serve a forged file list).
        C(true) says that endpoint is on a network you trust (the lab's local Hub on its own bridge).
      - Without a token, or with O(offline=true) (nothing is sent), C(http://) is always allowed.
    type: bool
    default: false
  workers:
    description: Files downloaded at once (one connection each).
    type: int
    default: 8
  verify:
    description:
      - C(full) hashes every file's content; C(size) only compares sizes (what huggingface_hub does).
    type: str
    choices: [full, size]
    default: full
  verify_workers:
    description: Threads hashing files in parallel; C(0) means the number of CPUs this process may use.
    type: int
    default: 0
  reverify:
    description:
      - Hash every selected file again even when the manifest vouches for it. Works offline (the
        manifest holds the commit's metadata). Files found bad are deleted and fetched again.
    type: bool
    default: false
  use_xet:
    description:
      - Let huggingface_hub use the Xet protocol where the Hub offers it (production default). C(false)
        forces plain HTTP downloads (mirrors, the lab's local Hub).
    type: bool
    default: true
  offline:
    description:
      - Never contact the Hub; resolve, list and verify from the manifest and the cache only. Fails
        when something would have to be downloaded.
    type: bool
    default: false
  retries:
    description: Extra attempts for a transient failure of one request or file, with exponential backoff.
    type: int
    default: 5
  retry_delay:
    description: Seconds before the first retry; doubled on each further one (at most 60).
    type: float
    default: 2.0
  timeout:
    description: Seconds to wait for the Hub to answer or send data before a retry.
    type: int
    default: 30
  lock_timeout:
    description:
      - Seconds to wait for another download of the same repository that holds the lock and shows no
        progress. One that does (its progress file, named in the lock, keeps moving) is followed to its
        end instead, such as the download a killed controller left running; this run then finds its
        manifest and only verifies. A holder that writes no progress file is waited for this long.
      - C(0) does not wait.
    type: int
    default: 600
  follow_timeout:
    description:
      - Seconds at most to follow another download of the same repository that keeps making progress
        (see O(lock_timeout)); then the module fails with C(cause=locked). C(0) follows none (the wait is
        O(lock_timeout) whatever the holder does). The task's C(async) limit ends the module anyway.
    type: int
    default: 86400
  progress_file:
    description:
      - Where to write the progress JSON (state, bytes, percent, rate, ETA, files) every
        O(progress_interval) seconds while the module runs. Not written in check mode.
      - The repository lock names it, so a run that waits for the lock follows this run's progress.
        While it follows a run that writes the same file, that run alone writes it.
    type: path
  progress_id:
    description: An opaque id written into O(progress_file), so a poller tells this run from an earlier one.
    type: str
    default: ""
  progress_interval:
    description: Seconds between progress file updates.
    type: float
    default: 5.0
  record:
    description:
      - A deployment record (JSON) in which to note, under C(fetched.<record_name>), what is on disk,
        at which commit, verified how. Other keys of the record are kept.
    type: path
  record_name:
    description: The catalog name under which O(record) notes this snapshot.
    type: str
  store:
    description:
      - The id of a model store that several hosts mount (NFS, Lustre, a shared SSD; the same id on
        every host that mounts it), or empty. The manifest records it, and its cheap check (one C(stat) per
        file) then ignores the device number, which differs between the hosts that mount one export.
    type: str
    default: ""
attributes:
  check_mode:
    support: full
    details:
      - A dry run. Resolves the revision and lists the files (Hub metadata, or the cache), then returns the
        files and bytes that would be fetched and predicts C(changed). One C(HEAD) request checks access to a
        file that would be fetched; no file content is transferred and nothing is written.
  diff_mode:
    support: full
    details: The manifest before and after (one line per file).
  async:
    description: Supports being used with the C(async) keyword.
    support: full
    details: Meant to run with C(async) and C(poll=0) for long downloads, polled with hf_snapshot_progress.
requirements:
  - huggingface_hub >= 1.0 (2.x tested) in the Python that runs the module, on the managed host.
notes:
  - Run the task with C(ansible_python_interpreter) set to a Python that has huggingface_hub (on serving
    hosts, the vLLM virtualenv's, as in the examples); without it the module fails and names the library.
  - A killed run leaves partial files that no later run of huggingface_hub reuses; the next hf_snapshot run
    deletes them under the repository lock and fetches those files again (completed files are kept).
  - Within one run, a dropped connection resumes from the last whole 1 MiB chunk received (the module sets
    huggingface_hub's read chunk from 10 MiB to 1 MiB, which also makes progress finer).
seealso:
  - module: modelswap.vllm.hf_snapshot_progress
  - module: modelswap.vllm.disk_plan
  - module: modelswap.vllm.model_purge
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Download a pinned model into the host's cache and verify it
  modelswap.vllm.hf_snapshot:
    repo_id: moonshotai/Kimi-K2.5
    revision: 0123456789abcdef0123456789abcdef01234567
    cache_dir: /var/lib/modelswap/hf/hub
    allow_patterns: ["*.safetensors", "*.json", "*.py", "tokenizer*"]
    token: "{{ hf_token }}"
    workers: 8
  vars:
    ansible_python_interpreter: /opt/modelswap/venvs/vllm/bin/python

- name: Start a long download in the background, with progress in a file
  modelswap.vllm.hf_snapshot:
    repo_id: lab/tiny-a
    revision: main
    endpoint: http://10.213.7.1:8480
    use_xet: false
    local_dir: /srv/models/tiny-a
    progress_file: /var/lib/modelswap/progress/tiny-a.json
    progress_id: "{{ run_id }}"
  async: 86400
  poll: 0
  register: fetch_job

- name: Re-verify a snapshot offline (no network), e.g. after a disk incident
  modelswap.vllm.hf_snapshot:
    repo_id: lab/tiny-a
    revision: 8976b4494868209c1aa701c350d8990989f06532
    cache_dir: /var/lib/modelswap/hf/hub
    offline: true
    reverify: true
"""

RETURN = r"""
repo_id:
  description: The repository.
  returned: always
  type: str
revision:
  description: The revision asked for.
  returned: always
  type: str
commit:
  description: The commit the revision resolved to (what was downloaded and verified).
  returned: success
  type: str
  sample: 8976b4494868209c1aa701c350d8990989f06532
snapshot_path:
  description: The snapshot folder to load the model from (C(snapshots/<commit>) in a cache, or the local_dir).
  returned: success
  type: str
layout:
  description: C(cache) or C(local_dir).
  returned: success
  type: str
files:
  description: Files selected (after patterns).
  returned: success
  type: int
bytes_total:
  description: Their total size.
  returned: success
  type: int
files_downloaded:
  description: Files fetched by this run (0 on a no-op).
  returned: success
  type: int
bytes_downloaded:
  description:
    - Bytes of the files this run fetched (their sizes, as stored; a transfer that restarted counts once),
      over Xet as over plain HTTP.
  returned: success
  type: int
bytes_received:
  description:
    - Bytes that actually arrived over the network in this run, counted as they arrived. More than
      RV(bytes_downloaded) when a transfer restarted from byte 0 (a server ignored a resume's Range) or
      a file was fetched again after a failed verification. Over Xet this is what hf_xet received,
      compressed chunks, so it can be less than RV(bytes_downloaded).
  returned: success
  type: int
target_files:
  description:
    - The selected files as C([{path, size, etag, xet_hash}]) (C(etag) - the LFS sha256, else the git
      blob id; C(xet_hash) only where the Hub stores the file with Xet), the Hub's listing of the
      commit after patterns. A check-mode run on the controller gives the
      expected list that modelswap.vllm.peer_snapshot verifies copies against.
  returned: success
  type: list
  elements: dict
  sample: [{"path": "config.json", "size": 652, "etag": "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"}]
kept_blobs:
  description:
    - Blobs that cleaning a bad file left in place because another snapshot links to them or another
      commit's verified manifest lists them (blob, because).
  returned: success
  type: list
  elements: dict
seconds:
  description: Wall time of the whole run.
  returned: always
  type: float
mb_per_s:
  description: Download rate (bytes_downloaded / download time, in MB/s of 10^6 bytes).
  returned: success
  type: float
verification:
  description: How the files were verified.
  returned: success
  type: dict
  contains:
    mode: {description: "full (content hashes) or size.", type: str}
    ok: {description: Every selected file is verified., type: bool}
    source: {description: "manifest (earlier verification, unchanged files) or this run.", type: str}
    files: {description: Files checked by this run., type: int}
    hashed_bytes: {description: Bytes hashed by this run., type: int}
    seconds: {description: Wall time from the first to the last verification of this run., type: float}
    workers: {description: Hashing threads., type: int}
    refetched: {description: "Files that failed verification and were fetched once more (path, reason).", type: list}
    verified_at: {description: When the manifest was written (UTC)., type: str}
manifest:
  description: The manifest's path.
  returned: success
  type: str
extra_files:
  description: In local_dir mode, files in the folder that the snapshot does not have (at most 20; left alone).
  returned: when there are any
  type: list
  elements: str
orphans_removed:
  description: Partial files of earlier killed runs deleted before downloading (path, bytes).
  returned: success
  type: list
  elements: dict
listing:
  description: The selected files of the commit, as the Hub listed them (path to size, blob id, LFS sha256).
  returned: when return_listing is true
  type: dict
  contains:
    commit: {description: The commit., type: str}
    files: {description: "Path to C({size, blob_id, lfs_sha256}).", type: dict}
would_fetch:
  description: In check mode, what a real run would fetch and verify.
  returned: check_mode
  type: dict
  contains:
    files: {description: Files to download., type: list}
    bytes: {description: Bytes to download., type: int}
    verify: {description: Files already present that would be verified., type: list}
record:
  description: The deployment record's entry for this snapshot, and whether it changed.
  returned: when record is set
  type: dict
summary:
  description: One line for humans.
  returned: success
  type: str
  sample: "lab/tiny-a@8976b449...: 9 files, 2.3 MiB; downloaded 9 files (2.3 MiB) in 0.8 s (12.1 MB/s); verified full (9 files); /var/..."
listing_source:
  description: >-
    Where the commit's file list came from, C(manifest), C(given) (O(listing)), C(tree_cache)
    (huggingface_hub's) or C(hub).
  returned: success
  type: str
resolved_by:
  description: How the revision became a commit, C(pinned) (it is one), C(given) (O(resolved_commit)), C(hub)
    or C(cache) (offline).
  returned: success
  type: str
requests_made:
  description: Whether this run sent any request to the Hub.
  returned: success
  type: bool
timings:
  description: Seconds spent planning (resolve, list), waiting for the lock, preparing, transferring and
    verifying, writing the manifest.
  returned: success
  type: dict
library_messages:
  description: Warnings of huggingface_hub and the module's retries (resumed transfers, retried requests).
  returned: always
  type: list
  elements: str
cause:
  description: On failure, a short code of the cause (repo_not_found, revision_not_found, gated, unauthorized,
    hub_unavailable, unreachable, disk_full, not_writable, corrupt, no_match, locked, offline, bad_repo_id,
    bad_listing, unsafe_path, insecure_endpoint, ...).
  returned: failure
  type: str
"""

import time
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.modelswap.vllm.plugins.module_utils.common.catalog import DEFAULT_REVISION
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_download
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.hub import hf_snapshot_result
from ansible_collections.modelswap.vllm.plugins.module_utils.hub.hf_snapshot_result import ACTION


def main():
    module = AnsibleModule(
        argument_spec=dict(
            repo_id=dict(type="str", required=True),
            revision=dict(type="str", default=DEFAULT_REVISION),
            resolved_commit=dict(type="str"),
            listing=dict(type="dict"),
            return_listing=dict(type="bool", default=False),
            cache_dir=dict(type="path"),
            local_dir=dict(type="path"),
            allow_patterns=dict(type="list", elements="str"),
            ignore_patterns=dict(type="list", elements="str"),
            token=dict(type="str", no_log=True),
            endpoint=dict(type="str"),
            http_endpoint_trusted=dict(type="bool", default=False),
            workers=dict(type="int", default=8),
            verify=dict(type="str", choices=["full", "size"], default="full"),
            verify_workers=dict(type="int", default=0),
            reverify=dict(type="bool", default=False),
            use_xet=dict(type="bool", default=True),
            offline=dict(type="bool", default=False),
            retries=dict(type="int", default=5),
            retry_delay=dict(type="float", default=2.0),
            timeout=dict(type="int", default=30),
            lock_timeout=dict(type="int", default=600),
            follow_timeout=dict(type="int", default=86400),
            progress_file=dict(type="path"),
            progress_id=dict(type="str", default=""),
            progress_interval=dict(type="float", default=5.0),
            record=dict(type="path"),
            record_name=dict(type="str"),
            store=dict(type="str", default=""),
        ),
        mutually_exclusive=[("cache_dir", "local_dir")],
        required_together=[("record", "record_name")],
        supports_check_mode=True,
    )
    p = module.params
    started = time.monotonic()
    base = {"repo_id": p["repo_id"], "revision": p["revision"]}

    def fail(failure):
        module.fail_json(msg="%s: %s" % (ACTION, failure.msg), cause=failure.cause, changed=False,
                         seconds=round(time.monotonic() - started, 3), **dict(base, **failure.extra))

    problem = hf_snapshot_result.options_problem(p)
    if problem:
        fail(hf_snapshot_result.Failed(problem, "bad_option"))
    if not hf_download.HAS_HF:
        reason = ("to download %s (set ansible_python_interpreter, e.g. model_fetch_python, "
                  "to the vLLM virtualenv's python)" % p["repo_id"])
        module.fail_json(msg=missing_required_lib("huggingface_hub", reason=reason),
                         cause="missing_library", **base)
    try:
        hf = hf_download.load_hf(use_xet=p["use_xet"], offline=p["offline"], timeout=p["timeout"])
    except Exception as exc:  # a broken install is as good as none
        module.fail_json(msg=missing_required_lib("huggingface_hub", reason="it failed to import: %s" % exc),
                         exception=traceback.format_exc(), cause="missing_library", **base)
    try:
        # counters always; the file only with progress_file; neither in check mode
        progress = None if module.check_mode else hf_snapshot_result.start_progress(p)
        job = hf_snapshot.job_for(p, hf, progress)
        changed, result = hf_snapshot_result.run(job, p, progress, check_mode=module.check_mode,
                                                 diff=module._diff, warn=module.warn, started=started)
    except hf_snapshot_result.Failed as failure:
        fail(failure)
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()
