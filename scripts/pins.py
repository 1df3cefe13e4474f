"""The pin file (constraints.txt): write it from an environment, check an environment against it, diff two.

    python scripts/pins.py write OUT          # every installed distribution -> OUT (scripts/update_pins.sh)
    python scripts/pins.py check PINS [--except torch]   # exit 1 naming each installed version != its pin
    python scripts/pins.py diff OLD NEW       # what moved: "transformers 5.24.0 -> 5.25.0", added, removed

``write`` runs with the interpreter of the environment whose test run passed: every installed distribution
but automodel itself (and pip/setuptools/wheel, which a venv brings) becomes one ``name==version`` line,
sorted, under a header. A local version label (``torch 2.13.0+cpu``) is dropped: ``torch==2.13.0`` matches
the CPU build and a CUDA build alike (PEP 440 ignores the label of a candidate against a public pin), and pip
picks whichever its index and find-links offer.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import sys

SKIP = {"automodel", "pip", "setuptools", "wheel"}

HEADER = """\
# The exact versions scripts/setup.sh installs (pip -c): the versions CI last passed with.
# Written by scripts/update_pins.sh from the environment its test run passed in (python {python},
# {machine}); never edit by hand. Users who `pip install` automodel themselves get pyproject.toml's
# ranges instead. Moving the pins: docs/compat.md ("Moving the pins").
"""


def canonical(name: str) -> str:
    """PEP 503 normal form of a distribution name (``Jinja2`` -> ``jinja2``, ``typing_extensions`` -> ``typing-extensions``)."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def public(version: str) -> str:
    """A version without its local label: ``2.13.0+cpu`` -> ``2.13.0``."""
    return version.split("+")[0]


def installed() -> dict[str, str]:
    """``{canonical name: public version}`` of every distribution this interpreter sees, but SKIP: the one it imports
    where several are installed (the first on ``sys.path``: a venv's own before the system's, which a venv made with
    ``--system-site-packages`` on a GPU host also sees)."""
    found: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) not in SKIP:
            found.setdefault(canonical(name), public(dist.version))
    return found


def read(path: str) -> dict[str, str]:
    """Parse a pin file: ``{canonical name: version}``; comments and blank lines skipped.

    Raises ``ValueError`` on a line that is not ``name==version``.
    """
    pins: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, version = line.partition("==")
            if not sep or not name.strip() or not version.strip() or any(c in name for c in "<>=!~ ;["):
                raise ValueError(f"{path}:{n}: {raw.strip()!r} is not `name==version`; the pin file holds exact "
                                 "versions only (regenerate it with scripts/update_pins.sh)")
            pins[canonical(name.strip())] = version.strip()
    return pins


def write(out: str) -> int:
    pins = installed()
    for need in ("torch", "transformers"):
        if need not in pins:
            print(f"error: {need} is not installed for {sys.executable}: run `pins.py write` with the python of "
                  "the environment whose tests passed", file=sys.stderr)
            return 2
    text = HEADER.format(python=platform.python_version(), machine=f"{sys.platform} {platform.machine()}")
    text += "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {len(pins)} pins to {out}")
    return 0


def check(path: str, allowed: set[str]) -> int:
    pins, have = read(path), installed()
    wrong = [f"{name} {have[name]} installed, pinned {version}" for name, version in sorted(pins.items())
             if name in have and name not in allowed and have[name] != version]
    missing = [name for name in ("torch", "transformers") if name not in have]
    for line in wrong:
        print(f"error: {line} ({path}); run `bash scripts/setup.sh` to install the pins", file=sys.stderr)
    for name in missing:
        print(f"error: {name} is not installed", file=sys.stderr)
    if not wrong and not missing:
        held = sum(1 for name in pins if name in have and name not in allowed)
        print(f"{held} installed distributions at their pins ({path})")
    return 1 if wrong or missing else 0


def diff(old_path: str, new_path: str) -> int:
    old, new = read(old_path), read(new_path)
    moved = [f"{n} {old[n]} -> {new[n]}" for n in sorted(old.keys() & new.keys()) if old[n] != new[n]]
    added = [f"{n} {new[n]} (new)" for n in sorted(new.keys() - old.keys())]
    gone = [f"{n} {old[n]} (no longer installed)" for n in sorted(old.keys() - new.keys())]
    for line in moved + added + gone:
        print(f"  {line}")
    if not (moved or added or gone):
        print("  nothing moved")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write, check or diff the pin file (constraints.txt)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("write", help="write every installed distribution's version to OUT")
    p.add_argument("out")
    p = sub.add_parser("check", help="exit 1 naming each installed distribution whose version is not its pin")
    p.add_argument("pins")
    p.add_argument("--except", dest="allowed", action="append", default=[],
                   help="a distribution allowed to differ (e.g. torch, when setup kept a host's CUDA build)")
    p = sub.add_parser("diff", help="print what moved between two pin files")
    p.add_argument("old")
    p.add_argument("new")
    args = parser.parse_args(argv)
    if args.command == "write":
        return write(args.out)
    if args.command == "check":
        return check(args.pins, {canonical(a) for a in args.allowed})
    return diff(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
