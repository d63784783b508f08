"""The repository stands alone: no text file points at a file outside it (issue 15).

A user has only this repository. A reference to a file it does not hold (a sibling folder of
the checkout, design notes kept elsewhere, the story the project started from) sends the reader
nowhere. The detector reads every file git knows (tracked, plus untracked files that are not
ignored) and reports, as ``file:line``:

- ``outside``: a path into a folder beside the checkout (the workplace's shared folder, by a relative or absolute path,
  or its notes and seed sub-folders);
- ``notes``: a ``notes/<name>.md`` (or a bare ``lab.md``, ``vllm-ops.md``, ``huggingface.md``,
  ``benchmarking.md``, ``house-style.md``: the names of those notes) that no folder between the
  citing file's own and the repository root holds;
- ``design``: ``DESIGN.md`` (or a bare ``DESIGN:`` citation) while the repository has no DESIGN.md;
- ``seed``: the words "the seed" (the operator's story the project started from): say what is
  meant instead ("the example fleet", "an 8x RTX PRO 6000 PCIe host");
- ``link``: a Markdown link (in ``*.md`` files) whose relative target leaves the repository or
  does not exist;
- ``see``: a ``see <path>`` reference whose path leaves the repository or exists in no folder
  between the citing file's own and the repository root;
- ``symlink``: a tracked symbolic link whose target resolves outside the repository.

The detector is pure (file names and text in, findings out); the synthetic cases below prove that
it flags each kind and leaves good references alone, and the last test runs it on the repository.
"""
from __future__ import annotations

import os
import posixpath
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.repo]

ROOT = Path(__file__).resolve().parents[2]

# Findings that are legitimate, each as (file, text its line holds; "" for every line): why.
# Keep it small. Absolute host paths (inventory/example/.../storage.yml's /shared/huggingface/hub,
# a model store on the example fleet's hosts) are not flagged in the first place.
ALLOWED: dict[tuple[str, str], str] = {
    ("tests/unit/test_repo_stands_alone.py", ""):
        "this test itself: its synthetic samples are the bad references the detector must flag",
}

# Paths into folders beside the checkout, or the notes and story kept there.
OUTSIDE = re.compile(r"(?:\.\./)+shared\b|/work/" r"shared\b|\bshared/(?:notes|seed)\b"
                     r"|(?<![\w.-])seed/[\w.-]+\.txt\b")
# notes/<name>.md, or a bare name of the notes kept beside the checkout (lab.md, vllm-ops.md, ...).
NOTES = re.compile(r"(?<![\w.-])((?:[\w.-]+/)*(?:notes/[\w.-]+|lab|vllm-ops|huggingface|benchmarking"
                   r"|house-style)\.md)\b")
DESIGN = re.compile(r"\bDESIGN(?:\.md)?\b")
# "the seed", also when a comment wraps between the two words ("the\n# seed's").
SEED = re.compile(r"\bthe\s+(?:(?:#|//|\*|--)\s*)?seed\b", re.IGNORECASE)
MD_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SEE = re.compile(r"(?i:\bsee)\s+(?:also\s+)?[`'\"]?([\w./~<>{}*-]+)")
FILE_SUFFIXES = (".md", ".py", ".yml", ".yaml", ".txt", ".json", ".j2", ".cfg", ".ini", ".sh",
                 ".toml", ".jinja")
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _ancestors(folder: str) -> list[str]:
    """The folder itself, then each parent up to the repository root ("")."""
    out = []
    while True:
        out.append(folder)
        if not folder:
            return out
        folder = posixpath.dirname(folder)


def _norm(folder: str, target: str) -> str:
    """The repository-relative path `target` names from `folder` ("../x" when it leaves the root)."""
    joined = posixpath.normpath(posixpath.join(folder, target)) if folder else posixpath.normpath(target)
    return "" if joined == "." else joined


def _outside(path: str) -> bool:
    return path == ".." or path.startswith("../")


class Repo:
    """The repository as the detector sees it: its file names (and the folders they imply)."""

    def __init__(self, files):
        self.files = set(files)
        self.dirs = {""}
        for name in self.files:
            parent = posixpath.dirname(name)
            while parent and parent not in self.dirs:
                self.dirs.add(parent)
                parent = posixpath.dirname(parent)

    def exists(self, path: str) -> bool:
        path = path.rstrip("/")
        return path in self.files or path in self.dirs

    def has_named(self, basename: str) -> bool:
        return any(posixpath.basename(name) == basename for name in self.files)


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _clean_target(raw: str) -> str:
    return raw.rstrip(".,:;)`'\"")


