"""An audit of pergrad in your own training loop: on some steps, its numbers against plain autograd's.

``Audit(psm, loss_fn, every=100, samples=4)`` audits the first step and every ``every``-th after it. A
step is the backward pass(es) before one optimizer step; call ``audit.check(batch)`` after them, before
``optimizer.step()`` (one batch per backward of the step, in order; a cheap counter on steps not due)::

    audit = Audit(psm, loss_fn, every=100)   # before the first forward: the first step is audited
    for batch in loader:
        loss_fn(psm, batch).backward()
        audit.check(batch)                   # raises AuditError where pergrad's numbers are not autograd's
        optimizer.step(); optimizer.zero_grad()

``loss_fn(model, batch)`` is the loss the loop backpropagates, as a scalar: the mean of the samples'
losses ``f_i`` (the wrapper's ``loss_reduction="mean"``) or their sum (``"sum"``), before any division
by the number of micro-batches (that is the wrapper's ``loss_scale``). On a due step, the wrapper holds
every backward's per-sample gradients ``g_i`` (``PerSampleModule.hold_per_sample``: armed at the step
before, whatever ``keep_grad_sample``; ``.grad`` is computed as on any other step) and ``check``, on a
``copy.deepcopy`` of the model (pergrad's hooks do nothing on a copy; its parameters are those the
step's forward used, since the optimizer has not stepped yet), checks for each backward ``k``:

1. the sum: ``sum_i g_i`` (``"mean"``: ``(1/B) sum_i g_i``) equals autograd's gradient of
   ``loss_fn(copy, batch)``: nothing in the loss is left out of the per-sample gradients (a
   regulariser) and no sample leaks into another's;
2. the samples: for ``samples`` samples drawn from the step's batches (by the audit's own
   ``torch.Generator``, not the global one), ``g_i`` equals autograd's gradient of
   ``loss_fn(copy, the sample alone)``;
3. the step: over the step, ``.grad`` changed by ``sum_k s_k R_k``, ``R_k`` the reduction of the
   transformed per-sample gradients ``T(g_i)`` of backward ``k`` (``(1/B) sum_i T(g_i)`` for
   ``reduction="mean"``, ``sum_i`` for ``"sum"``; ``T`` the identity outside every transform's target),
   ``s_k`` the loss scale of that backward. With ``accumulate="samples"`` (and ``"mean"``), ``.grad``
   must be cleared before the step and is then ``sum_k B_k s_k R_k / sum_k B_k``. ``.grad`` is read as
   it was at the step's first forward (a forward pre-hook copies it on due steps).

Each ``T`` is the registered transform applied to the held ``g_i`` of the whole batch (a sample whose
gradient over a norm-based transform's target is not finite contributes nothing, as in pergrad).

Tolerances: a difference passes if its norm, per parameter, is at most
``rtol * (max(|a|, |b|) + 0.01 * scale)``, ``|a|`` and ``|b|`` the norms of the two sides for that
parameter and ``scale`` the norm of the whole gradient they belong to (over every parameter; for a sum
over samples, the sum of the samples' norms): a parameter whose gradient is a small part of the whole
is held to the precision of the whole. ``rtol`` defaults to ``RTOL`` of the lowest precision among
the parameters and the step's autocast dtype: 1e-9 in float64, 1e-3 in float32, 1e-2 in float16 and
5e-2 in bfloat16. Under autocast (on at the step's forward) the recomputation runs under it too.

What it cannot follow: randomness in the forward (the recomputation draws other dropout masks):
``nn.Dropout`` modules (and ``nn.MultiheadAttention``'s and the recurrent layers' dropout) active in
training mode are refused at a due step, and functional dropout shows as a difference. One process
only (no DDP, FSDP2), no ``grad_scaler``, ``batch_first=True`` unless ``select`` is given. Projections
registered with ``grads=False`` leave ``.grad`` unwritten: check 3 reports them.

Cost, on a due step: holding the per-sample gradients (``B x #params``, as ``keep_grad_sample=True``;
held by reference when it is True), a copy of the model and of ``.grad``, one forward and backward of
the copy on each batch and on each audited sample, and the transforms applied to the held gradients.
Nothing on other steps but a counter (docs/guides/audit.md has measurements).

DP-SGD
------

``check_private`` is ``check`` for a DP-SGD step (``pergrad.privacy``): call it on every step, after
the noise is added, with what the step used. A DP-SGD implementation wires it in as::

    due = audit.due                        # this step is audited: keep .grad before the noise
    before = [None if p.grad is None else p.grad.detach().clone() for p in params] if due else None
    ...add the noise to every p.grad of params...
    audit.check_private(*batches, max_grad_norm=C, noise_std=sigma * C / expected_batch_size,
                        expected_batch_size=expected_batch_size, params=params, grad_before_noise=before)

``params``: the parameters clipped and noised, in order (the target of ONE transform registered on
the wrapper, whose ``T(g_i)`` reduced into ``.grad`` gives ``sum_i clip_C(g_i) / expected_batch_size``,
e.g. ``PrivateClip``); ``grad_before_noise``: their ``.grad`` after the step's backward passes, before
the noise (None for a ``.grad`` of None), on due steps (anything, e.g. None, on others). On a due step
it runs checks 1-3 (3 on ``grad_before_noise``) and then:

4. sensitivity: every parameter that received a gradient is in ``params``; each sample's contribution
   to the sum, ``c_i = E[B] s_k w_k T(g_i)`` (``w_k = 1/B_k`` for ``reduction="mean"``, else 1), has
   norm at most ``C (1 + rtol)`` over all of ``params`` (flat), for EVERY sample of the step; and for
   the audited samples, ``c_i`` equals ``clip_C`` of autograd's gradient of the sample alone;
5. the noise: ``n`` = the coordinates of ``params``, ``e = .grad - grad_before_noise``. For
   ``noise_std > 0``: every ``e_j`` is finite; ``rms(e) = sqrt(sum(e_j^2) / n)`` (the mean not subtracted:
   ``sum(e_j^2) / noise_std^2`` is chi-square with ``n`` degrees of freedom) lies in
   ``noise_std * [sqrt(q_lo / n), sqrt(q_hi / n)]``, ``q_lo``, ``q_hi`` that distribution's exact quantiles
   with ``P(chi2_n < q_lo) = P(chi2_n > q_hi) = 1e-9`` (``TAIL``; widened by the rounding of ``.grad``'s
   dtype); and ``|mean(e)| <= z noise_std / sqrt(n)`` with ``z = 6`` (exact: the mean of ``n`` Gaussians
   of known std is normal): the noise was added once, with that std; and it is no repeat of the last audited
   step's noise (the uncentred correlation ``rho`` of ``m <= 4096`` coordinates at most ``z / sqrt(m)``;
   ``rho^2`` is Beta(1/2, (m-1)/2), whose tail is lighter than the normal's: at most 1.9e-9). A correct step
   false-alarms with probability at most 2e-9 per check, about 6e-9 per audited step, for every ``n``. For
   ``noise_std == 0``: ``e`` is exactly 0.

A failing check raises ``AuditError`` naming the check, the parameter, the sample and the size of the
difference, with what to do; the audit then stays disarmed until the next due step.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pergrad._core.backward.targets import Target
from pergrad._core.consumers.grad_sample import Held
from pergrad.errors import PergradError
from pergrad.module import PerSampleModule
from pergrad.transforms import Scaling

RTOL = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
Z = 6.0  # normal standard deviations of the noise's mean and correlation checks (false alarm <= 2e-9 each)
TAIL = 1e-9  # each side's false-alarm probability of the noise's rms check (exact chi-square quantiles)
FLOOR = 1e-2  # a parameter's difference is also measured against this fraction of the whole gradient's norm
PROBE = 4096  # coordinates of the noise compared with the last audited step's

LossFn = Callable[[nn.Module, Any], Tensor]
Select = Callable[[Any, int], Any]


@functools.lru_cache(maxsize=64)
def chi2_quantiles(n: int, tail: float = TAIL) -> tuple[float, float]:
    """``(q_lo, q_hi)`` with ``P(chi2_n < q_lo) = P(chi2_n > q_hi) = tail``: the chi-square distribution's quantiles.

    Up to ``n = 10^6``: exact, by bisection of ``log x`` in float64 on ``P(chi2_n < x) = gammainc(n / 2, x / 2)``
    (``gammaincc`` above) between brackets that hold them: ``n`` (beyond the median), Laurent and Massart's
    ``n -+ 2 sqrt(n L) (+ 2 L)`` with ``L = -log(tail)``, and ``2 (tail Gamma(n/2 + 1))^(2/n)`` (as
    ``gammainc(a, y) <= y^a / Gamma(a + 1)``). Beyond, where torch's ``gammainc`` of the lower tail loses digits
    (its tail at the bisected ``q_lo`` is 1.2e-9 at ``n = 10^8``, 2.4e-9 at ``10^9``): Wilson and Hilferty's
    ``n (1 - 2/(9n) -+ z sqrt(2/(9n)))^3``, ``z = -ndtri(tail)``, whose tails are within 3e-5 of ``tail`` there."""
    log_tail = math.log(tail)
    if n > 10**6:
        z, c = -float(torch.special.ndtri(torch.tensor(tail, dtype=torch.float64))), 2 / (9 * n)
        return n * (1 - c - z * math.sqrt(c)) ** 3, n * (1 - c + z * math.sqrt(c)) ** 3
    a = torch.tensor(n / 2, dtype=torch.float64)

    def p(f: Callable[[Tensor, Tensor], Tensor], x: float) -> float:
        return float(f(a, torch.tensor(x / 2, dtype=torch.float64)))

    def solve(lo: float, hi: float, above: Callable[[float], bool]) -> float:
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if not lo < mid < hi or hi - lo <= 1e-15 * hi:
                break
            lo, hi = (lo, mid) if above(mid) else (mid, hi)
        return math.sqrt(lo * hi)

    lower = max(n - 2 * math.sqrt(-n * log_tail), 2 * math.exp(2 / n * (log_tail + math.lgamma(n / 2 + 1))))
    upper = n + 2 * math.sqrt(-n * log_tail) - 2 * log_tail
    q_lo = solve(lower, float(n), lambda x: p(torch.special.gammainc, x) >= tail)
    q_hi = solve(float(n), upper, lambda x: p(torch.special.gammaincc, x) <= tail)
    return q_lo, q_hi


class AuditError(PergradError, RuntimeError):
    """An audited step's numbers differ from plain autograd's, or its DP-SGD clipping or noise is not
    what it must be (``pergrad.privacy.audit``); or the audit cannot run as asked."""


_REPORT = (
    "If none of these is the cause, pergrad computed a wrong number: please report it (pergrad's version, the "
    "model, this message)."
)


def _fallback_fix(kind: type[nn.Module]) -> str:
    name = f"{kind.__module__}.{kind.__qualname__}"
    return (
        " Meanwhile compute that layer with the torch.func fallback: registry = pergrad.default_registry.copy(); "
        f"registry.register({name!r}, overwrite=True, all_inputs=True, subtree=True)(pergrad.rules.fallback); "
        "PerSampleModule(model, rules=registry, ...)."
    )


def _batch_size(batch: Any) -> int | None:
    """Dim 0 of the first tensor in ``batch`` (tensors, and sequences and mappings of them)."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        found = _batch_size(item)
        if found is not None:
            return found
    return None


