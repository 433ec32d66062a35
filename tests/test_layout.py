"""The engine's tree shows its design, and ARCHITECTURE.md's file map shows the tree.

The map is the table in ARCHITECTURE.md whose rows start with a folder under
`jaxpd/engine/` (`| \\`jaxpd/engine/kv/\\` | ...`). The rule: every module file under
`jaxpd/engine/` (recursively, `__init__.py` aside) is named by its file name
(`host_tier.py`) on the row of the folder it lies in, every row's folder is a package
that exists, and every `.py` name on a row is a module of that row's folder, so the map
can neither miss a module nor name one that moved.

Modules import one another without a cycle at import time: only imports that run when
a module is imported count (its top level, including `if`/`try`/`with` blocks and class
bodies; not function bodies, not `if TYPE_CHECKING:`). Read with `ast`: no jax is loaded.
"""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "jaxpd", "engine")
ROW = re.compile(r"^\|\s*`(jaxpd/engine/(?:[\w/]*/)?)`\s*\|(.*)$")


def _map_rows() -> dict[str, str]:
    """Folder relative to the repository ('jaxpd/engine/kv/') -> the rest of its row."""
    with open(os.path.join(ROOT, "ARCHITECTURE.md")) as f:
        rows = [ROW.match(line) for line in f]
    found = {}
    for m in filter(None, rows):
        assert m.group(1) not in found, f"{m.group(1)} has two rows in the map"
        found[m.group(1)] = m.group(2)
    return found


def _engine_modules() -> dict[str, str]:
    """Module name ('jaxpd.engine.kv.host_tier', packages by their own name) -> path."""
    found = {}
    for dirpath, dirs, files in os.walk(ENGINE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name[:-3]), ROOT)
                module = rel.replace(os.sep, ".").removesuffix(".__init__")
                found[module] = os.path.join(dirpath, name)
    return found


def test_each_folder_on_the_map_is_an_engine_package():
    rows = _map_rows()
    assert "jaxpd/engine/" in rows
    missing = [folder for folder in rows
               if not os.path.isfile(os.path.join(ROOT, folder, "__init__.py"))]
    assert missing == []


def test_each_engine_module_is_named_on_its_folders_row_and_nothing_else_is():
    rows = _map_rows()
    unnamed, stale = [], []
    for dirpath, dirs, files in os.walk(ENGINE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        folder = os.path.relpath(dirpath, ROOT).replace(os.sep, "/") + "/"
        modules = {f for f in files if f.endswith(".py") and f != "__init__.py"}
        row = rows.get(folder, "")
        named = set(re.findall(r"(?<![\w/.])(\w+\.py)\b", row))
        unnamed += [folder + f for f in sorted(modules - named)]
        stale += [folder + f for f in sorted(named - modules)]
    assert unnamed == [], "modules the map does not name on their folder's row"
    assert stale == [], "names on the map that are no module of that folder"


def test_engine_packages_import_nothing():
    """A subpackage's `__init__` stays empty of imports: importing one module (the
    router's, the config's) must not load its neighbours, or jax with them."""
    importers = []
    for module, path in _engine_modules().items():
        if path.endswith("__init__.py"):
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)):
                importers.append(module)
    assert importers == []


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_imports(body: list[ast.stmt]):
    """Import nodes that run when a module whose top level is `body` is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _import_time_imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None) or []
                if field == "handlers":
                    for handler in inner:
                        yield from _import_time_imports(handler.body)
                else:
                    yield from _import_time_imports(inner)


def _targets(module: str, is_package: bool, node, modules: set[str]) -> set[str]:
    """Engine modules that `node` in `module` loads: each named one, the modules among
    the names a `from` imports, and the packages above each."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    loaded = set()
    for name in names:
        parts = name.split(".")
        loaded |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in loaded if m in modules and m != module}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle_among_engine_modules():
    modules = _engine_modules()
    edges = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        edges[module] = set().union(*(_targets(module, is_package, n, set(modules))
                                      for n in _import_time_imports(tree.body)))
    assert "jaxpd.engine.scheduling.scheduler" in edges["jaxpd.engine.loops.decode_loop"]
    cycle = _cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
