"""The examples that need only torch run here on small settings and say what they claim."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_hooks_example_matches_the_hand_computed_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    results = load("hooks").main(["--quick"])
    plain, rescaled = results["no rescaling"], results["head returns 0.5 * grad_input"]
    assert plain["block full grad_input"] == [6.0, 6.0] and plain["block full grad_output"] == [3.0, 3.0]
    assert plain["pergrad block.weight per sample"] == [3.0, 6.0]
    assert plain["pergrad head.weight per sample"] == [2.0, 4.0]
    assert plain["block[0] legacy grad_input"] == [6.0, 12.0, 9.0]
    # head's rescaled grad_input halves everything before head, not head's own gradient
    assert rescaled["pergrad block.weight per sample"] == [1.5, 3.0]
    assert rescaled["pergrad head.weight per sample"] == [2.0, 4.0]
    assert rescaled["x.grad"] == [3.0, 3.0]
    assert "legacy grad_input" in capsys.readouterr().out


def test_saliency_example_fgsm_raises_the_loss() -> None:
    result = load("saliency").main(["--quick"])  # 60 steps, eps 0.2
    # measured with --seed 0..39 x torch.set_num_threads(1, 2), 80 runs: accuracy worst 0.992 (median
    # 1.0; chance 0.5), adversarial accuracy worst 0.004 (median 0), adversarial / clean loss worst 87
    # (median 140). Input gradients mixed up between samples leave about half the predictions
    # (adversarial accuracy ~0.5), with the wrong sign all of them, and the loss falls.
    assert result["accuracy"] > 0.9
    assert result["adversarial_accuracy"] < 0.25
    assert result["adversarial_loss"] > 10 * result["clean_loss"]


def test_clip_vs_mean_example(capsys: pytest.CaptureFixture[str]) -> None:
    load("clip_vs_mean").main(["--quick"])
    out = capsys.readouterr().out
    assert "||T(E[g])|| = 1.0000" in out and "cosine" in out


def test_dp_sgd_example_learns_with_noise() -> None:
    result = load("dp_sgd").main(["--quick"])  # 2 epochs, sigma 1.0
    # chance is 1/3. The batches and the noise come from the OS's entropy: 700 runs with 1 and 2
    # threads gave worst 0.794, 1st percentile 0.808, median 0.842 (a spread of about 0.013).
    assert result["accuracy"] > 0.6


def test_cabs_example_grows_the_batch() -> None:
    sizes = load("cabs").main(["--quick"])["batch_sizes"]  # 120 steps
    # --seed 0..39 x torch.set_num_threads(1, 2), 80 runs: first 16..22, last 47..67, last / first
    # 2.41..4.19 (median 3.30). A tr(Sigma) of zero (or B times too small) stays at 16 throughout;
    # one B times too large ends at the cap 2048 (the example clips every size to [16, 2048]).
    assert sizes[-1] > 1.5 * sizes[0]  # the noise dominates as the loss falls
    assert sizes[-1] < 200


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.py")))
def test_every_example_answers_help_and_has_a_quick_mode(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``python examples/NAME.py --help`` prints its options and exits without running; ``--quick`` is one of them
    (the tests run each example in its quick mode: here, tests/test_examples_*.py)."""
    with pytest.raises(SystemExit) as exit_:
        load(name).main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--quick" in out, out


def test_the_examples_are_found() -> None:
    assert {"hooks", "clip_vs_mean", "dp_sgd", "dp_finetune", "fishr", "attribution"} <= {
        p.stem for p in EXAMPLES.glob("*.py")
    }