def select_sample(batch: Any, i: int) -> Any:
    """The default ``select``: sample ``i`` of ``batch`` as a batch of one, every tensor whose dim 0 has the
    batch's size (that of its first tensor) sliced ``[i : i + 1]`` (through tuples, lists and mappings);
    anything else as it is. Pass your own ``select`` where a tensor shared by the batch may have the
    batch's size on dim 0."""
    size = _batch_size(batch)

    def one(x: Any) -> Any:
        if isinstance(x, Tensor):
            return x[i : i + 1] if x.dim() and x.shape[0] == size else x
        if isinstance(x, Mapping):
            return type(x)({k: one(v) for k, v in x.items()})  # type: ignore[call-arg]
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(one(v) for v in x))
        if isinstance(x, (tuple, list)):
            return type(x)(one(v) for v in x)
        return x

    return one(batch)


def _random_layers(model: nn.Module) -> list[str]:
    """The modules whose forward is random in their current mode (dropout in training mode)."""
    found = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        dropout = isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
        inner = isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and getattr(m, "dropout", 0) > 0
        if dropout or inner:
            found.append(f"{name or 'the root module'} ({type(m).__name__})")
    return found


def _wide(t: Tensor) -> Tensor:
    """``t`` in float32 at least (float32 norms and differences are far within every tolerance)."""
    t = t.detach()
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _norm(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(_wide(t)))


