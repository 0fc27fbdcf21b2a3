"""Run the demo and the examples, and save what they print and plot under docs/outputs/ for the site.

    python docs/generate_outputs.py            # every example (minutes)
    python docs/generate_outputs.py cabs demo  # some of them

Running them while the site builds would take too long for CI, so their outputs are committed. Each one is saved
with the SHA-256 of the sources it ran (``docs/outputs/<name>.json``); ``tests/test_docs.py`` recomputes those
hashes, so an example edited without regenerating its output fails the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ROOT / "docs" / "outputs"


@dataclass(frozen=True)
class Example:
    name: str
    sources: tuple[str, ...]  # what the output depends on, relative to the repository root
    command: tuple[str, ...]  # run from the repository root; "{tmp}" is a fresh folder
    plots: dict[str, str] = field(default_factory=dict)  # file under {tmp} -> name under docs/outputs/


EXAMPLES = [
    Example(
        "demo",
        ("pergrad/cli/demo.py", "pergrad/cli/__init__.py"),
        ("-m", "pergrad", "demo", "--out", "{tmp}"),
        {"pergrad-demo.png": "demo.png"},
    ),
    Example("clip_vs_mean", ("examples/clip_vs_mean.py",), ("examples/clip_vs_mean.py",)),
    Example("dp_sgd", ("examples/dp_sgd.py",), ("examples/dp_sgd.py",)),
    Example("cabs", ("examples/cabs.py",), ("examples/cabs.py",)),
    Example("saliency", ("examples/saliency.py",), ("examples/saliency.py",)),
    Example("hooks", ("examples/hooks.py",), ("examples/hooks.py",)),
    Example("fishr", ("examples/fishr.py",), ("examples/fishr.py",)),
    Example("attribution_lm", ("examples/attribution_lm.py",), ("examples/attribution_lm.py",)),
    Example("dp_finetune", ("examples/dp_finetune.py",), ("examples/dp_finetune.py",)),
    Example(
        "attribution",
        ("examples/attribution.py",),
        ("examples/attribution.py", "--plot", "{tmp}/attribution.png"),
        {"attribution.png": "attribution.png"},
    ),
]


def source_hash(example: Example) -> str:
    digest = hashlib.sha256()
    for name in example.sources:
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes() + b"\0")
    return digest.hexdigest()


def command_line(example: Example) -> str:
    return "python " + " ".join(a.replace("{tmp}", "OUT") for a in example.command)


def generate(example: Example) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        args = [a.replace("{tmp}", tmp) for a in example.command]
        env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1", MPLBACKEND="Agg")
        done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{example.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        for produced, saved in example.plots.items():
            shutil.copyfile(Path(tmp) / produced, OUTPUTS / saved)
        printed = done.stdout.replace(tmp, "OUT")
    (OUTPUTS / f"{example.name}.txt").write_text(printed)
    record = {
        "command": command_line(example),
        "sources": list(example.sources),
        "sha256": source_hash(example),
        "plots": sorted(example.plots.values()),
    }
    (OUTPUTS / f"{example.name}.json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str]) -> None:
    OUTPUTS.mkdir(parents=True, exist_ok=True)
    chosen = [e for e in EXAMPLES if not argv or e.name in argv]
    unknown = set(argv) - {e.name for e in EXAMPLES}
    if unknown:
        raise SystemExit(f"unknown example(s) {sorted(unknown)}; choose from {[e.name for e in EXAMPLES]}")
    for example in chosen:
        print(f"{example.name}: {command_line(example)}", flush=True)
        generate(example)


if __name__ == "__main__":
    main(sys.argv[1:])
