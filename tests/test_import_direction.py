"""``lightning_zeromoe`` never imports ``troubleshooter`` (docs/architecture: the training library
does not depend on the assistant; the assistant may import the library).

An AST scan of every module of the package, imports inside functions (lazy ones) included, and
``importlib.import_module`` / ``__import__`` calls with a literal name. Then, for real, in a fresh
interpreter: importing the knowledge base the library's errors are rendered from loads neither the
troubleshooter nor torch, DeepSpeed or Lightning.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "lightning_zeromoe"
FORBIDDEN = "troubleshooter"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and (
                    (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                    or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module"))):
            out.append((node.lineno, node.args[0].value))
    return out


def _forbidden(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line}: imports {module}"
            for line, module in _imports(path) if module == FORBIDDEN or module.startswith(FORBIDDEN + ".")]


def test_lightning_zeromoe_never_imports_troubleshooter():
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 70  # the whole package, sub-packages included (75 modules)
    assert [problem for path in files for problem in _forbidden(path)] == []


def test_the_scan_sees_lazy_and_dynamic_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""
        import importlib

        def remedies():
            from troubleshooter import knowledge
            import troubleshooter.knowledge as k
            return importlib.import_module("troubleshooter.cli"), __import__("troubleshooter")

        from lightning_zeromoe import knowledge  # allowed
    """))
    assert [p.split(": ", 1)[1] for p in _forbidden(bad)] == [
        "imports troubleshooter", "imports troubleshooter.knowledge", "imports troubleshooter.cli",
        "imports troubleshooter"]


def test_the_knowledge_base_loads_light_and_without_the_troubleshooter():
    code = ("import sys; from lightning_zeromoe import knowledge; "
            "text = knowledge.say('batch-arithmetic', 'strategy-total', 'set-derived-total', total=10, micro=4, "
            "accumulation=1, world_size=2, expected=8); "
            "heavy = sorted(m for m in ('troubleshooter', 'torch', 'deepspeed', 'lightning') if m in sys.modules); "
            "print(heavy, len(knowledge.load_entries())); print(text)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    first, text = proc.stdout.splitlines()
    assert first.startswith("[] ") and int(first.split()[-1]) >= 80
    assert text == ("[batch-arithmetic] train_batch_size=10 but train_micro_batch_size_per_gpu x gradient "
                    "accumulation x data-parallel ranks = 4 x 1 x 2 = 8. DeepSpeed refuses this. Set "
                    "train_batch_size=8, or drop it and let DeepSpeed derive it.")


def test_top_level_exports_are_visible_to_static_tools_and_stay_lazy():
    """``dir()`` and ``__all__`` list the lazy exports, and an ``if TYPE_CHECKING:`` block imports each
    from the module ``__getattr__`` loads it from (what IDEs and pyright read); importing the package
    and listing its names still loads neither torch, Lightning nor DeepSpeed."""
    code = ("import sys, lightning_zeromoe as z; names = dir(z); "
            "print(sorted(m for m in ('torch', 'deepspeed', 'lightning', 'transformers') if m in sys.modules)); "
            "print('ZeroMoEStrategy' in names, sorted(z.__all__) == sorted(z._LAZY), set(z.__all__) <= set(names))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "True True True"]
    import lightning_zeromoe

    tree = ast.parse((LIBRARY / "__init__.py").read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    static = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
              for alias in node.names}
    assert static == lightning_zeromoe._LAZY
    for package in ("lightning_zeromoe", "troubleshooter"):  # PEP 561 marker, shipped by package-data
        assert (ROOT / package / "py.typed").is_file()
