"""Attack on the rules of 2026-11-28: ``torch.gradient``, ``fft.fftshift``/``ifftshift``, ``cross``, ``inner``,
``put``/``masked_scatter`` with the batch as source, ``pixel_shuffle``/``channel_shuffle``, and boolean masks over
the batch dim and others (``h[mask]`` of a ``[B, T]`` mask, its values read).

Each model is ``head(pick(tanh(body(x))))`` in float64 (``x`` of any shape, the batch on dim 0, or dim 1 with
``batch_first=False``), run several steps with the batch size changing, against each loss term's gradient by plain
autograd through the whole batch forward. Each case is exact (row ``i`` of ``head``'s input depends on sample ``i``
alone, in order) or refused; which one is decided from the math. Cases where pergrad gets it wrong are strict
xfails whose reason says what happens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule
from pergrad.errors import BatchMixingError, BatchSizeError, SharedInputError

pytestmark = [
    pytest.mark.usefixtures("float64"),
    pytest.mark.filterwarnings("ignore:Using torch.cross without specifying the dim"),
    pytest.mark.filterwarnings("ignore:indexing with dtype torch.uint8"),
]

REORDERED = "reordered or mixed the samples along the batch dim"
D, T, K = 3, 5, 4


class Picked(nn.Module):
    """``head(pick(tanh(body(x))))``; ``calls`` counts the forwards (two a step: the reference's, pergrad's)."""

    def __init__(self, pick: Callable[[Picked, Tensor], Tensor], width: int) -> None:
        super().__init__()
        self.body, self.head, self.pick, self.calls = nn.Linear(D, D), nn.Linear(width, 2), pick, 0

    @property
    def step(self) -> int:
        return (self.calls - 1) // 2

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.head(self.pick(self, torch.tanh(self.body(x))))


def run(
    pick: Callable[[Picked, Tensor], Tensor],
    shape: Callable[[int], tuple[int, ...]] = lambda b: (b, D),
    sizes: tuple[int, ...] = (4, 6, 5),
    width: int = D,
    out_dim: int = 0,
    batch_first: bool = True,
) -> float:
    """The largest error of ``grad_sample`` over the steps; ``out_dim``: the batch dim of the model's output."""
    torch.manual_seed(0)
    model = Picked(pick, width)
    psm = PerSampleModule(model, loss_reduction="sum", batch_first=batch_first)
    params = [model.body.weight, model.head.weight]
    worst = 0.0
    for b in sizes:
        x = torch.randn(*shape(b))
        out = model(x)
        y = torch.randn_like(out)
        terms = (out - y).pow(2)
        expect = [torch.autograd.grad(terms.select(out_dim, i).sum(), params, retain_graph=True) for i in range(b)]
        model.zero_grad()
        (psm(x) - y).pow(2).sum().backward()
        for j, p in enumerate(params):
            worst = max(worst, float((p.grad_sample - torch.stack([e[j] for e in expect])).abs().max()))
    return worst


def seq(b: int) -> tuple[int, ...]:
    return (b, T, D)


def seq_first(b: int) -> tuple[int, ...]:
    return (T, b, D)


def square(b: int) -> tuple[int, ...]:
    return (b, b, D)


def last_token(b: int, t: int, seed: int = 0) -> Tensor:
    """HF-style ``[B, T]`` mask of each sample's last token, from random lengths (right padding)."""
    lengths = torch.randint(1, t + 1, (b,), generator=torch.Generator().manual_seed(7 * b + seed))
    return torch.arange(t)[None, :] == (lengths - 1)[:, None]


def spread(b: int, t: int) -> Tensor:
    """One position of each sample, ``(2 i + 1) % t``: not increasing with ``i``."""
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[torch.arange(b), (2 * torch.arange(b) + 1) % t] = True
    return mask


# --- masks over the batch dim and others -------------------------------------------------------------------------


def _every_step_elsewhere(m: Picked, h: Tensor) -> Tensor:
    return h[last_token(h.shape[0], h.shape[1], seed=m.step)]


def _zero_picks_in_step_2(m: Picked, h: Tensor) -> Tensor:
    mask = last_token(h.shape[0], h.shape[1]).clone()
    if m.step >= 1:
        mask[1] = False
    return h[mask]


