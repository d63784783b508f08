"""The lab's local Hugging Face Hub (plain HTTP and Xet) with fault injection and a request log.

- store.py    content store: real git commit/tree/blob ids, LFS sha256, blobs stored once
- server.py   `python -m tests.lab.hub.server --root DIR --host H --port P` (endpoints in its docstring)
- xet.py      Xet from the spec: chunk/xorb/file hashes, xorbs, reconstructions, signed tokens and URLs
- publish.py  `python -m tests.lab.hub.publish --root DIR REPO_ID SRC [--gated] [--branch B] [--tag T]`
- faults.py   fault kinds, selectors and counts (the semantics are in its docstring)
- client.py   HubClient(url, root): publish, token, fault, clear_faults, requests, clear_log
- fixtures.py pytest fixtures `local_hub`, `hf_env` (plain HTTP) and `hf_xet_env` (Xet)
"""
