"""Batch statistics computed in a forward couple the samples: refused where the graph shows them
(``F.batch_norm`` in training mode), while per-sample normalisations stay exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad import BatchMixingError, PerSampleModule
from tests.reference import assert_close, reference_grad_sample


class Normed(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.inp, self.out, self.how = nn.Linear(4, 6), nn.Linear(6, 2), how
        self.register_buffer("mean", torch.zeros(6))
        self.register_buffer("var", torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.how == "batch":
            h = F.batch_norm(h, self.mean, self.var, training=True)
        elif self.how == "batch-no-stats":
            h = F.batch_norm(h, None, None, training=True)
        elif self.how == "running":
            h = F.batch_norm(h, self.mean, self.var, training=False)
        else:  # each sample's own statistics, through batch norm on a [1, B*C, L] view
            h = F.instance_norm(h.view(h.shape[0], 2, 3)).view(h.shape[0], 6)
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("how", ["batch", "batch-no-stats"])
def test_functional_batch_norm_in_training_mode_is_refused(how: str) -> None:
    model = Normed(how).double()
    psm = PerSampleModule(model)
    with pytest.raises(BatchMixingError, match=r"F.batch_norm\(\.\.\., training=True\), on an input of shape \(5, 6\)"):
        psm(torch.randn(5, 4, dtype=torch.float64))
    with torch.no_grad():  # nothing to differentiate: nothing to refuse
        model(torch.randn(5, 4, dtype=torch.float64))


@pytest.mark.parametrize("how", ["running", "instance"])
def test_per_sample_normalisations_stay_exact(how: str) -> None:
    torch.manual_seed(0)
    model = Normed(how).double()
    psm = PerSampleModule(model)
    for b in (5, 3, 4):
        x, y = torch.randn(b, 4, dtype=torch.float64), torch.randn(b, 2, dtype=torch.float64)
        ref = reference_grad_sample(model, x, y)
        model.zero_grad()
        (psm(x) - y).pow(2).sum(1).mean().backward()
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], f"{name} at B={b}")