def _two_and_zero_in_step_2(m: Picked, h: Tensor) -> Tensor:
    mask = last_token(h.shape[0], h.shape[1]).clone()
    if m.step >= 1:
        mask[1, :2] = True
        mask[2] = False
    return h[mask]


def _two_picks_of_one(m: Picked, h: Tensor) -> Tensor:
    mask = spread(h.shape[0], h.shape[1])
    mask[2, 4] = True
    return h[mask]


def _padded_mean(m: Picked, h: Tensor) -> Tensor:
    keep = ~last_token(h.shape[0], h.shape[1]).cumsum(1).cumsum(1).gt(1)  # (positions up to the last token)
    return h.masked_fill(~keep[..., None], 0).sum(1) / keep.sum(1, keepdim=True)


def _first_and_last(m: Picked, h: Tensor) -> Tensor:
    mask = torch.zeros(h.shape[0], h.shape[1], dtype=torch.bool)
    mask[:, 0] = mask[:, -1] = True
    return h[mask].view(h.shape[0], -1)


MASK_CASES: dict[str, Any] = {
    "last token by mask [B, T, D]": (lambda m, h: h[last_token(h.shape[0], h.shape[1])], dict(shape=seq), None),
    "last token by mask, T == B": (
        lambda m, h: h[last_token(h.shape[0], h.shape[1])],
        dict(shape=square, sizes=(4, 5, 3)),
        None,
    ),
    "one position of each sample, elsewhere every step": (
        _every_step_elsewhere,
        dict(shape=seq, sizes=(4, 4, 4)),
        None,
    ),
    "positions not increasing with the sample": (lambda m, h: h[spread(h.shape[0], h.shape[1])], dict(shape=seq), None),
    "uint8 mask": (lambda m, h: h[last_token(h.shape[0], h.shape[1]).to(torch.uint8)], dict(shape=seq), None),
    "CLS by an expanded mask": (
        lambda m, h: h[(torch.arange(h.shape[1]) == 0)[None].expand(h.shape[0], -1)],
        dict(shape=seq),
        None,
    ),
    "[B, 1] mask, all True": (
        lambda m, h: h[torch.ones(h.shape[0], 1, dtype=torch.bool)],
        dict(shape=lambda b: (b, 1, D)),
        None,
    ),
    "[B, T] scores masked, then view(B, -1)": (
        lambda m, h: h.sum(-1)[last_token(h.shape[0], h.shape[1])].view(h.shape[0], -1) * torch.ones(D),
        dict(shape=seq),
        None,
    ),
    "h[mask, :2]": (lambda m, h: h[last_token(h.shape[0], h.shape[1]), :2], dict(shape=seq, width=2), None),
    "h[:, mask] of a [D, B, T], transposed": (
        lambda m, h: h.permute(2, 0, 1)[:, spread(h.shape[0], h.shape[1])].T,
        dict(shape=seq),
        None,
    ),
    "seq-first, h.transpose(0, 1)[mask]": (
        lambda m, h: h.transpose(0, 1)[spread(h.shape[1], h.shape[0])],
        dict(shape=seq_first, batch_first=False),
        None,
    ),
    "an expanded batch [B, B, D] by the identity mask": (
        lambda m, h: h[:, None].expand(-1, h.shape[0], -1)[torch.eye(h.shape[0], dtype=torch.bool)],
        dict(),
        None,
    ),
    "masked_select of the token's features, view(B, -1)": (
        lambda m, h: torch.masked_select(h, last_token(h.shape[0], h.shape[1])[..., None]).view(h.shape[0], -1),
        dict(shape=seq),
        None,
    ),
    "h[torch.where(mask)]": (lambda m, h: h[torch.where(last_token(h.shape[0], h.shape[1]))], dict(shape=seq), None),
    "mean over the unpadded positions (masked_fill)": (_padded_mean, dict(shape=seq), None),
    # refused: row i is not sample i
    "seq-first h[mask] of a [T, B] mask (picks in the positions' order)": (
        lambda m, h: h[spread(h.shape[1], h.shape[0]).T],
        dict(shape=seq_first, batch_first=False),
        "refused",
    ),
    "batch-first h.transpose(0, 1)[mask.T] (picks in the positions' order)": (
        lambda m, h: h.transpose(0, 1)[spread(h.shape[0], h.shape[1]).T],
        dict(shape=seq),
        "refused",
    ),
    "a step where one sample has no pick": (_zero_picks_in_step_2, dict(shape=seq, sizes=(4, 4)), "refused"),
    "a step where one sample has two picks, another none": (
        _two_and_zero_in_step_2,
        dict(shape=seq, sizes=(4, 4)),
        "refused",
    ),
    "one sample with two picks (B + 1 rows)": (_two_picks_of_one, dict(shape=seq, sizes=(4, 4)), "refused"),
    "B picks all of sample 0": (
        lambda m, h: h[torch.arange(h.shape[0] * h.shape[1]).view(h.shape[0], -1) < h.shape[0]],
        dict(shape=lambda b: (b, 6, D), sizes=(4, 5)),
        "refused",
    ),
    # false refusals
    "mask with a leading dim of size 1: h[None][mask[None]]": (
        lambda m, h: h[None][last_token(h.shape[0], h.shape[1])[None]],
        dict(shape=seq),
        None,  # (the batch the mask's dim 1, after a dim of size 1: the picks are in order; was refused)
    ),
    "seq-first [B, B, D], the diagonal (t == b, in order)": (
        lambda m, h: h[torch.eye(h.shape[0], dtype=torch.bool)],
        dict(shape=square, batch_first=False),
        "xfail: refused (the batch the mask's dim 1, but picking t == b gives the samples in order)",
    ),
    "first and last token by mask, view(B, -1)": (
        _first_and_last,
        dict(shape=seq, width=2 * D),
        "xfail: refused (two picks of every sample, batch first: view(B, -1) is each sample's two rows, in order)",
    ),
    "a token's features by an expanded mask, view(B, -1)": (
        lambda m, h: h[last_token(h.shape[0], h.shape[1])[..., None].expand_as(h)].view(h.shape[0], -1),
        dict(shape=seq),
        "xfail: refused (D picks of every sample, batch first: view(B, -1) is each sample's token, in order;"
        " masked_select of the same mask is followed)",
    ),
}


