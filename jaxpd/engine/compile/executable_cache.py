"""Kept executables: the programs warm-up compiles, written whole to disk and loaded on
the next start without tracing or lowering them.

jax's persistent compilation cache (`jaxpd.xla_cache`) saves XLA's compile, but its key
is the lowered program's, so a start that finds every entry there still traces and
lowers every program to look it up. A kept executable is found by a key computed
without tracing (`KeptExecutables.key`): the engine's context (`context_digest`: the
model fingerprint, the `EngineConfig`, jax and jaxlib versions, XLA flags and the jax
options that change lowering, the devices and the host CPU, and `source_digest`, jaxpd's
own Python and its native kernels' C++) and the program's name and abstract arguments
(tree, shapes, dtypes, shardings with their devices in order). Anything of these that
changes misses: the program compiles again and is kept under its new key.

A loaded executable is not a jitted function: its serving call must run it. Each runner
keeps an `Executables` table from the key its call computes to the executable warm-up
installed there (`Program.install`); the call runs the table's entry, else its jitted
function.

A program that misses is lowered; its lowered text (with the devices and platform) is a
second key (`lowered-<key>.exe`): another engine whose config lowers it the same (a
changed timeout, a change of jaxpd's source that leaves it as it was) loads it from
there, and keeps it under its own key for its next start. Only a fresh compile is
kept: an executable read back from a serialized form (jax's persistent cache) serializes
again without all of its code (XLA:CPU), so one jax found in its caches is served but
not kept.

Files: `<dir>/<program name>-<key>.exe`: a one-line JSON header (format, key, the
devices it runs on, size and sha256 of the payload and the header's own fields) and the
payload, written to a temporary file and renamed into place. A file whose header or
digest does not match, or that does not load, is refused with a warning: the program
compiles again and replaces it. The payload is a pickle (jax's serialized form), so the
directory must be as trusted as the code, as jax's own cache is. After warm-up, the
least recently used files past `MAX_BYTES` are removed (`prune`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Hashable

import jax
from jax.experimental import serialize_executable
from jax.sharding import NamedSharding

from jaxpd.engine.programs.program import Program, check_carried

_log = logging.getLogger(__name__)

FORMAT = 1
SUFFIX = ".exe"
# Kept executables past this many bytes in one directory: the least recently used go.
MAX_BYTES = 2 << 30
_STALE_TMP_S = 3600.0
# jax options that change what a program lowers to.
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable",
                "jax_use_shardy_partitioner", "jax_default_prng_impl")
# Source files whose text decides a program: jaxpd's Python and its kernels' C++.
_SOURCE_SUFFIXES = (".py", ".cc", ".h")


class Executables:
    """One runner's table: the key its serving call computes -> the executable warm-up
    installed for it (loaded or compiled ahead). Filled by warm-up's threads before the
    runner serves, read by its serving loop."""

    def __init__(self):
        self._by_key: dict[Hashable, object] = {}

    def get(self, key: Hashable, default=None):
        return self._by_key.get(key, default)

    def put(self, key: Hashable, executable) -> None:
        self._by_key[key] = executable

    def __len__(self) -> int:
        return len(self._by_key)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of jaxpd's source: every Python and C++ file of its package directories
    (the package's own and those it extends its path with: models, sharding, ...), by
    relative path and content."""
    import jaxpd

    digest = hashlib.sha256()
    roots = [Path(p) for p in jaxpd.__path__]
    own = Path(jaxpd.__file__).resolve().parent
    for root in roots:
        root = root.resolve()
        if root == own:
            dirs = [root]
        else:     # a checkout's top: only the packages that are jaxpd's subpackages
            dirs = sorted(d for d in root.iterdir()
                          if (d / "__init__.py").is_file() and d.name != own.name)
        for top in dirs:
            for path in sorted(top.rglob("*")):
                if path.suffix in _SOURCE_SUFFIXES and path.is_file() and \
                        "__pycache__" not in path.parts:
                    digest.update(str(path.relative_to(root)).encode() + b"\0")
                    digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _cpu_identity() -> str:
    """The host CPU's model and instruction-set flags: XLA:CPU code is built for them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first: dict[str, str] = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags"):
            first.setdefault(key, line)
    return "\n".join(first.values()) or platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def platform_digest() -> str:
    """sha256 of what decides a lowered program's executable besides its text: jax and
    jaxlib, the XLA flags and lowering options, the devices and the host CPU."""
    import jaxlib

    devices = jax.devices()
    backend = devices[0].client
    parts = {
        "format": FORMAT, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "libtpu_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
        "options": {name: str(getattr(jax.config, name, None)) for name in _JAX_OPTIONS},
        "platform": [backend.platform, backend.platform_version],
        "devices": [[d.id, d.platform, d.device_kind, d.process_index] for d in devices],
        "processes": jax.process_count(),
        "cpu": _cpu_identity() if backend.platform == "cpu" else "",
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def context_digest(fingerprint: str, config) -> str:
    """sha256 of what decides every program of an engine besides its own name and
    arguments: `fingerprint` (`models.fingerprint`), `config` (an `EngineConfig`),
    `source_digest` and `platform_digest`."""
    parts = [fingerprint, repr(config), source_digest(), platform_digest()]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


class _Compiles(threading.local):
    fresh = 0       # XLA compiles jax timed on this thread
    read_back = 0   # of them, read back from its persistent cache


_compiles = _Compiles()
_listening = threading.Lock()
_listener_registered = False


def _on_event(event: str, *args, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles.fresh += 1
    elif event == "/jax/compilation_cache/cache_hits":
        _compiles.read_back += 1


@contextlib.contextmanager
def _compiling():
    """While entered, what jax compiles on this thread: yields an object whose
    `fresh` says, once exited, whether XLA compiled (a fresh executable: neither read
    back from jax's persistent cache nor found in its memory)."""
    global _listener_registered
    with _listening:
        if not _listener_registered:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listener_registered = True

    class Seen:
        fresh = False

    seen, before = Seen(), (_compiles.fresh, _compiles.read_back)
    try:
        yield seen
    finally:
        seen.fresh = _compiles.fresh > before[0] and _compiles.read_back == before[1]


def _sharding_key(sharding) -> list | None:
    """A sharding as the key sees it: its form and its devices, in order (an executable
    runs on exactly those, in that order)."""
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        ids = [d.id for d in sharding.mesh.devices.flat]
    else:
        ids = sorted(d.id for d in sharding.device_set)
    return [repr(sharding), ids]


def _devices(program: Program) -> set[int]:
    """Ids of every device the program's arguments are placed on."""
    ids: set[int] = set()
    for leaf in jax.tree.leaves(program.abstract_args()):
        if leaf.sharding is not None:
            ids |= {d.id for d in leaf.sharding.device_set}
    return ids


class KeptExecutables:
    """Compiles or loads each program warm-up installs (`install`, `compile`), keeping
    what it compiles under `directory` for the next start. `directory` None: compiles
    only (no compilation cache in use). `context`: `context_digest` of the engine.
    Thread-safe: warm-up's threads and the background compilers share one.
    `loaded`, `lowered` (missed their key), `compiled`, `refused`, `unkept` (compiled
    from jax's caches, so not kept): counts of programs, for the log and tests."""

    def __init__(self, directory: str | None, context: str = ""):
        self.directory = Path(directory) if directory else None
        self.context = context
        self.platform = platform_digest() if directory else ""
        self.loaded = self.lowered = self.compiled = self.refused = self.unkept = 0
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, fingerprint: str, config, directory: str | None = None
                   ) -> "KeptExecutables":
        """The store of an engine of `fingerprint` and `config`: under `directory`, by
        default the compilation cache's (`xla_cache.kept_dir`; none: compile only)."""
        from jaxpd import xla_cache

        directory = directory or xla_cache.kept_dir()
        return cls(directory, context_digest(fingerprint, config) if directory else "")

    def key(self, program: Program) -> str:
        """sha256 of the engine's context and the program's name, argument tree and
        each argument's shape, dtype, weak type and sharding."""
        args = program.abstract_args()
        leaves, tree = jax.tree.flatten(args)
        described = [[list(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                      _sharding_key(x.sharding)] for x in leaves]
        text = json.dumps([self.context, program.name, str(tree), described])
        return hashlib.sha256(text.encode()).hexdigest()

    def install(self, program: Program) -> None:
        """Put `program`'s executable (`compile`) in its serving call's table
        (`Program.install`); a program without one compiles the jax way (lowered with
        its call's arguments, so the call finds it in jax's cache)."""
        if program.install is None:
            check_carried(program, program.fn.lower(*program.args).compile())
        else:
            program.install(self.compile(program))

    def compile(self, program: Program):
        """`program`'s executable (a `jax.stages.Compiled`): loaded when kept, else
        lowered and loaded by its lowered text when kept under that (another engine's,
        of a config that lowers it the same), else compiled; kept under both keys.
        Refused (`LayoutMismatch`) where it returns carried state in another layout
        than it takes it back (`check_carried`)."""
        executable = self._compile(program)
        check_carried(program, executable)
        return executable

    def _compile(self, program: Program):
        """`compile` before the layout check."""
        key = self.key(program) if self.directory is not None else ""
        executable = self._load(self.path(program.name, key), key, program) if key else None
        if executable is not None:
            return self._count("loaded", executable)
        # Lowered from the arguments' shapes and shardings, not their buffers: a pool
        # a background compile names may be donated by a serving call meanwhile.
        lowered = program.fn.lower(*program.abstract_args())
        self._count("lowered", None)
        text_key = self._text_key(lowered, program) if key else ""
        if text_key:
            path = self.path("lowered", text_key)
            executable = self._load(path, text_key, program)
            if executable is not None:
                self._copy(path, text_key, self.path(program.name, key), key)
                return self._count("loaded", executable)
        with _compiling() as seen:
            executable = lowered.compile()
        if key and not seen.fresh:
            # An executable jax read back (from its persistent cache, or one its memory
            # holds that may come from there) serializes without all of its code:
            # served, not kept (a fresh compile of it will be).
            _log.info("program %s came from jax's caches: not kept", program.name)
            self._count("unkept", None)
        elif key:
            payload = self._serialize(program, executable)
            if payload is not None:
                self._write(self.path("lowered", text_key), text_key, *payload)
                self._write(self.path(program.name, key), key, *payload)
        return self._count("compiled", executable)

    def _count(self, what: str, executable):
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)
        return executable

    def path(self, name: str, key: str) -> Path:
        """The file of a program named `name` under `key`."""
        return self.directory / f"{name}-{key}{SUFFIX}"

    def _text_key(self, lowered, program: Program) -> str:
        """sha256 of what decides an executable besides the config: the lowered
        program's text, its arguments' tree (what a call passes), the devices it runs
        on, in order, and `platform_digest`."""
        leaves, tree = jax.tree.flatten(program.abstract_args())
        devices = [_sharding_key(leaf.sharding)[1] for leaf in leaves
                   if leaf.sharding is not None]
        text = lowered.as_text()
        return hashlib.sha256(json.dumps([self.platform, str(tree), devices]).encode() +
                              b"\0" + text.encode()).hexdigest()

    def _load(self, path: Path, key: str, program: Program):
        """The executable kept at `path` under `key`, or None (absent, or refused)."""
        checked = self._read(path, key, program)
        if checked is None:
            return None
        payload, devices = checked
        by_id = {d.id: d for d in jax.devices()}
        try:
            blob, in_tree, out_tree = pickle.loads(payload)
            executable = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, execution_devices=[by_id[i] for i in devices])
        except Exception as e:             # noqa: BLE001 -- recompiled, as a miss
            return self._refuse(path, f"does not load: {type(e).__name__}: {e}")
        try:
            os.utime(path)                 # recently used: `prune` keeps it
        except OSError:
            pass
        return executable

    def _read(self, path: Path, key: str, program: Program) -> tuple[bytes, list] | None:
        """(payload, device ids) of the file at `path` when its header and digest match
        `key` and `program`'s devices; None when absent or refused."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._refuse(path, f"unreadable: {e}")
        try:
            end = data.index(b"\n")
            header = json.loads(data[:end])
            payload = data[end + 1:]
        except ValueError:
            return self._refuse(path, "no header")
        if not isinstance(header, dict) or header.get("format") != FORMAT or \
                header.get("key") != key:
            return self._refuse(path, "its header is not this program's")
        devices = header.get("devices")
        if header.get("size") != len(payload) or \
                header.get("sha256") != _digest(key, devices, payload):
            return self._refuse(path, "truncated or corrupt")
        known = {d.id for d in jax.devices()}
        if not isinstance(devices, list) or not devices or \
                any(i not in known for i in devices) or not _devices(program) <= set(devices):
            return self._refuse(path, f"devices {devices} are not the program's")
        return payload, devices

    def _refuse(self, path: Path, why: str) -> None:
        _log.warning("kept executable %s refused (%s); compiling it again", path, why)
        with self._lock:
            self.refused += 1
        return None

    def _serialize(self, program: Program, executable) -> tuple[bytes, list] | None:
        """(payload, device ids in the executable's order), or None where jax cannot
        serialize it (logged: served, just not kept)."""
        try:
            blob, in_tree, out_tree = serialize_executable.serialize(executable)
            devices = [d.id for d in executable.runtime_executable().local_devices()]
            return pickle.dumps((blob, in_tree, out_tree)), devices
        except Exception as e:             # noqa: BLE001
            _log.info("program %s is not kept: %s: %s", program.name, type(e).__name__, e)
            return None

    def _copy(self, source: Path, source_key: str, path: Path, key: str) -> None:
        """Keep the payload of `source` (checked) under `key` at `path` too."""
        try:
            data = source.read_bytes()
        except OSError:
            return
        end = data.index(b"\n")
        devices = json.loads(data[:end])["devices"]
        self._write(path, key, data[end + 1:], devices)

    def _write(self, path: Path, key: str, payload: bytes, devices: list) -> None:
        """Write atomically (a temporary file renamed into place); a directory that
        refuses the write is logged."""
        header = {"format": FORMAT, "key": key, "devices": devices, "size": len(payload),
                  "sha256": _digest(key, devices, payload)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(json.dumps(header).encode() + b"\n")
                    f.write(payload)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            _log.warning("could not keep an executable in %s: %s", path.parent, e)

    def prune(self, max_bytes: int = MAX_BYTES) -> int:
        """Remove the least recently used kept files (by modification time, which a load
        refreshes) until the rest hold at most `max_bytes`, and temporary files an hour
        old (their writer died); returns how many kept files went."""
        if self.directory is None or not self.directory.is_dir():
            return 0
        for tmp in self.directory.glob(".tmp-*"):     # a writer that died mid-way
            try:
                if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
                    tmp.unlink()
            except OSError:
                pass
        files = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= max_bytes:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            removed += 1
        return removed


def _digest(key: str, devices, payload: bytes) -> str:
    return hashlib.sha256(json.dumps([key, devices]).encode() + b"\0" + payload).hexdigest()


def lowering(keep: KeptExecutables, program: Program):
    """What a `BackgroundCompiler` compiles: an object whose `compile()` is
    `keep.compile(program)` (loaded when kept)."""
    return _Deferred(keep, program)


class _Deferred:
    def __init__(self, keep: KeptExecutables, program: Program):
        self.keep, self.program = keep, program

    def compile(self):
        return self.keep.compile(self.program)
