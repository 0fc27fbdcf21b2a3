"""examples/attribution.py and examples/attribution_lm.py: the features they write are ``P vec(g_i)`` of
torch.func's per-sample gradients (float64, every step of a loop), a stopped run resumes to the same
scores, and each says what it claims on its real data."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import assert_close, reference_grad_sample
from torch import Tensor, nn

from pergrad.attribution import StoreSpecError
from pergrad.attribution.projectors import Projector, Spec
from tests.test_examples_core import load

pytest.importorskip("sklearn")
pytest.importorskip("numpy")
attribution = load("attribution")
attribution_lm = load("attribution_lm")


def projected(ref: dict[str, Tensor], net: nn.Module, dim: int, seed: int) -> Tensor:
    """``sum_p P_p vec(g_i(p))`` over every parameter, ``P_p`` regenerated from its name and shape."""
    spec = Spec(dim, "kron", seed)
    blocks = [
        ref[name].flatten(1) @ Projector(spec, name, tuple(p.shape)).matrix().T for name, p in net.named_parameters()
    ]
    return torch.stack(blocks).sum(0)


def check_loop(
    net: nn.Module,
    psm_features: Callable[[Tensor, Tensor], Tensor],
    step: Callable[[Tensor, Tensor], Tensor],
    batches: list[tuple[Tensor, Tensor]],
    loss: Callable[[Tensor, Tensor], Tensor],
    dim: int,
    seed: int,
) -> None:
    """At every step: the example's features of a batch against torch.func's, then an SGD step."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for t, (x, y) in enumerate(batches):
        expected = projected(reference_grad_sample(net, x, y, loss), net, dim, seed)
        assert_close(psm_features(x, y), expected, f"step {t}: features")
        assert all(p.grad is None for p in net.parameters())  # a feature pass is not a training step
        optimizer.zero_grad()
        step(x, y).backward()
        optimizer.step()


def test_digits_features_are_the_projected_gradients_of_each_samples_loss() -> None:
    torch.manual_seed(0)
    data = attribution.make_data(0)
    net = attribution.mlp(hidden=12).double()
    dim, seed = 32, 7  # kron 4 x 8
    psm = attribution.wrap(net, dim, seed)
    x, y = data.x.double(), data.y
    batches = [(x[s : s + b], y[s : s + b]) for s, b in ((0, 5), (40, 17), (80, 9), (120, 12))]
    check_loop(
        net,
        lambda xb, yb: attribution.features(psm, xb, yb),
        lambda xb, yb: F.cross_entropy(psm(xb), yb),
        batches,
        lambda out, t: F.cross_entropy(out, t, reduction="sum"),
        dim,
        seed,
    )
    psm.remove()


def test_lm_features_are_the_projected_gradients_of_each_sequences_loss() -> None:
    """Sequences of 20 positions: the example's regime (32), past the 16 positions from which pergrad
    sums built per-sample gradients instead of asking autograd for the weight gradient."""
    torch.manual_seed(0)
    seqs = attribution_lm.sequences(20)
    net = attribution_lm.TinyLM(20, width=8, heads=2, blocks=1).double()
    dim, seed = 18, 3  # kron 3 x 6
    psm = attribution_lm.wrap(net, dim, seed)
    batches = [(seqs[s : s + b, :-1], seqs[s : s + b, 1:]) for s, b in ((0, 3), (10, 6), (30, 4), (50, 5))]

    def feats(x: Tensor, y: Tensor) -> Tensor:
        return attribution_lm.features(psm, torch.cat([x, y[:, -1:]], 1))

    def step(x: Tensor, y: Tensor) -> Tensor:
        return attribution_lm.sequence_losses(psm(x), torch.cat([x, y[:, -1:]], 1)).mean()

    check_loop(
        net,
        feats,
        step,
        batches,
        lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum"),
        dim,
        seed,
    )
    psm.remove()


QUICK = {"epochs": 2, "dim": 64}  # small: this test is about the store, not the ranking


