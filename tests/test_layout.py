"""The house layout (.plan/LAYOUT.md), checked by reading the sources with `ast`: nothing of the project is imported.

Layers: fllama_cli -> (calibrate, kernels_cu) -> model_zoo, no import cycle anywhere, developer tools in
kernels_cu/lab/ out of the product's reach, knobs only in kernels_cu/tuning.py, short files and docs.
Every import counts: module level, inside functions, relative, and importlib.import_module("a.b").
"""

from __future__ import annotations

import ast
import functools
import io
import tokenize
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fllama_cli", "calibrate", "kernels_cu", "model_zoo")
# Which top-level packages each one may import (itself included).
ALLOWED = {
    "fllama_cli": set(PACKAGES),
    "calibrate": {"calibrate", "model_zoo"},
    "kernels_cu": {"kernels_cu", "model_zoo"},
    "model_zoo": {"model_zoo"},
}
LAB = "kernels_cu.lab"
LAB_TOOLS = ("microbench", "attention_probe", "attention_bench", "gemv_probe", "profile_engine", "engine_ab",
             "timeline")
MAX_PRODUCT_LINES = 450
MAX_DOC_LINES = {"docs/benchmarks.md": 400, "docs/gpu.md": 400}


# ---------------------------------------------------------------- the import graph

@dataclass(frozen=True)
class Import:
    src: str   # importing module
    dst: str   # imported module of the scanned packages
    path: str  # importing file, relative to the root
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__.py)."""
    mods = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            parts = f.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a scanned module (None: outside the packages)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.AST, mod: str, is_pkg: bool, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
            anchor = ".".join(pkg[:len(pkg) - (node.level - 1)])
            base = f"{anchor}.{base}" if base else anchor
        # `from pkg import sub` imports the submodule when there is one, else a name of pkg
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        arg = node.args[0].value
        if name in ("import_module", "__import__") and isinstance(arg, str) and not arg.startswith("."):
            return [arg]
    return []


def imports_in(mod: str, path: Path, mods: dict[str, Path], root: Path) -> list[Import]:
    """Every import of one file (anywhere in it) that lands in the scanned packages."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel, is_pkg = path.relative_to(root).as_posix(), path.name == "__init__.py"
    found: dict[Import, None] = {}  # ordered, one per (module, line): `from a import b, c` is one import of a
    for node in ast.walk(tree):
        for name in _imported_names(node, mod, is_pkg, mods):
            dst = _resolve(name, mods)
            if dst is not None and dst != mod:
                found[Import(mod, dst, rel, node.lineno)] = None
    return list(found)


@functools.lru_cache(maxsize=None)
def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> tuple[Import, ...]:
    mods = module_files(root, packages)
    return tuple(imp for mod, path in mods.items() for imp in imports_in(mod, path, mods, root))


def adjacency(edges: tuple[Import, ...]) -> dict[str, dict[str, Import]]:
    """src -> {dst: the first import of dst in src}."""
    adj: dict[str, dict[str, Import]] = {}
    for e in edges:
        adj.setdefault(e.src, {}).setdefault(e.dst, e)
    return adj