def _difference(a: Tensor, b: Tensor) -> float:
    """``|a - b|``; positions where both hold the same non-finite value count 0, others inf."""
    a, b = _wide(a), _wide(b)
    found = float(torch.linalg.vector_norm(a - b))
    if math.isfinite(found):
        return found
    d = torch.where((a == b) | (a.isnan() & b.isnan()), torch.zeros_like(a), a - b)
    return float(torch.linalg.vector_norm(d)) if bool(torch.isfinite(d).all()) else math.inf


@dataclass
class _Miss:
    """The worst parameter of a comparison: its name, the difference, the two sides' norms, the tolerance."""

    name: str
    difference: float
    got: float
    expected: float
    tolerance: float

    def __str__(self) -> str:
        return (
            f"|difference| = {self.difference:.3g} (pergrad's side {self.got:.3g}, the reference's "
            f"{self.expected:.3g}; tolerance {self.tolerance:.3g})"
        )


def _worst(got: Mapping[str, Tensor], expected: Mapping[str, Tensor], rtol: float, scale: float) -> _Miss | None:
    """The parameter whose difference most exceeds ``rtol * (max(|got|, |expected|) + FLOOR * scale)``,
    or None if none does."""
    worst, ratio = None, 1.0
    for name, e in expected.items():
        g = got[name]
        difference, a, b = _difference(g, e), _norm(g), _norm(e)
        tolerance = rtol * (max(a, b) + FLOOR * scale)
        if difference > tolerance and (difference == math.inf or difference > ratio * tolerance):
            worst, ratio = _Miss(name, difference, a, b, tolerance), difference / tolerance if tolerance else math.inf
    return worst


def _total(grads: Mapping[str, Tensor]) -> float:
    return math.sqrt(sum(_norm(g) ** 2 for g in grads.values()))


def _sq_norms(held: Held) -> dict[nn.Parameter, Tensor]:
    """``||g_i||^2`` of each parameter of ``held``, ``[B]`` in float64 on the CPU (one pass over the held gradients)."""
    return {p: _row_norms(g).square() for p, g in held.grads.items()}


def _row_norms(g: Tensor) -> Tensor:
    """``||g_i||`` of each sample, ``[B]`` in float64 on the CPU (the audit's bookkeeping lives there)."""
    return torch.linalg.vector_norm(_wide(g).flatten(1), dim=1).double().cpu()


def _sum_over(squares: dict[nn.Parameter, Tensor], params: Sequence[nn.Parameter], size: int) -> Tensor:
    found = [squares[p] for p in params if p in squares]
    return torch.stack(found).sum(0) if found else torch.zeros(size, dtype=torch.float64)


@dataclass
class _Applied:
    """One target's transform applied to one backward's held ``g_i``: ``T(g_i) = factors_i g_i`` for a
    ``Scaling`` transform (``values`` None; ``factors`` 0 where the sample is left out, ``bad``), else
    ``values`` ``[B, *shape]``; ``sq_norms``: ``||T(g_i)||^2`` over the target, ``[B]`` float64."""

    target: Target
    params: list[nn.Parameter]  # those of the target the backward reached
    factors: Tensor | None
    bad: Tensor | None
    values: dict[nn.Parameter, Tensor] | None
    sq_norms: Tensor

    def covers(self, p: nn.Parameter) -> bool:
        return any(p is q for q in self.params)

    def _grads(self, held: Held, p: nn.Parameter) -> Tensor:
        g = held.grads[p].detach()
        if self.bad is None:
            return g
        return g.masked_fill(self.bad.view(-1, *([1] * (g.dim() - 1))), 0)  # 0, not 0 * NaN

    def row(self, held: Held, p: nn.Parameter, i: int) -> Tensor:
        """``T(g_i)`` of parameter ``p`` for sample ``i``."""
        if self.values is not None:
            return self.values[p][i]
        assert self.factors is not None
        return self._grads(held, p)[i] * self.factors[i].to(held.grads[p].dtype)

    def reduced(self, held: Held, p: nn.Parameter, weights: Tensor) -> Tensor:
        """``sum_i weights_i T(g_i)`` of parameter ``p`` (``weights`` float64)."""
        if self.values is not None:
            v = self.values[p]
            return torch.tensordot(weights.to(v.device, v.dtype), v.detach(), dims=1)
        assert self.factors is not None
        g = self._grads(held, p)
        return torch.tensordot((weights.to(g.device) * self.factors.double()).to(g.dtype), g, dims=1)


