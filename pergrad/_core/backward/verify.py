"""The checks of one backward, and what pergrad says when a gradient reached a parameter in a way
it cannot split into samples.

Every backward: each parameter the backward reached got its gradient from its layers' outputs
(``check_reached``), backward(inputs=...) named all of a transform's target or none of it
(``check_partial``), and nothing but the layers' outputs reached a tapped parameter
(``check_taps``, see ``pergrad._core.shortcuts.reach``); the integrations' checks of ``INTEGRATION_CHECKS``
(Opacus's route: ``pergrad.integrations.opacus``). The first backward (``check_sums``):
the per-sample gradients must add up to autograd's gradient of every parameter,
``sum_i g_i = grad`` (``(1/B) sum_i g_i`` for a mean loss). They do unless part of the loss reaches
a parameter other than through its layer's output: a regulariser added to the loss, or a parent
module using the parameter directly. pergrad cannot attribute that part to samples, so it refuses
rather than drop or transform it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Container

import torch
from torch import Tensor, nn

from pergrad._core.backward.sources import Fused, Materialized
from pergrad._core.backward.state import Backward, Unchecked
from pergrad._core.backward.targets import Target, Targets
from pergrad._core.capture.calls import Call, HookedLayer
from pergrad._core.consumers import Batch
from pergrad.errors import RECOMPUTED, HookStateError, TransformError

Canonical = Callable[[nn.Parameter], nn.Parameter]


def check_sums(
    sources: Callable[[nn.Parameter], Materialized | Fused],
    params: list[nn.Parameter],
    batch_grads: dict[nn.Parameter, Tensor],
    batch_size: int,
    loss_reduction: str,
    names: dict[nn.Parameter, str],
) -> None:
    """Raise ``HookStateError`` for the first parameter whose per-sample gradients (``sources(p)``: those of
    the calls not compared yet) do not add up to autograd's ``batch_grads`` (in the units of the per-sample
    gradients; none: 0). One parameter at a time: no second copy of every gradient at once."""
    for p in params:
        autograd = batch_grads.get(p)
        autograd = torch.zeros_like(p) if autograd is None else autograd
        difference = _difference(autograd, sources(p), p, batch_size, loss_reduction)
        if difference is not None:
            raise HookStateError(
                unattributable(names[p], f"max difference {difference:.3g}")
                + " Or pass verify=False to PerSampleModule if dropping that part is intended."
            )


def check_first(batch: Batch, loss_reduction: str, canonical: Canonical) -> None:
    """The first backward's sums at its end: every parameter it reached, or, where it compared them as it
    ran (``check_part``), those with calls or a part of autograd's since they last agreed (or never agreed)."""
    state, source = batch.state, batch.source
    grads, checking, names = state.autograd.batch_grads, state.checking, batch.names
    params = list(batch.params)
    if checking is None:
        check_sums(lambda p: source, params, grads, batch.size, loss_reduction, names)
        return
    left = [p for p in params if p in checking.since or p in grads or p not in checking.agreed]

    def since(p: nn.Parameter) -> Materialized | Fused:  # the batch's calls of p, where p never agreed
        return Fused(checking.since.get(p, []), canonical) if p in checking.agreed else source

    check_sums(since, left, grads, batch.size, loss_reduction, names)


def check_part(state: Backward, param: nn.Parameter, part: Tensor, loss_reduction: str, canonical: Canonical) -> None:
    """``param``'s ``AccumulateGrad`` ran in the first backward with autograd's ``part`` (in the samples'
    units): compared now with the calls that fed it since it last agreed (``Unchecked``). Where they agree,
    those calls are done with ``param`` (one no consumer reads is let go once all its parameters agreed);
    where not (the rest of its calls has not arrived: reentrant checkpointing, a rule of every output),
    ``part`` waits in ``batch_grads`` for the next comparison, the last one at the end (``check_sums``)."""
    checking, batch_grads = state.checking, state.autograd.batch_grads
    assert checking is not None and state.batch_size is not None
    before = batch_grads.pop(param, None)
    total = part if before is None else before + part
    calls = checking.since.get(param)
    if calls:
        source = Fused(calls, canonical)
        agreed = _difference(total, source, param, state.batch_size, loss_reduction) is None
        source.lend_builds()
        if agreed:
            del checking.since[param]
            checking.agreed[param] = None
            for call in calls:
                _done_with(state, checking, call, param, canonical)
            return
    batch_grads[param] = total


def _done_with(state: Backward, checking: Unchecked, call: Call, param: nn.Parameter, canonical: Canonical) -> None:
    """``param`` of ``call`` agreed: a call kept only for the check is let go after its last parameter."""
    left = checking.waiting.get(call)
    if left is None:
        return
    left.discard(param)
    if left:
        return
    del checking.waiting[call]
    calls = state.arrived.calls
    for i in range(len(calls) - 1, -1, -1):  # mostly the last few calls
        if calls[i] is call:
            del calls[i]
            break
    state.arrived.passed.update((canonical(p), None) for _, p in call.layer.trainable())


