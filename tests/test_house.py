"""The house rules, checked on the code itself: no import cycle among dsc's modules, the format
module free of operating-system plumbing and the only one that spells the format's file names and
dtypes, no function body over 80 lines; and durable writes that make their names durable too."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import dsc
from dsc import format as fmt
from dsc.storage import local

from conftest import make_folder

PACKAGE = Path(dsc.__file__).parent
MAX_BODY_LINES = 80


def modules() -> dict[str, Path]:
    """Every module of the dsc package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The dsc modules that `name` names in any import statement (nested and TYPE_CHECKING ones too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {t for t in targets if t in known and t != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_dsc_modules() -> None:
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert graph["dsc.reader.loader"] and graph["dsc.compiler.pipeline"]  # the reading above sees imports
    assert cycles(graph) == []


def test_the_format_module_does_no_os_plumbing() -> None:
    tree = ast.parse(Path(fmt.__file__).read_text())
    names = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    names |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names & {"ctypes", "fcntl", "mmap", "stat", "shutil", "time"} == set()


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, classes and functions."""
    owners = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                           ast.AsyncFunctionDef))]
    return {id(n.body[0].value) for n in owners
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_only_the_format_module_spells_the_formats_file_names_and_dtypes() -> None:
    spelled = {fmt.MANIFEST_FILE, fmt.SKIP_LIST_FILE, *fmt.INDEX_FILES.values(),
               *(d.str for d in (fmt.LABEL_DTYPE, fmt.SIZE_DTYPE, fmt.OFFSET_DTYPE, *fmt.FIELD_DTYPES.values()))}
    found = []
    for name, path in modules().items():
        if name == "dsc.format":
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        found += [f"{path.name}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
                  and any(s in n.value for s in spelled)]
    assert found == []


def test_no_function_body_is_longer_than_80_lines() -> None:
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if id(node.body[0].value if isinstance(node.body[0], ast.Expr) else None) \
                    in _docstrings(node) else node.body
                if body and body[-1].end_lineno - body[0].lineno + 1 > MAX_BODY_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name}")
    assert long == []


class _Spy:
    """Records, in order, each rename's target folder and each fsync of a folder (by inode), calling the real ones."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, int]] = []
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd: int) -> None:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                self.events.append(("fsync", st.st_ino))
            real_fsync(fd)

        def renamer(real):
            def rename(a, b) -> None:
                real(a, b)
                self.events.append(("rename", os.stat(Path(b).parent).st_ino))
            return rename

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", renamer(real_replace))
        monkeypatch.setattr(os, "rename", renamer(real_rename))

    def fsynced(self) -> set[int]:
        return {ino for what, ino in self.events if what == "fsync"}


def test_a_durable_write_fsyncs_its_folder_after_the_rename(tmp_path: Path, monkeypatch) -> None:
    spy = _Spy(monkeypatch)
    local.write_durably(tmp_path / "state.json", b"{}")
    folder = tmp_path.stat().st_ino
    assert ("rename", folder) in spy.events and ("fsync", folder) in spy.events
    assert spy.events.index(("rename", folder)) < len(spy.events) - 1 - spy.events[::-1].index(("fsync", folder))
    assert (tmp_path / "state.json").read_bytes() == b"{}"


def test_a_compile_fsyncs_every_folder_whose_names_it_made(tmp_path: Path, monkeypatch) -> None:
    """Every folder a compile creates names in (OUT's parent, the build that becomes OUT, shards/, fields/)
    is fsynced, and after the last rename into it."""
    src = make_folder(tmp_path / "src", sides=(20, 30))
    table = tmp_path / "labels.csv"
    names = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.*"))
    table.write_text("path,label,score\n" + "".join(f"{n},{n.split('/')[0]},{k / 2}\n" for k, n in enumerate(names)))
    from dsc import compile_folder

    spy = _Spy(monkeypatch)
    out = tmp_path / "out"
    compile_folder(src, out, size=8, workers=1, records_per_shard=5, labels=table)
    folders = {p: p.stat().st_ino for p in (tmp_path, out, out / fmt.SHARD_DIR, out / fmt.FIELD_DIR)}
    assert {p: ino in spy.fsynced() for p, ino in folders.items()} == {p: True for p in folders}
    for path, ino in folders.items():
        renames = [k for k, event in enumerate(spy.events) if event == ("rename", ino)]
        syncs = [k for k, event in enumerate(spy.events) if event == ("fsync", ino)]
        assert not renames or syncs[-1] > renames[-1], path
