#!/usr/bin/env bash
# ansible-test sanity for the built collection (issue 9). ansible-test skips symlinked folders,
# so it runs on an installed copy with plugins/modules and plugins/module_utils as real folders.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
bin="$repo/.venv/bin"
work="$repo/build/sanity"
rm -rf "$work" && mkdir -p "$work"
"$bin/ansible-galaxy" collection build --force --output-path "$work" "$repo" >/dev/null
mkdir -p "$work/tmp" && tar -xzf "$work"/modelswap-vllm-*.tar.gz -C "$work/tmp"
dest="$work/ansible_collections/modelswap/vllm"
mkdir -p "$dest" && cp -rL "$work/tmp/." "$dest/"
rm -rf "$dest/library" "$dest/module_utils" "$work/tmp"    # the same files live in plugins/
# ansible-test bootstraps pip in its virtualenvs with a script from outside the registries.
cache="$HOME/.ansible/test/cache"
mkdir -p "$cache"
for v in 24_2 25_1 25_3; do cp "$repo/tests/sanity/get_pip_standin.py" "$cache/get_pip_$v.py"; done
cd "$dest"
git init -q . && git add -A   # ansible-test lists targets from git
# Without arguments: every sanity test of ansible-core but pylint, whose collection profile flags
# `_` as a name and subprocess.run without check= (130+ findings, mostly in tests/; 80 s here):
# run it alone with `tests/sanity/run.sh --test pylint`. shellcheck runs only where installed.
# With arguments (e.g. `--test pep8`), exactly those tests.
[ $# -gt 0 ] || set -- --skip-test pylint
"$bin/ansible-test" sanity --python 3.11 --color no "$@" 2>&1 \
  | grep -v -E "is ignored: it is neither a file nor a directory|^(Processing|Looking in (links|indexes)|Collecting|Downloading|Using cached|Requirement already|Installing collected|Successfully|Attempting uninstall)|^ +(━|Found existing|Uninstalling|Successfully)"
