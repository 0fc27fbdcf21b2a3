"""Hypothesis profiles, and which tests ``python -m pytest`` runs.

``python -m pytest`` runs the core's tests: torch, pytest and hypothesis are all they need
(``pip install -c constraints.txt -e ".[test]"``). The tests that need an optional extra, build and open the
documentation site, run the benchmark scripts or the examples, start several processes, or take long (second
order, the review sweeps) are marked ``slow`` here, in one place, and left out of it. ``python -m pytest --full`` (after ``pip install -c constraints.txt -e ".[test-all]"``)
runs every test, as CI does; ``-m slow`` selects the slow ones alone; a test file or test named on the command line
runs whatever its mark.

Under ``--full`` with ``CI=true``, a test skipped because a package of the ``test-all`` extra could not be imported
fails the run: the full suite must not pass by skipping what it was meant to run.
"""

from __future__ import annotations

import fnmatch
import inspect
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from pergrad._core.shortcuts import detach

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(2)

HERE = Path(__file__).resolve().parent

# whole files left out of `python -m pytest`, and why
SLOW_FILES: dict[str, str] = {
    "test_attack_40.py": "subprocesses importing opacus, lightning, transformers; two gloo processes",
    "test_benchmarks.py": "runs the benchmark scripts",
    "test_captum.py": "captum",
    "test_lightning.py": "lightning",
    "test_attack_lightning_compile.py": 'lightning under torch.compile; a strategy="ddp" launch of 2 processes',
    "test_attack_ddp_compile.py": "two gloo processes compiling training steps",
    "test_opacus_route.py": "opacus and transformers",
    "test_hf_models.py": "transformers",
    "test_hf_rules.py": "transformers",
    "test_hf_trainer.py": "transformers",
    "test_projection.py": "transformers (HF's Conv1D among the projected layers)",
    "test_projection_core.py": "transformers (HF's Conv1D among the projected layers)",
    "test_attribution_store.py": "numpy (the attribution extra)",
    "test_attribution_scores.py": "numpy (the attribution extra)",
    "test_attribution_kfac.py": "numpy (the attribution extra)",
    "test_attribution_trak.py": "numpy (the attribution extra)",
    "test_attack_42.py": "numpy (the attribution extra); a minute of one-sample references",
    "test_demo.py": "runs the demo (the demo extra)",
    "test_examples_attribution.py": "runs the examples (scikit-learn)",
    "test_examples_dp.py": "runs the examples (dp-accounting, transformers)",
    "test_examples_fishr.py": "runs the examples (scikit-learn)",
    # long: together half of the core's time (about 5 of 10 CPU-minutes), left to the full run
    "test_second_order.py": "long: differentiating through the per-sample gradients of every rule",
    "test_attack_few_flops.py": "long: one-sample loops over up to 64 samples of a 256 x 256 layer",
    "test_attack_loops.py": "long: users' loops of 20 to 100 steps (Lightning, transformers, opacus), one-sample references",
    "test_second_order_shared.py": "long: second order through outputs shared by the batch",
    "test_attack_39.py": "long: an adversarial review's whole models (checkpointing, compile, ViT)",
    "test_attack_compiled_step.py": "long: compiled training steps (aot_eager, inductor, max-autotune), one-sample references",
    "test_sweep3_hooks.py": "long: a review's sweep of users' hooks",
    "test_sweep3_shared.py": "long: a review's sweep of outputs shared by the batch",
    "test_sweep3_misc.py": "long: a review's sweep",
    "test_distributed.py": "several processes (DDP and FSDP2 over gloo)",
}

# single tests left out of `python -m pytest`, and why: patterns (fnmatch) of "file::name[parameters]"
SLOW_TESTS: dict[str, str] = {
    "test_docs.py::test_site_*": "builds the site (the docs extra)",
    "test_docs.py::test_every_public_name_has_an_api_entry": "builds the site (the docs extra)",
    "test_docs.py::test_api_pages_render_the_docstrings_formulas": "builds the site (the docs extra)",
    "test_docs.py::test_newcomer_questions_within_two_clicks_of_home*": "builds the site (the docs extra)",
    "test_docs.py::test_browser_renders_page*": "opens the site in Chromium",
    "test_docs.py::test_docs_code_block_runs[[]docs/guides/audit.md#3]": "dp-accounting",
    "test_docs.py::test_docs_code_block_runs[[]docs/integrations/*": "the integrations' extras",
    "test_docs.py::test_docs_code_block_runs[[]docs/coming-from/opacus.md*": "dp-accounting",
    "test_docs.py::test_docs_code_block_runs[[]docs/guides/attribution.md*": "numpy (the attribution extra)",
    "test_attribution_fisher.py::test_ekfac_of_the_sampled_label_fisher_equals_the_naive_formula": "numpy (a store)",
    "test_audit.py::test_the_cost_benchmark_runs": "runs a benchmark script",
    "test_host_syncs.py::test_the_counter_sees_every_kind_of_sync": "numpy (Tensor.numpy is one of the syncs)",
    "test_privacy.py::test_epsilon_is_the_accountants_for_the_steps_taken": "dp-accounting",
    "test_privacy.py::test_noise_multiplier_for_round_trips*": "dp-accounting",
    "test_privacy.py::test_no_noise_no_privacy_no_step_no_cost": "dp-accounting",
}

