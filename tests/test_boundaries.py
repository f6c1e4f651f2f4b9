"""The process boundaries docs/architecture.md promises: what each part of the tree may import, and
its map of the tree naming every module that exists (and nothing that does not); the README's
options table and length, and the links of the README and docs/."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

import sglang_capture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(sglang_capture.__file__)


def _module_files() -> dict:
    """Every module of the installed package (``patches/`` as ``sglang_capture.patches``) and its file."""
    files = {}
    for base, prefix in ((PACKAGE, "sglang_capture"), (os.path.join(ROOT, "patches"), "sglang_capture.patches")):
        for d, _, names in os.walk(base):
            if "__pycache__" in d or (base == PACKAGE and os.path.join("testbed", "site") in d):
                continue
            for f in names:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), base)[:-3].replace(os.sep, ".")
                    name = prefix if rel == "__init__" else prefix + "." + rel.removesuffix(".__init__")
                    files[name] = os.path.join(d, f)
    return files


def _modules(subpackage: str):
    return sorted(m for m in _module_files() if m.startswith(f"sglang_capture.{subpackage}."))


def _imported_after(modules) -> set:
    """Top-level packages in sys.modules after importing ``modules`` in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


# doctor checks the installed SGLang's functions against the seam table, so it must import them.
@pytest.mark.parametrize("part", ["tools", "core"])
def test_offline_tools_and_the_shared_core_never_import_sglang(part):
    modules = [m for m in _modules(part) if m != "sglang_capture.tools.doctor"]
    assert modules
    assert "sglang" not in _imported_after(modules)


def test_importing_the_shared_core_does_not_load_torch():
    assert "torch" not in _imported_after(_modules("core"))


def test_a_writer_process_imports_neither_torch_nor_sglang():
    loaded = _imported_after(_modules("writer"))
    assert not {"torch", "sglang"} & loaded


def test_the_architecture_map_names_every_module_and_only_existing_ones():
    doc = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    table = doc[doc.index("## What exactly happens"):doc.index("Choices worth knowing:")]
    named = set(re.findall(r"`(sglang_capture/[\w/]+\.py|patches/[\w.]+\.(?:json|py))`", table))
    assert all(os.path.exists(os.path.join(ROOT, p)) for p in named), sorted(p for p in named if not os.path.exists(p))
    modules = {os.path.relpath(path, ROOT) for name, path in _module_files().items()
               if ".testbed" not in name and os.path.basename(path) not in ("__init__.py", "__main__.py")}
    assert modules - named == set()


def test_the_readme_documents_every_launcher_option_and_no_other():
    from dataclasses import fields

    from sglang_capture.core.config import CaptureConfig

    readme = open(os.path.join(ROOT, "README.md")).read()
    flags = {flag for f in fields(CaptureConfig) for flag in f.metadata["option"]["flag"].split("/")}
    documented = set(re.findall(r"--capture-[a-z-]+", readme))
    assert flags - documented == set() and documented - flags == set(), (flags - documented, documented - flags)


def test_only_the_capture_plugin_is_an_sglang_entry_point_of_this_install():
    """The test bed's CPU patches reach its own servers through their PYTHONPATH, never through an
    entry point that every SGLang server of a user's install would load."""
    from importlib.metadata import entry_points

    ours = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("sglang_capture")}
    assert ours == {"sglang_capture": "sglang_capture.server.plugin:register"}


def _markdown_docs():
    return [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "patches", "README.md"),
            *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def test_the_readme_stays_short_and_every_relative_link_of_the_docs_names_an_existing_file():
    """The README is the way in (at most 250 lines); the rest lives in docs/ behind its links."""
    with open(os.path.join(ROOT, "README.md")) as f:
        assert len(f.read().splitlines()) <= 250
    broken = []
    for doc in _markdown_docs():
        with open(doc) as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):  # in-page anchors, URLs
                continue
            if not os.path.exists(os.path.join(os.path.dirname(doc), path)):
                broken.append(f"{os.path.relpath(doc, ROOT)}: {target}")
    assert broken == []


def _runtime_imports(path: str, name: str, modules) -> set:
    """The package modules ``path`` imports when it runs, at module level or inside functions
    (imports under ``if TYPE_CHECKING:`` never run and are left out)."""
    import ast

    tree = ast.parse(open(path).read())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
            for stmt in node.body for n in ast.walk(stmt)}
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict:
    modules = _module_files()
    return {name: _runtime_imports(path, name, modules) for name, path in modules.items()}


def import_circles(graph: dict) -> list:
    """Each set of modules that import one another, directly or around a circle (Tarjan's SCCs)."""
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_circle_finder_finds_a_circle_closed_by_an_import_inside_a_function(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n"
                                   "def g():\n    import a\n")
    graph = {m: _runtime_imports(str(tmp_path / f"{m}.py"), m, {"a", "b", "c"}) for m in "abc"}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_around_a_circle():
    graph = import_graph()
    assert len(graph) > 60 and "sglang_capture.patches.version_gate" in graph
    assert import_circles(graph) == []


def _reached(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_offline_tools_never_import_the_server_side_directly_or_through_another_module():
    graph = import_graph()
    crossing = {m: sorted(d for d in _reached(graph, m) if d.startswith("sglang_capture.server"))
                for m in graph if m.startswith("sglang_capture.tools")}
    assert {m: d for m, d in crossing.items() if d} == {}


def test_no_hook_imports_another_hook():
    graph = import_graph()
    hooks = "sglang_capture.server.hooks."
    crossing = {m: sorted(d for d in deps if d.startswith(hooks)) for m, deps in graph.items() if m.startswith(hooks)}
    assert {m: d for m, d in crossing.items() if d} == {}