def _apply(held: Held, target: Target, squares: dict[nn.Parameter, Tensor]) -> _Applied:
    """``T(g_i)`` of ``target`` for every sample of ``held``, as pergrad defines it (a sample whose
    gradient over a norm-based transform's target is not finite contributes nothing)."""
    params = [p for p in target.params.values() if p in held.grads]
    transform, size = target.transform, held.batch_size
    total = _sum_over(squares, params, size)
    if isinstance(transform, Scaling):
        norms = bad = None
        like = held.grads[params[0]].detach() if params else torch.zeros(())
        if transform.needs_norms and params:
            norms = total.sqrt().to(like.device, like.dtype)
            bad = ~torch.isfinite(norms)
        factors = transform.factors(norms, size, like)
        if bad is not None:
            factors = factors.masked_fill(bad, 0)
        applied = factors.detach().double().cpu().square() * total
        if bad is not None:
            applied = applied.masked_fill(bad.cpu(), 0)
        return _Applied(target, params, factors, bad if bad is not None and bool(bad.any()) else None, None, applied)
    first = held.grads[params[0]] if params else None
    per_sample = {
        key: held.grads[p] if p in held.grads else first.new_zeros((size, *p.shape))  # type: ignore[union-attr]
        for key, p in target.params.items()
    }
    result = transform.apply(per_sample)
    values = {p: result[key].detach() for key, p in target.params.items() if p in held.grads}
    value_squares = {p: _row_norms(v).square() for p, v in values.items()}
    return _Applied(target, params, None, None, values, _sum_over(value_squares, params, size))


@dataclass
class _Step:
    """One backward of an audited step, with its batch."""

    index: int
    held: Held
    batch: Any
    scale: float  # the loss scale s_k
    squares: dict[nn.Parameter, Tensor]  # ||g_i||^2 of each parameter, [B] float64
    applied: list[_Applied]  # each target's T(g_i)

    def norms(self) -> Tensor:
        """``||g_i||`` over every parameter, ``[B]`` float64, non-finite ones 0."""
        return _sum_over(self.squares, list(self.squares), self.held.batch_size).sqrt().nan_to_num(0, 0, 0)


