"""`ckptune.optimizer_in_backward`: one optimizer per parameter, stepped in its post-accumulate-grad
hook. The weights after several steps equal a loop's that steps after backward, bit for bit (SGD
with momentum and Adam(W) in each torch.optim implementation; GPT-2's tied embedding, which one
hook steps once); no gradient outlives backward; and `training_config` reads the plan's choice,
refusing a plan that could not have been made with it. Run from the repository root:

    .venv/bin/python -m unittest discover -s python/tests
"""

import sys
import unittest
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# test_companion's set-up puts the checkout's python/ on the path and takes one thread.
from test_companion import build, loss_of, make_plan  # noqa: E402, I001

import ckptune  # noqa: E402

OPTIMIZERS = [
    (torch.optim.AdamW, {"weight_decay": 1e-2, "foreach": False}),
    (torch.optim.AdamW, {"weight_decay": 1e-2, "foreach": True}),
    (torch.optim.AdamW, {"weight_decay": 1e-2, "fused": True}),
    (torch.optim.Adam, {"foreach": False}),
    (torch.optim.SGD, {"momentum": 0.9, "foreach": False}),
    (torch.optim.SGD, {"momentum": 0.9, "foreach": True}),
]


def _train(name, optimizer_class, kwargs, in_backward, steps=3):
    """The parameters after `steps` steps, stepping after backward or in it."""
    model, _ = build(name)
    model.train()
    if in_backward:
        handle = ckptune.optimizer_in_backward(model.parameters(), optimizer_class, lr=1e-3, **kwargs)
    else:
        opt = optimizer_class(model.parameters(), lr=1e-3, **kwargs)
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same dropout masks in both runs
        loss_of(name, model).backward()
        if in_backward:
            assert all(p.grad is None for p in model.parameters()), "a gradient outlived backward"
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
    if in_backward:
        handle.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class OptimizerInBackwardTest(unittest.TestCase):
    def test_weights_equal_the_step_after_backward_bit_for_bit(self):
        for name in ["tiny-gpt2", "tiny-bert", "tiny-resnet"]:
            for optimizer_class, kwargs in OPTIMIZERS:
                with self.subTest(model=name, optimizer=optimizer_class.__name__, **kwargs):
                    after = _train(name, optimizer_class, kwargs, in_backward=False)
                    inside = _train(name, optimizer_class, kwargs, in_backward=True)
                    self.assertEqual(after.keys(), inside.keys())
                    for n in after:
                        self.assertTrue(torch.equal(after[n], inside[n]), n)

    def test_a_tied_parameter_has_one_optimizer(self):
        model, _ = build("tiny-gpt2")
        handle = ckptune.optimizer_in_backward(model.parameters(), torch.optim.SGD, lr=0.1)
        self.assertIs(model.lm_head.weight, model.transformer.wte.weight)
        self.assertEqual(len(handle.optimizers), len(list(model.parameters())))
        state = handle.state_dict()
        handle.load_state_dict(state)
        with self.assertRaises(ValueError):
            handle.load_state_dict({"optimizers": state["optimizers"][1:]})

    def test_training_config_reads_the_choice_and_refuses_what_cannot_step_in_backward(self):
        self.assertFalse(ckptune.training_config(make_plan([])).optimizer_in_backward)
        self.assertTrue(ckptune.training_config(make_plan([], optimizer_in_backward=True)).optimizer_in_backward)
        for bad in [{"grad_accum": 2}, {"set_to_none": False}, {"precision": "fp16"}]:
            with self.subTest(**bad), self.assertRaisesRegex(ValueError, "in backward"):
                ckptune.training_config(make_plan([], optimizer_in_backward=True, **bad))


if __name__ == "__main__":
    unittest.main()
