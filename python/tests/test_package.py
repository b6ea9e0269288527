"""The boundary between what users install and what needs a checkout: `ckptune` (python/ckptune/,
shipped by python/pyproject.toml) imports torch, the standard library and itself, nothing else,
and never the harness (`ckptune_harness`); the harness imports `ckptune` only through its public
names. Read from the sources, so an import inside a function counts too.

    .venv/bin/python -m unittest discover -s python/tests
"""

import ast
import subprocess
import sys
import tomllib
import unittest
from pathlib import Path

PYTHON = Path(__file__).resolve().parents[1]
USER = PYTHON / "ckptune"
HARNESS = PYTHON / "ckptune_harness"
sys.path.insert(0, str(PYTHON))  # the checkout's python/, so no install is needed

import ckptune  # noqa: E402


def imports(path):
    """(line, module, level, names) of every import statement in the file `path`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, 0, []
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or "", node.level, [a.name for a in node.names]


def module_graph():
    """{module: the modules of python/ckptune and python/ckptune_harness it imports}. `from . import
    x` of a submodule `x` is an edge to `x`, not to the package."""
    paths = {}
    for path in sorted(USER.rglob("*.py")) + sorted(HARNESS.rglob("*.py")):
        parts = list(path.relative_to(PYTHON).with_suffix("").parts)
        name = parts[:-1] if parts[-1] == "__init__" else parts
        paths[".".join(name)] = (path, ".".join(parts[:-1]))  # the package relative imports start at
    graph = {}
    for name, (path, package) in paths.items():
        deps = set()
        for _, module, level, names in imports(path):
            if level:
                base = package.split(".")[:len(package.split(".")) - (level - 1)]
                module = ".".join(base + ([module] if module else []))
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in paths]
            deps |= {m for m in ([module] if not subs else subs) if m in paths and m != name}
        graph[name] = deps
    return graph


class BoundaryTest(unittest.TestCase):
    def test_imports_form_a_tree(self):
        graph, state, cycles = module_graph(), {}, []

        def visit(module, path):
            state[module] = "open"
            for dep in sorted(graph[module]):
                if state.get(dep) == "open":
                    cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
                elif dep not in state:
                    visit(dep, path + [dep])
            state[module] = "done"

        for module in sorted(graph):
            if module not in state:
                visit(module, [module])
        self.assertIn("ckptune_harness.fsdp.rank", graph)
        self.assertEqual(cycles, [])

    def test_the_user_package_imports_only_torch_and_the_standard_library(self):
        allowed = set(sys.stdlib_module_names) | {"torch", "ckptune"}
        files = sorted(USER.rglob("*.py"))
        self.assertTrue(files)
        for path in files:
            for line, module, level, _ in imports(path):
                where = f"{path.relative_to(PYTHON)}:{line}"
                if level:
                    # Relative: inside ckptune, never above it (a sibling package).
                    self.assertEqual(level, 1, f"{where} imports from outside ckptune")
                    continue
                self.assertTrue(module.split(".")[0] in allowed, f"{where} imports {module}")
            self.assertNotIn("ckptune_harness", path.read_text(), f"{path.relative_to(PYTHON)} names the harness")

    def test_importing_the_user_package_loads_no_harness_module(self):
        code = ("import importlib, pkgutil, sys, ckptune\n"
                "for m in pkgutil.iter_modules(ckptune.__path__): importlib.import_module('ckptune.' + m.name)\n"
                "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ckptune_harness'))")
        out = subprocess.run([sys.executable, "-c", code], cwd=PYTHON, capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.strip(), "[]")

    def test_the_harness_uses_ckptune_through_its_public_names(self):
        public = set(ckptune.__all__)
        for path in sorted(HARNESS.rglob("*.py")):
            for line, module, level, names in imports(path):
                if not level and module.split(".")[0] == "ckptune":
                    where = f"{path.relative_to(PYTHON)}:{line}"
                    self.assertEqual(module, "ckptune", f"{where} imports {module}, not the package")
                    self.assertLessEqual(set(names), public, where)

    def test_pyproject_ships_the_user_package_alone(self):
        with open(PYTHON / "pyproject.toml", "rb") as f:
            project = tomllib.load(f)
        self.assertEqual(project["tool"]["setuptools"]["packages"], ["ckptune"])
        self.assertEqual(project["project"]["dependencies"], ["torch"])


if __name__ == "__main__":
    unittest.main()
