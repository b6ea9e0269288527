"""Wrapping the plan's modules in `torch.utils.checkpoint`, keeping every name as it was."""

import difflib
import functools
import re
import types
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .plan import PlanLike, load_plan
from .selective import POLICIES, context_fn, policy_fn

# Where a wrapped module keeps its own forward. Its presence is also the mark `apply` looks for
# to refuse wrapping twice (a checkpoint inside a checkpoint recomputes twice for no memory).
_INNER = "_ckptune_inner_forward"


def _checkpointed_forward(self, *args, **kwargs):
    """A wrapped module's forward: its own forward under non-reentrant checkpointing, the kind
    ckptune measured (it saves nothing inside the module, restores the RNG state so dropout
    draws the same masks on recompute, and accepts keyword arguments and non-tensor inputs)."""
    inner = getattr(self, _INNER)
    if not torch.is_grad_enabled():
        # Nothing is saved for backward without grad mode, so there is nothing to recompute.
        return inner(*args, **kwargs)
    # Keyword arguments travel in a partial rather than as checkpoint's **kwargs, so that one
    # named like a checkpoint option (`preserve_rng_state`, `context_fn`, ...) reaches the module.
    return checkpoint(functools.partial(inner, **kwargs), *args, use_reentrant=False)


def _selective_forward(self, *args, **kwargs):
    """A module run selective: as `_checkpointed_forward`, with the plan's policy choosing which
    operators' outputs its forward keeps for the recompute (`ckptune.selective`).

    `early_stop=False`: the recompute runs the whole forward, as ckptune's runtime does, so it
    takes every output the forward kept. Stopped early (PyTorch's default), it never reaches the
    operators after the last tensor the backward needs, and their kept outputs (a layer's last
    matmul) stay in the cache until the module's backward ends, above the plan's peak."""
    inner = getattr(self, _INNER)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    return checkpoint(functools.partial(inner, **kwargs), *args, use_reentrant=False,
                      context_fn=context_fn(self.__dict__[_POLICY]), early_stop=False)


# Where a module run selective keeps its policy's name.
_POLICY = "_ckptune_selective_policy"


