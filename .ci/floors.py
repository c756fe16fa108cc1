"""The floor pins for CI's second environment, read from pyproject.toml (the floors are stated there once).

`python .ci/floors.py` prints the pins (`transformers==5.17 accelerate==1.15 triton==3.6`) for pip;
`python .ci/floors.py --check` exits 1 unless the installed versions are those floors, so a resolver
that quietly picked another version cannot pass the floor run off as tested.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

import tomllib

# The GPU image's versions (torch stays on the CPU wheel CI installs first). triton's floor is the test
# extra's: its kernels run under TRITON_INTERPRET=1 in the tests.
FLOORED = ("transformers", "accelerate", "triton")


def floors() -> dict[str, str]:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    found: dict[str, str] = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)(?:\s*,.*)?", requirement.strip())
        if match and match[1].lower() in FLOORED:
            found[match[1].lower()] = match[2]
    missing = [name for name in FLOORED if name not in found]
    if missing:
        raise SystemExit(f"floors.py: pyproject.toml states no '>=' floor for {', '.join(missing)}")
    return found


def main() -> int:
    pins = floors()
    if sys.argv[1:] != ["--check"]:
        print(" ".join(f"{name}=={floor}" for name, floor in pins.items()))
        return 0
    from packaging.version import Version  # installed in the floor environment (a transformers dependency)

    wrong = [
        f"{name} {version(name)} (floor {floor})"
        for name, floor in pins.items()
        if Version(version(name)) != Version(floor)
    ]
    print("floors installed: " + ", ".join(f"{name} {version(name)}" for name in pins))
    if wrong:
        print("not at the floor: " + "; ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
