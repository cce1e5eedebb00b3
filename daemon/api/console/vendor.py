"""Copy the console's browser libraries out of an npm install into ``static/vendor/``.

``make console-assets`` runs ``npm ci`` here (package.json + package-lock.json pin each
library and its sha512), then this script. The copies are committed, so a clone serves
the page without npm; run it again only to change a pinned version.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENDOR = HERE / "static" / "vendor"
#: npm package -> (its minified browser build, its licence file), paths inside the package
FILES = {
    "marked": ("marked.min.js", "LICENSE.md"),
    "dompurify": ("dist/purify.min.js", "LICENSE"),
}


def main() -> int:
    modules = HERE / "node_modules"
    if not modules.is_dir():
        print(f"no {modules}: run `npm ci` in {HERE} first (make console-assets)", file=sys.stderr)
        return 1
    VENDOR.mkdir(parents=True, exist_ok=True)
    for package, (build, licence) in FILES.items():
        root = modules / package
        version = json.loads((root / "package.json").read_text())["version"]
        shutil.copyfile(root / build, VENDOR / f"{package}.min.js")
        shutil.copyfile(root / licence, VENDOR / f"{package}.LICENSE.txt")
        print(f"vendored {package} {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
