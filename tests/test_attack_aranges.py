"""Attack on the counted aranges (5b985e0): an integer ``torch.arange(n)`` the forward made, or a view of it laid out
as it is, indexes the batch in order with no values read (``dims._counts_in_order``), as long as its version is
unchanged and nothing wrote into it past the version counter (``_count`` in ``shared.py``); and an index along the
batch dim that does not vary along exactly one dim of the batch's size is a reorder.

Every case is a small float64 model (a layer, the index op under attack, a layer), two steps of different batch
sizes, against each loss term ``f_i = ||out_i - y_i||^2`` differentiated by plain autograd through the whole batch
forward of an unwrapped copy. A model that keeps each sample in its row must be exact; one that moves samples must
be refused. Anything else is a pergrad bug, marked ``xfail(strict=True)``.

Found, and fixed with this file: an arange written through an alias with a version counter of its own
(``other.set_(i)``, ``other.data = i``, ``to_dlpack``/``from_dlpack``, ``i.detach()`` or ``i.view(dtype)`` or
``Parameter(i)`` then ``.data``/``.numpy()``/``__array__``/``__dlpack__``/``untyped_storage()``) was taken as in order:
silently wrong ``grad_sample``; and a row index materialized rather than expanded (``arange(B)[:, None].repeat(1, K)``)
was refused though in order. The reason given with each case says how it went wrong.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable

import pytest
import torch
import torch.utils.dlpack
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import pergrad
from pergrad import PerSampleModule
from tests.test_attack_reorder import outcome as reorder_outcome

pytestmark = pytest.mark.usefixtures("float64")

REORDERED = "reordered or mixed the samples along the batch dim"
HAS_NUMPY = importlib.util.find_spec("numpy") is not None
SWAP = (1, 0)  # what the attacks write into the first two entries of the arange: rows 0 and 1 swapped


def outcome(model: nn.Module, sizes: tuple[int, ...] = (4, 6)) -> str:
    """``tests.test_attack_reorder.outcome`` over one SGD step per batch size."""

    def make(s: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(s)
        return torch.randn(sizes[s], 4, generator=g), torch.randn(sizes[s], 3, generator=g)

    return reorder_outcome(model, make, steps=len(sizes))


class Picked(nn.Module):
    """``b(tanh(pick(self, tanh(a(x)))))``: ``pick`` indexes the batch of ``a``'s output ([B, 5])."""

    def __init__(self, pick: Callable[[nn.Module, Tensor], Tensor]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.pick = pick
        self.cache: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.pick(self, torch.tanh(self.a(x)))))


def swap(t: Tensor) -> None:
    """Rows 0 and 1 swapped in an index tensor (or one sharing its memory), by a plain in-place write."""
    t[:2] = torch.tensor(SWAP, dtype=t.dtype)


def refused(pick: Callable[[nn.Module, Tensor], Tensor]) -> None:
    torch.manual_seed(0)
    got = outcome(Picked(pick))
    assert got.startswith("refused") and REORDERED in got, got


def exact(pick: Callable[[nn.Module, Tensor], Tensor]) -> None:
    torch.manual_seed(0)
    got = outcome(Picked(pick))
    assert got == "exact", got


def bug(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"pergrad bug: {reason}")


# ---------------------------------------------------------------- written past the version counter: must be refused