def find_cycles(edges: tuple[Import, ...]) -> list[list[Import]]:
    """One cycle (as its imports, in order) per strongly connected component of more than one module."""
    adj = adjacency(edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in adj.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            strongconnect(v)
    return [_shortest_cycle(comp[0], set(comp), adj) for comp in sorted(components)]


def _shortest_cycle(start: str, within: set[str], adj: dict[str, dict[str, Import]]) -> list[Import]:
    """Breadth-first from `start` back to itself inside its component: the imports along the way."""
    came: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w, imp in sorted(adj.get(v, {}).items()):
            if w not in within or w in came:
                continue
            came[w] = imp
            if w == start:
                path = [imp]
                while path[0].src != start:
                    path.insert(0, came[path[0].src])
                return path
            queue.append(w)
    raise AssertionError(f"no cycle through {start}")  # a component of more than one module always has one


def format_cycle(cycle: list[Import]) -> str:
    names = " -> ".join([cycle[0].src] + [imp.dst for imp in cycle])
    return f"{names}  [{', '.join(imp.where() for imp in cycle)}]"


def reach_path(edges: tuple[Import, ...], start: str, target_prefix: str) -> list[Import] | None:
    """The shortest import chain from `start` to a module under `target_prefix`. Importing a.b.c also runs
    a/__init__.py and a/b/__init__.py, so each import reaches the packages above its module too."""
    adj = adjacency(edges)
    came: dict[str, Import | None] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v == target_prefix or v.startswith(target_prefix + "."):
            path: list[Import] = []
            while came[v] is not None:
                path.insert(0, came[v])
                v = came[v].src
            return path
        for w, imp in sorted(adj.get(v, {}).items()):
            parts = w.split(".")
            for u in (".".join(parts[:k]) for k in range(1, len(parts) + 1)):
                if u not in came:
                    came[u] = imp
                    queue.append(u)
    return None


def format_chain(chain: list[Import]) -> str:
    return "; ".join(f"{imp.src} imports {imp.dst} ({imp.where()})" for imp in chain)


def top(module: str) -> str:
    return module.split(".")[0]


def is_lab(module: str) -> bool:
    return module == LAB or module.startswith(LAB + ".")


# ---------------------------------------------------------------- other readers

def bool_switches(source: str) -> list[tuple[int, str]]:
    """Module-level `NAME = True/False` (annotated or not, also inside module-level if/try/with) with an
    UPPER_CASE name: (line, name)."""
    found = []

    def visit(body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, (ast.Assign, ast.AnnAssign)):
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                for t in targets:
                    pairs = (zip(t.elts, st.value.elts) if isinstance(t, ast.Tuple) and isinstance(st.value, ast.Tuple)
                             else [(t, st.value)])
                    for name, value in pairs:
                        if (isinstance(name, ast.Name) and name.id.isupper() and isinstance(value, ast.Constant)
                                and isinstance(value.value, bool)):
                            found.append((st.lineno, name.id))
            elif isinstance(st, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(st, field, []))
                for h in getattr(st, "handlers", []):
                    visit(h.body)

    visit(ast.parse(source).body)
    return found


def _is_frozen_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        if isinstance(d, ast.Call):
            name = d.func.attr if isinstance(d.func, ast.Attribute) else getattr(d.func, "id", "")
            if name == "dataclass" and any(k.arg == "frozen" and getattr(k.value, "value", None) is True
                                           for k in d.keywords):
                return True
    return False


def uncommented_fields(source: str) -> tuple[int, list[tuple[int, str]]]:
    """(number of frozen dataclasses, their fields with no comment on their lines or on the line just above)."""
    comment_lines = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                     if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    classes = [c for c in ast.walk(ast.parse(source)) if isinstance(c, ast.ClassDef) and _is_frozen_dataclass(c)]
    bare = []
    for cls in classes:
        for st in cls.body:
            if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                continue
            if "ClassVar" in ast.unparse(st.annotation):
                continue
            own = any(n in comment_lines for n in range(st.lineno, st.end_lineno + 1))
            above = st.lineno > 1 and lines[st.lineno - 2].lstrip().startswith("#")
            if not (own or above):
                bare.append((st.lineno, f"{cls.name}.{st.target.id}"))
    return len(classes), bare


def product_files(root: Path = ROOT) -> list[Path]:
    mods = module_files(root, PACKAGES)
    return [f for m, f in sorted(mods.items()) if not is_lab(m)]


def rel(path: Path, root: Path = ROOT) -> str:
    return path.relative_to(root).as_posix()


def report(title: str, offenders: list[str]) -> str:
    return f"{title} ({len(offenders)}):\n  " + "\n  ".join(offenders)


# ---------------------------------------------------------------- the rules

def test_layers_point_one_way():
    bad = [f"{e.where()}: {e.src} imports {e.dst}" for e in import_graph()
           if top(e.dst) not in ALLOWED[top(e.src)]]
    assert not bad, report("imports against fllama_cli -> (calibrate, kernels_cu) -> model_zoo", bad)


def test_no_import_cycles():
    cycles = [format_cycle(c) for c in find_cycles(import_graph())]
    assert not cycles, report("import cycles", cycles)


def test_lab_is_apart_from_the_product():
    bad = [f"kernels_cu/{t}.py: a lab tool outside kernels_cu/lab/" for t in LAB_TOOLS
           if (ROOT / "kernels_cu" / f"{t}.py").exists()]
    bad += [f"kernels_cu/lab/{t}.py: missing" for t in LAB_TOOLS if not (ROOT / "kernels_cu/lab" / f"{t}.py").exists()]
    if not (ROOT / "kernels_cu/lab/__init__.py").exists():
        bad.append("kernels_cu/lab/__init__.py: missing")
    edges = import_graph()
    bad += [f"{e.where()}: product module {e.src} imports {e.dst}" for e in edges
            if is_lab(e.dst) and not is_lab(e.src)]
    chain = reach_path(edges, "fllama_cli.main", LAB)
    if chain:
        bad.append("fllama_cli.main reaches kernels_cu.lab: " + format_chain(chain))
    assert not bad, report("kernels_cu.lab is not apart from the product", bad)


def test_no_boolean_switches_outside_tuning():
    bad = []
    for f in sorted((ROOT / "kernels_cu").rglob("*.py")):
        r = rel(f)
        if "__pycache__" in f.parts or r == "kernels_cu/tuning.py" or r.startswith("kernels_cu/lab/"):
            continue
        bad += [f"{r}:{line}: {name}" for line, name in bool_switches(f.read_text(encoding="utf-8"))]
    assert not bad, report("module-level boolean switches (knobs belong in kernels_cu/tuning.py)", bad)


def test_tuning_is_one_frozen_dataclass_with_reasons():
    path = ROOT / "kernels_cu/tuning.py"
    assert path.exists(), "kernels_cu/tuning.py is missing"
    n, bare = uncommented_fields(path.read_text(encoding="utf-8"))
    assert n >= 1, "kernels_cu/tuning.py defines no @dataclass(frozen=True)"
    assert not bare, report("tuning fields without a comment giving the reason",
                            [f"kernels_cu/tuning.py:{line}: {name}" for line, name in bare])


def test_product_files_are_short():
    bad = []
    kernels = sorted(p for ext in ("*.cu", "*.cuh") for p in (ROOT / "kernels_cu").glob(ext))  # not lab/
    for f in product_files() + kernels:
        n = len(f.read_text(encoding="utf-8").splitlines())
        if n > MAX_PRODUCT_LINES:
            bad.append(f"{rel(f)}: {n} lines")
    assert not bad, report(f"product modules over {MAX_PRODUCT_LINES} lines", bad)


def test_docs_sizes():
    bad = []
    for name, limit in MAX_DOC_LINES.items():
        path = ROOT / name
        n = len(path.read_text(encoding="utf-8").splitlines()) if path.exists() else 0
        if n > limit:
            bad.append(f"{name}: {n} lines (at most {limit})")
    if not (ROOT / "docs/architecture.md").exists():
        bad.append("docs/architecture.md: missing")
    assert not bad, report("docs", bad)


# ---------------------------------------------------------------- the rule code itself, on made-up packages

def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_graph_resolves_relative_function_level_and_dynamic_imports(tmp_path):
    root = _write(tmp_path, {
        "app/__init__.py": "",
        "app/main.py": "import os\nfrom .sub import leaf\n",
        "app/sub/__init__.py": "from . import leaf\n",
        "app/sub/leaf.py": "def f():\n    from ..other import thing\n",
        "app/other.py": "import importlib\nthing = importlib.import_module('lib.core')\n",
        "lib/__init__.py": "",
        "lib/core.py": "from lib import missing_name\n",
    })
    edges = {(e.src, e.dst, e.line) for e in import_graph(root, ("app", "lib"))}
    assert edges == {("app.main", "app.sub.leaf", 2), ("app.sub", "app.sub.leaf", 1),
                     ("app.sub.leaf", "app.other", 2), ("app.other", "lib.core", 2), ("lib.core", "lib", 1)}


def test_cycle_through_a_function_level_import_is_found(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def g():\n    from . import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "import pkg.a\n",  # on no cycle
    })
    cycles = [format_cycle(c) for c in find_cycles(import_graph(root, ("pkg",)))]
    assert cycles == ["pkg.a -> pkg.b -> pkg.c -> pkg.a  [pkg/a.py:1, pkg/b.py:2, pkg/c.py:1]"]
    clean = _write(tmp_path / "clean", {"q/__init__.py": "", "q/x.py": "import q.y\n", "q/y.py": ""})
    assert find_cycles(import_graph(clean, ("q",))) == []


def test_reach_path_follows_parent_packages(tmp_path):
    root = _write(tmp_path, {
        "k/__init__.py": "from k import lab\n",
        "k/lab/__init__.py": "",
        "k/engine.py": "",
        "cli/__init__.py": "",
        "cli/main.py": "def run():\n    import k.engine\n",
    })
    chain = reach_path(import_graph(root, ("k", "cli")), "cli.main", "k.lab")
    assert [(e.src, e.dst) for e in chain] == [("cli.main", "k.engine"), ("k", "k.lab")]


def test_switch_and_tuning_readers():
    src = ("FAST = True\n_SLOW: bool = False\nif x:\n    A, b = False, True\nlimit = True\nN = 3\n"
           "def f():\n    G = True\n")
    assert bool_switches(src) == [(1, "FAST"), (2, "_SLOW"), (4, "A")]
    tuning = ("from dataclasses import dataclass\n@dataclass(frozen=True)\nclass T:\n    # why\n    a: int = 1\n"
              "    b: int = 2  # why\n    c: int = 3\n\n@dataclass\nclass U:\n    d: int = 4\n")
    assert uncommented_fields(tuning) == (1, [(7, "T.c")])
