"""The documentation site: built strictly, every public name in the API pages, every code block run, the examples'
saved outputs current, and the built pages rendered by a real headless browser (Debian's ``chromium``).

``mkdocs build --strict`` turns a broken link, a missing cross-reference or a docstring that does not render into a
failure. The browser check skips where no Chromium is installed, except under CI (``CI=true``), where it fails.
Screenshots go to ``docs-screenshots/`` at the repository root (ignored by git).
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import pergrad
from tests.reference import assert_close, reference_grad_sample, run_pergrad

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SCREENSHOTS = ROOT / "docs-screenshots"
TWO_COMMANDS = [
    'pip install -c constraints.txt -e ".[demo]" && pergrad demo        # install, run the demo on real data',
    'pip install -c constraints.txt -e ".[test]" && python -m pytest    # install, run the core\'s tests',
]


# -- the build ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built with ``mkdocs build --strict`` into a fresh folder."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,  # stops a hang only: a busy machine takes many times a quiet one's minute
        check=False,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return out


def test_site_builds_with_mathjax_served_from_it(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "assets" / "mathjax" / "tex-chtml.js").stat().st_size > 500_000
    assert list((site / "assets" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").glob("*.woff"))
    home = (site / "index.html").read_text()
    assert "assets/mathjax/tex-chtml.js" in home
    assert not re.search(r"<script[^>]+src=\"https?://", home), "a script loaded from outside the site"


def api_ids(site: Path) -> set[str]:
    return {m for page in (site / "api").rglob("*.html") for m in re.findall(r'id="(pergrad[\w.]*)"', page.read_text())}


def test_every_public_name_has_an_api_entry(site: Path) -> None:
    ids = api_ids(site)
    missing = [name for name in pergrad.__all__ if f"pergrad.{name}" not in ids]
    assert not missing, f"pergrad.__all__ names without an API entry: {missing}"
    from pergrad import attribution

    modules = [
        "pergrad.transforms",
        "pergrad.rules",
        "pergrad.statistics",
        "pergrad.attribution",
        "pergrad.attribution.projectors",
    ]
    missing = [m for m in modules if m not in ids]
    for module, names in [
        ("pergrad.attribution", attribution.__all__),
        ("pergrad.rules", pergrad.rules.__all__),
        ("pergrad.transforms", ["clip_norm", "normalize", "scale", "square"]),
    ]:
        # a function named like the submodule that defines it (pergrad.rules.linear) is documented by its full path
        missing += [f"{module}.{n}" for n in names if not {f"{module}.{n}", f"{module}.{n}.{n}"} & ids]
    assert not missing, f"public modules' names without an API entry: {missing}"


def test_api_pages_render_the_docstrings_formulas(site: Path) -> None:
    page = (site / "api" / "statistics" / "index.html").read_text()
    assert 'class="arithmatex"' in page, "the statistics docstring's display formulas are not marked up for MathJax"


def links_of(html: str) -> set[str]:
    return set(re.findall(r'href="([^"#]*)', html))


@pytest.mark.parametrize(
    ("page", "must_say"),
    [
        ("guides/transforms/", "clip_norm"),  # how to clip per sample
        ("guides/norms-clipping-statistics/", "per_sample_norms"),  # how to read norms
        ("guides/writing-a-rule/", "register_rule"),  # how to write a rule
    ],
)
def test_newcomer_questions_within_two_clicks_of_home(site: Path, page: str, must_say: str) -> None:
    home = (site / "index.html").read_text()
    one_click = {link for link in links_of(home) if not link.startswith(("http", "assets"))}
    assert page in one_click, f"{page} is not linked from the home page"
    assert must_say in (site / page / "index.html").read_text()


# -- every python block of the docs and the README runs -------------------------------------------------------------

FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)


def blocks(path: Path) -> list[tuple[str, str, str]]:
    """``(header, code, id)`` of each python block in ``path`` (snippet includes left out: their files are tested
    where they live)."""
    found = []
    for n, m in enumerate(FENCE.finditer(path.read_text())):
        header, code = m.group(0).split("\n", 1)[0], m.group(2)
        if "python" in m.group(1) and not code.lstrip().startswith("--8<--"):
            found.append((header, code, f"{path.relative_to(ROOT)}#{n}"))
    return found


DOC_BLOCKS = [b for path in [README, *sorted(DOCS.rglob("*.md"))] for b in blocks(path)]


def namespace() -> dict[str, Any]:
    """What the docs' snippets take as given: a small classifier, a batch, a loss, an optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return {
        "torch": torch,
        "nn": torch.nn,
        "F": torch.nn.functional,
        "pergrad": pergrad,
        "PerSampleModule": pergrad.PerSampleModule,
        "transforms": pergrad.transforms,
        "model": model,
        "p": model[0].weight,
        "x": torch.randn(8, 4),
        "y": torch.randint(0, 3, (8,)),
        "loss_fn": torch.nn.functional.cross_entropy,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "lam": 0.1,
    }