def _cases(table: dict[str, Any]) -> list[Any]:
    params = []
    for name, (pick, kwargs, outcome) in table.items():
        marks = ()
        if outcome is not None and outcome.startswith("xfail"):
            marks = pytest.mark.xfail(strict=True, reason="pergrad bug: " + outcome[len("xfail: ") :])
        params.append(pytest.param(pick, kwargs, outcome, id=name, marks=marks))
    return params


def _check(pick: Callable[[Picked, Tensor], Tensor], kwargs: dict[str, Any], outcome: str | None) -> None:
    if outcome == "refused" or (outcome is not None and outcome.startswith("xfail: silent")):
        with pytest.raises((BatchMixingError, BatchSizeError), match=REORDERED):
            run(pick, **kwargs)
    else:
        assert run(pick, **kwargs) < 1e-9


@pytest.mark.parametrize(("pick", "kwargs", "outcome"), _cases(MASK_CASES))
def test_masks_over_the_batch_and_other_dims(pick, kwargs, outcome):
    _check(pick, kwargs, outcome)


# --- the ops ruled today ------------------------------------------------------------------------------------------


def w3() -> Tensor:
    return torch.linspace(1, 2, 3)  # (made in the test: float64)


def _put_into_alias(m: Picked, h: Tensor) -> Tensor:
    h2 = h * 1
    h2.view(-1).put_(torch.tensor([0, 4]), torch.tensor([1.0, 2.0]))
    return h2


def _put_accumulate_into_alias(m: Picked, h: Tensor) -> Tensor:
    h2 = h * 1
    h2[:].put_(torch.tensor([0, 4, 4]), torch.tensor([1.0, 2.0, 3.0]), accumulate=True)
    return h2


def _scattered_from(source: Callable[[Picked, Tensor], Tensor]) -> Callable[[Picked, Tensor], Tensor]:
    def pick(m: Picked, h: Tensor) -> Tensor:
        mask = torch.arange(h.numel()).view_as(h).remainder(2).bool()
        return h.masked_scatter(mask, source(m, h)[: int(mask.sum())])

    return pick


