"""The packages' imports point one way: app -> decoding (engine -> kernels -> model) -> kvcache,
threadpool; bench may import anything; nothing imports bench but the command line's dispatch. Read
from the source (every import statement, lazy ones inside functions too), so a new module that
imports against the layering fails here before anyone has to notice."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "decoding", "kvcache", "threadpool", "bench")

# importer prefix -> module prefixes it must not import
FORBIDDEN = {
    "kvcache": ("decoding", "app", "bench", "threadpool"),
    "threadpool": ("decoding", "app", "bench", "kvcache"),
    "decoding": ("app", "bench"),
    "decoding.model": ("decoding.kernels", "decoding.engine"),
    "decoding.kernels": ("decoding.engine",),
    "app": ("bench",),
}
# The one place the server package reaches into bench: `treadle bench NAME` dispatches by name.
ALLOWED = {("app.cli", "bench")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every module of ours that an import statement in `source` (module `name`) names, relative
    imports resolved, lazy imports inside functions included."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if m.split(".")[0] in PACKAGES}


def all_modules() -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p.read_text(), module_name(p), p.name == "__init__.py")
            for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


MODULES = all_modules()


def is_within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layering_violations(modules: dict[str, set[str]]) -> list[str]:
    violations = []
    for importer, imports in modules.items():
        for layer, forbidden in FORBIDDEN.items():
            if not is_within(importer, layer):
                continue
            for target in imports:
                if any(is_within(target, f) for f in forbidden) and not any(
                        is_within(importer, a) and is_within(target, b) for a, b in ALLOWED):
                    violations.append(f"{importer} imports {target}")
    return violations


def mutual_imports(modules: dict[str, set[str]]) -> list[tuple[str, str]]:
    edges = {importer: {t for t in imports if t in modules and t != importer} for importer, imports in modules.items()}
    # a package's __init__ re-exporting its own modules is not a cycle between two modules
    return sorted({tuple(sorted((a, b))) for a, targets in edges.items() for b in targets  # type: ignore[misc]
                   if a in edges.get(b, set()) and not (is_within(a, b) or is_within(b, a))})


def test_every_package_imports_only_the_layers_below_it():
    assert layering_violations(MODULES) == []


def test_no_two_modules_import_each_other():
    assert mutual_imports(MODULES) == []


def test_the_checks_catch_an_upward_import_a_lazy_one_and_a_pair():
    source = "from ..engine.engine import Engine\n\ndef later():\n    import app.server\n"
    imports = imported_modules(source, "decoding.kernels.probe")
    assert {"decoding.engine.engine", "app.server"} <= imports
    assert sorted(layering_violations({"decoding.kernels.probe": imports})) == [
        "decoding.kernels.probe imports app.server", "decoding.kernels.probe imports decoding.engine.engine",
        "decoding.kernels.probe imports decoding.engine.engine.Engine"]
    assert layering_violations({"app.cli": {"bench.serve"}, "app.routes": {"bench.serve"}}) == \
        ["app.routes imports bench.serve"]
    assert mutual_imports({"app.a": {"app.b"}, "app.b": {"app.a"}, "app": {"app.a"}}) == [("app.a", "app.b")]