def find_references(name: str, text: str, repo: Repo) -> list[tuple[int, str, str]]:
    """Bad references in file `name` (repository-relative) with content `text`:
    a sorted list of (line, kind, what)."""
    found = []
    folder = posixpath.dirname(name)

    for match in OUTSIDE.finditer(text):
        found.append((_line_of(text, match.start()), "outside", match.group(0)))

    for match in NOTES.finditer(text):
        target = match.group(1)
        if not any(repo.exists(_norm(base, target)) and not _outside(_norm(base, target))
                   for base in _ancestors(folder)):
            found.append((_line_of(text, match.start()), "notes", target))

    if not repo.has_named("DESIGN.md"):
        for match in DESIGN.finditer(text):
            found.append((_line_of(text, match.start()), "design", match.group(0)))

    for match in SEED.finditer(text):
        found.append((_line_of(text, match.start()), "seed", " ".join(match.group(0).split())))

    if name.endswith((".md", ".md.j2")):
        for match in MD_LINK.finditer(text):
            target = match.group(1).split("#", 1)[0]
            if not target or URL.match(target) or "{{" in target or "{%" in target:
                continue
            path = _norm("", target.lstrip("/")) if target.startswith("/") else _norm(folder, target)
            if _outside(path):
                found.append((_line_of(text, match.start()), "link", f"{target} leaves the repository"))
            elif not repo.exists(path):
                found.append((_line_of(text, match.start()), "link", f"{target} does not exist"))

    for match in SEE.finditer(text):
        target = _clean_target(match.group(1))
        if (not target or target.startswith(("/", "~")) or URL.match(target)
                or any(c in target for c in "<>{}*")
                or not ("/" in target or target.endswith(FILE_SUFFIXES))):
            continue
        # "./x" and "../x" are relative to the citing file's folder; "a/b.md" may also be
        # relative to a folder above it (a role's "see meta/argument_specs.yml", the root's).
        bases = [folder] if target.startswith(".") else _ancestors(folder)
        candidates = [_norm(base, target) for base in bases]
        if all(_outside(path) for path in candidates):
            found.append((_line_of(text, match.start()), "see", f"{target} leaves the repository"))
        elif not any(not _outside(path) and repo.exists(path) for path in candidates):
            found.append((_line_of(text, match.start()), "see", f"{target} does not exist"))

    return sorted(set(found))


def find_symlink_escapes(name: str, link_target: str) -> bool:
    """True when the symbolic link `name` -> `link_target` resolves outside the repository."""
    if link_target.startswith("/"):
        return True
    return _outside(_norm(posixpath.dirname(name), link_target))


def repository_files(root: Path) -> list[str]:
    """Every file git knows in `root`: tracked, and untracked but not ignored (new, uncommitted)."""
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                           "--exclude-standard"], capture_output=True, check=False)
    if proc.returncode == 0:
        return sorted({n for n in proc.stdout.decode().split("\0") if n})
    names = []          # not a git checkout (a copied tree): every file but .git and .venv
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (".git", ".venv")]
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]   # not descended
        for fname in filenames + links:
            names.append(os.path.relpath(os.path.join(dirpath, fname), root).replace(os.sep, "/"))
    return sorted(names)


def scan(root: Path, allowed=None) -> list[str]:
    """Every bad reference in the repository at `root`, as 'file:line: kind: what' lines,
    less the `allowed` ones (default: ALLOWED)."""
    allowed = ALLOWED if allowed is None else allowed
    names = repository_files(root)
    repo = Repo(n for n in names if os.path.lexists(root / n))
    problems = []
    for name in names:
        path = root / name
        if path.is_symlink():
            if find_symlink_escapes(name, os.readlink(path)):
                problems.append(f"{name}:1: symlink: points at {os.readlink(path)}, outside the repository")
            continue
        if not path.is_file():
            continue                                   # deleted in the work tree, not committed yet
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue                                   # binary
        text = data.decode("utf-8", errors="replace")
        lines = text.splitlines()
        for line, kind, what in find_references(name, text, repo):
            content = lines[line - 1] if line <= len(lines) else ""
            if any(name == f and snippet in content for (f, snippet) in allowed):
                continue
            problems.append(f"{name}:{line}: {kind}: {what}")
    return problems


# ------------------------------------------------------------------------------------------
# The detector on synthetic text: each kind of bad reference is flagged, good ones are not.
# ------------------------------------------------------------------------------------------
SYNTHETIC_REPO = Repo([
    "README.md", "docs/architecture.md", "docs/lab.md", "docs/huggingface.md", "galaxy.yml",
    "roles/migrate/README.md", "roles/migrate/meta/argument_specs.yml",
    "roles/migrate/defaults/main.yml", "roles/vllm_service/tasks/main.yml",
    "roles/vllm_service/README.md", "tests/lab/hub/server.py", "tests/lab/hub/store.py",
    "tests/lab/notes/" "readme.md", "plugins/plugin_utils/runner.py", "meta/runtime.yml",
    "execution-environment.yml",
])