def _frozen_parameter(m: Picked, h: Tensor) -> Tensor:
    if not hasattr(m, "source"):
        m.source = nn.Parameter(torch.linspace(0, 1, 60), requires_grad=False)
    return m.source


def _trained_parameter(m: Picked, h: Tensor) -> Tensor:
    if not hasattr(m, "source"):
        m.source = nn.Parameter(torch.linspace(0, 1, 60))
    return m.source


def _uneven_rows_scattered(m: Picked, h: Tensor) -> Tensor:
    mask = torch.zeros(h.shape[0], 6, dtype=torch.bool)
    mask[0, :4] = True
    mask[1, :2] = True
    mask[2:, 1::2] = True
    return torch.zeros(h.shape[0], 6).masked_scatter_(mask, h).sum(1, keepdim=True) * torch.ones(D)


def _image_tokens(m: Picked, h: Tensor) -> Tensor:
    """LLaVA's ``inputs_embeds.masked_scatter(image_mask, image_features)``: each sample's 2 features in its 2 image
    token positions (the same count in every sample: row ``i`` is sample ``i``'s)."""
    b = h.shape[0]
    features = (h[:, :1] * torch.tensor([[1.0], [2.0]])).reshape(b, 2, D)
    mask = torch.zeros(b, T, D, dtype=torch.bool)
    mask[:, 1:3] = True
    return (h * 0.5).masked_scatter(mask, features)


def _shuffled_image(m: Picked, h: Tensor) -> Tensor:
    image = (h[:, :, None, None] * torch.linspace(0.5, 1.5, 32).view(1, 1, 8, 4)).reshape(h.shape[0], 12, 2, 4)
    return F.pixel_shuffle(image, 2).mean((-2, -1))


def _unshuffled_image(m: Picked, h: Tensor) -> Tensor:
    image = h[:, :, None, None] * torch.linspace(0.5, 1.5, 16).view(1, 1, 4, 4)
    return F.pixel_unshuffle(image, 2).mean((-2, -1)).view(h.shape[0], D, 4).mean(-1)


def _shuffled_5d(m: Picked, h: Tensor) -> Tensor:
    image = (h[:, :, None, None, None] * torch.linspace(0.5, 1.5, 4).view(1, 1, 4, 1, 1)).transpose(0, 1)
    return F.pixel_shuffle(image, 2).sum((-3, -2, -1)).T  # ([3, B, 4, 1, 1]: the batch a leading dim)


def _batch_as_rows_unshuffled(m: Picked, h: Tensor) -> Tensor:
    image = h.T[None, :, :, None].expand(1, D, h.shape[0], 2)  # (the batch the image's rows)
    return F.pixel_unshuffle(image, 2).reshape(-1)[: h.numel()].view_as(h)