# a test whose own source imports one of these, or calls pytest.importorskip, needs an extra
EXTRA_MODULES = (
    "captum", "dp_accounting", "lightning", "matplotlib", "mkdocs", "numpy", "opacus", "peft", "scipy", "sklearn",
    "tqdm", "transformers",
)  # fmt: skip
NEEDS_EXTRA = re.compile(
    r"importorskip\(|^\s*(?:import|from)\s+(?:"
    + "|".join(EXTRA_MODULES)
    + r")\b|pergrad\.(?:integrations\.)?(?:hf|lightning|captum)\b",
    re.M,
)

# peers that only the benchmark's own virtual environment installs: their tests skip in CI too
NEVER_INSTALLED = {"trak", "dattri", "logix"}


@pytest.fixture
def float64() -> Iterator[None]:
    """float64 as torch's default dtype during the test, the previous default restored after it (a file uses it
    with ``pytestmark = pytest.mark.usefixtures("float64")``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


LIBRARY_FEW_FLOPS = detach.FEW_FLOPS  # the library's own threshold (``detach_at_any_size`` sets it to 0 in tests)


@pytest.fixture(autouse=True)
def detach_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights run detached whatever their layer's flops (``detach.FEW_FLOPS`` 0), as the shortcut's tests, written
    with tiny layers, mean them to. Its threshold is tested in ``test_detach_flops.py`` and drawn by the fuzzer."""
    monkeypatch.setattr(detach, "FEW_FLOPS", 0)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="run every test, the slow ones too (needs pip install -c constraints.txt -e '.[test-all]')",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: needs an optional extra, runs scripts, builds the site, or takes long (run with --full)"
    )
    config.pluginmanager.register(MissingExtras(config), "pergrad-missing-extras")


def _named(config: pytest.Config) -> set[Path]:
    """The test files named on the command line (a folder named runs its default selection)."""
    named = set()
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::", 1)[0]).resolve()
        if path.suffix == ".py":
            named.add(path)
    return named


def _selects_by_default(config: pytest.Config) -> bool:
    """Whether slow tests are left out: not with --full, nor with a -m expression of the caller's."""
    return not config.getoption("full") and not config.option.markexpr


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A slow file is not even imported by default: its imports may be of packages the core does not install
    (pytest calls this only for files it finds in folders, never for a file named on the command line)."""
    if _selects_by_default(config) and collection_path.parent == HERE and collection_path.name in SLOW_FILES:
        return True
    return None


def _why_slow(item: pytest.Item) -> str | None:
    path = Path(str(item.path))
    if path.parent != HERE:
        return None
    if path.name in SLOW_FILES:
        return SLOW_FILES[path.name]
    found = next(
        (why for pattern, why in SLOW_TESTS.items() if fnmatch.fnmatchcase(f"{path.name}::{item.name}", pattern)), None
    )
    if found is not None:
        return found
    function = getattr(item, "function", None)
    if function is not None:
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            return None
        if NEEDS_EXTRA.search(source):
            return "needs an optional extra"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    named = _named(config)
    kept, left_out = [], []
    for item in items:
        why = _why_slow(item)
        if why is not None:
            item.add_marker(pytest.mark.slow(reason=why))
        if why is not None and _selects_by_default(config) and Path(str(item.path)) not in named:
            left_out.append(item)
        else:
            kept.append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
    config.stash[_LEFT_OUT] = len(left_out)


_LEFT_OUT = pytest.StashKey[int]()


class MissingExtras:
    """Records the tests and files skipped because a package the ``test-all`` extra installs could not be
    imported; under ``--full`` with ``CI=true`` they fail the run."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.missing: list[str] = []

    def record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if not report.skipped or not isinstance(report.longrepr, tuple):
            return
        found = re.search(r"could not import '([\w.]+)'", str(report.longrepr[2]))
        if found is not None and found.group(1).split(".")[0] not in NEVER_INSTALLED:
            self.missing.append(f"{report.nodeid}: could not import {found.group(1)}")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.record(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.record(report)

    def failing(self) -> bool:
        return bool(self.missing) and self.config.getoption("full") and os.environ.get("CI") == "true"

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.failing() and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        left_out = self.config.stash.get(_LEFT_OUT, 0)
        if left_out:
            terminalreporter.write_line(
                f"{left_out} slow tests left out (optional extras, scripts, the site, several processes, long files), and the files "
                f"{', '.join(sorted(SLOW_FILES))}; to run them: "
                "pip install -c constraints.txt -e '.[test-all]' && python -m pytest --full"
            )
        if self.missing and self.config.getoption("full"):
            title = "skipped for a missing package" + (": a failure under CI" if self.failing() else "")
            terminalreporter.section(title)
            for line in self.missing:
                terminalreporter.write_line(line)
