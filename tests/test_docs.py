"""The documentation site builds strictly, and its generated pages are what the generators give.

``mkdocs build --strict`` (mkdocs.yml: ``validation`` warns on a broken link, a missing anchor, a page
outside the nav, an absolute link; ``strict`` turns every warning into a failure) runs as a real
subprocess into a temporary directory. The error index must hold one anchor per knowledge-base
entry, and the compatibility table must be what ``scripts/gen_docs.py`` derives from pyproject.toml
and ``lightning_zeromoe/compat.py``: regenerate both with ``python scripts/gen_docs.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_what_the_generator_gives() -> None:
    gen = _gen_docs()
    for path, text in gen.generated().items():
        assert path.read_text() == text, (f"{path.relative_to(REPO)} differs from scripts/gen_docs.py's output; "
                                          "run python scripts/gen_docs.py and commit the result")


def test_the_error_index_has_one_anchor_per_knowledge_base_entry() -> None:
    from lightning_zeromoe.knowledge.load import load_entries

    page = (REPO / "docs" / "reference" / "errors.md").read_text()
    anchors = re.findall(r"^## \S+ \{#([^}]+)\}$", page, flags=re.MULTILINE)
    ids = [entry.id for entry in load_entries()]
    assert sorted(anchors) == sorted(ids), (set(ids) ^ set(anchors))
    assert len(set(anchors)) == len(anchors)


def test_the_compatibility_table_names_every_declared_package() -> None:
    import tomllib

    gen = _gen_docs()
    table = (REPO / "docs" / "compatibility.md").read_text().split(gen.COMPAT_START, 1)[1].split(gen.COMPAT_END, 1)[0]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + [r for reqs in project["optional-dependencies"].values() for r in reqs]
    for req in declared:
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower()
        assert f"\n| {name} | `" in table, name
    from lightning_zeromoe import compat

    assert f"| deepspeed | `>=0.19.8` | dependencies | {compat.CHECKED_AGAINST['deepspeed']} |" in table


def readme_links() -> list[tuple[str, str]]:
    """The README's relative links, as (path, anchor)."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [tuple((link.split("#", 1) + [""])[:2]) for link in links if "://" not in link]


def test_readme_is_the_front_door() -> None:
    """At most 250 lines; the demo and test commands first; one quickstart block between its markers,
    and that block is ``examples/quickstart.py`` word for word (the file CI runs, tests/test_examples.py)."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    assert "lightning_zeromoe.demo" in lines[3] and "pytest" in lines[5], lines[:6]
    text = "\n".join(lines)
    assert text.count("<!-- quickstart:start -->") == 1 and text.count("<!-- quickstart:end -->") == 1
    block = text.split("<!-- quickstart:start -->", 1)[1].split("<!-- quickstart:end -->", 1)[0].strip()
    assert block.startswith("```python") and block.endswith("```")
    code = block.removeprefix("```python\n").removesuffix("```")
    assert code == (REPO / "examples" / "quickstart.py").read_text(), "README's quickstart differs from examples/quickstart.py"
    assert readme_links()


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """A broken link, anchor, nav entry or API reference fails the build (and so this test)."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]' (scripts/setup.sh test installs it)")
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
               "-d", str(site)]
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    errors = (site / "reference" / "errors" / "index.html").read_text()
    assert 'id="ep-size-divisibility"' in errors
    api = (site / "reference" / "api" / "index.html").read_text()
    # The README is not part of the site: its links into docs/ are checked against the built pages.
    for target, anchor in readme_links():
        assert (REPO / target).exists(), target
        if target.startswith("docs/") and target.endswith(".md"):
            page = target[len("docs/"):-len(".md")]
            html = site / (page[:-len("index")] if page.endswith("index") else page + "/") / "index.html"
            assert html.exists(), (target, html)
            missing = anchor and f'id="{anchor}"' not in html.read_text()
            assert not missing, f"README links to {target}#{anchor}: no such anchor"
    for path in ("strategy.ZeroMoEStrategy", "discovery.find.MoEPattern", "observe.monitor.ExpertUtilizationMonitor",
                 "balance.balancer.ExpertBiasBalancer", "observe.comm_ledger.CommLedger", "balance.rules.router_z_loss",
                 "checkpoint.export.export", "planner.plan.plan"):
        assert f'id="lightning_zeromoe.{path}"' in api, path
