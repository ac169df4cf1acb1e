"""Put a build of the default `tiny` target into the package (src/blockdraft/targets/tiny_weights).

    python scripts/ship_tiny.py                 # build from source here (minutes), then ship it
    python scripts/ship_tiny.py --from DIR      # ship a finished build directory

Run it after changing `TinyConfig`'s defaults or the build (FORMAT_VERSION): until then
the package holds no weights for the new defaults and `tiny` builds on first use
(`shipped_tiny_path()` is None). The shipped manifest records the machine that built it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from blockdraft.targets import tiny


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", type=Path, default=None, help="a finished build")
    args = ap.parse_args()
    source = args.source or tiny.build_tiny_target(tiny.TinyConfig(), progress=True)
    manifest = tiny.read_manifest(source)
    if manifest.get("config") != asdict(tiny.TinyConfig()):
        print(f"error: {source} was built from another config than TinyConfig()", file=sys.stderr)
        return 2
    dest = tiny.SHIPPED_DIR
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != tiny.CHECKSUMS:
            shutil.copyfile(f, dest / f.name)
    tiny.write_checksums(dest)
    tiny.verify_shipped(dest)
    print(
        f"shipped {source} -> {dest} (built on {manifest.get('cpu_model')}, "
        f"{manifest.get('cpu_capability')}, Python {manifest.get('python_version')})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