BAD = [
    ("README.md", "The architecture is in `../" "shared/DESIGN.md`.", {"outside", "design"}),
    ("tests/lab/labctl.py", "Measured facts behind the choices here: ../" "shared/" "notes/" "lab.md.",
     {"outside", "notes"}),
    ("module_utils/x.py", "# read /work/" "shared/" "notes/" "vllm-ops.md first", {"outside", "notes"}),
    ("docs/x.md", "copied from shared/" "seed/000_abc.txt", {"outside"}),
    ("module_utils/serving/vllm_ready.py", "proved in gates, in order (notes/" "vllm-ops.md): the port",
     {"notes"}),
    ("roles/vllm_service/README.md", "the role applies the fixes of notes/" "lab.md: removes", {"notes"}),
    ("tests/lab/labctl.py", "a bootable base (lab.md: 'Prepare the base once')", {"notes"}),
    ("module_utils/hf.py", "the client's habits (huggingface.md)", {"notes"}),
    ("roles/x/defaults/main.yml", "# The catalog name (DESIGN.md \"Desired state\")", {"design"}),
    ("tests/unit/test_x.py", '"""Wiring (DESIGN: a collection from day one)."""', {"design"}),
    ("README.md", "of the seed's kind (8x 96 GB GPUs over PCIe)", {"seed"}),
    ("inventory/x.yml", "# An example fleet of the seed's kind: 8x RTX PRO 6000", {"seed"}),
    ("roles/migrate/README.md", "The seed's five-step pivot as one role", {"seed"}),
    ("inventory/y.yml", "# settings that the\n# seed's host ran with", {"seed"}),
    ("module_utils/gpu/gpu_ready.py", '"NCCL_PROTO; the seed host used NCCL_PROTO=LL"', {"seed"}),
    ("docs/guide.md", "Read [the design](../../DESIGN.md).", {"design", "link"}),
    ("docs/guide.md", "Read [the notes](../../" "shared/x.md).", {"outside", "link"}),
    ("docs/guide.md", "Read [the lab](lab-facts.md) first.", {"link"}),
    ("README.md", "Read [the lab](docs/missing.md#the-machine).", {"link"}),
    ("roles/migrate/README.md", "Variables: see `meta/specs.yml` for all.", {"see"}),
    ("roles/migrate/README.md", "see ../../../elsewhere/README.md for the story", {"see"}),
    ("tests/lab/hub/server.py", "the store (see storage.py)", {"see"}),
    ("README.md", "See docs/vllm.md.", {"see"}),
]

GOOD = [
    ("README.md", "The architecture is in [docs/architecture.md](docs/architecture.md)."),
    ("docs/architecture.md", "See [the lab](lab.md#the-machine) and [README](../README.md)."),
    ("docs/lab.md", "[vLLM](https://docs.vllm.ai/) and [a section](#tiny-models)."),
    ("roles/migrate/README.md", "Variables: see `meta/argument_specs.yml` (ansible-doc)."),
    ("roles/vllm_service/tasks/main.yml", "# Each step's purpose: see README.md."),
    ("tests/lab/hub/server.py", "from the store under --root (see store.py), and"),
    ("module_utils/common/fsutil.py", "# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)"),
    ("library/x.py", "# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0.txt)"),
    ("roles/migrate/README.md", "reach callers through set_stats: see `plugins/plugin_utils/runner.py`."),
    ("meta/execution-environment.yml", "# The buildable definition (see ../execution-environment.yml)."),
    ("tests/lab/hub/client.py", "raises FaultError (see tests.lab.hub.faults)"),
    ("inventory/example/group_vars/gpu_hosts/storage.yml", "modelswap_hf_cache: /shared/huggingface/hub"),
    ("module_utils/store/model_store.py", 'stack = [(rev.path, "../../blobs/")]  # see /etc/fstab'),
    ("tests/lab/models/make_models.py", "The same name gives byte-identical files (fixed seeds)."),
    ("library/benchmark_run.py", "  seed:\n    description: The prompts' random seed."),
    ("tests/unit/test_m.py", "def test_the_preview_reads_like_a_todo_list(): seed = 1"),
    ("tests/lab/notes.py", "see tests/lab/notes/" "readme.md and notes/" "readme.md"),
    ("docs/lab.md", "vLLM's design notes (see <cache>/models--org--name) are fine"),
    ("module_utils/bench.py", "'DESIGNATED' and 'design' are ordinary words; see the docs"),
    ("docs/lab.md", "the next seed is drawn; a seed of 0 is the default"),
    ("docs/architecture.md", "how the lab works: lab.md and docs/huggingface.md"),
    ("tests/lab/labctl.py", "the facts behind it: docs/lab.md, 'The base'"),
]