def _weight(batch_size: int, loss_reduction: str) -> float:
    return 1.0 / batch_size if loss_reduction == "mean" else 1.0


def _fed(source: Materialized | Fused, p: nn.Parameter) -> bool:
    """Whether some call of ``source`` fed ``p``."""
    return p in (source.uses if isinstance(source, Fused) else source.grads)


def _difference(
    autograd: Tensor, source: Materialized | Fused, p: nn.Parameter, batch_size: int, loss_reduction: str
) -> float | None:
    """None where pergrad's sum ``ours = sum_i w_i g_i`` of ``p``'s per-sample gradients in ``source``
    (``w_i = 1/B`` for a mean loss; 0 where no call fed ``p``) agrees with ``autograd``'s within the round-off
    of two summation orders: relative to the larger side, or, where the samples' terms cancel, to the terms
    themselves (``sum_i w_i |g_i|`` elementwise, built only then: a layer that computes in float32 inside
    float64 parameters, as HF's Gemma RMSNorm does, rounds each term at float32); else their largest
    difference."""
    autograd = autograd.detach()  # (create_graph=True: compared as values)
    if not torch.isfinite(autograd).all():
        return None  # non-finite values: nothing to compare; a poisoned sample is handled elsewhere
    weight = _weight(batch_size, loss_reduction)
    if _fed(source, p):
        ours = source.summed([p], autograd.new_full((batch_size,), weight))[p].detach().to(autograd.dtype)
    else:
        ours = torch.zeros_like(autograd)
    # a floor for sums that cancel to ~0 (a term below it would not change training anyway)
    rel, floor = (1e-6, 1e-10) if autograd.dtype == torch.float64 else (1e-2, 1e-4)
    scale = torch.maximum(autograd.abs().max(), ours.abs().max())
    if torch.allclose(autograd, ours, rtol=0, atol=float(rel * scale + floor)):
        return None
    difference = (autograd - ours).abs()
    if not _fed(source, p):  # no call fed it: no terms
        return float(difference.max())
    terms = source.per_sample([p])[p].detach().abs().sum(0).mul_(weight)
    if (difference <= rel * terms.to(autograd.dtype) + floor).all():
        return None
    return float(difference.max())


def unreached(
    param: nn.Parameter, name: str, layers: list[HookedLayer], canonical: Callable[[nn.Parameter], nn.Parameter]
) -> str:
    """What pergrad saw when a parameter got a gradient that none of its layers' outputs passed on."""
    holders = [layer for layer in layers if any(canonical(p) is param for _, p in layer.trainable())]

    def caught(layer: HookedLayer) -> str:
        if layer.spec.raw:
            return f"the uses of {layer.label} in its forward"
        if layer.spec.output_dims is not None:
            return f"any tensor returned by {layer.label}"
        return (
            f"the first tensor returned by {layer.label}" if layer.spec.all_inputs else f"the output of {layer.label}"
        )

    where = " or ".join(caught(layer) for layer in holders)
    return (
        f"parameter {name!r} received a gradient in this backward pass, but pergrad caught "
        f"no gradient on {where or 'the output of a hooked layer holding it'} in a forward of the wrapped "
        "model: the gradient reached the parameter another way, which pergrad cannot split into samples. "
        "Such a way is a loss computed from a forward run before wrapping (or through another wrapper), a "
        "module using the parameter outside the layer's own forward (e.g. F.linear(x, self.emb.weight)), or "
        "an output of the layer that its rule does not take (a rule registered without output_dims takes "
        "the first tensor the layer returns)."
        + (ROOT_FORWARD if any(layer.name == "" for layer in holders) else "")
        + (COMPILED if compiled_in_process() else "")
    )


def compiled_in_process() -> bool:
    """Whether Dynamo (``torch.compile``) holds code it compiled in this process (none since its last reset)."""
    convert = sys.modules.get("torch._dynamo.convert_frame")  # (torch is pinned: a private name)
    return convert is not None and bool(convert.output_codes.seen)


# appended where torch.compile has compiled code in the process: Dynamo does not guard on module hooks
# (torch._dynamo.config.skip_nnmodule_hook_guards), so code it compiled for an unhooked module of the
# same class (or for this model before wrapping) runs the wrapped model without pergrad's hooks
COMPILED = (
    " torch.compile has compiled code in this process: code Dynamo compiled for a model of the same class "
    "before it had pergrad's hooks (another copy of it, or this model before wrapping) runs this model without "
    "calling them, as Dynamo does not check module hooks (torch._dynamo.config.skip_nnmodule_hook_guards), so "
    "pergrad saw no forward. Call torch._dynamo.reset() just before the compiled wrapped model's first call "
    "(after wrapping it and after compiling other models of its class), or set torch._dynamo.config.skip_nnmodule_hook_guards = False before compiling anything."
)


# appended where the root module holds the parameter: its hooks run only when the module itself is called
ROOT_FORWARD = (
    " The root module's own hooks run only when it is called: a wrapper that calls its .forward() directly "
    "skips them (Opacus's GradSampleModule does: pass wrap_model=False to make_private and call the model, or "
    "the PerSampleModule, yourself)."
)


