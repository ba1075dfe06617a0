"""A non-editable install (``pip install .``) ships every package and data file."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_of(directory: Path, dirs: dict) -> str | None:
    for package, where in dirs.items():
        base = ROOT / where
        if directory == base or base in directory.parents:
            return ".".join([package, *directory.relative_to(base).parts])
    return None


def test_every_python_package_is_listed():
    conf = _setuptools()
    dirs = conf["package-dir"]
    found = set()
    for where in dirs.values():
        for init in (ROOT / where).rglob("__init__.py"):
            found.add(_package_of(init.parent, dirs))
        for module in (ROOT / where).rglob("*.py"):
            found.add(_package_of(module.parent, dirs))
    missing = found - set(conf["packages"])
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {sorted(missing)}"


def test_data_files_are_declared():
    conf = _setuptools()
    dirs = conf["package-dir"]
    declared = conf.get("package-data", {})
    for where in dirs.values():
        for data in (ROOT / where).rglob("*.json"):
            package = _package_of(data.parent, dirs)
            owner = next((p for p in declared if package == p or package.startswith(p + ".")), None)
            assert owner is not None, f"{data.relative_to(ROOT)} is not in [tool.setuptools.package-data]"
            rel = data.relative_to(ROOT / dirs[owner]).as_posix()
            assert any(Path(rel).match(g) for g in declared[owner]), f"{rel} matches no glob of {owner}"