def _set_alias(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    alias = torch.empty(0, dtype=torch.long).set_(i)  # shares i's memory, its own version counter
    swap(alias)
    return h[i]


def _data_alias(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    alias = torch.empty(0, dtype=torch.long)
    alias.data = i  # (the arange is the value set, not the tensor whose .data is set)
    swap(alias)
    return h[i]


def _dlpack_alias(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(i)))
    return h[i]


def _from_dlpack(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(torch.from_dlpack(i))  # (calls i.__dlpack__: seen)
    return h[i]


def _swapped_tensors(m: nn.Module, h: Tensor) -> Tensor:
    scale, other = torch.ones(h.shape[0]), torch.full((h.shape[0],), 2.0)
    torch.utils.swap_tensors(scale, other)  # (keeps every sample in its row)
    return h * scale[:, None]


def _detached_data(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(i.detach().data)
    return h[i]


def _detached_storage_copy(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    order = torch.arange(h.shape[0])
    swap(order)
    i.detach().untyped_storage().copy_(order.untyped_storage())
    return h[i]


def _detached_numpy_shuffle(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    rows = i.detach().cpu().numpy()  # (the usual idiom; on a CPU, the arange's own memory)
    rows[:2] = rows[1::-1].copy()
    return h[i]


def _detached_numpy_array(m: nn.Module, h: Tensor) -> Tensor:
    import numpy as np

    i = torch.arange(h.shape[0])
    np.asarray(i.detach())[:2] = SWAP
    return h[i]


def _parameter_data(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    held = nn.Parameter(i, requires_grad=False)  # (wraps i's memory)
    swap(held.data)
    return h[i]


def _index_select_set_alias(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(torch.empty(0, dtype=torch.long).set_(i))
    return h.index_select(0, i)


def _gather_set_alias(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(torch.empty(0, dtype=torch.long).set_(i))
    return h.gather(0, i[:, None].expand_as(h))


def _take_along_dim_set_alias(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(torch.empty(0, dtype=torch.long).set_(i))
    return torch.take_along_dim(h, i[:, None], dim=0)


def _written_rows_set_alias(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(torch.empty(0, dtype=torch.long).set_(i))
    out = torch.zeros_like(h)
    out[i] = h  # (x[perm] = h)
    return out


def _dtype_view_data(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    words = i.view(torch.int32).data  # (a view of another dtype has no _base either)
    words[0], words[2] = 1, 0  # (the low words of i[0] and i[1], little-endian)
    return h[i]


def _detached_from_dlpack(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(torch.from_dlpack(i.detach()))
    return h[i]


def _mask_style_set_alias(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(torch.empty(0, dtype=torch.long).set_(i))
    return h[i[:, None], torch.arange(h.shape[1])[None, :]]


SILENT = {
    "other.set_(arange) written": (_set_alias, "set_ makes an alias with its own version counter"),
    "other.data = arange, written": (_data_alias, "the arange as the value of .data = is not forgotten"),
    "to_dlpack/from_dlpack written": (_dlpack_alias, "torch.utils.dlpack.to_dlpack is not seen"),
    "arange.detach().data written": (_detached_data, "detach() has no _base: .data of it is not forgotten"),
    "arange.detach().untyped_storage().copy_": (_detached_storage_copy, "detach() has no _base"),
    "Parameter(arange).data written": (_parameter_data, "a Parameter wrapping it has no _base"),
    "index_select after set_ alias": (_index_select_set_alias, "set_ alias"),
    "gather after set_ alias": (_gather_set_alias, "set_ alias"),
    "take_along_dim after set_ alias": (_take_along_dim_set_alias, "set_ alias"),
    "out[arange] = h after set_ alias": (_written_rows_set_alias, "set_ alias (x[perm] = h)"),
    "mask-style [arange[:, None], arange(F)] after set_ alias": (_mask_style_set_alias, "set_ alias"),
    "arange.view(int32).data written": (_dtype_view_data, "view(dtype) has no _base: .data of it is not forgotten"),
    "torch.from_dlpack(arange.detach()) written": (_detached_from_dlpack, "detach() has no _base: __dlpack__"),
}
if HAS_NUMPY:
    SILENT["arange.detach().cpu().numpy() shuffled"] = (_detached_numpy_shuffle, "detach() has no _base: .numpy()")
    SILENT["np.asarray(arange.detach()) written"] = (_detached_numpy_array, "detach() has no _base: __array__")


@pytest.mark.parametrize("pick", [p for p, _ in SILENT.values()], ids=list(SILENT))
def test_arange_written_past_its_version_counter_is_refused(pick):
    refused(pick)


# ---------------------------------------------------------------- written with a version bump: refused (guards)


def _no_grad_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    with torch.no_grad():
        swap(i)
    return h[i]


def _inference_mode_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    with torch.inference_mode():
        swap(i)
    return h[i]


def _out_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    torch.remainder(i + 1, h.shape[0], out=i)
    return h[i]


def _index_put_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    torch.index_put_(i, (torch.tensor([0, 1]),), torch.tensor(SWAP))
    return h[i]


def _detached_view_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    i[:, None].detach()[:2, 0] = torch.tensor(SWAP)
    return h.index_select(0, i)


def _as_strided_in_place(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    i.as_strided_((h.shape[0],), (0,))
    return h.index_select(0, i)


def _set_in_place(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    i.set_(torch.arange(h.shape[0]).flip(0))
    return h.index_select(0, i)


@torch.jit.script
def _scripted_swap(i: Tensor) -> None:
    i[0] = 1
    i[1] = 0


def _jit_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    _scripted_swap(i)
    return h[i]


class _SwapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, i: Tensor) -> Tensor:
        swap(i)
        return h.clone()

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:
        return g, None


def _autograd_function_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    h = _SwapFunction.apply(h, i)
    return h[i]


def _foreach_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    torch._foreach_add_([i], 1)
    return h[i % h.shape[0]]


def _functionalized_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    torch.func.functionalize(swap)(i)
    return h[i]


def _compiled_write(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    torch.compile(swap, backend="aot_eager")(i)
    return h[i]


def _no_grad_swap(t: Tensor) -> None:
    with torch.no_grad():
        swap(t)


def _compiled_no_grad_write(m: nn.Module, h: Tensor) -> Tensor:
    # (AOTAutograd hides a mutation under no_grad from autograd by setting the version counter back)
    i = torch.arange(h.shape[0])
    torch.compile(_no_grad_swap, backend="aot_eager")(i)
    return h[i]


def _cached_then_aliased(m: nn.Module, h: Tensor) -> Tensor:
    """An arange made in one forward, kept on the module, written through an alias in the next."""
    if m.cache is None:
        m.cache = torch.arange(16)
        return h[m.cache[: h.shape[0]]]
    swap(torch.empty(0, dtype=torch.long).set_(m.cache))
    return h[m.cache[: h.shape[0]]]


def _made_in_thread(m: nn.Module, h: Tensor) -> Tensor:
    made: list[Tensor] = []
    worker = threading.Thread(target=lambda: made.append(torch.arange(h.shape[0])))
    worker.start()
    worker.join()
    swap(torch.empty(0, dtype=torch.long).set_(made[0]))
    return h[made[0]]


BUMPED = {
    "in place under no_grad": _no_grad_write,
    "in place under inference_mode": _inference_mode_write,
    "remainder(arange + 1, B, out=arange)": _out_write,
    "torch.index_put_ into it": _index_put_write,
    "a detached view written": _detached_view_write,
    "as_strided_ in place (stride 0)": _as_strided_in_place,
    "set_ in place to a flip": _set_in_place,
    "_foreach_add_ in place": _foreach_write,
    "torch.jit.script helper writing": _jit_write,
    "autograd.Function writing into it": _autograd_function_write,
    "torch.func.functionalize writing": _functionalized_write,
    "torch.compile(aot_eager) helper writing": _compiled_write,
    "torch.compile(aot_eager) helper writing under no_grad": _compiled_no_grad_write,
    "h[arange(B).view(int32)[:B]] (0, 0, 1, 0, ...)": lambda m, h: h[
        torch.arange(h.shape[0]).view(torch.int32)[: h.shape[0]]
    ],
    "cached on the module, aliased in the next forward": _cached_then_aliased,
    "made in another thread, aliased": _made_in_thread,
}


@pytest.mark.parametrize("pick", BUMPED.values(), ids=BUMPED.keys())
def test_arange_written_with_a_version_bump_is_refused(pick):
    refused(pick)


@bug("crash, not from 5b985e0: swap_tensors refuses a tensor with a weakref (Provenance holds one to each)")
def test_swap_tensors_in_the_forward_is_exact():
    exact(_swapped_tensors)


@bug("false refusal, not from 5b985e0 (torch.vmap(lambda r: r * 2)(h) alone is refused the same way)")
def test_vmap_over_rows_is_exact():
    exact(_vmapped_rows)


# ---------------------------------------------------------------- in order: exact


def _checkpointed(m: nn.Module, h: Tensor) -> Tensor:
    return checkpoint(lambda t: t[torch.arange(t.shape[0])] * 2, h, use_reentrant=False)


def _meshgrid(m: nn.Module, h: Tensor) -> Tensor:
    rows, cols = torch.meshgrid(torch.arange(h.shape[0]), torch.arange(h.shape[1]), indexing="ij")
    return h[rows, cols.flip(1)]


def _cached_across_forwards(m: nn.Module, h: Tensor) -> Tensor:
    if m.cache is None or len(m.cache) < h.shape[0]:
        m.cache = torch.arange(16)
    return h[m.cache[: h.shape[0]]]


def _in_order_writes(m: nn.Module, h: Tensor) -> Tensor:
    out = torch.zeros_like(h)
    out[torch.arange(h.shape[0])] = h
    return out


def _nested_model(m: nn.Module, h: Tensor) -> Tensor:
    inner = lambda t: t[torch.arange(t.shape[0])]  # noqa: E731
    return inner(inner(h) + 1.0)


def _vmapped_rows(m: nn.Module, h: Tensor) -> Tensor:
    return torch.vmap(lambda r: r * torch.arange(r.shape[0]).to(r.dtype))(h[torch.arange(h.shape[0])])


HELD = {
    "index_select(0, arange(B, int32))": lambda m, h: h.index_select(0, torch.arange(h.shape[0], dtype=torch.int32)),
    "h[arange(127, int8)[:B].long()] (at the int8 limit)": lambda m, h: h[
        torch.arange(127, dtype=torch.int8)[: h.shape[0]].long()
    ],
    "h[arange(B).to(int32)]": lambda m, h: h[torch.arange(h.shape[0]).to(torch.int32)],
    "h[arange(tensor B)]": lambda m, h: h[torch.arange(torch.tensor(h.shape[0]))],
    "h[arange(B).to('cpu')]": lambda m, h: h[torch.arange(h.shape[0]).to("cpu")],
    "h[arange(2B)[:B].clone()]": lambda m, h: h[torch.arange(2 * h.shape[0])[: h.shape[0]].clone()],
    "h[arange(B).view(B, 1).t().t()[:, 0]]": lambda m, h: h[torch.arange(h.shape[0]).view(-1, 1).t().t()[:, 0]],
    "h[arange(B).unfold(0, B, 1)[0]]": lambda m, h: h[torch.arange(h.shape[0]).unfold(0, h.shape[0], 1)[0]],
    "h[arange(B)[None].expand(B, B).as_strided((B,), (1,))]": lambda m, h: h[
        torch.arange(h.shape[0])[None].expand(h.shape[0], -1).as_strided((h.shape[0],), (1,))
    ],
    "h[arange(B).view(int32)[::2]] (the low words)": lambda m, h: h[torch.arange(h.shape[0]).view(torch.int32)[::2]],
    "take_along_dim(h, arange(B)[:, None], 0)": lambda m, h: torch.take_along_dim(
        h, torch.arange(h.shape[0])[:, None], dim=0
    ),
    "index_put of h at arange(B)": lambda m, h: torch.zeros_like(h).index_put((torch.arange(h.shape[0]),), h),
    "out[arange(B)] = h": _in_order_writes,
    "meshgrid rows with flipped columns": _meshgrid,
    "arange cached on the module across forwards": _cached_across_forwards,
    "checkpointed index by arange": _checkpointed,
    "nested helper calls": _nested_model,
}


@pytest.mark.parametrize("pick", HELD.values(), ids=HELD.keys())
def test_in_order_indexes_are_exact(pick):
    exact(pick)


# ---------------------------------------------------------------- the stride rule: in order, yet refused?


def _topk_rows_repeated(m: nn.Module, h: Tensor) -> Tensor:
    """Per-sample top-2 features, picked with a row index materialized by ``repeat`` (not a stride-0 expand)."""
    top = h.detach().topk(2, dim=1).indices
    rows = torch.arange(h.shape[0])[:, None].repeat(1, 2)
    picked = h[rows, top]  # [B, 2]: each row from its own sample
    return torch.cat([picked, h[:, :3]], 1)


def _rows_expanded_contiguous(m: nn.Module, h: Tensor) -> Tensor:
    rows = torch.arange(h.shape[0])[:, None].expand(-1, h.shape[1]).contiguous()
    return h[rows, torch.arange(h.shape[1]).flip(0)]


def _rows_repeat_interleave(m: nn.Module, h: Tensor) -> Tensor:
    rows = torch.arange(h.shape[0]).repeat_interleave(h.shape[1]).view(h.shape[0], h.shape[1])
    return h[rows, torch.arange(h.shape[1]).roll(1)]


def _topk_rows_expanded(m: nn.Module, h: Tensor) -> Tensor:
    top = h.detach().topk(2, dim=1).indices
    picked = h[torch.arange(h.shape[0])[:, None].expand_as(top), top]
    return torch.cat([picked, h[:, :3]], 1)


FALSELY = {
    "h[arange(B)[:, None].repeat(1, K), topk]": _topk_rows_repeated,
    "h[arange(B)[:, None].expand(B, F).contiguous(), cols]": _rows_expanded_contiguous,
    "h[arange(B).repeat_interleave(F).view(B, F), cols]": _rows_repeat_interleave,
}


@pytest.mark.parametrize("pick", list(FALSELY.values()), ids=list(FALSELY))
def test_materialized_row_index_in_order_is_exact(pick):
    exact(pick)


def test_expanded_row_index_with_topk_is_exact():
    exact(_topk_rows_expanded)


REPEATS = {
    "h[i.expand(B)]": lambda m, h: h[torch.tensor([1]).expand(h.shape[0])],
    "h[arange(B)[:1].expand(B)]": lambda m, h: h[torch.arange(h.shape[0])[:1].expand(h.shape[0])],
    "h[arange(B).as_strided((B,), (0,))] via index_select": lambda m, h: h.index_select(
        0, torch.arange(h.shape[0]).as_strided((h.shape[0],), (0,))
    ),
    "gather(0, arange(B)[:1, None].expand(B, F))": lambda m, h: h.gather(
        0, torch.arange(h.shape[0])[:1, None].expand(h.shape[0], h.shape[1])
    ),
    "h[arange(B+1).unfold(0, B, 1)[1]] (shifted view)": lambda m, h: h[
        torch.arange(h.shape[0] + 1).unfold(0, h.shape[0], 1)[1] % h.shape[0]
    ],
}


@pytest.mark.parametrize("pick", REPEATS.values(), ids=REPEATS.keys())
def test_repeated_or_shifted_rows_are_refused(pick):
    refused(pick)


# ---------------------------------------------------------------- nothing leaks across forwards or threads


def test_no_record_outlives_the_forward():
    from pergrad._core.capture import dims

    model = Picked(lambda m, h: h[torch.arange(h.shape[0])])
    psm = PerSampleModule(model, loss_reduction="sum")
    try:
        assert dims._aranges.table is None
        psm(torch.randn(4, 4)).sum().backward()
        assert dims._aranges.table is None
        with pytest.raises(BatchMixingError, match=REORDERED):
            PerSampleModule(Picked(lambda m, h: h.flip(0)), loss_reduction="sum")(torch.randn(4, 4))
        assert dims._aranges.table is None
    finally:
        psm.remove()


def test_forwards_in_threads_keep_their_own_records():
    errors: list[str] = []

    def work(pick: Callable[[nn.Module, Tensor], Tensor], expect: str) -> None:
        got = outcome(Picked(pick))
        if not got.startswith(expect):
            errors.append(got)

    threads = [threading.Thread(target=work, args=(_set_alias_free, "exact")) for _ in range(3)]
    threads += [threading.Thread(target=work, args=(_written_in_place, "refused")) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _set_alias_free(m: nn.Module, h: Tensor) -> Tensor:
    return h[torch.arange(h.shape[0])]


def _written_in_place(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    swap(i)
    return h[i]


BatchMixingError = pergrad.errors.BatchMixingError