def unattributable(name: str, seen: str) -> str:
    """A parameter's gradient has a part no hooked layer's output produced (``seen``: the evidence)."""
    return (
        f"parameter {name!r}: its gradient has a part that no hooked layer's output "
        f"produced ({seen}). A term of the loss that uses the parameter directly (a regulariser such as "
        "weight decay: use the optimizer's weight_decay instead) or a parent module using it outside the "
        "layer's forward (e.g. F.linear(x, self.emb.weight)) cannot be attributed to samples. Compute it "
        "through the layer."
    )


def check_reached(
    state: Backward, known: Container[nn.Parameter], names: dict[nn.Parameter, str], layers: list[HookedLayer],
    canonical: Canonical,
) -> None:  # fmt: skip
    """Every parameter the backward reached got a gradient through a hooked layer's output (``known``:
    those with per-sample gradients, or kept ``(a, d)``)."""
    missing = [p for p in state.autograd.reached if p not in known and p not in state.arrived.passed]
    if missing:
        message = unreached(missing[0], names[missing[0]], layers, canonical)
        raise HookStateError(message + (RECOMPUTED if state.nested else ""))


def check_partial(
    state: Backward, targets: Targets, known: Container[nn.Parameter], layers: list[HookedLayer], canonical: Canonical
) -> None:
    """A backward that accumulates into part of a transform's target only -- ``backward(inputs=...)``
    naming some of its parameters: their per-sample gradients were computed, their ``AccumulateGrad``
    did not run -- cannot transform: ``T`` of a sample's gradient needs every parameter it covers (a
    clipping norm over all of them). Told from a parameter of a layer whose rule computes one op on
    its parameters (an output gradient flowed, so they are in the graph); a rule over a subtree or
    every input may give zeros for parameters off the loss's path."""
    reached = state.autograd.reached
    for target in targets:
        if not any(p in reached for p in target.params.values()):
            continue
        left = {p: n for n, p in target.params.items() if p in known and p not in reached}
        if left:
            _refuse_partial(target, left, layers, canonical)


def _refuse_partial(
    target: Target, left: dict[nn.Parameter, str], layers: list[HookedLayer], canonical: Canonical
) -> None:
    """Raise where a parameter of ``target`` the backward did not accumulate into although its per-sample
    gradients were computed (``left``, by name) is of a layer whose rule computes one op on its parameters."""
    in_graph = {
        canonical(p)
        for layer in layers
        if not (layer.spec.subtree or layer.spec.all_inputs or layer.spec.parametrized)
        for _, p in layer.trainable()
    }
    named = [n for p, n in left.items() if p in in_graph]
    if named:
        raise TransformError(
            f"this backward accumulates into some of the parameters the transform registered for "
            f"{target.label} covers, but not into {named} (backward(inputs=...) names part of them), "
            "although their per-sample gradients flowed: the transform of each sample's gradient "
            "needs all of them. Name every parameter the target covers in inputs, or none."
        )


def check_taps(state: Backward, detached: Collection[nn.Parameter], names: dict[nn.Parameter, str]) -> None:
    """Whatever reached a tapped parameter's ``AccumulateGrad`` beside its tap's very tensor must add
    up to what the tap passed on (``pergrad._core.shortcuts.reach``): values read (a host sync) only where such an
    arrival happened. A term that is exactly zero (``loss + 0 * p.sum()``) is let through.
    ``detached``: the parameters that ran detached in the backward's forward."""
    seen = state.autograd
    for param, grads in seen.untapped.items():
        tapped = seen.tapped.get(param)
        if tapped is None and param not in detached:  # no layer sent it anything in this backward
            continue
        extra = torch.stack(grads).sum(0)
        if tapped is not None and param not in seen.matched:  # summed with the tap's part
            extra = extra - tapped
        if bool(extra.any()):
            raise HookStateError(
                unattributable(names[param], "it arrived beside what the parameter's layers sent it")
                + " Or pass verify=False to PerSampleModule if dropping that part is intended."
            )


def check_hooked(state: Backward, names: dict[nn.Parameter, str]) -> None:
    """A tensor hook of the user's (``p.register_hook``) on a parameter whose ``.grad`` pergrad writes
    from the transformed per-sample gradients may observe autograd's sum but not change it: what it
    returns would be dropped. Values are read only where a hook returned another tensor."""
    for param, pairs in state.autograd.rehooked.items():
        for summed, returned in pairs:
            if returned.shape == summed.shape and torch.equal(returned, summed):
                continue
            raise HookStateError(
                f"parameter {names[param]!r}: a hook registered on it with register_hook returned a gradient other "
                "than the one autograd gave it, but a transform covers this parameter, so pergrad writes its .grad "
                "from the transformed per-sample gradients and the hook's change would be dropped (a tensor hook "
                "sees autograd's gradient of the whole batch, untransformed). Return None from the hook (to observe "
                "the gradient), or change the gradient pergrad writes: in a post-accumulate-grad hook, which runs "
                "once .grad is final (p.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))), or per "
                "sample, in the transform."
            )
