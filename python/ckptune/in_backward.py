"""The optimizer step in backward: each parameter updated as soon as its gradient is accumulated.

A plan whose `config.optimizer_in_backward` is true was measured with one optimizer per
parameter, stepped inside its parameter's post-accumulate-grad hook and followed by
`zero_grad(set_to_none=True)` there (torchtune's `optimizer_in_bwd`), so the parameter gradients
never all exist at once and the optimizer's temporaries are one parameter's at a time. The loop
then calls `loss.backward()` and no `optimizer.step()`:

    cfg = ckptune.training_config(plan)
    opt = ckptune.optimizer_in_backward(model.parameters(), cfg.optimizer_class, lr=lr,
                                        **cfg.optimizer_kwargs)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()            # every parameter is stepped here
        del x, y, loss

Each parameter's update is the arithmetic its optimizer applies in a whole-model step, so the
weights equal a loop's that steps after backward (bit for bit with the single-tensor, `foreach`
and `fused` implementations of SGD and Adam(W), which update each parameter on its own).
Anything that must see every gradient before a step cannot run so: gradient accumulation over
several backwards, gradient-norm clipping, fp16's GradScaler (it unscales and checks all
gradients first); `optimizer_in_backward` does not stop a loop from doing them, the plan refuses
them.
"""

from typing import Any, Dict, Iterable, List

import torch


class OptimizerInBackward:
    """One `optimizer_class` per parameter, each stepped by its parameter's post-accumulate-grad
    hook. `optimizers` lists them in parameter order; `remove()` takes the hooks off.
    `state_dict()`/`load_state_dict()` save and restore them all (a list, in parameter order)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer_class, **kwargs: Any):
        self.params: List[torch.nn.Parameter] = []
        seen = set()
        for p in params:
            if p.requires_grad and id(p) not in seen:  # a tied parameter is listed once
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError("optimizer_in_backward: no parameter requires grad")
        self.optimizers = [optimizer_class([p], **kwargs) for p in self.params]
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(opt))
                         for p, opt in zip(self.params, self.optimizers)]

    @staticmethod
    def _hook(opt):
        def step(_param):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def remove(self) -> None:
        """Takes every hook off: later backwards leave gradients in `.grad` again."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        states = state["optimizers"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"state for {len(states)} parameters; this has {len(self.optimizers)}")
        for o, s in zip(self.optimizers, states):
            o.load_state_dict(s)


def optimizer_in_backward(params: Iterable[torch.nn.Parameter], optimizer_class, **kwargs: Any) -> OptimizerInBackward:
    """Registers the optimizer step in backward on `params` (see the module's docstring): one
    `optimizer_class(params=[p], **kwargs)` per parameter that requires grad, stepped and its
    gradient freed as soon as that gradient is accumulated. Returns the handle holding them."""
    return OptimizerInBackward(params, optimizer_class, **kwargs)
