"""What one clipped training step runs of pergrad: the functions, their lines, modules and types (issue 40).

The step is the documented training loop (docs/getting-started.md): ``PerSampleModule(model,
keep_grad_sample=False)``, ``register_transform(model, transforms.clip_norm(1.0))``, then
``optimizer.zero_grad()``, ``F.cross_entropy(psm(x), y).backward()``, ``optimizer.step()``. After
3 warm-up steps (the first backward checks and records; shortcuts start from the second), ONE step
runs under ``sys.settrace``, which records every frame of code inside the pergrad package and its
executed lines. Reported, per model:

- functions: the distinct functions that ran (comprehensions count as part of their function);
- lines: the source lines of those functions (``inspect.getsourcelines``, def to last line, each
  line once where functions nest), what a newcomer reads to follow the step; executed: the distinct
  lines that ran;
- modules; types: the classes whose methods ran (and those whose generated methods ran: a
  dataclass's ``__init__``);
- the functions of FEATURES the step does not ask for, classified by the one table below.

    python benchmarks/trace_step.py                        # gpt, mlp, cnn
    python benchmarks/trace_step.py --model mlp --show-functions
    python benchmarks/trace_step.py --budget-lines 1200 --budget-modules 12 --budget-types 12 --budget-feature-lines 0
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import inspect
import json
import platform
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# ---- THE ONE TABLE THAT NAMES TODAY'S CODE: update it when code moves ------------------------------------------
# Space-separated "module:qualname" patterns (fnmatch: `*` crosses dots). A function belongs to the first feature
# with a pattern that matches it, unless a CORE pattern does (what every step needs, in a feature's module today).
CORE = "pergrad*.shared:batch_of_call* pergrad*.shared:BatchInfo* pergrad*.shared:_storage*"
FEATURES = {
    "Opacus route": "pergrad*:*opacus* pergrad*.consumers.grad_sample:GradSample.held*",
    "K-FAC factors": "pergrad*.attribution.factors:* pergrad*.attribution.forms*:*_factors* "
    "pergrad*:PerSampleModule.*factors*",
    "projection": "pergrad*.attribution*:* pergrad*:PerSampleModule.*project* pergrad*:PerSampleModule._attributing",
    "statistics": "pergrad*.statistics:* pergrad*.rules.*:*_dots* pergrad*.rules.*:*_moments* "
    "pergrad*.rules.*:*_sum_squares* pergrad*.sources:*dots* pergrad*.sources:*oments* pergrad*.sources:*sum_squares*",
    "kept grad_sample": "pergrad*.consumers.grad_sample:GradSample.*",
    "audit": "pergrad*.privacy.audit:* pergrad*.consumers.grad_sample:Hold*",
    "LM-loss warning": "pergrad*.integrations.lm:*",
    "Lightning": "pergrad*.lightning:* pergrad*:*lightning* pergrad*:PerSampleModule._check_loss_divisor*",
    "DDP / FSDP2": "pergrad*.distributed:*",
    "second order": "pergrad*:Engine.*second_order* pergrad*:Engine.*input_grad* pergrad*:Engine._drop_input_hooks",
    # following every op of the forward to tell batched from shared inputs: counted as issue 40 counts it, but
    # it is also what refuses a batch folded into another dim, a check a lean core must keep some other way
    "provenance": "pergrad*.dims:* pergrad*:Provenance* pergrad*.shared:provenance pergrad*.shared:located "
    "pergrad*.shared:_writes_into_first pergrad*.shared:_tensors* pergrad*.shared:_without_dynamo "
    "pergrad*:LayerHooks._follow* pergrad*:LayerHooks.following",
    "shared inputs": "pergrad*.shared:* pergrad*:LayerHooks._keep_shared*",
    "integrations": "pergrad*.integrations*:* pergrad*.hf:* pergrad*.rules.hf:* pergrad*.captum:* pergrad*.privacy*:* "
    "pergrad*.cli:* pergrad*.demo:*",
}
USES = {"gpt": {"shared inputs"}}  # features a model's step needs: gpt's positions wpe(arange(T)) are shared
# ---------------------------------------------------------------------------------------------------------------

COMPREHENSIONS = {"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"}
MODELS = ["gpt", "mlp", "cnn"]


def feature_of(module: str, qualname: str) -> str | None:
    """The feature of the table above that function ``module:qualname`` belongs to (None: the core)."""
    name = f"{module}:{qualname}"
    if any(fnmatch.fnmatchcase(name, p) for p in CORE.split()):
        return None
    return next((f for f, ps in FEATURES.items() if any(fnmatch.fnmatchcase(name, p) for p in ps.split())), None)


def lines_of(rows: list[dict[str, Any]]) -> int:
    """The source lines of the functions of ``rows``, each once (a nested function's lie in its parent's)."""
    return len({(r["module"], n) for r in rows for n in range(r["line"], r["line"] + r["lines"])})


def build(model: str) -> tuple[Any, Any, Any]:
    """``(model, x, y)``: tiny, B=4, the model maps ``x`` to ``[B, 10]`` logits."""
    import torch
    import transformer
    from torch import nn

    torch.manual_seed(0)
    if model == "gpt":  # Embedding, LayerNorm, attention, GELU MLP: 2 pre-norm blocks
        return transformer.gpt_stack(16, 2, 8, 2, 50), torch.randint(0, 50, (4, 8)), torch.randint(0, 10, (4,))
    if model == "mlp":
        net = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10))
        return net, torch.randn(4, 32), torch.randint(0, 10, (4,))
    if model == "cnn":
        net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 8 * 8, 10),
        )  # fmt: skip
        return net, torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    raise ValueError(f"unknown model {model!r}")


def traced(fn: Callable[[], None], root: Path) -> tuple[set[CodeType], set[tuple[str, int]], set[type]]:
    """Run ``fn`` under ``sys.settrace``: the code objects of ``root`` (a package folder) that ran, their
    executed ``(file, line)`` pairs, and the classes of ``root``'s modules whose generated methods ran
    (a dataclass's ``__init__``, compiled from a string). The previous tracers are restored."""
    codes: set[CodeType] = set()
    lines: set[tuple[str, int]] = set()
    generated: set[type] = set()
    prefix, package = str(root) + "/", root.name

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            lines.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code.co_filename.startswith(prefix):
            codes.add(code)
            return local
        if code.co_filename == "<string>" and code.co_argcount:
            first = frame.f_locals.get(code.co_varnames[0])
            cls = first if isinstance(first, type) else type(first)
            if cls.__module__.split(".")[0] == package:
                generated.add(cls)
        return None

    before, before_threads = sys.gettrace(), threading.gettrace()
    gc.collect()  # the collector off while tracing: what was dropped before is freed (finalizers run) now
    enabled = gc.isenabled()
    gc.disable()
    threading.settrace(on_call)
    sys.settrace(on_call)
    try:
        fn()
    finally:
        sys.settrace(before)
        threading.settrace(before_threads)
        if enabled:
            gc.enable()
    return codes, lines, generated


def trace_step(model: str, warmup: int = 3, lean: bool = False) -> dict[str, Any]:
    """The report of one clipped step of ``model`` after ``warmup`` steps (see the module docstring); ``lean``:
    with ``lean_forwards=True``."""
    import torch
    import torch.nn.functional as F

    import pergrad
    from pergrad import PerSampleModule, transforms

    net, x, y = build(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    psm = PerSampleModule(net, keep_grad_sample=False, lean_forwards=lean)
    psm.register_transform(net, transforms.clip_norm(1.0))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(psm(x), y).backward()  # .grad = (1/B) sum_i clip(g_i), one backward
        optimizer.step()

    for _ in range(warmup):
        step()
    root = Path(pergrad.__file__).parent  # as the code objects name their files
    try:
        codes, executed, generated = traced(step, root)
    finally:
        psm.remove()

    def module_of(code: CodeType) -> str:
        parts = Path(code.co_filename).relative_to(root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    functions = sorted(
        (c for c in codes if c.co_name not in COMPREHENSIONS), key=lambda c: (module_of(c), c.co_firstlineno)
    )
    rows: list[dict[str, Any]] = []
    types = {f"{c.__module__}.{c.__qualname__}" for c in generated}
    for code in functions:
        source, first = inspect.getsourcelines(code)
        mod = module_of(code)
        # the classes this code belongs to: every name but the last of each segment between "<locals>"
        owners = [seg.split(".")[:-1] for seg in code.co_qualname.split(".<locals>.")]
        types.update(f"{mod}.{'.'.join(seg[: i + 1])}" for seg in owners for i in range(len(seg)))
        feature = feature_of(mod, code.co_qualname)
        rows.append(
            {"module": mod, "function": code.co_qualname, "line": first, "lines": len(source), "feature": feature}
        )
    features = {r["feature"]: [x for x in rows if x["feature"] == r["feature"]] for r in rows if r["feature"]}
    unused = [r for r in rows if r["feature"] is not None and r["feature"] not in USES.get(model, set())]
    modules = {r["module"]: [x for x in rows if x["module"] == r["module"]] for r in rows}
    return {
        "model": model,
        "functions": len(rows),
        "lines": lines_of(rows),
        "lines_executed": len(executed),
        "modules": len(modules),
        "types": len(types),
        "type_names": sorted(types),
        "features_used": sorted(USES.get(model, set())),
        "unused_feature_functions": len(unused),
        "unused_feature_lines": lines_of(unused),
        "features": {f: {"functions": len(rs), "lines": lines_of(rs)} for f, rs in features.items()},
        "per_module": {m: {"functions": len(rs), "lines": lines_of(rs)} for m, rs in modules.items()},
        "rows": rows,
    }


def report(r: dict[str, Any], show_functions: bool) -> str:
    """Plain text: the totals, the table per module, the feature functions (every function if asked)."""
    out = [
        f"## {r['model']}: {r['functions']} functions, {r['lines']} lines ({r['lines_executed']} executed), "
        f"{r['modules']} modules, {r['types']} types; unused features: {r['unused_feature_functions']} functions, "
        f"{r['unused_feature_lines']} lines",
        "",
        "| module | functions | lines |",
        "|---|---|---|",
        *(f"| {m} | {v['functions']} | {v['lines']} |" for m, v in r["per_module"].items()),
        "",
        "| feature | functions | lines |",
        "|---|---|---|",
        *(
            f"| {f}{' (used)' if f in r['features_used'] else ''} | {v['functions']} | {v['lines']} |"
            for f, v in r["features"].items()
        ),
    ]
    shown = [row for row in r["rows"] if show_functions or row["feature"] is not None]
    out += ["", *(f"  {x['module']}:{x['line']} {x['function']} ({x['lines']}) {x['feature'] or ''}" for x in shown)]
    out += ["", "types: " + ", ".join(t.split(".", 1)[1] for t in r["type_names"]), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--show-functions", action="store_true", help="list every function, not only the features'")
    parser.add_argument("--lean", action="store_true", help="with lean_forwards=True")
    for what in ("lines", "modules", "types", "feature-lines"):
        parser.add_argument(f"--budget-{what}", type=int, default=None, help=f"exit 1 where a model's {what} exceed it")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "trace_step.json")
    args = parser.parse_args(argv)
    import torch

    results = [trace_step(m, args.warmup, args.lean) for m in args.model]
    for r in results:
        print(report(r, args.show_functions))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    saved = {
        "command": " ".join(["python", "benchmarks/trace_step.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": commit.stdout.strip() or None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(saved, indent=1) + "\n")
    budgets = {"lines": args.budget_lines, "modules": args.budget_modules, "types": args.budget_types}
    budgets["unused_feature_lines"] = args.budget_feature_lines
    over = [
        f"{r['model']}: {k} {r[k]} > {b}" for r in results for k, b in budgets.items() if b is not None and r[k] > b
    ]
    for line in over:
        print(f"over budget: {line}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