def test_a_stopped_run_resumes_to_the_same_scores(tmp_path: Path) -> None:
    """``--stop-after 3``: three batches of 256 rows written, then stopped; the same run again writes
    only the missing rows and ranks as a run that was never stopped; a third run writes nothing; a
    store written by another configuration is refused."""
    whole = attribution.run(1, **QUICK)
    n = whole.n_train
    stopped = attribution.run(1, **QUICK, store=str(tmp_path), stop_after=3)
    assert not stopped.complete and stopped.rows_written == 3 * 256 and not stopped.detection
    resumed = attribution.run(1, **QUICK, store=str(tmp_path))
    assert resumed.complete and resumed.rows_written == 2 * n - 3 * 256
    again = attribution.run(1, **QUICK, store=str(tmp_path))
    assert again.rows_written == 0
    for name in attribution.RANKINGS[:3]:
        torch.testing.assert_close(resumed.scores[name], whole.scores[name], rtol=1e-5, atol=0, msg=name)
        torch.testing.assert_close(again.scores[name], whole.scores[name], rtol=1e-5, atol=0, msg=name)
    with pytest.raises(StoreSpecError, match="was written with k=64"):
        attribution.run(1, epochs=2, dim=128, store=str(tmp_path))


def test_self_influence_finds_the_flipped_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot, record = tmp_path / "ranking.png", tmp_path / "record.json"
    results = attribution.main(["--quick", "--plot", str(plot), "--json", str(record)])
    out = capsys.readouterr().out
    assert all(name in out for name in attribution.RANKINGS)
    assert plot.stat().st_size > 10_000
    saved = json.loads(record.read_text())
    assert saved[0]["detection"] == results[0].detection and saved[0]["complete"]
    (result,) = results
    assert result.n_flipped == 72 and result.n_train == 1438
    d = {name: result.detection[name] for name in attribution.RANKINGS}
    # Measured (quick: 3 epochs, dim 256) on seeds 0..11 with 1 thread, and 0..2 with 2 threads (the same
    # numbers): ROC AUC / precision at 72, min..max (median):
    #   TracIn self-influence      0.970..0.992 (0.980) / 0.639..0.806 (0.694)
    #   loss-gradient Gram         0.988..0.996 (0.993) / 0.764..0.875 (0.819)
    #   loss, last checkpoint      0.982..0.998 (0.994) / 0.764..0.903 (0.847)
    # Seed 0 (this run): 0.976 / 0.694, 0.992 / 0.819, 0.985 / 0.833. Random: 0.5 / 0.05.
    assert d["TracIn self-influence"]["auc"] > 0.95 and d["TracIn self-influence"]["precision"] > 0.55, d
    assert d[attribution.RANKINGS[1]]["auc"] > 0.97 and d[attribution.RANKINGS[1]]["precision"] > 0.7, d
    assert d["loss at the last checkpoint"]["auc"] > 0.95 and d["loss at the last checkpoint"]["precision"] > 0.65, d
    assert d["random"] == {"auc": 0.5, "precision": 72 / 1438}


def test_the_copies_source_is_the_top_proponent(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    (result,) = attribution_lm.main(["--quick"])  # one intra-op thread inside, the caller's restored after
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    assert "TracIn on unit features (cosine), exact" in out and "top-1 proponent" in out
    # Measured (quick: 2 epochs, dim 256) on seeds 0..9, 1 thread: top-1 is the source for unit features
    # (cosine) exact 1.0 on every seed, near 0.95..1.0 (median 1.0); raw TracIn exact 0.55..0.95 (0.75),
    # near 0.25..0.95 (0.675): raw inner products favour the sequences with the largest gradients; a random
    # ranking 0.00085..0.001. Seed 0 (this run, a projection seed per checkpoint, projection version 3): unit 1.0 / 1.0,
    # raw 0.85 / 1.0.
    assert result.random_top1 < 0.002, result
    assert result.top1["unit"]["exact"] >= 0.9 and result.top1["unit"]["near"] >= 0.8, result
    assert result.top1["raw"]["exact"] >= 0.4, result
    # per-token scores of the half copies, seed 0: a copied token's best training token is the same token of
    # its source 0.756 of the time (1 / (n T) by chance), a random token's is in the source 0.003
    assert "per token: copied token found at its source" in out
    assert result.per_token["copied"] >= 0.5 and result.per_token["random"] <= 0.05, result