class Audit:
    """Checks pergrad's numbers against plain autograd's on the first step and every ``every``-th step
    after it (see the module ``pergrad.privacy.audit``).

    Args:
        psm: the wrapper of the model being trained (one process; no ``grad_scaler``).
        loss_fn: ``loss_fn(model, batch) -> scalar``, the loss the loop backpropagates on ``batch``
            (before dividing it by the number of micro-batches): the mean or sum of the samples' losses,
            as the wrapper's ``loss_reduction`` says. It must call only ``model`` (it gets a copy).
        every: audit steps 0, every, 2 * every, ... (steps are counted by the calls of ``check``).
        samples: how many samples of a due step are recomputed alone (drawn from all its batches).
        seed: the seed of the audit's own generator (which samples are drawn).
        rtol: the relative tolerance (default: ``RTOL`` by the parameters' and autocast's dtype).
        select: ``select(batch, i)``: sample ``i`` of ``batch`` as a batch of one (default
            ``select_sample``: dim 0 of every tensor of the batch's size).
    """

    def __init__(
        self,
        psm: PerSampleModule,
        loss_fn: LossFn,
        *,
        every: int = 100,
        samples: int = 4,
        seed: int = 0,
        rtol: float | None = None,
        select: Select | None = None,
    ) -> None:
        if not isinstance(psm, PerSampleModule):
            raise AuditError(f"Audit needs the PerSampleModule wrapping the model, got {type(psm).__name__}")
        if not (isinstance(every, int) and every > 0):
            raise ValueError(f"every must be a positive int, got {every!r}")
        if not (isinstance(samples, int) and samples > 0):
            raise ValueError(f"samples must be a positive int, got {samples!r}")
        if rtol is not None and not rtol > 0:
            raise ValueError(f"rtol must be > 0, got {rtol!r}")
        if psm.grad_scaler is not None:
            raise AuditError(
                "Audit does not take a wrapper with grad_scaler= (fp16 loss scaling: an overflow step would read as "
                "a difference). Audit a float32 or bfloat16 run of the same model (a few steps are enough)"
            )
        model = psm.module
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        fsdp_module = sys.modules.get("torch.distributed.fsdp")
        fsdp = fsdp_module is not None and any(isinstance(m, fsdp_module.FSDPModule) for m in model.modules())
        if distributed or fsdp or isinstance(model, DistributedDataParallel):
            raise AuditError(
                "Audit runs in one process: under DDP or FSDP2 .grad holds every rank's samples, which one "
                "process cannot recompute. Audit a one-process run of the same model (a few steps are enough)"
            )
        if not psm.batch_first and select is None:
            raise AuditError(
                "the wrapper has batch_first=False: tell the audit how to take one sample of a batch, "
                "Audit(..., select=lambda batch, i: ...) returning sample i as a batch of one"
            )
        self.psm, self.loss_fn, self.every, self.samples = psm, loss_fn, every, samples
        self.rtol = rtol
        self.select: Select = select_sample if select is None else select
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0  # calls of check so far
        self.audited = 0  # steps audited (and passed) so far
        self._model = model
        self._holder = psm.hold_per_sample()
        self._before: dict[str, Tensor | None] | None = None  # .grad at the due step's first forward
        self._autocast: tuple[str, torch.dtype] | None = None  # at that forward
        self._noise: tuple[Tensor, Tensor] | None = None  # the last audited noise's probe: indices, values
        self._handle = model.register_forward_pre_hook(_OnForward(self))
        self._arm(0)

    # -- arming ------------------------------------------------------------------------------------

    @property
    def due(self) -> bool:
        """Whether the step running now (the one the next ``check`` ends) is audited."""
        return self._holder.armed

    def _arm(self, step: int) -> None:
        self._holder.armed = step % self.every == 0
        self._holder.take()
        self._before, self._autocast = None, None

    def _forward(self) -> None:
        """A forward of the model: before a due step's first backward, note ``.grad`` and autocast."""
        if not (self._holder.armed and not self._holder.held and torch.is_grad_enabled()):
            return
        self._before = {n: None if p.grad is None else p.grad.detach().clone() for n, p in self._trainable().items()}
        first = next(iter(self._model.parameters()), None)
        device = "cpu" if first is None else first.device.type
        on = torch.is_autocast_enabled(device)
        self._autocast = (device, torch.get_autocast_dtype(device)) if on else None

    def close(self) -> None:
        """Remove the audit's hook and holder: nothing is held or copied any more."""
        self._handle.remove()
        self._holder.close()

    def __enter__(self) -> Audit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Audit(every={self.every}, samples={self.samples}, steps={self.steps}, due={self.due})"

    # -- the checks --------------------------------------------------------------------------------

    def check(self, *batches: Any) -> None:
        """End of a step (after its backward passes, before ``optimizer.step()``): on a due step, the
        checks 1-3 of ``pergrad.privacy.audit`` on ``batches`` (one per backward of the step, in order; raises
        ``AuditError``); on other steps, only counts the step."""
        self._end_step(batches, None)

    def check_private(
        self,
        *batches: Any,
        max_grad_norm: float,
        noise_std: float,
        expected_batch_size: float,
        params: Sequence[nn.Parameter],
        grad_before_noise: Sequence[Tensor | None] | None,
    ) -> None:
        """End of a DP-SGD step, after the noise: ``check`` and the checks 4-5 of ``pergrad.privacy.audit`` (the
        clipping's bound, each contribution, the noise). ``grad_before_noise`` is needed on due steps."""
        before = None if grad_before_noise is None else list(grad_before_noise)
        private = _Private(float(max_grad_norm), float(noise_std), float(expected_batch_size), list(params), before)
        self._end_step(batches, private)

    def _end_step(self, batches: tuple[Any, ...], private: _Private | None) -> None:
        step = self.steps
        self.steps += 1
        if not self._holder.armed:
            self._arm(self.steps)
            return
        held, before, autocast = self._holder.take(), self._before, self._autocast
        self._arm(self.steps)  # also when a check below raises
        if not batches:
            raise AuditError("check() needs the step's batch (one per backward pass of the step, in order)")
        if private is not None and (private.before is None or len(private.before) != len(private.params)):
            raise AuditError(
                f"audited step {step}: check_private needs grad_before_noise on a due step (audit.due): the .grad of "
                "each of params after the step's backward passes, before the noise (None where .grad was None)"
            )
        empty = private is not None and all(_batch_size(b) == 0 for b in batches)  # DP-SGD: the noise alone
        if not (held and before is not None) and not (empty and not held):
            raise AuditError(
                f"audited step {step}: no backward pass ran since the last check (or the audit was made after the "
                "step's forward). Make the Audit before the training loop and call check once per optimizer step, "
                "after the step's backward passes"
            )
        _Run(self, step, list(batches), held, before, autocast, private).run()
        self.audited += 1

    def _trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self._model.named_parameters() if p.requires_grad}


class _Idle:
    """What the audit's hook becomes in a copied or pickled model: a hook that does nothing."""

    def __call__(self, *args: Any) -> None:
        return None


class _OnForward:
    """The audit's forward pre-hook on the model (``Audit._forward``). Copying or pickling the model
    copies no audit: the copy gets an ``_Idle`` hook in its place."""

    def __init__(self, audit: Audit) -> None:
        self.audit = weakref.ref(audit)

    def __call__(self, module: nn.Module, args: Any) -> None:
        found = self.audit()
        if found is not None:
            found._forward()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Idle:
        return _Idle()

    def __reduce__(self) -> tuple[type[_Idle], tuple[()]]:
        return (_Idle, ())


@dataclass
class _Private:
    """What a DP-SGD step used (``check_private``)."""

    max_grad_norm: float
    noise_std: float
    expected_batch_size: float
    params: list[nn.Parameter]
    before: list[Tensor | None] | None = None