@pytest.mark.parametrize(("header", "code"), [b[:2] for b in DOC_BLOCKS], ids=[b[2] for b in DOC_BLOCKS])
def test_docs_code_block_runs(header: str, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every python block runs (on the CPU: ``"cuda"`` becomes ``"cpu"``), or is marked
    ``{.python .skip reason="..."}`` with the reason."""
    if ".skip" in header:
        reason = re.search(r'reason="([^"]+)"', header)
        assert reason, f"a skipped block needs a reason: {header}"
        pytest.skip(reason.group(1))
    registry = pergrad.default_registry.copy()  # a rule a page registers stays out of the default registry
    monkeypatch.setattr(pergrad, "register_rule", registry.register)
    exec(compile(code.replace('"cuda"', '"cpu"'), "<docs>", "exec"), namespace())


def test_no_escaped_underscore_in_text_mode_math() -> None:
    """MathJax shows ``\\_`` inside ``\\texttt{}`` or ``\\text{}`` as a backslash and an underscore (seen in Chromium:
    ``p.grad\\_sample`` rendered with a backslash glyph); ``_`` alone is literal there."""
    pattern = re.compile(r"\\(?:text|texttt|textrm|textsf|mathrm|mathtt)\{[^}]*\\_")
    sources = [README, *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "pergrad").rglob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sources
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and "texttt" in pattern.search(line).group(0)  # type: ignore[union-attr]
    ]
    assert not found, f"\\_ inside text-mode math renders a backslash: {found}"
    assert pattern.search(r"(\texttt{p.grad\_sample}[i])"), "the pattern finds what it looks for"


def test_every_block_is_found() -> None:
    """The fence pattern finds the blocks (a pattern that finds none would make the test above vacuous)."""
    pages = {b[2].split("#")[0] for b in DOC_BLOCKS}
    assert len(DOC_BLOCKS) >= 15 and {"README.md", "docs/guides/writing-a-rule.md", "docs/index.md"} <= pages


def block_under(page: str, heading: str) -> str:
    """The first python block after ``heading`` on ``page``."""
    text = (ROOT / page).read_text()
    return text.split(heading, 1)[1].split("```python", 1)[1].split("```", 1)[0]


def test_writing_a_rule_example() -> None:
    block = block_under("docs/guides/writing-a-rule.md", "# Writing a rule")
    registry = pergrad.default_registry.copy()
    ns: dict[str, object] = {"registry": registry}
    exec(block.replace("@pergrad.register_rule(Scale)", "@registry.register(Scale)"), ns)
    scale = ns["Scale"]
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), scale(4)).double()  # type: ignore[operator]
    with torch.no_grad():
        model[1].w.normal_()
    for batch in (5, 3, 7):
        x, target = torch.randn(batch, 2, 3, dtype=torch.float64), torch.randn(batch, 2, 4, dtype=torch.float64)
        ref = reference_grad_sample(model, x, target)
        with pergrad.PerSampleModule(model, rules=registry) as psm:
            run_pergrad(psm, x, target)
            assert_close(model[1].w.grad_sample, ref["1.w"])


def test_loss_scaling_example() -> None:
    """The precision guide's GradScaler loop, on the CPU: one step within 3% of the float32 step without autocast
    or scaling (the default scale 2**16 would shrink a clipped step 65536-fold)."""
    block = block_under("docs/guides/precision.md", "## Mixed precision and loss scaling")
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    models = [torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    before = [p.detach().clone() for p in models[0].parameters()]
    ns = namespace() | {
        "model": models[0],
        "optimizer": torch.optim.SGD(models[0].parameters(), lr=1.0),
        "x": x,
        "y": y,
    }
    exec(block.replace('"cuda"', '"cpu"'), ns)
    with pergrad.PerSampleModule(models[1]) as psm:
        psm.register_transform(models[1], pergrad.transforms.clip_norm(1.0))
        torch.nn.functional.cross_entropy(psm(x), y).backward()
    for p, q, start in zip(models[0].parameters(), models[1].parameters(), before):
        assert q.grad is not None
        step = start - p.detach()
        assert (step - q.grad).norm() <= 3e-2 * q.grad.norm()


def test_attribution_example() -> None:
    """The attribution guide's snippet gives ``P vec(g_i)`` of each sample's own loss (torch.func's per-sample
    gradients times the regenerated P), float64."""
    from pergrad.attribution.projectors import Projector, Spec

    block = block_under("docs/guides/attribution.md", "# Training-data attribution")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    ns = namespace() | {"model": model, "x": x, "y": y}
    exec(block, ns)
    features = ns["features"]
    assert isinstance(features, torch.Tensor) and features.shape == (5, 512)
    ref = reference_grad_sample(model, x, y, loss=lambda out, t: torch.nn.functional.cross_entropy(out, t))
    spec = Spec(512, "kron", 0, None)
    expected = sum(Projector(spec, n, tuple(p.shape)).apply(ref[n]) for n, p in model.named_parameters())
    assert_close(features, expected, "the guide's projected features")  # type: ignore[arg-type]


# -- the README -------------------------------------------------------------------------------------------------------


def test_readme_opens_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert lines[:6] == ["# pergrad", "", "```bash", *TWO_COMMANDS, "```"]


def test_readme_links_into_the_site() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(targets) >= 5
    assert [t for t in targets if not (ROOT / t).is_file()] == []
    assert len(text.splitlines()) < 80, "the README stays short: what it said is in docs/"


# -- the examples' saved outputs ----------------------------------------------------------------------------------------


@functools.cache
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_outputs", DOCS / "generate_outputs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_example_outputs_are_current() -> None:
    """Each example's saved output was made from its current source: edit an example, then run
    ``python docs/generate_outputs.py NAME``."""
    import json

    gen = generator()
    stale = []
    for example in gen.EXAMPLES:
        record = json.loads((DOCS / "outputs" / f"{example.name}.json").read_text())
        if record["sha256"] != gen.source_hash(example):
            stale.append(f"{example.name} (python docs/generate_outputs.py {example.name})")
        assert (DOCS / "outputs" / f"{example.name}.txt").read_text().strip(), example.name
        for plot in record["plots"]:
            assert (DOCS / "outputs" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    assert not stale, f"outputs older than their example: {stale}"


def test_a_stale_output_is_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: one line added to an example changes the hash it compares."""
    import json

    gen = generator()
    example = next(e for e in gen.EXAMPLES if e.name == "cabs")
    for name in example.sources:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, tmp_path / name)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    recorded = json.loads((DOCS / "outputs" / "cabs.json").read_text())["sha256"]
    assert gen.source_hash(example) == recorded
    with (tmp_path / example.sources[0]).open("a") as f:
        f.write("# edited\n")
    assert gen.source_hash(example) != recorded


