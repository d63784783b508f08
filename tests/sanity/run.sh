#!/usr/bin/env bash
# ansible-test on the built collection, as a reviewer or AWX gets it (galaxy.yml's build_ignore
# applied): `run.sh [sanity args]` runs sanity, `run.sh units [units args]` the unit tests that
# need neither the lab, the local Hub nor the repository around the collection (the files that
# import the lab's tooling are left out below; tests/conftest.py deselects the marked tests).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
bin="$repo/.venv/bin"
work="$repo/build/sanity"
rm -rf "$work" && mkdir -p "$work"
"$bin/ansible-galaxy" collection build --force --output-path "$work" "$repo" >/dev/null
mkdir -p "$work/tmp" && tar -xzf "$work"/modelswap-vllm-*.tar.gz -C "$work/tmp"
dest="$work/ansible_collections/modelswap/vllm"
mkdir -p "$dest" && cp -rL "$work/tmp/." "$dest/"
rm -rf "$work/tmp"
# ansible-test bootstraps pip in its virtualenvs with a script from outside the registries.
cache="$HOME/.ansible/test/cache"
mkdir -p "$cache"
for v in 24_2 25_1 25_3; do cp "$repo/tests/sanity/get_pip_standin.py" "$cache/get_pip_$v.py"; done
cd "$dest"
git init -q . && git add -A   # ansible-test lists targets from git
if [ "${1:-}" = units ]; then
  shift
  # every test file under tests/unit (laid out like the code: plugins/..., roles/, the repository's
  # own at the top), less the ones that import the lab's tooling (not shipped): directly, or through
  # tests.support.bench_accuracy or the fixtures of tests/unit/roles/test_benchmark.py
  [ $# -gt 0 ] || set -- $(grep -rL -E "tests[.](lab|support[.]bench_accuracy|unit[.]roles[.]test_benchmark\b)|from tests[.]support import bench_accuracy" --include="test_*.py" tests/unit | sort)
  exec "$bin/ansible-test" units --python 3.11 --color no "$@"
fi
# Without arguments: every sanity test of ansible-core, pylint included (shellcheck only where
# installed). With arguments (e.g. `--test pep8`), exactly those tests.
"$bin/ansible-test" sanity --python 3.11 --color no "$@" 2>&1 \
  | grep -v -E "is ignored: it is neither a file nor a directory|^(Processing|Looking in (links|indexes)|Collecting|Downloading|Using cached|Requirement already|Installing collected|Successfully|Attempting uninstall)|^ +(━|Found existing|Uninstalling|Successfully)"