class _Run:
    """The checks of one audited step."""

    def __init__(
        self,
        audit: Audit,
        step: int,
        batches: list[Any],
        held: list[Held],
        before: dict[str, Tensor | None] | None,
        autocast: tuple[str, torch.dtype] | None,
        private: _Private | None,
    ) -> None:
        self.audit, self.step, self.autocast, self.private = audit, step, autocast, private
        self.psm = audit.psm
        model = audit._model
        self.model = model
        self.params = audit._trainable()
        self.names = {p: n for n, p in self.params.items()}
        self.before = before
        self.mean = self.psm.reduction == "mean"
        if len(batches) != len(held):  # a backward of an empty batch may have been skipped
            batches = [b for b in batches if _batch_size(b) != 0]
        if len(batches) != len(held):
            raise AuditError(
                f"audited step {step} ran {len(held)} backward pass(es) but check got {len(batches)} batch(es): pass "
                "the batch of every backward pass of the step, in order (check once per optimizer step)"
            )
        self.steps = []
        for k, (h, batch) in enumerate(zip(held, batches, strict=True)):
            size = _batch_size(batch)
            if size != h.batch_size:
                raise AuditError(
                    f"audited step {step}: check got a batch of {size} samples for backward pass {k + 1}, which "
                    f"saw {h.batch_size}: pass the batches of the step's backward passes, in order"
                )
            scale = 1.0 if h.loss_scale is None else float(h.loss_scale)
            squares = _sq_norms(h)
            self.steps.append(_Step(k, h, batch, scale, squares, [_apply(h, t, squares) for t in h.targets]))
        dtypes = [p.dtype for p in self.params.values()] + ([autocast[1]] if autocast else [])
        self.rtol = audit.rtol if audit.rtol is not None else max(RTOL.get(d, 1e-3) for d in dtypes)

    def where(self, k: int | None = None) -> str:
        count = len(self.steps)
        during = f", backward pass {k + 1} of {count}" if k is not None and count > 1 else ""
        return f"pergrad audit, step {self.step}{during}"

    def label(self, name: str) -> tuple[str, type[nn.Module]]:
        """How a message names a parameter, and its module's type."""
        owner = name.rpartition(".")[0]
        kind = type(self.model.get_submodule(owner))
        where = "the root module" if not owner else repr(owner)
        return f"parameter {name!r} (of {where}, {kind.__name__})", kind

    def run(self) -> None:
        random = _random_layers(self.model)
        if random:
            raise AuditError(
                f"{self.where()}: the model's forward is random ({', '.join(random[:3])} in training mode), so the "
                "audit's recomputation cannot reproduce it. Audit with dropout off (p=0, or those modules in eval "
                "mode), e.g. a few steps of the same run"
            )
        replica = copy.deepcopy(self.model)
        self.replica = {n: p for n, p in replica.named_parameters() if n in self.params}
        self.replica_model = replica
        for s in self.steps:
            self.check_sum(s)
        self.check_samples()
        if self.before is not None:  # else no backward ran: an empty DP-SGD batch
            self.check_grad(self.before)
        if self.private is not None:
            self.check_private(self.private)

    # -- the reference -------------------------------------------------------------------------------

    def reference(self, batch: Any) -> dict[str, Tensor]:
        """Autograd's gradient of ``loss_fn(copy, batch)``, by parameter name (0 where unused)."""
        context = torch.autocast(self.autocast[0], dtype=self.autocast[1]) if self.autocast else torch.enable_grad()
        with torch.enable_grad(), context:
            loss = self.audit.loss_fn(self.replica_model, batch)
        if not (isinstance(loss, Tensor) and loss.numel() == 1):
            raise AuditError(
                f"{self.where()}: loss_fn(model, batch) must return the loss as a one-element tensor, got "
                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}"
            )
        names = list(self.replica)
        if not loss.requires_grad:
            return {n: torch.zeros_like(self.replica[n]) for n in names}
        grads = torch.autograd.grad(loss.reshape(()), [self.replica[n] for n in names], allow_unused=True)
        return {n: torch.zeros_like(self.replica[n]) if g is None else g.detach() for n, g in zip(names, grads)}

    def per_sample(self, s: _Step, name: str) -> Tensor:
        p = self.params[name]
        g = s.held.grads.get(p)
        return g if g is not None else torch.zeros((s.held.batch_size, *p.shape), dtype=p.dtype, device=p.device)

    # -- 1. the sum --------------------------------------------------------------------------------

    def check_sum(self, s: _Step) -> None:
        size = s.held.batch_size
        if size == 0:
            return
        expected = self.reference(s.batch)
        loss_mean = self.psm.loss_reduction == "mean"
        got = {n: self.per_sample(s, n).sum(0) / (size if loss_mean else 1) for n in self.params}
        spread = float(s.norms().sum()) / (size if loss_mean else 1)
        miss = _worst(got, expected, self.rtol, max(_total(expected), spread))
        if miss is None:
            return
        label, kind = self.label(miss.name)
        combined = "(1/B) sum_i g_i" if loss_mean else "sum_i g_i"
        raise AuditError(
            f"{self.where(s.index)}: the per-sample gradients of {label} do not add up to autograd's gradient of "
            f"loss_fn on the whole batch ({combined} against it, loss_reduction={self.psm.loss_reduction!r}): {miss}. "
            "Causes: a part of the loss that is not a sum of the samples' own losses (a regulariser on the "
            "parameters: use the optimizer's weight_decay instead; a term computed from the whole batch), which "
            "pergrad attributes to no sample; a forward that couples the samples (batch statistics computed by "
            "hand, a forward hook mixing them); loss_fn returning another loss than the loop's (a mean where the "
            f"wrapper says 'sum', or the reverse). {_REPORT}{_fallback_fix(kind)}"
        )

    # -- 2. the samples ----------------------------------------------------------------------------

    def picks(self) -> list[tuple[_Step, int]]:
        """``samples`` samples of the step, drawn by the audit's generator: (backward, index in its batch)."""
        flat = [(s, i) for s in self.steps for i in range(s.held.batch_size)]
        order = torch.randperm(len(flat), generator=self.audit.generator)[: self.audit.samples]
        return [flat[j] for j in sorted(order.tolist())]

    def sample_reference(self, s: _Step, i: int) -> dict[str, Tensor]:
        return self.reference(self.audit.select(s.batch, i))

    def check_samples(self) -> None:
        self.references: dict[tuple[int, int], dict[str, Tensor]] = {}
        for s, i in self.picks():
            expected = self.sample_reference(s, i)
            self.references[(s.index, i)] = expected
            got = {n: self.per_sample(s, n)[i] for n in self.params}
            miss = _worst(got, expected, self.rtol, _total(expected))
            if miss is None:
                continue
            label, kind = self.label(miss.name)
            raise AuditError(
                f"{self.where(s.index)}: the per-sample gradient of {label} for sample {i} of the batch differs from "
                f"autograd's gradient of that sample's own loss (loss_fn on the sample alone, on a copy of the "
                f"model): {miss}. Causes: a forward that couples the samples (batch statistics computed by hand, a "
                "forward hook mixing them), a random forward (functional dropout: turn it off on audited steps), "
                f"loss_fn computing another loss than the loop's. {_REPORT}{_fallback_fix(kind)}"
            )

    # -- 3. the step -------------------------------------------------------------------------------

    def increments(self) -> dict[str, Tensor]:
        """What ``.grad`` of each parameter must have received over the step, in ``.grad``'s units."""
        out: dict[str, Tensor] = {}
        running = self.psm.accumulate == "samples" and self.mean
        total = sum(s.held.batch_size for s in self.steps)
        for s in self.steps:
            size = s.held.batch_size
            if size == 0:
                continue
            weight = 1.0 / size if self.mean else 1.0
            if running:
                weight *= size / total  # .grad := sum_k B_k s_k R_k / sum_k B_k
            weights = torch.full((size,), weight * s.scale, dtype=torch.float64)
            covered: dict[nn.Parameter, _Applied] = {p: a for a in s.applied for p in a.params}
            for p in s.held.grads:
                name = self.names.get(p)
                if name is None:
                    continue
                applied = covered.get(p)
                if applied is None:
                    g = s.held.grads[p]
                    reduced = torch.tensordot(weights.to(g.device, g.dtype), g.detach(), dims=1)
                else:
                    reduced = applied.reduced(s.held, p, weights)
                out[name] = reduced.detach() if name not in out else out[name] + reduced.detach()
        return out

    def check_grad(self, before: dict[str, Tensor | None]) -> None:
        if self.psm.accumulate == "samples" and self.mean:
            dirty = [n for n, g in before.items() if g is not None and bool(g.any())]
            if dirty:
                raise AuditError(
                    f"{self.where()}: with accumulate='samples' the audit needs .grad cleared before the step "
                    f"(optimizer.zero_grad() before its first forward); {dirty[0]!r} held a gradient"
                )
        expected = self.increments()
        now = self.grads_now()
        got = {}
        for n, p in self.params.items():
            start, end = before.get(n), now[n]
            zero = torch.zeros_like(p)
            got[n] = (zero if end is None else end) - (zero if start is None else start)
            expected.setdefault(n, zero)
        spread = 0.0
        for s in self.steps:
            size = s.held.batch_size
            if size == 0:
                continue
            covered = {p for a in s.applied for p in a.params}
            outside = [p for p in s.squares if p not in covered]
            squares = _sum_over(s.squares, outside, size) + sum(a.sq_norms for a in s.applied)
            spread += abs(s.scale) * float(squares.sqrt().nan_to_num(0, 0, 0).sum()) / (size if self.mean else 1)
        miss = _worst(got, expected, self.rtol, max(_total(expected), spread))
        if miss is None:
            return
        label, _ = self.label(miss.name)
        transforms = self.psm.registered_transforms()
        applied = f" with the transforms {transforms}" if transforms else ""
        raise AuditError(
            f"{self.where()}: over the step, .grad of {label} changed by other than the reduction of the per-sample "
            f"gradients{applied} (reduction={self.psm.reduction!r}, accumulate={self.psm.accumulate!r}, the "
            f"backward passes' loss scales {[s.scale for s in self.steps]}): {miss}. Causes: something else wrote "
            ".grad during the step (a hook, a second wrapper, zero_grad or an optimizer step between the backward "
            "passes and check), check did not get every backward pass of the step, a transform that is not a "
            f"fixed function of the per-sample gradients (random, or changed since the backward). {_REPORT}"
        )

    def grads_now(self) -> dict[str, Tensor | None]:
        now: dict[str, Tensor | None] = {n: p.grad for n, p in self.params.items()}
        if self.private is not None:
            assert self.private.before is not None
            for p, g in zip(self.private.params, self.private.before, strict=True):
                if p in self.names:
                    now[self.names[p]] = g
        return now

    # -- 4. and 5. DP-SGD --------------------------------------------------------------------------

    def check_private(self, private: _Private) -> None:
        covered = set(private.params)
        for s in self.steps:
            outside = [n for n, p in self.params.items() if p in s.held.grads and p not in covered]
            if outside:
                raise AuditError(
                    f"{self.where(s.index)}: DP-SGD: {outside[:3]} received gradients but are not among the clipped and "
                    "noised parameters: training on them is not private. Freeze them or clip the whole model"
                )
        bound = private.max_grad_norm
        tolerance = bound * (1 + self.rtol)
        for s in self.steps:
            if s.held.batch_size == 0:
                continue
            applied = self.private_target(s, covered)
            weight = private.expected_batch_size * s.scale / (s.held.batch_size if self.mean else 1)
            norms = applied.sq_norms.sqrt() * abs(weight)
            over = (norms > tolerance) | ~torch.isfinite(norms)
            if bool(over.any()):
                i = int(over.nonzero()[0])
                raise AuditError(
                    f"{self.where(s.index)}: DP-SGD: sample {i}'s contribution to the clipped sum has norm "
                    f"{float(norms[i]):.6g} over the private parameters, above max_grad_norm={bound:g}: its "
                    "sensitivity is not bounded, so the step is not private. Do not train on (report it with this "
                    f"message; the transform on them: {applied.target.transform!r})"
                )
            for (k, i), reference in self.references.items():
                if k != s.index:
                    continue
                self.check_contribution(s, i, reference, applied, weight, private)
        self.check_noise(private)

    def private_target(self, s: _Step, covered: set[nn.Parameter]) -> _Applied:
        found = next((a for a in s.applied if set(a.target.params.values()) == covered), None)
        if found is None:
            raise AuditError(
                f"{self.where(s.index)}: DP-SGD: no transform registered on the wrapper covers exactly the "
                f"{len(covered)} clipped parameters (registered: {self.psm.registered_transforms()}): the clipping "
                "cannot be checked. Register the clipping on the target DP-SGD noises"
            )
        return found

    def check_contribution(
        self, s: _Step, i: int, reference: dict[str, Tensor], applied: _Applied, weight: float, private: _Private
    ) -> None:
        """Sample ``i``'s contribution equals ``clip_C`` of autograd's gradient of the sample alone."""
        names = [self.names[p] for p in private.params if p in self.names]
        norm = math.sqrt(sum(_norm(reference[n]) ** 2 for n in names))
        factor = min(1.0, private.max_grad_norm / norm) if norm > 0 else 1.0
        expected = {n: reference[n] * factor for n in names}
        got = {}
        for n in names:
            p = self.params[n]
            if applied.covers(p):
                got[n] = applied.row(s.held, p, i) * weight
            else:
                got[n] = torch.zeros_like(p)
        miss = _worst(got, expected, self.rtol, private.max_grad_norm)
        if miss is None:
            return
        label, _ = self.label(miss.name)
        raise AuditError(
            f"{self.where(s.index)}: DP-SGD: sample {i}'s clipped contribution to {label} is not clip_C of autograd's "
            f"gradient of that sample alone (C={private.max_grad_norm:g}, the sample's norm {norm:.6g}): {miss}. "
            f"The clipping or its normalisation by the expected batch size is wrong. {_REPORT}"
        )

    def check_noise(self, private: _Private) -> None:
        assert private.before is not None
        diffs, after_abs = [], []
        for p, before in zip(private.params, private.before, strict=True):
            after = p.grad
            if after is None:
                raise AuditError(
                    f"{self.where()}: DP-SGD: {self.names.get(p, 'a private parameter')!r} has no .grad after the "
                    "noise: the noise was not added to it"
                )
            a = after.detach().double().flatten()
            diffs.append(a - (0 if before is None else before.detach().double().flatten()))
            after_abs.append(a.abs())
        e, magnitude = torch.cat(diffs), torch.cat(after_abs)
        n, std = e.numel(), private.noise_std
        if n == 0:
            return
        dtype = private.params[0].dtype
        if std == 0:
            if bool((e != 0).any()):
                raise AuditError(f"{self.where()}: DP-SGD: noise_std is 0 but .grad changed by {_norm(e):.3g}")
            return
        if not bool(torch.isfinite(e).all()):
            raise AuditError(f"{self.where()}: DP-SGD: the noise added to .grad holds NaN or Inf")
        unit = torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0
        rounding = unit * float((magnitude + e.abs()).square().mean().sqrt())  # rms of the rounding's bound
        rms, mean = float(e.square().mean().sqrt()), float(e.mean())
        q_lo, q_hi = chi2_quantiles(n)  # sum(e^2) / std^2 is chi2_n: rms = std sqrt(chi2_n / n)
        low, high = std * math.sqrt(q_lo / n) - rounding, std * math.sqrt(q_hi / n) + rounding
        if not low <= rms <= high:
            what = "was not added" if rms <= rounding else "has another standard deviation"
            raise AuditError(
                f"{self.where()}: DP-SGD: the noise {what}: .grad changed by {rms:.6g} per coordinate (rms over "
                f"{n} coordinates), expected noise_std={std:.6g} (within [{max(low, 0):.6g}, {high:.6g}]: noise_std "
                f"sqrt(q / n) at the chi-square quantiles q of {n} degrees of freedom with {TAIL:g} on each side). "
                "The noise must be N(0, (sigma C / expected_batch_size)^2) added once per step to every private "
                "parameter's .grad; the step is not private as the accountant counts it"
            )
        if abs(mean) > Z * std / math.sqrt(n) + unit * float(magnitude.mean() + e.abs().mean()):
            raise AuditError(
                f"{self.where()}: DP-SGD: the noise added to .grad has mean {mean:.6g} over {n} coordinates, expected "
                f"0 (within {Z * std / math.sqrt(n):.3g}): it is not centred Gaussian noise"
            )
        self.check_repeat(e)

    def check_repeat(self, e: Tensor) -> None:
        """The noise is no repeat of the last audited step's (a generator seeded again at each step)."""
        audit, n = self.audit, e.numel()
        last = audit._noise
        if last is None or int(last[0].max()) >= n:
            index = torch.randperm(n, generator=audit.generator)[:PROBE]
            last = None
        else:
            index = last[0]
        now = e[index]
        audit._noise = (index, now.clone())
        if last is None or index.numel() < 16:
            return
        before = last[1]
        denominator = float(now.norm() * before.norm())
        rho = float(now @ before) / denominator if denominator else 0.0
        if abs(rho) > Z / math.sqrt(index.numel()):
            raise AuditError(
                f"{self.where()}: DP-SGD: this step's noise correlates with the last audited step's (rho = {rho:.3f} on "
                f"{index.numel()} coordinates): the noise repeats (a generator seeded again with the same seed?), so "
                "steps are not independently noised and the privacy accounting does not hold"
            )