# -- a real browser ---------------------------------------------------------------------------------------------------------


def chromium() -> str:
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed; CI needs it for the browser check (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI runs this check")
    return found


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on localhost, as a reader's browser gets it."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    thread.join()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def browse(url: str, screenshot: Path, profile: Path) -> str:
    """The DOM after the page's scripts ran (MathJax included), and a screenshot of it."""
    flags = [
        "--headless",
        "--no-sandbox",  # as root, and in containers
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=15000",
        "--window-size=1280,1400",
    ]
    browser = chromium()
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=900, check=True)
    subprocess.run([browser, *flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=900, check=True)
    return dom.stdout


@pytest.mark.parametrize(("page", "title"), [("", "pergrad"), ("api/statistics/", "Statistics")])
def test_browser_renders_page(served: str, page: str, title: str, tmp_path: Path) -> None:
    SCREENSHOTS.mkdir(exist_ok=True)
    shot = SCREENSHOTS / f"{page.strip('/').replace('/', '-') or 'home'}.png"
    shot.unlink(missing_ok=True)
    dom = browse(served + page, shot, tmp_path / "profile")
    found = re.search(r"<title>(.*?)</title>", dom, re.S)
    assert found and title in found.group(1) and "pergrad" in found.group(1), found
    assert 'class="md-nav' in dom and "Guides" in dom and "API reference" in dom, "no navigation"
    assert "<mjx-container" in dom, "no formula rendered by MathJax"
    assert "<mjx-merror" not in dom, "MathJax could not typeset a formula"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000, "an empty screenshot"
