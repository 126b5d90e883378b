"""Put pip into a virtual environment made without it, from PyPI: `make`'s fallback for a Python without ensurepip.

Why: Debian's and Ubuntu's system Python ships the `venv` module but not `ensurepip` (that is the
`python3-venv` package), so `python3 -m venv .venv` fails on a fresh machine where nobody installed
it. `make` then creates the environment with `--without-pip` and runs this with the environment's
Python: it fetches pip's wheel from PyPI (the only network the set-up needs), checks the sha256 PyPI
publishes for it, and installs pip from the wheel itself (a pip wheel runs as `python pip.whl/pip`).

  .venv/bin/python container/bootstrap_pip.py [--index https://pypi.org]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request


def pip_wheel(index: str) -> tuple[str, str, str]:
    """(file name, URL, sha256) of the newest pip wheel on `index` (PyPI's JSON API)."""
    api = f"{index.rstrip('/')}/pypi/pip/json"
    with urllib.request.urlopen(api, timeout=60) as resp:
        release = json.load(resp)
    for f in release["urls"]:
        if f["packagetype"] == "bdist_wheel" and f["filename"].endswith("-py3-none-any.whl"):
            return f["filename"], urllib.parse.urljoin(api, f["url"]), f["digests"]["sha256"]  # (mirrors: relative)
    raise RuntimeError(f"no pip wheel in {index}'s release {release['info']['version']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--index", default="https://pypi.org")
    args = ap.parse_args()
    if sys.prefix == sys.base_prefix:
        raise SystemExit("bootstrap_pip: run it with the virtual environment's python, not the system's")
    name, url, sha256 = pip_wheel(args.index)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = os.path.join(tmp, name)
        with urllib.request.urlopen(url, timeout=300) as resp, open(wheel, "wb") as out:
            out.write(resp.read())
        with open(wheel, "rb") as fh:
            got = hashlib.sha256(fh.read()).hexdigest()
        if got != sha256:
            raise SystemExit(f"bootstrap_pip: {name} has sha256 {got}, PyPI says {sha256}")
        print(f"[bootstrap_pip] installing {name} into {sys.prefix}", flush=True)
        return subprocess.call([sys.executable, os.path.join(wheel, "pip"), "install", "--no-index", "-q", wheel])


if __name__ == "__main__":
    sys.exit(main())