OP_CASES: dict[str, Any] = {
    # torch.gradient
    "gradient(h, dim=1, spacing=0.5)": (lambda m, h: torch.gradient(h, dim=1, spacing=0.5)[0], dict(shape=seq), None),
    "gradient(h, dim=(1,))": (lambda m, h: torch.gradient(h, dim=(1,))[0], dict(shape=seq), None),
    "gradient(h, dim=[1, 2]), summed": (lambda m, h: sum(torch.gradient(h, dim=[1, 2])), dict(shape=seq), None),
    "gradient(h, dim=-1, edge_order=2)": (
        lambda m, h: torch.gradient(h, dim=-1, edge_order=2)[0],
        dict(shape=seq),
        None,
    ),
    "gradient with coordinates along dim 1": (
        lambda m, h: torch.gradient(h, spacing=(torch.linspace(0, 1, T) ** 2,), dim=1)[0],
        dict(shape=seq),
        None,
    ),
    "gradient(h, dim=-3) (the batch)": (lambda m, h: torch.gradient(h, dim=-3)[0], dict(shape=seq), "refused"),
    "gradient(h, dim=(2, 0)), along dim 2": (
        lambda m, h: torch.gradient(h, dim=(2, 0))[0],
        dict(shape=seq),
        "refused",
    ),
    "gradient(h, spacing=[1, 2, 3]), along dim 2": (
        lambda m, h: torch.gradient(h, spacing=[1.0, 2.0, 3.0])[2],
        dict(shape=seq),
        "refused",
    ),
    "gradient(h)[1] (every dim computed, the one along T used)": (
        lambda m, h: torch.gradient(h)[1],
        dict(shape=seq),
        "xfail: refused (the tuple's item along T is per sample; only item 0 is along the batch)",
    ),
    "gradient seq-first along T (dim 0)": (
        lambda m, h: torch.gradient(h, dim=0)[0],
        dict(shape=seq_first, batch_first=False, out_dim=1),
        None,
    ),
    "gradient seq-first along the batch (dim 1)": (
        lambda m, h: torch.gradient(h, dim=1)[0],
        dict(shape=seq_first, batch_first=False, out_dim=1),
        "refused",
    ),
    # fftshift
    "fftshift(h, dim=(-1,))": (lambda m, h: torch.fft.fftshift(h, dim=(-1,)), dict(shape=seq), None),
    "fftshift(h, dim=-2)": (lambda m, h: torch.fft.fftshift(h, dim=-2), dict(shape=seq), None),
    "fftshift(h, -2) positional": (lambda m, h: torch.fft.fftshift(h, -2), dict(shape=seq), None),
    "ifftshift(h, (1, 2))": (lambda m, h: torch.fft.ifftshift(h, (1, 2)), dict(shape=seq), None),
    "fftshift(h, dim=-3) (the batch)": (lambda m, h: torch.fft.fftshift(h, dim=-3), dict(shape=seq), "refused"),
    "fftshift(h, dim=[0])": (lambda m, h: torch.fft.fftshift(h, dim=[0]), dict(shape=seq), "refused"),
    "fftshift seq-first along T": (
        lambda m, h: torch.fft.fftshift(h, dim=0),
        dict(shape=seq_first, batch_first=False, out_dim=1),
        None,
    ),
    "ifftshift seq-first along the batch": (
        lambda m, h: torch.fft.ifftshift(h, dim=1),
        dict(shape=seq_first, batch_first=False, out_dim=1),
        "refused",
    ),
    "fftshift of every dim, one sample": (
        lambda m, h: torch.fft.fftshift(h),
        dict(sizes=(1, 1)),
        "xfail: refused (one sample: shifting a batch dim of size 1 moves nothing)",
    ),
    # cross
    "cross(h, w, dim=-1), B == 3": (lambda m, h: torch.cross(h, w3().expand_as(h), dim=-1), dict(sizes=(3, 3)), None),
    "cross(h, w, dim=1), B == 3": (lambda m, h: torch.cross(h, w3().expand_as(h), dim=1), dict(sizes=(3, 3)), None),
    "h.cross(w, 1), B == 3": (lambda m, h: h.cross(w3().expand_as(h), 1), dict(sizes=(3, 3)), None),
    "linalg.cross(w, h), B == 3": (lambda m, h: torch.linalg.cross(w3().expand_as(h), h), dict(sizes=(3, 3)), None),
    "cross without dim of [B, 3, 3], B != 3": (
        lambda m, h: torch.cross(
            h[:, None, :] * torch.linspace(1, 2, 3)[:, None],
            torch.linspace(0, 1, 9).view(3, 3).expand(h.shape[0], 3, 3),
        ).sum(1),
        dict(sizes=(4, 5)),
        None,
    ),
    "linalg.cross(h, w, dim=-2), B == 3 (the batch)": (
        lambda m, h: torch.linalg.cross(h, w3().expand_as(h), dim=-2),
        dict(sizes=(3, 3)),
        "refused",
    ),
    "cross(w[None], h) without dim, B == 3": (
        lambda m, h: torch.cross(w3()[None], h),
        dict(sizes=(3, 3)),
        None,  # (torch takes the first dim of size 3 of the first operand [1, 3]: the features)
    ),
    "cross(h[None], W[3, 3, 3]) without dim, B == 3": (
        lambda m, h: torch.cross(h[None], torch.linspace(1, 2, 27).view(3, 3, 3)).sum(0),
        dict(sizes=(3, 3)),
        "refused",  # (torch crosses along the first operand's first dim of size 3, dim 1: the batch)
    ),
    # inner
    "inner([B, T, D], [K, D])": (
        lambda m, h: torch.inner(h, torch.linspace(-1, 1, K * D).view(K, D)),
        dict(shape=seq, width=K),
        None,
    ),
    "inner([K, D], [B, T, D]), permuted back": (
        lambda m, h: torch.inner(torch.linspace(-1, 1, K * D).view(K, D), h).permute(1, 2, 0),
        dict(shape=seq, width=K),
        None,
    ),
    "inner([D], [B, T, D])": (
        lambda m, h: torch.inner(w3(), h)[..., None] * torch.ones(D),
        dict(shape=seq),
        None,
    ),
    "inner(0-dim, h)": (lambda m, h: torch.inner(torch.tensor(2.0), h), dict(shape=seq), None),
    "inner(h, 2 h)": (lambda m, h: torch.inner(h, 2 * h)[:, :3], dict(sizes=(4, 5)), "refused"),
    "inner(h, h) of [B, T, D], summed over the other sample": (
        lambda m, h: torch.inner(h, h).sum((-2, -1))[..., None] * torch.ones(D),
        dict(shape=seq),
        "refused",
    ),
    "inner(h, h) of one sample": (lambda m, h: torch.inner(h, h) * h, dict(sizes=(1, 1)), None),
    # put / masked_scatter
    "put_ of constants into an alias of h": (_put_into_alias, dict(), None),
    "put_ accumulate of constants into an alias of h": (_put_accumulate_into_alias, dict(), None),
    "put of the batch by keyword source, reversed": (
        lambda m, h: torch.zeros_like(h).put(torch.arange(h.numel()).flip(0), source=h.flatten()),
        dict(),
        "refused",
    ),
    "masked_scatter of a frozen parameter into h": (_scattered_from(_frozen_parameter), dict(), None),
    "masked_scatter of a trained parameter into h": (
        _scattered_from(_trained_parameter),
        dict(),
        "xfail: refused with SharedInputError (each element of the source lands in one sample's row: its per-sample"
        " gradient is a scatter)",
    ),
    "masked_scatter_ of the batch, rows of uneven counts": (_uneven_rows_scattered, dict(), "refused"),
    "masked_scatter of the batch, T image tokens each (LLaVA)": (
        _image_tokens,
        dict(shape=seq),
        "xfail: refused (the mask has the same count in each sample as each sample's features: row i gets sample i's)",
    ),
    "put of the batch at arange(numel) (identity)": (
        lambda m, h: torch.zeros_like(h).put(torch.arange(h.numel()), h.flatten()),
        dict(),
        "xfail: refused (put at arange(numel) writes each row from the same sample)",
    ),
    # pixel / channel shuffles
    "pixel_shuffle of [B, C * 4, H, W]": (_shuffled_image, dict(), None),
    "pixel_unshuffle of [B, C, H, W]": (_unshuffled_image, dict(), None),
    "pixel_shuffle of [C, B, 4, 1, 1] (batch leading)": (_shuffled_5d, dict(), None),
    "nn.PixelShuffle module": (
        lambda m, h: nn.PixelShuffle(2)(h.repeat(1, 4)[:, :, None, None]).mean((-2, -1)),
        dict(),
        None,
    ),
    "pixel_unshuffle with the batch as the image rows": (_batch_as_rows_unshuffled, dict(sizes=(4, 6)), "refused"),
    "channel_shuffle of [B, C, L]": (
        lambda m, h: F.channel_shuffle(h.repeat(1, 2)[:, :, None], 3)[:, :3, 0],
        dict(),
        None,
    ),
    "nn.ChannelShuffle module": (
        lambda m, h: nn.ChannelShuffle(3)(h.repeat(1, 2)[:, :, None, None])[:, :3, 0, 0],
        dict(),
        None,
    ),
    "channel_shuffle of seq-first [T, B, C, 1] (the batch as channels)": (
        lambda m, h: F.channel_shuffle(h[..., None], 2)[..., 0],
        dict(shape=seq_first, batch_first=False, out_dim=1, sizes=(4, 6)),
        "refused",
    ),
}


@pytest.mark.parametrize(("pick", "kwargs", "outcome"), _cases(OP_CASES))
def test_ops_ruled_today(pick, kwargs, outcome):
    if outcome is not None and "SharedInputError" in outcome:
        try:
            assert run(pick, **kwargs) < 1e-9
        except SharedInputError as error:
            raise AssertionError("refused") from error
        return
    _check(pick, kwargs, outcome)
