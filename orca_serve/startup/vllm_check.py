"""Does the installed vLLM still have every name orca-serve reaches outside its extension points?

`orca-serve --check-vllm` runs `main()`: it walks orca_serve/vllm_compat/, collects each module's
`TOUCH_POINTS` and resolves every entry (imports the module, follows the attributes) without
starting an engine, so that a user can check a vLLM upgrade before deploying it. One line per
touch point; exit code 0 when all resolve, 1 otherwise.

An entry is "module.path:attr.path", or alternatives joined by " | " (one must resolve) where a
name moved between the supported releases.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from orca_method.errors import first_line

ALTERNATIVES = " | "
COMPAT_PACKAGE = "orca_serve.vllm_compat"


@dataclass(frozen=True)
class Resolution:
    owner: str  # the vllm_compat module that lists the touch point
    entry: str  # as listed
    found: str | None  # the alternative that resolved; None: none did
    error: str  # why the last alternative failed (empty when found)


def resolve_name(spec: str) -> object:
    """The object named by "module.path:attr.path" (ImportError / AttributeError when absent)."""
    module, _, attrs = spec.strip().partition(":")
    obj: object = importlib.import_module(module)
    for name in filter(None, attrs.split(".")):
        obj = getattr(obj, name)
    return obj


def resolve(owner: str, entry: str) -> Resolution:
    error = ""
    for alt in entry.split(ALTERNATIVES):
        try:
            resolve_name(alt)
        except Exception as e:  # noqa: BLE001 - any failure means "does not resolve"
            error = f"{type(e).__name__}: {first_line(e)}"
            continue
        return Resolution(owner, entry, alt.strip(), "")
    return Resolution(owner, entry, None, error)


def compat_modules() -> Iterator[tuple[str, tuple[str, ...]]]:
    """(module name, TOUCH_POINTS) of every module of the compatibility package."""
    package = importlib.import_module(COMPAT_PACKAGE)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        name = f"{COMPAT_PACKAGE}.{info.name}"
        points = getattr(importlib.import_module(name), "TOUCH_POINTS", None)
        if points:
            yield name, tuple(points)


def check() -> list[Resolution]:
    return [resolve(owner, entry) for owner, points in compat_modules() for entry in points]


def main(header: str) -> int:
    """Print `header`, one line per touch point and a summary; 0 when every one resolves."""
    print(header)
    results = check()
    for r in results:
        where = r.owner.rsplit(".", 1)[-1]
        if r.found is not None:
            print(f"ok       {r.found}  [{where}]")
        else:
            print(f"MISSING  {r.entry}  [{where}]  {r.error}")
    missing = sum(r.found is None for r in results)
    print(f"{len(results) - missing} of {len(results)} touch points resolve"
          + ("" if not missing else f"; {missing} missing: this vLLM is not usable with "
             "orca-serve"))
    sys.stdout.flush()
    return 0 if not missing else 1
