#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, modelswap engineers
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)
# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: peer_snapshot
short_description: Copy a verified model snapshot from a peer host, and verify it against the Hub's file list
version_added: "0.1.0"
description:
  - Works on one commit of a repository in the host's Hugging Face hub cache (C(blobs/<etag>),
    C(snapshots/<commit>/<path>) as relative links to the blobs, C(refs/)), against the expected
    file list O(files), the Hub's listing of that commit made once on the controller. A copy counts
    only when every expected file hashes to its C(etag) here (C(sha256) for LFS files, the git blob
    C(sha1) for the others), whatever the peer says.
  - O(state=read) reads only - whether a verified manifest vouches for the files (one C(stat) per
    file, no hashing) and which blobs are missing, with their bytes.
  - O(state=copied) pulls the missing blobs from O(source) with C(rsync) over SSH (host key checking
    on), by name and never over an existing file, under the repository lock hf_snapshot takes
    (C(<cache>/.locks/<repo folder>/modelswap.lock)), into a staging folder
    (C(<cache>/.locks/<repo folder>/peer-incoming)); checks and hashes every blob; only then publishes
    the received ones, makes the snapshot's links here from O(files), and writes the verified manifest (format C(modelswap.hf_snapshot/1), as
    M(modelswap.vllm.hf_snapshot) writes it, so hf_snapshot, vllm_service and the next run see the
    snapshot verified), the ref of O(revision), and C(fetched.<record_name>) in the deployment record.
    Nothing is done when the manifest already vouches for the files.
  - A copy that does not verify is undone - the links it made and the blobs it wrote are deleted
    (never a blob another snapshot links to or another commit's verified manifest lists) - and the
    module fails with a RV(cause) that says whom to blame - C(bad_copy) (a blob the peer sent does not
    match - the peer's copy is damaged), C(source_incomplete) (the peer lacks files), C(copy_failed)
    (rsync or SSH failed), C(local_bad) (a blob already here does not match; it is deleted when nothing
    else uses it).
  - O(state=verified) makes sure the files are verified here - without O(rehash), the manifest must
    vouch for them (a host of a shared store after another host filled it); with O(rehash), every
    file is hashed again, the manifest rewritten, and on a mismatch the manifest and the bad blobs
    nothing else uses are removed, so the host stops claiming the snapshot (C(bad_content)).
  - The manifest written after a copy lists only the expected files (the patterns that selected them
    are recorded); hf_snapshot uses that list only for the same patterns.
  - A peer sends bytes, never links or special files - rsync runs with C(--times --no-links --no-devices
    --no-specials --ignore-existing --files-from), not C(--archive), so the peer chooses no symlink,
    device, FIFO, owner, group or mode here (files get this host's umask, as huggingface_hub's own).
    Every blob - received or already here - is opened with C(O_NOFOLLOW) (each folder on the way too)
    and C(fstat)ed before it is hashed from that descriptor; a symbolic link, directory, FIFO, socket or
    device is refused (a received one fails the copy as C(bad_copy), naming the file and what it is;
    the peer is blamed and another peer tried). The one link accepted is one this host's own
    huggingface_hub made - C(blobs/<sha256>) into the cache's marked shared Xet store
    (C(<cache>/blobs/<xx>/<xet hash>)), whose entry is then opened the same way.
  - A peer that downloaded through hf_xet (huggingface_hub 2.4) keeps each payload once per cache at
    C(<cache>/blobs/<xx>/<xet hash>) and C(models--o--n/blobs/<sha256>) is a relative link to it. A dry
    run lists the peer's entries with their link targets; a link into that store is pulled by the
    store entry's own name (a link elsewhere is refused as C(bad_copy)). rsync's C(--copy-links) is not
    used - rrsync refuses it under a restricted folder, and it would follow any link the peer has.
  - A received blob is published here as a regular repository blob C(models--o--n/blobs/<sha256>) (a
    hard link of the checked file, never over an existing entry). With O(use_xet), a blob whose
    O(files) entry has a C(xet_hash) is then moved into this cache's shared Xet store
    (C(<cache>/blobs/<xx>/<xet hash>), the store made and marked if the cache has none) and the
    repository blob becomes the relative link huggingface_hub's own Xet downloads make, its
    reference written to C(<xet hash>.refs) under C(<xet hash>.lock) first - so a later download
    through hf_xet of another repository with that file links it instead of storing it twice, and
    huggingface_hub's purge and scan see a normal cache. The hash comes from the controller's listing,
    never from the peer. As with huggingface_hub's own publish this is best effort - the blob stays a
    regular repository blob when the store already has that payload (another repository's), its lock
    is held, or C(<cache>/blobs) is a folder that is not a marked store (RV(shared_store)).
extends_documentation_fragment:
  - modelswap.vllm.attributes
  - ansible.builtin.action_common_attributes
options:
  state:
    description: C(read), C(copied) or C(verified), as described above.
    type: str
    choices: [read, copied, verified]
    default: read
  repo_id:
    description: The repository, C(org/name).
    type: str
    required: true
  commit:
    description: The commit (40 hex digits) the expected file list belongs to.
    type: str
    required: true
  revision:
    description: The catalog's revision (a branch or tag is written as C(refs/<revision>)); empty for the commit.
    type: str
    default: ""
  files:
    description:
      - The expected files, the Hub's listing of O(commit) after the catalog's patterns (what
        C(store/disk_plan.py) C(list_target) and hf_snapshot's RV(modelswap.vllm.hf_snapshot#module:target_files) return).
    type: list
    elements: dict
    required: true
    suboptions:
      path:
        description: The file's path in the repository.
        type: str
        required: true
      size:
        description: Its size in bytes.
        type: int
        required: true
      etag:
        description: Its blob name in the cache - the sha256 of an LFS file (64 hex), else the git blob sha1 (40 hex).
        type: str
        required: true
      xet_hash:
        description:
          - The file's Xet hash (64 hex) where the Hub stores it with Xet - the name of its payload in a
            shared Xet store (the Hub's C(xetHash), which hf_snapshot's RV(modelswap.vllm.hf_snapshot#module:target_files) carries).
        type: str
  cache_dir:
    description: The Hugging Face hub cache on this host (the folder holding C(models--org--name)).
    type: path
    required: true
  allow_patterns:
    description: The catalog's allow patterns that selected O(files) (recorded in the manifest).
    type: list
    elements: str
  ignore_patterns:
    description: The catalog's ignore patterns that selected O(files) (recorded in the manifest).
    type: list
    elements: str
  source:
    description: The address (or name) this host reaches the peer at, over SSH. Required with O(state=copied).
    type: str
  source_name:
    description: The peer's inventory name, for messages and the manifest (defaults to O(source)).
    type: str
    default: ""
  source_cache_dir:
    description: The hub cache on the peer; empty for the same path as O(cache_dir).
    type: path
  source_root:
    description:
      - The folder the peer serves this host's key from, read-only, through the forced command
        C(rrsync -ro <source_root>) in its C(authorized_keys) (least privilege - see notes); the
        peer's files are then named relative to it, and O(source_cache_dir) must be that folder or
        under it. Usually the peer's cache folder itself.
      - Empty when the peer's key is not restricted (a plain SSH login that runs C(rsync --server));
        the peer's files are then named by their absolute path.
    type: str
    default: ""
  source_user:
    description: The user to log in as on the peer (it must read the peer's cache).
    type: str
    default: root
  source_port:
    description: The peer's SSH port.
    type: int
    default: 22
  ssh_key:
    description: The private key on this host that the peer accepts; empty for SSH's defaults.
    type: path
  known_hosts:
    description:
      - A known_hosts file with the peer's host key; empty for SSH's own (C(~/.ssh/known_hosts),
        C(/etc/ssh/ssh_known_hosts)). Host key checking is always on.
    type: path
  connect_timeout:
    description: Seconds SSH waits to connect to the peer.
    type: int
    default: 10
  io_timeout:
    description: Seconds without data after which rsync gives up (C(--timeout)).
    type: int
    default: 300
  bwlimit:
    description: Bandwidth cap of the copy in KiB/s (rsync's C(--bwlimit)); 0 for none.
    type: int
    default: 0
  store:
    description:
      - The id of a store several hosts mount, or empty. The manifest records it; the cheap check then
        ignores the device number, which differs between the hosts that mount one export.
    type: str
    default: ""
  endpoint:
    description: The Hub the expected list came from (recorded in the manifest).
    type: str
    default: ""
  verify_workers:
    description: Threads hashing files; 0 for the host's CPUs.
    type: int
    default: 0
  rehash:
    description: With O(state=verified), hash every file again even when the manifest vouches for it.
    type: bool
    default: false
  lock_timeout:
    description: Seconds to wait for another download of the repository to release its lock.
    type: int
    default: 3600
  use_xet:
    description:
      - Whether this host's cache takes the Xet layout - a copied blob with a C(xet_hash) goes into the
        cache's shared Xet store, as a download through hf_xet would put it. Without it copies stay
        regular repository blobs, as plain HTTP downloads.
    type: bool
    default: true
  record:
    description: A deployment record in which to note C(fetched.<record_name>) once the snapshot is verified.
    type: path
  record_name:
    description: The catalog name under which O(record) notes the snapshot.
    type: str
attributes:
  check_mode:
    support: full
    details:
      - Reads only, never contacts the peer - reports whether the files are verified, the blobs and
        bytes a copy would bring, and predicts C(changed).
  diff_mode:
    support: none
requirements:
  - rsync and an SSH client on this host, rsync on the peer, for O(state=copied). Python's standard
    library only (no huggingface_hub).
notes:
  - The copy pulls from the peer, so the SSH trust runs from the receiving host to the peer - its key
    (O(ssh_key)) in the peer's C(authorized_keys), the peer's host key in its known hosts.
  - Least privilege on the peer - the key is accepted only with a forced command that serves the cache
    read-only, from the site's network, with no shell, forwarding or terminal -
    C(from="10.0.0.0/24",restrict,command="/usr/bin/rrsync -ro /var/lib/modelswap/hf/hub" ssh-ed25519 AAAA... modelswap-peer)
    (rrsync ships with Debian's and Ubuntu's rsync package since 3.2.4), and O(source_root) set to that
    folder. Holding the key then lets one read the peer's cache, not log in as root
    (roles/model_fetch/README.md, Peer access).
  - Hashing is the cost of trusting nothing - about 0.75 GB/s per core with Python's hashlib
    (docs/huggingface.md), done after the copy.
seealso:
  - module: modelswap.vllm.hf_snapshot
author:
  - modelswap engineers (@modelswap)
"""

EXAMPLES = r"""
- name: Is the target verified here, and what would a copy bring?
  modelswap.vllm.peer_snapshot:
    state: read
    repo_id: lab/tiny-b
    commit: 5adf7ab29f6060a97a9982849ec851bb2442f6f2
    files: "{{ target.files }}"
    cache_dir: /var/lib/modelswap/hf/hub
  register: here

- name: Copy it from gpu1, verify every file, record it
  modelswap.vllm.peer_snapshot:
    state: copied
    repo_id: lab/tiny-b
    commit: 5adf7ab29f6060a97a9982849ec851bb2442f6f2
    revision: main
    files: "{{ target.files }}"
    cache_dir: /var/lib/modelswap/hf/hub
    source: "{{ hostvars['gpu1'].ansible_host }}"
    source_name: gpu1
    ssh_key: /root/.ssh/modelswap_peer
    record: /var/lib/modelswap/deployment.json
    record_name: tiny-b

- name: Hash it all again (a source whose copy did not verify elsewhere)
  modelswap.vllm.peer_snapshot:
    state: verified
    rehash: true
    repo_id: lab/tiny-b
    commit: 5adf7ab29f6060a97a9982849ec851bb2442f6f2
    files: "{{ target.files }}"
    cache_dir: /var/lib/modelswap/hf/hub
"""

RETURN = r"""
verified:
  description: Whether the files are verified here after the task (in check mode, now).
  returned: always
  type: bool
reason:
  description: Why they are not verified (null when they are).
  returned: always
  type: str
missing:
  description: The blobs missing here after the task (C(blobs), C(bytes)); in check mode and for O(state=read), now.
  returned: always
  type: dict
  sample: {"blobs": 3, "bytes": 7130412}
copied:
  description: What the copy brought (C(from), C(blobs), C(bytes), C(seconds)); in check mode, what it would.
  returned: always
  type: dict
verification:
  description:
    - How the files were verified - C(mode) (C(manifest) - one stat per file, or C(full) - hashed), C(ok),
      C(files), C(hashed_bytes), C(seconds), C(failures) (C(path), C(blob), C(reason)).
  returned: always
  type: dict
removed:
  description: Files deleted because a copy or a rehash did not verify (and leftovers of a killed copy).
  returned: always
  type: list
  elements: str
kept_blobs:
  description: Blobs of a failed copy left in place because other revisions use them (C(blob), C(because)).
  returned: always
  type: list
  elements: dict
links:
  description: Snapshot links made (C(created)) and wrong ones replaced (C(replaced)).
  returned: always
  type: dict
shared_store:
  description:
    - Copied blobs moved into this cache's shared Xet store (C(published), a count) and those kept as
      regular repository blobs (C(kept), each C(blob) and C(because)); see O(use_xet).
  returned: always
  type: dict
cause:
  description:
    - Why the task failed - C(bad_copy), C(source_incomplete), C(copy_failed), C(local_bad), C(bad_content),
      C(not_verified), C(disk_full), C(locked), C(no_rsync), C(bad_files), C(bad_option), C(bad_record),
      C(unsafe_path), C(bad_layout), C(error).
  returned: failure
  type: str
snapshot_path:
  description: The snapshot folder (C(<cache>/models--org--name/snapshots/<commit>)).
  returned: always
  type: str
manifest:
  description: The verified manifest's path.
  returned: always
  type: str
files:
  description: Number of expected files.
  returned: always
  type: int
bytes_total:
  description: Their total size.
  returned: always
  type: int
recorded:
  description: Whether the deployment record's C(fetched.<record_name>) changed.
  returned: always
  type: bool
summary:
  description: One line for humans.
  returned: success
  type: str
  sample: "lab/tiny-b@5adf7ab29f60: 7 files, 6.8 MiB; copied 2 blob(s) (6.8 MiB) from gpu1 in 0.2 s; verified 7 files (6.8 MiB hashed in 0.1 s)"
"""

import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.modelswap.vllm.plugins.module_utils.common.command_runner import HostCommands
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_files
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_snapshot
from ansible_collections.modelswap.vllm.plugins.module_utils.fleet import peer_transfer

ACTION = "peer_snapshot"


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=list(peer_snapshot.STATES), default="read"),
            repo_id=dict(type="str", required=True),
            commit=dict(type="str", required=True),
            revision=dict(type="str", default=""),
            files=dict(type="list", elements="dict", required=True, options=dict(
                path=dict(type="str", required=True),
                size=dict(type="int", required=True),
                etag=dict(type="str", required=True),
                xet_hash=dict(type="str"),
            )),
            cache_dir=dict(type="path", required=True),
            allow_patterns=dict(type="list", elements="str"),
            ignore_patterns=dict(type="list", elements="str"),
            source=dict(type="str"),
            source_name=dict(type="str", default=""),
            source_cache_dir=dict(type="path"),
            source_root=dict(type="str", default=""),
            source_user=dict(type="str", default="root"),
            source_port=dict(type="int", default=22),
            ssh_key=dict(type="path"),
            known_hosts=dict(type="path"),
            connect_timeout=dict(type="int", default=10),
            io_timeout=dict(type="int", default=300),
            bwlimit=dict(type="int", default=0),
            store=dict(type="str", default=""),
            endpoint=dict(type="str", default=""),
            verify_workers=dict(type="int", default=0),
            rehash=dict(type="bool", default=False),
            lock_timeout=dict(type="int", default=3600),
            record=dict(type="path"),
            record_name=dict(type="str"),
            use_xet=dict(type="bool", default=True),
        ),
        required_if=[("state", "copied", ("source",))],
        required_together=[("record", "record_name")],
        supports_check_mode=True,
    )
    p = module.params
    copier = None
    try:
        if p["state"] == "copied" and not module.check_mode:
            copier = peer_transfer.rsync_copier(
                HostCommands.of(module), source_cache_dir=p["source_cache_dir"] or p["cache_dir"],
                serve_root=p["source_root"] or "", source=p["source"], user=p["source_user"], port=p["source_port"],
                ssh_key=p["ssh_key"] or "", known_hosts=p["known_hosts"] or "",
                connect_timeout=p["connect_timeout"], io_timeout=p["io_timeout"], bwlimit=p["bwlimit"])
        result = peer_snapshot.run(p, copier=copier, check_mode=module.check_mode)
    except peer_files.PeerError as exc:
        # an undone copy or a rehash that dropped bad files changed the host
        module.fail_json(msg="%s: %s" % (ACTION, exc), cause=exc.cause,
                         **dict(exc.result, changed=bool(exc.result.get("removed"))))
    except OSError as exc:
        module.fail_json(msg="%s: %s of %s failed: %s; check the cache folder's permissions and free space"
                         % (ACTION, p["state"], p["repo_id"], exc), cause="error", exception=traceback.format_exc())
    module.exit_json(**result)


if __name__ == "__main__":
    main()
