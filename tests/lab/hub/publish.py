"""Publish a folder to the lab Hub's store: `python -m tests.lab.hub.publish --root DIR REPO_ID SRC`.

Prints the commit id. Safe while the server runs (every write is atomic).
"""
from __future__ import annotations

import argparse
import sys

from tests.lab.hub.store import Store, StoreError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.lab.hub.publish", description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="the Hub's store folder")
    ap.add_argument("repo_id", help="e.g. lab/tiny-a")
    ap.add_argument("src", help="folder whose files become the branch head")
    ap.add_argument("--branch", default="main")
    ap.add_argument("--tag", help="also point this tag at the commit")
    ap.add_argument("--message", help="commit message")
    gate = ap.add_mutually_exclusive_group()
    gate.add_argument("--gated", dest="gated", action="store_true", default=None,
                      help="files need a token (metadata stays public)")
    gate.add_argument("--not-gated", dest="gated", action="store_false")
    args = ap.parse_args(argv)
    try:
        commit = Store(args.root).publish(args.repo_id, args.src, gated=args.gated, branch=args.branch,
                                          tag=args.tag, message=args.message)
    except (StoreError, OSError) as e:
        print(f"publish {args.repo_id} from {args.src}: {e}", file=sys.stderr)
        return 1
    print(commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
