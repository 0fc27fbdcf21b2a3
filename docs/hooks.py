"""mkdocs hook: serve MathJax from the site itself (no CDN), copied from the ``django-static-mathjax`` wheel.

That wheel (PyPI, no dependencies, no Django needed) carries MathJax 3.2.2's release files; the ``docs`` extra
installs it. Only the TeX-to-CommonHTML component and its fonts are copied (about 1.4 MB), keeping MathJax's own
layout (``output/chtml/fonts/woff-v2`` beside the script), so the component finds its fonts without configuration.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

FILES = ["tex-chtml.js", "output/chtml/fonts/woff-v2", "LICENSE"]


def mathjax_root() -> Path:
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            'MathJax not found: install the docs extra, pip install -e ".[docs]" (django-static-mathjax)'
        )
    return Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax"


def on_post_build(config: Any, **kwargs: Any) -> None:
    root = mathjax_root()
    target = Path(config["site_dir"]) / "assets" / "mathjax"
    for name in FILES:
        source = root / name if name == "LICENSE" else root / "es5" / name
        if not source.exists():
            raise RuntimeError(f"MathJax file missing from the django-static-mathjax package: {source}")
        if source.is_dir():
            shutil.copytree(source, target / name, dirs_exist_ok=True)
        else:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
