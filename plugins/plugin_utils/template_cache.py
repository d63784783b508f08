# -*- coding: utf-8 -*-
# Copyright: modelswap engineers; Apache-2.0 (see galaxy.yml)
"""Compiled Jinja templates shared by every process of one ansible-playbook run.

ansible-playbook forks a worker for every task and host, and a worker compiles every template it
renders from source (ansible-core keeps no compiled templates across processes): on the lab's
migration preview about 250 compiles and 0.2 s of CPU per host, most of what a host costs the
controller. Jinja's compile is a pure function of the source and of the environment's settings;
its result, a Python code object, is what Jinja's own bytecode cache stores with marshal. Here the
first process that compiles a template stores it in a folder of the run (created private by the
parent, removed at the end of the run) and every other process loads it from there.

Only ansible's own Jinja environment is touched, and only while a cache is installed. The key holds
everything the generated code depends on (the source, the name, the lexer's and code generator's
settings, ansible's compile-time switches, the versions of Python, Jinja and ansible-core); what it
cannot judge (an AST rather than a source, raw output, a debuggable or autoescaping environment)
is compiled as before. A cache file that cannot be read is compiled again; a failure to store is
ignored: the cache can make a run faster, never different.
"""
from __future__ import annotations

import hashlib
import marshal
import os
import shutil
import sys
import tempfile

import jinja2

# the lexer's and the code generator's settings of a jinja2.Environment (its public attributes)
ENVIRONMENT_SETTINGS = ("block_start_string", "block_end_string", "variable_start_string", "variable_end_string",
                        "comment_start_string", "comment_end_string", "line_statement_prefix",
                        "line_comment_prefix", "trim_blocks", "lstrip_blocks", "newline_sequence",
                        "keep_trailing_newline", "optimized", "is_async")
# bumped when what a cache file holds changes
FORMAT = "1"


class TemplateCache:
    """One run's folder of compiled templates, with its counts (for the callback's summary)."""

    def __init__(self, directory: str, versions: str):
        self.directory = directory
        self.versions = versions
        self.hits = self.misses = self.errors = 0

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key)

    def load(self, key: str):
        """The code object stored under key, or None (absent, or unreadable: compiled again)."""
        try:
            with open(self.path(key), "rb") as handle:
                code = marshal.load(handle)
        except FileNotFoundError:
            return None
        except (OSError, EOFError, ValueError, TypeError):
            self.errors += 1
            return None
        return code if type(code).__name__ == "code" else None

    def store(self, key: str, code) -> None:
        """Write atomically (a reader sees the whole file or none); a failure only costs speed."""
        try:
            fd, staged = tempfile.mkstemp(dir=self.directory, prefix=".staged-")
            with os.fdopen(fd, "wb") as handle:
                marshal.dump(code, handle)
            os.replace(staged, self.path(key))
        except (OSError, ValueError):
            self.errors += 1


def versions() -> str:
    """What a compiled template depends on besides its source and settings."""
    from ansible.release import __version__ as ansible_version  # pylint: disable=import-outside-toplevel
    return "|".join((FORMAT, sys.version, jinja2.__version__, ansible_version))


def key(cache_versions: str, environment, source: str, name, filename, defer_init: bool,
        escape_backslashes, embedded_templates) -> str:
    """The cache file's name: a digest of everything the compiled code depends on."""
    cls = type(environment)
    settings = tuple((attr, getattr(environment, attr, None)) for attr in ENVIRONMENT_SETTINGS)
    # what the code generator reads of the environment besides its settings (the filters and
    # tests it looks up by name are the same plugins in every process of a run)
    finalize = environment.finalize
    generator = (environment.code_generator_class.__qualname__, getattr(finalize, "__qualname__", repr(finalize)),
                 str(getattr(finalize, "jinja_pass_arg", None)), getattr(environment, "sandboxed", False),
                 tuple(sorted(getattr(environment, "intercepted_binops", ()))),
                 tuple(sorted(getattr(environment, "intercepted_unops", ()))))
    parts = (cache_versions, cls.__module__, cls.__qualname__, generator, tuple(sorted(environment.extensions)),
             settings, bool(escape_backslashes), bool(embedded_templates), name, filename, bool(defer_init), source)
    return hashlib.sha256(repr(parts).encode("utf-8", "surrogatepass")).hexdigest()


class _Installed:
    """What install() changed, to undo it."""
    cache: TemplateCache | None = None
    environment_class = None
    compile_before = None


def _ansible_internals():
    """ansible-core's Jinja environment and its compile-time switches; None where this ansible-core
    does not have them (the cache is then not installed)."""
    try:
        # pylint: disable=import-outside-toplevel
        from ansible._internal._templating._jinja_bits import AnsibleEnvironment, _TemplateCompileContext
        from ansible._internal._templating._jinja_common import _TemplateConfig
    except ImportError:
        return None
    return AnsibleEnvironment, _TemplateCompileContext, _TemplateConfig


def install(directory: str) -> TemplateCache | None:
    """Serve ansible's template compiles from ``directory`` in this process and in every process
    it forks afterwards. None (nothing changed) where this ansible-core's templating is not the
    one this was written for."""
    internals = _ansible_internals()
    if internals is None or _Installed.cache is not None:
        return _Installed.cache
    environment_class, compile_context, template_config = internals
    cache = TemplateCache(directory, versions())
    compile_before = environment_class.compile

    def compile(self, source, name=None, filename=None, raw=False, defer_init=False):  # pylint: disable=redefined-builtin
        if (raw or not isinstance(source, str) or self.autoescape
                or getattr(self, "_debuggable_template_source", False)):
            return compile_before(self, source, name, filename, raw, defer_init)
        context = compile_context.current(optional=True)
        digest = key(cache.versions, self, source, name, filename, defer_init,
                     context is not None and context.escape_backslashes,
                     getattr(template_config, "allow_embedded_templates", None))
        code = cache.load(digest)
        if code is not None:
            cache.hits += 1
            return code
        code = compile_before(self, source, name, filename, raw, defer_init)
        cache.misses += 1
        cache.store(digest, code)
        return code

    environment_class.compile = compile
    _Installed.cache, _Installed.environment_class, _Installed.compile_before = cache, environment_class, compile_before
    return cache


def uninstall() -> None:
    """Compile as ansible-core does again (the folder is the caller's)."""
    if _Installed.cache is not None:
        _Installed.environment_class.compile = _Installed.compile_before
        _Installed.cache = _Installed.environment_class = _Installed.compile_before = None


PREFIX = "modelswap-templates-"


def new_folder() -> str:
    """A private folder for one run (mode 0700, a name no other run has, with the run's PID)."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def stale_folders(parent: str | None = None) -> list:
    """This user's folders of runs that ended without removing theirs (a controller killed): their
    process is gone. A compiled template holds its source's constants, which no file should keep."""
    parent = parent or tempfile.gettempdir()
    stale = []
    try:
        names = os.listdir(parent)
    except OSError:
        return stale
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        path = os.path.join(parent, name)
        if not pid.isdigit():
            continue
        try:
            if os.lstat(path).st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            stale.append(path)
        except OSError:
            continue
    return stale


def remove_folder(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
