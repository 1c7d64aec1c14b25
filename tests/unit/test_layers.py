"""Module boundaries: each outside library is used by one module, and the core does no network I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "skyring"

#: library -> the only modules that may import it
OWNERS = {
    "orjson": {"codec"},
    "nats": {"cluster"},
    "uhashring": {"ring"},
    "aiohttp.web": {"api", "app", "server"},
    "aiohttp": {"api", "app", "server", "transports.http"},
    "sqlite3": {"storage.sqlite"},
}
#: the core: no sockets, no event-loop I/O, no skyring module above it
CORE = {"errors", "settings", "timers", "ring", "codec"}
CORE_MAY_IMPORT = {"errors", "settings", "timers", "ring", "codec"}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports: absolute names (``aiohttp``, ``aiohttp.web``) and relative ones (``.codec``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules() -> dict[str, set[str]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        found[name] = imports_of(path)
    return found


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_each_library_is_imported_by_its_owner_only(library):
    """orjson only in codec, nats only in cluster, uhashring only in ring, aiohttp's server only in the web layer."""
    users = {
        module
        for module, names in modules().items()
        if any(name == library or name.startswith(library + ".") for name in names)
    }

    assert users <= OWNERS[library]


def test_core_imports_no_io_and_nothing_above_it():
    """The core modules import only each other and the standard library (no asyncio networking, no adapters)."""
    for module in CORE:
        relative = {n.lstrip(".").split(".")[0] for n in modules()[module] if n.startswith(".")}
        assert relative <= CORE_MAY_IMPORT, (module, relative - CORE_MAY_IMPORT)
        assert not any(n.split(".")[0] in {"socket", "aiohttp", "nats", "sqlite3"} for n in modules()[module])
