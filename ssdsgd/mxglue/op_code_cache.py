"""MXNet's generated operator functions, compiled once per machine instead of per process.

``import mxnet`` writes a Python function for each of its operators (about 1,200, for
``mx.nd`` and again for ``mx.sym``, plus the numpy ones) as source text and compiles
every one with ``exec``: about 0.35 of the 1.4 CPU seconds the import takes. Every
process of a job pays it: on the emulated cluster (six processes on two cores) about a
second of a job's start-up (docs/design.md, "Start-up"). The text is the same in
every process of one MXNet build but for the operator's handle (an address; filed as a
placeholder and put back into the function's constants), so it need be compiled once:
the two modules that
generate it (``MODULES``) get an ``exec`` of their own (a module global shadows the
builtin) that looks each text up by its SHA-256 in a file of code objects and compiles
only what it lacks; the file is written once MXNet's import is done.

The file is ``marshal`` (the format of Python's own ``.pyc`` files), named by the
interpreter's bytecode magic number, in ``$SSDSGD_CACHE_DIR`` (``off``: no cache), else
``$XDG_CACHE_HOME/ssdsgd``, else ``~/.cache/ssdsgd``. It is read only if it belongs to
this user and nobody else may write it or its directory, as one trusts one's own pyc
files; anything else wrong with it (unreadable, damaged, another Python) and it is
ignored: MXNet's text is compiled as MXNet would. A code object is used only for the text
whose hash it is filed under, so the cache changes when the import's work is done, never
what it makes.
"""
import builtins
import hashlib
import importlib.util
import marshal
import os
import stat
import sys

#: The modules of MXNet 1.x whose ``exec`` compiles generated operator functions.
MODULES = ("mxnet.ndarray.register", "mxnet.symbol.register")
#: Beyond this many entries (several MXNet builds on one machine) a process that compiled
#: something keeps only its own texts in the file.
MAX_ENTRIES = 20000
_FORMAT = "ssdsgd-op-code-1"


class OpCodeCache:
    """Code objects by the SHA-256 of their source text, loaded from and saved to ``path``
    (None: compile everything, save nothing)."""

    def __init__(self, path):
        self.path = path
        self.code = self._read(path) if path else {}
        self.hits = self.misses = 0
        self.loaded = len(self.code)
        self.used = set()       # this process's texts: what a full file keeps

    @staticmethod
    def _read(path):
        try:
            with open(path, "rb") as f:
                info = os.fstat(f.fileno())
                if not _trusted(info) or not _trusted(os.stat(os.path.dirname(path))):
                    return {}
                data = marshal.loads(f.read())
        except (OSError, ValueError, EOFError, TypeError):
            return {}
        if not (isinstance(data, dict) and data.get("format") == _FORMAT and
                data.get("magic") == importlib.util.MAGIC_NUMBER and
                isinstance(data.get("code"), dict)):
            return {}
        return {k: v for k, v in data["code"].items()
                if isinstance(k, str) and type(v).__name__ == "code"}

    def exec(self, source, globals=None, locals=None):  # noqa: A002 - exec's own names
        """``exec`` for the generating modules: a text is compiled once per cache. As the
        builtin, no ``globals`` means the caller's (MXNet passes None and its own locals)."""
        if globals is None:
            caller = sys._getframe(1)       # noqa: SLF001 - what the builtin would take
            globals = caller.f_globals      # noqa: A001
            if locals is None:
                locals = caller.f_locals    # noqa: A001
        slot = _handle_slot(source) if isinstance(source, str) else None
        if slot is None:                # not an operator's text: as the builtin does
            return builtins.exec(source, globals, locals)
        start, end = slot
        handle = int(source[start:end])
        text = f"{source[:start]}{_SLOT}{source[end:]}"
        key = hashlib.sha256(text.encode()).hexdigest()
        self.used.add(key)
        code = self.code.get(key)
        if code is None:
            self.misses += 1
            code = self.code[key] = compile(text, "<string>", "exec")
        else:
            self.hits += 1
        return builtins.exec(_bind(code, handle), globals, locals)

    def save(self):
        """Write the file if this process compiled anything (atomically: processes that
        start together each write a whole file, the last one stays)."""
        if not self.path or not self.misses:
            return
        code = self.code if len(self.code) <= MAX_ENTRIES else \
            {key: self.code[key] for key in self.used}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(marshal.dumps({"format": _FORMAT, "magic": importlib.util.MAGIC_NUMBER,
                                       "code": code}))
            os.replace(tmp, self.path)
        except OSError:         # a read-only home, a full disk: the next import compiles
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self.misses = 0


# The one part of an operator's text that differs between processes: its handle (an
# address), the first argument of the call that invokes it. It is filed as _SLOT and put
# back when used.
_CALLS = ("_imperative_invoke(", "_symbol_creator(")
_SLOT = 7_305_201_446_517_049_343       # appears in no text MXNet writes (checked on use)


def _handle_slot(source):
    """(start, end) of the handle's digits in an operator's text; None if the text is not
    one (no such call, or more than one, or _SLOT already in it). str methods, not a
    regular expression: 6 MB of text go through here in every import."""
    if sum(source.count(call) for call in _CALLS) != 1 or str(_SLOT) in source:
        return None
    for call in _CALLS:
        at = source.find(call)
        if at >= 0:
            start = at + len(call)
            end = source.find(",", start)
            return (start, end) if end > start and source[start:end].isdigit() else None
    return None


def _bind(code, handle):
    """``code`` with the constant _SLOT, in it or in the functions it defines, = handle."""
    consts = tuple(handle if type(c) is int and c == _SLOT else
                   _bind(c, handle) if type(c) is type(code) else c
                   for c in code.co_consts)
    return code.replace(co_consts=consts)


def _trusted(info):
    return (info.st_uid == os.getuid() and
            not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def cache_path():
    """Where this interpreter's cache file is, or None if ``SSDSGD_CACHE_DIR`` is off
    (its row of ssdsgd/settings.py; empty is unset, as for every variable; an invalid
    value is an error naming it)."""
    from ..settings import BY_ENV, env_value
    base = env_value(BY_ENV["SSDSGD_CACHE_DIR"], os.environ)
    if base == "off":
        return None
    if base is None:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or
                            os.path.join(os.path.expanduser("~"), ".cache"), "ssdsgd")
    tag = importlib.util.MAGIC_NUMBER.hex()
    return os.path.join(base, f"mxnet-op-code-{sys.implementation.cache_tag}-{tag}.marshal")


_cache = None


def cache():
    """This process's cache (made at the first generating module's import)."""
    global _cache
    if _cache is None:
        _cache = OpCodeCache(cache_path())
    return _cache


def prepare(module):
    """Give a generating module, before it executes, the cache's ``exec``."""
    module.__dict__["exec"] = cache().exec


def finish():
    """MXNet's import is done: save what was compiled (if a generating module ran)."""
    if _cache is not None:
        _cache.save()
