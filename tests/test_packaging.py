"""ssdsgd.testing (test and benchmark support) stays out of the installed package, and
nothing in the package needs it."""
import ast
import configparser
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]


def _find_options():
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    return {k: v.split() for k, v in cfg["options.packages.find"].items()}


def test_the_wheel_leaves_out_ssdsgd_testing():
    packages = setuptools.find_packages(str(ROOT), **_find_options())
    assert "ssdsgd" in packages and "ssdsgd.launch" in packages
    assert not [p for p in packages if p.startswith("ssdsgd.testing")], packages


def _imports(path: Path) -> list[str]:
    """The absolute module names ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{a.name}" for a in node.names]
    return names


def test_nothing_in_the_package_imports_ssdsgd_testing():
    bad = [(str(p.relative_to(ROOT)), name)
           for p in sorted((ROOT / "ssdsgd").rglob("*.py"))
           if "testing" not in p.relative_to(ROOT / "ssdsgd").parts
           for name in _imports(p) if name.startswith("ssdsgd.testing")]
    assert bad == []