def _selective(doc: Dict[str, Any], planned: List[str]) -> Dict[str, str]:
    """The plan's selective modules, each with its policy (`checkpoint.selective`: one
    `{"policy", "modules"}` for a plan with one policy, a list of them for a plan mixing
    policies, absent when every checkpointed module is checkpointed whole), checked: known
    policies, modules the plan checkpoints, each under one policy."""
    sel = doc["checkpoint"].get("selective")
    if sel is None:
        return {}
    groups = sel if isinstance(sel, list) else [sel]
    out: Dict[str, str] = {}
    for group in groups:
        try:
            policy = str(group["policy"])
            modules = [str(m) for m in group["modules"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"plan's checkpoint.selective lacks policy or modules ({e!r}); re-plan with "
                             f"this ckptune") from None
        if policy not in POLICIES:
            raise ValueError(f"plan's selective policy {policy!r} is not one this ckptune knows "
                             f"({', '.join(POLICIES)}); upgrade the ckptune package")
        if modules:
            policy_fn(policy)  # refuses, before anything is wrapped, a policy this torch cannot run
        stray = [m for m in modules if m not in planned]
        if stray:
            raise ValueError(f"plan runs {', '.join(stray)} selective but does not checkpoint them; "
                             f"re-plan with this ckptune")
        twice = [m for m in modules if m in out]
        if twice:
            raise ValueError(f"plan runs {', '.join(twice)} selective under two policies; re-plan with "
                             f"this ckptune")
        out.update((m, policy) for m in modules)
    return out


def apply(model: nn.Module, plan: PlanLike) -> List[str]:
    """Checkpoints the modules of `model` whose qualified names fully match the plan's regex.

    Each match gets an instance-level `forward` that runs its class's forward under
    `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, with
    `context_fn=partial(create_selective_checkpoint_contexts, policy)` for the modules the plan
    runs selective, each under its own policy (`checkpoint.selective`: the policy's operators'
    outputs are kept, the rest recomputed; `ckptune.selective`): no module is renamed or
    re-parented, so `state_dict` keys, `named_modules` and optimizers built before or after
    are unaffected. Returns the wrapped names in `named_modules` order ([] for a plan that
    checkpoints nothing).

    Plan names are the model's names as ckptune loaded it, which drops a task model's backbone
    prefix (`bert.`, `transformer.`); the plan records that prefix, so `model` may be the whole
    task model (`BertForSequenceClassification`, a LightningModule holding it): the plan is
    applied to the submodule its names are found under (`plan_root`); the returned names are
    the plan's (relative to that submodule). Everything is checked before anything is
    wrapped, so a refusal (ValueError) leaves the model untouched: a regex that matches nothing
    although the plan checkpoints modules, plan modules the model lacks (the message names the
    closest), a match nested in another match, or a model already wrapped by `apply`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply expects a torch.nn.Module, found {type(model).__name__}")
    doc = load_plan(plan)
    try:
        pattern = doc["checkpoint"]["regex"]
        planned = [str(m) for m in doc["checkpoint"]["modules"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"plan lacks checkpoint.regex or checkpoint.modules ({e!r}); re-plan with "
                         f"this ckptune") from None
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"plan's checkpoint regex {pattern!r} is not a valid regex: {e}") from None

    wrapped = [name or "<root>" for name in wrapped_modules(model)]
    if wrapped:
        raise ValueError(f"model is already wrapped by ckptune.apply (modules {', '.join(wrapped)}); "
                         f"apply a plan once, to a model that has not been wrapped")

    selective = _selective(doc, planned)
    _, root = _find_root(model, doc, planned)
    # The root ("") is never a candidate: plans name submodules only.
    modules = [(name, m) for name, m in root.named_modules() if name]
    names = [name for name, _ in modules]
    matched = [(name, m) for name, m in modules if regex.fullmatch(name)]

    if not matched:
        if not planned:
            return []
        raise ValueError(f"checkpoint regex {pattern} matches no module of this model, but the plan "
                         f"checkpoints {', '.join(planned)}; {_closest(planned, names)}")

    present = set(names)
    missing = [p for p in planned if p not in present]
    if missing:
        raise ValueError(f"this model's module names differ from the plan's: {', '.join(missing)} "
                         f"not found; {_closest(missing, names)}")

    matched_names = {name for name, _ in matched}
    nested = [f"{name} inside {outer}" for name, _ in matched for outer in _ancestors(name)
              if outer in matched_names]
    if nested:
        raise ValueError(f"checkpoint regex {pattern} matches modules nested in other matches "
                         f"({'; '.join(nested)}); checkpoint a module or its parts, never both")

    for name, m in matched:
        m.__dict__[_INNER] = m.forward
        # A bound method (not a closure) so that copy.deepcopy rebinds it to the copy.
        if name in selective:
            m.__dict__[_POLICY] = selective[name]
            m.forward = types.MethodType(_selective_forward, m)
        else:
            m.forward = types.MethodType(_checkpointed_forward, m)
    if selective:
        _no_kv_cache(model)
    return [name for name, _ in matched]


def _no_kv_cache(model: nn.Module) -> None:
    """Turns off a transformers model's KV cache (`config.use_cache`), with a warning. Each decoder
    layer appends to the cache in its forward and again in its recompute, so a selective layer's
    recompute calls other operators than its forward did, and PyTorch's selective checkpointing
    refuses the backward ("encountered during backward but not found in storage"). A training
    step needs no cache; transformers' own gradient checkpointing turns it off in training too."""
    for config in {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}.values():
        if getattr(config, "use_cache", False) is True:
            warnings.warn("ckptune.apply: the plan runs layers selective, which transformers' KV cache "
                          "breaks (each layer appends to it in its forward and again in its recompute); "
                          "setting config.use_cache=False", stacklevel=3)
            config.use_cache = False


def selective_policy(module: nn.Module) -> Optional[str]:
    """The policy `module` runs selective under, for a module `apply` wrapped as the plan's
    `checkpoint.selective` says; None for any other module (checkpointed whole, or not at all)."""
    return module.__dict__.get(_POLICY) if _INNER in module.__dict__ else None


def plan_root(model: nn.Module, plan: PlanLike) -> nn.Module:
    """The submodule of `model` whose qualified names are the plan's: `model` itself when it
    has them, else the one under the prefix the plan records (`bert` of a
    `BertForSequenceClassification`, `model.bert` of a LightningModule keeping it as
    `self.model`), else the only submodule that has them all. Raises ValueError naming the
    closest module names when none has them, and the candidates when several do.
    """
    doc = load_plan(plan)
    try:
        planned = [str(m) for m in doc["checkpoint"]["modules"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"plan lacks checkpoint.modules ({e!r}); re-plan with this ckptune") from None
    _, root = _find_root(model, doc, planned)
    probe = _probe(doc, planned)
    names = {n for n, _ in root.named_modules() if n}
    missing = [p for p in probe if p not in names]
    if missing:
        raise ValueError(f"this model's module names differ from the plan's: {', '.join(missing)} "
                         f"not found; {_closest(missing, [n for n, _ in model.named_modules() if n])}")
    return root


def _probe(doc: Dict[str, Any], planned: List[str]) -> List[str]:
    """Names that must all be found under the plan's root: its checkpointed modules, or, for a
    plan that checkpoints nothing, its candidate blocks."""
    if planned:
        return planned
    blocks = (doc.get("model") or {}).get("blocks") or []
    return [str(b["name"]) for b in blocks if isinstance(b, dict) and b.get("candidate") and "name" in b]


def _find_root(model: nn.Module, doc: Dict[str, Any], planned: List[str]) -> Tuple[str, nn.Module]:
    """Where in `model` the plan's names are (see `plan_root`); `("", model)` when nowhere, so
    that the caller's checks refuse with the closest names."""
    probe = _probe(doc, planned)
    names = [n for n, _ in model.named_modules() if n]
    present = set(names)

    def holds(root: str) -> bool:
        return all((f"{root}.{p}" if root else p) in present for p in probe)

    prefix = str((doc.get("model") or {}).get("prefix") or "").rstrip(".")
    if not probe:
        # Nothing to look for but the recorded prefix itself.
        at = [n for n in names if prefix and (n == prefix or n.endswith("." + prefix))]
        return (at[0], model.get_submodule(at[0])) if len(at) == 1 else ("", model)
    if holds(""):
        return "", model
    roots = [n for n in names if holds(n)]
    if prefix:
        recorded = [r for r in roots if r == prefix or r.endswith("." + prefix)]
        roots = recorded or roots
    if len(roots) > 1:
        raise ValueError(f"the plan's modules are found under several submodules of this model "
                         f"({', '.join(roots)}); apply the plan to the one it was made for, e.g. "
                         f"ckptune.apply(model.get_submodule({roots[0]!r}), plan)")
    if roots:
        return roots[0], model.get_submodule(roots[0])
    return "", model


def _ancestors(name: str) -> List[str]:
    """`a.b.c` -> [`a`, `a.b`]: the qualified names of the modules containing it."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _closest(wanted: Sequence[str], names: Sequence[str]) -> str:
    """The model's names closest to the plan's, and the submodule to apply the plan to when the
    plan's names are the model's under a wrapper prefix (`bert.encoder.layer.0`)."""
    close: List[str] = []
    for w in wanted:
        for c in difflib.get_close_matches(w, names, n=3):
            if c not in close:
                close.append(c)
    text = (f"closest module names: {', '.join(close)}" if close
            else f"no module name is close (the model's first are {', '.join(names[:5])})")
    prefix = _wrapper_prefix(wanted, names)
    if prefix is not None:
        text += (f"; the plan's names are this model's under {prefix!r}: apply the plan to "
                 f"model.get_submodule({prefix!r})")
    return text


def _wrapper_prefix(wanted: Sequence[str], names: Sequence[str]) -> Optional[str]:
    present = set(names)
    prefixes = sorted({n[: -len(wanted[0]) - 1] for n in names if n.endswith("." + wanted[0])}, key=len)
    for prefix in prefixes:
        if all(f"{prefix}.{w}" in present for w in wanted):
            return prefix
    return None


def wrapped_modules(model):
    """The qualified names of `model`'s modules that `apply` wrapped, whose forward recomputes
    in backward ("" for the model itself)."""
    return [name for name, m in model.named_modules() if _INNER in m.__dict__]