@pytest.mark.parametrize("name,text,kinds", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_each_kind_of_bad_reference_is_flagged(name, text, kinds):
    found = find_references(name, text, SYNTHETIC_REPO)
    assert {kind for _line, kind, _what in found} == kinds, found


@pytest.mark.parametrize("name,text", GOOD, ids=[f"good-{i}" for i in range(len(GOOD))])
def test_good_references_are_not_flagged(name, text):
    assert find_references(name, text, SYNTHETIC_REPO) == []


def test_findings_carry_the_line_number():
    text = "line one\nline two\nsee ../" "shared/" "notes/" "lab.md\n"
    found = find_references("tests/lab/x.py", text, SYNTHETIC_REPO)
    assert found and {line for line, _kind, _what in found} == {3}


def test_design_md_is_fine_once_the_repository_has_one():
    text = "The architecture: DESIGN.md"
    assert find_references("README.md", text, Repo(["README.md", "DESIGN.md"])) == []
    assert [k for _l, k, _w in find_references("README.md", text, Repo(["README.md"]))] == ["design"]


def test_notes_that_the_repository_holds_are_fine():
    repo = Repo(["docs/notes/" "lab.md", "docs/x.md"])
    assert find_references("docs/x.md", "see notes/" "lab.md", repo) == []
    assert [k for _l, k, _w in find_references("docs/x.md", "see notes/" "hub.md", repo)] == ["notes", "see"]


def test_symlinks_that_leave_the_repository_are_flagged():
    assert find_symlink_escapes(".venv", "/opt/venvs/shared")
    assert find_symlink_escapes("docs/notes", "../../" "shared/" "notes")
    assert not find_symlink_escapes("plugins/modules", "../library")
    assert not find_symlink_escapes(".collections/ansible_collections/modelswap/vllm", "../../..")


def test_scan_reports_file_and_line(tmp_path):
    """The whole scan on a small git repository: tracked and new files, symlinks, binaries."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
                            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"})
    git("init", "-q")
    (tmp_path / "README.md").write_text("# x\n\nSee [the docs](docs/a.md).\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text("fine\n")
    (tmp_path / "tool.py").write_text('"""Facts:\n../' 'shared/' 'notes/' 'lab.md."""\n')
    (tmp_path / "blob.bin").write_bytes(b"\0" + "../" "shared".encode())
    (tmp_path / ".gitignore").write_text("ignored.txt\n")
    (tmp_path / "ignored.txt").write_text("../" "shared\n")
    os.symlink("../../elsewhere", tmp_path / "escape")
    git("add", "README.md", "docs/a.md", "blob.bin", ".gitignore", "escape")
    git("commit", "-qm", "x")
    problems = scan(tmp_path)
    assert problems == ["escape:1: symlink: points at ../../elsewhere, outside the repository",
                        "tool.py:2: notes: ../" "shared/" "notes/" "lab.md",
                        "tool.py:2: outside: ../" "shared"], problems


def test_scan_of_a_tree_that_is_not_a_git_checkout(tmp_path):
    """A copied tree (no .git) is walked whole, but for .venv; links to folders are checked."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text("Read [the lab](../lab.md).\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv/x.py").write_text("# ../" "shared\n")
    os.symlink("/opt/elsewhere", tmp_path / "linked")
    os.symlink("docs", tmp_path / "docs-link")
    assert scan(tmp_path) == ["docs/a.md:1: link: ../lab.md does not exist",
                              "docs/a.md:1: notes: ../lab.md",
                              "linked:1: symlink: points at /opt/elsewhere, outside the repository"]


def test_every_allowed_entry_is_still_needed():
    """The allow-list cannot grow stale: each entry still matches a finding."""
    everything = scan(ROOT, allowed={})
    for (name, snippet), why in ALLOWED.items():
        assert any(p.startswith(name + ":") for p in everything), (name, snippet, why)


def test_the_repository_stands_alone():
    problems = scan(ROOT)
    assert not problems, (
        "References to files outside the repository (a user of this repository does not have "
        "them). Put what the reader needs into the repository (README.md, docs/, a role's "
        "README) and point there, or say it in plain words:\n  " + "\n  ".join(problems))
