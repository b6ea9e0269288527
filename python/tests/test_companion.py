"""The companion against the plain-torch reference models of models/fixtures/reference.py:
wrapped names, unchanged state dicts, gradients equal to the bit with and without `apply`,
every refusal, and the training config. Run from the repository root:

    .venv/bin/python -m unittest discover -s python/tests
"""

import copy
import dataclasses
import importlib.util
import json
import os
import re
import sys
import tempfile
import unittest
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's python/, so no install is needed

import ckptune  # noqa: E402
from ckptune.checkpointing import _INNER  # noqa: E402


def _load_reference():
    path = HERE.parents[1] / "models" / "fixtures" / "reference.py"
    spec = importlib.util.spec_from_file_location("ckptune_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load_reference()
torch.set_num_threads(1)  # the same kernels' chunking in both runs, and a light load


def make_plan(modules, **config):
    """A plan dict as `ckptune plan` writes it, with only the fields this package reads."""
    regex = "^(?:" + "|".join(re.escape(m) for m in modules) + ")$" if modules else r"^[^\s\S]$"
    cfg = {"precision": "fp32", "optimizer": "adamw", "micro_batch": 4, "grad_accum": 1, "set_to_none": True}
    cfg.update(config)
    return {"format": "ckptune.plan/1", "checkpoint": {"regex": regex, "modules": list(modules)},
            "config": cfg, "model": {"modules": []}, "budget_bytes": 1 << 30, "predicted": {}}


def build(name):
    """The reference model and its backbone: the module plan names are relative to."""
    torch.manual_seed(0)
    model, prefix = reference.build(name)
    backbone = model.get_submodule(prefix[:-1]) if prefix else model
    return model, backbone


def _prefix(name):
    """The backbone's name (`get_submodule("")` is the model itself)."""
    return {"tiny-bert": "bert", "tiny-gpt2": "transformer"}.get(name, "")


def loss_of(name, model):
    """One training loss on a fixed small batch (the seed is set by the caller)."""
    g = torch.Generator().manual_seed(1)
    if name == "tiny-resnet":
        x = torch.randn(2, 3, 32, 32, generator=g)
        return F.cross_entropy(model(x), torch.tensor([1, 7]))
    if name == "tiny-bert":
        ids = torch.randint(0, 100, (2, 16), generator=g)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 12:] = 0
        _, pooled = model.bert(ids, mask)
        return F.cross_entropy(model.classifier(model.dropout(pooled)), torch.tensor([0, 1]))
    if name == "tiny-gpt2":
        ids = torch.randint(0, 100, (2, 16), generator=g)
        return model(ids, ids)[1]
    raise AssertionError(name)


def gradients(name, model):
    model.train()  # dropout on: the recompute must draw the same masks
    torch.manual_seed(2)
    loss = loss_of(name, model)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def wrapped_names(model):
    return [n for n, m in model.named_modules() if _INNER in m.__dict__ or "forward" in m.__dict__]


CASES = [
    ("tiny-resnet", ["layer1", "layer3"]),
    ("tiny-resnet", ["layer2.0", "layer4"]),
    ("tiny-bert", ["embeddings", "encoder.layer.0", "encoder.layer.1", "pooler"]),
    ("tiny-bert", ["encoder.layer.0.attention", "encoder.layer.1"]),  # nested granularity
    ("tiny-gpt2", ["h.1"]),
    ("tiny-gpt2", ["h.0.attn", "h.0.mlp", "h.1"]),
]


class ApplyTest(unittest.TestCase):
    def test_wraps_exactly_the_planned_modules_in_named_modules_order(self):
        for name, modules in CASES:
            with self.subTest(name=name, modules=modules):
                _, backbone = build(name)
                got = ckptune.apply(backbone, make_plan(list(reversed(modules))))
                self.assertEqual(got, modules)
                self.assertEqual(wrapped_names(backbone), modules)

    def test_names_and_state_dict_are_unchanged(self):
        for name, modules in CASES:
            with self.subTest(name=name, modules=modules):
                model, backbone = build(name)
                names = [n for n, _ in model.named_modules()]
                before = {k: v.clone() for k, v in model.state_dict().items()}
                ckptune.apply(backbone, make_plan(modules))
                self.assertEqual([n for n, _ in model.named_modules()], names)
                after = model.state_dict()
                self.assertEqual(list(after), list(before))
                for k, v in before.items():
                    self.assertTrue(torch.equal(after[k], v), k)

    def test_gradients_equal_to_the_bit_with_and_without_apply(self):
        for name, modules in CASES:
            with self.subTest(name=name, modules=modules):
                plain, _ = build(name)
                ckpt = copy.deepcopy(plain)
                backbone = ckpt.get_submodule(_prefix(name))
                ckptune.apply(backbone, make_plan(modules))
                # Count calls of a child of the first wrapped module: twice (forward and
                # recompute) proves the checkpoint really ran. A pre-hook, because the
                # recompute stops once it has what backward needs (checkpoint's early stop).
                first = backbone.get_submodule(modules[0])
                child = next(first.children())
                calls = []
                child.register_forward_pre_hook(lambda *_: calls.append(1))
                loss_a, grads_a = gradients(name, plain)
                loss_b, grads_b = gradients(name, ckpt)
                self.assertEqual(len(calls), 2)
                self.assertTrue(torch.equal(loss_a, loss_b))
                self.assertEqual(list(grads_a), list(grads_b))
                for k, g in grads_a.items():
                    self.assertIsNotNone(g, k)
                    self.assertTrue(torch.equal(g, grads_b[k]), f"{name}: gradient of {k} differs")

    def test_keyword_arguments_pass_through(self):
        _, plain = build("tiny-bert")
        wrapped = copy.deepcopy(plain)
        ckptune.apply(wrapped, make_plan(["encoder.layer.0"]))
        outs = []
        for bert in (plain, wrapped):
            bert.train()
            torch.manual_seed(3)
            h = torch.randn(2, 16, 32, requires_grad=True)
            mask = torch.zeros(2, 1, 1, 16)
            mask[1, ..., 10:] = torch.finfo(torch.float32).min
            (out,) = bert.encoder.layer[0](h, attention_mask=mask)
            out.sum().backward()
            outs.append((out.detach(), h.grad))
        self.assertTrue(torch.equal(outs[0][0], outs[1][0]))
        self.assertTrue(torch.equal(outs[0][1], outs[1][1]))

    def test_without_grad_runs_the_module_directly(self):
        _, bert = build("tiny-bert")
        plain = copy.deepcopy(bert).eval()
        ckptune.apply(bert, make_plan(["encoder.layer.1"]))
        bert.eval()
        ids = torch.randint(0, 100, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)
        with torch.no_grad():
            self.assertTrue(torch.equal(bert(ids, mask)[0], plain(ids, mask)[0]))

    def test_deepcopy_of_a_wrapped_model_runs_its_own_weights(self):
        _, bert = build("tiny-bert")
        ckptune.apply(bert, make_plan(["encoder.layer.0"]))
        twin = copy.deepcopy(bert)
        layer = twin.encoder.layer[0]
        self.assertIs(layer.forward.__self__, layer)
        self.assertIs(layer.__dict__[_INNER].__self__, layer)

    def test_a_plan_that_checkpoints_nothing_wraps_nothing(self):
        model, backbone = build("tiny-bert")
        self.assertEqual(ckptune.apply(backbone, make_plan([])), [])
        self.assertEqual(wrapped_names(model), [])

    def test_plan_from_a_file(self):
        _, backbone = build("tiny-gpt2")
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "plan.json"
            path.write_text(json.dumps(make_plan(["h.0"])))
            self.assertEqual(ckptune.apply(backbone, str(path)), ["h.0"])


def _load_export_fixtures():
    sys.modules.setdefault("reference", reference)  # the script imports it from beside itself
    path = HERE.parents[1] / "models" / "fixtures" / "make_export_fixtures.py"
    spec = importlib.util.spec_from_file_location("ckptune_export_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SharedModuleTest(unittest.TestCase):
    """A module the model calls several times (`layer` of models/fixtures/shared_layer.pt2, three
    times in a row as ALBERT's shared layer group): ckptune plans it as one candidate with a block
    per call, and `apply` makes each call a checkpoint segment of its own, recomputed once in the
    backward, with the plain model's gradients to the bit (dropout in each call included)."""

    def test_each_call_is_a_segment_recomputed_once(self):
        fixtures = _load_export_fixtures()
        torch.manual_seed(11)
        plain = fixtures.SharedLayer().train()
        wrapped = copy.deepcopy(plain)
        self.assertEqual(ckptune.apply(wrapped, make_plan(["layer"])), ["layer"])
        x = torch.randn(4, 8)
        runs = []
        results = []
        for model in (plain, wrapped):
            runs.append(0)
            hook = model.layer.up.register_forward_pre_hook(lambda *_: runs.__setitem__(-1, runs[-1] + 1))
            torch.manual_seed(5)
            model(x).sum().backward()
            hook.remove()
            results.append({k: p.grad for k, p in model.named_parameters()})
        self.assertEqual(runs, [3, 6], "three calls, each recomputed once")
        for k, g in results[0].items():
            self.assertTrue(torch.equal(g, results[1][k]), f"gradient of {k} differs")


class WholeModelTest(unittest.TestCase):
    def test_the_whole_task_model_takes_its_backbones_plan(self):
        model, bert = build("tiny-bert")  # the whole model, not its backbone the plan names
        wrapped = ckptune.apply(model, make_plan(["encoder.layer.0", "encoder.layer.1"]))
        self.assertEqual(wrapped, ["encoder.layer.0", "encoder.layer.1"])
        self.assertEqual(wrapped_names(model), ["bert.encoder.layer.0", "bert.encoder.layer.1"])
        self.assertIs(ckptune.plan_root(model, make_plan(["encoder.layer.0"])), bert)


class RefusalTest(unittest.TestCase):
    def refuses(self, model, plan, *fragments):
        before = wrapped_names(model)
        with self.assertRaises(ValueError) as cm:
            ckptune.apply(model, plan)
        for fragment in fragments:
            self.assertIn(fragment, str(cm.exception))
        self.assertEqual(wrapped_names(model), before, "a refusal changes nothing")
        return str(cm.exception)

    def test_regex_matching_nothing_names_the_closest_modules(self):
        model, _ = build("tiny-resnet")
        self.refuses(model, make_plan(["layer9"]), "matches no module", "closest module names: layer4, layer3, layer2")

    def test_nested_matches(self):
        _, bert = build("tiny-bert")
        self.refuses(bert, make_plan(["encoder.layer.0", "encoder.layer.0.attention.self", "pooler"]),
                     "encoder.layer.0.attention.self inside encoder.layer.0")

    def test_plan_modules_missing_from_the_model(self):
        _, bert = build("tiny-bert")
        self.refuses(bert, make_plan(["encoder.layer.0", "encoder.layer.2"]),
                     "this model's module names differ from the plan's: encoder.layer.2")

    def test_model_already_wrapped(self):
        _, bert = build("tiny-bert")
        ckptune.apply(bert, make_plan(["encoder.layer.0"]))
        self.refuses(bert, make_plan(["encoder.layer.0"]), "already wrapped", "encoder.layer.0")
        self.refuses(bert, make_plan(["encoder.layer.1"]), "already wrapped")
        self.assertEqual(wrapped_names(bert), ["encoder.layer.0"])

    def test_another_format(self):
        _, bert = build("tiny-bert")
        plan = make_plan(["encoder.layer.0"])
        plan["format"] = "ckptune.plan/2"
        self.refuses(bert, plan, "'ckptune.plan/2'", "'ckptune.plan/1'", "re-plan")


class LoadPlanTest(unittest.TestCase):
    def test_rejects_another_format_tag(self):
        for tag in ["ckptune.plan/2", "ckptune.profile/1", None]:
            with self.subTest(tag=tag), tempfile.TemporaryDirectory() as d:
                plan = make_plan([])
                plan["format"] = tag
                path = Path(d) / "plan.json"
                path.write_text(json.dumps(plan))
                with self.assertRaises(ValueError) as cm:
                    ckptune.load_plan(path)
                message = str(cm.exception)
                self.assertIn(repr(tag), message)
                self.assertIn("expected 'ckptune.plan/1'", message)
                self.assertIn("re-plan with this ckptune", message)

    def test_returns_the_document(self):
        plan = make_plan(["h.0"])
        self.assertIs(ckptune.load_plan(plan), plan)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "plan.json"
            path.write_text(json.dumps(plan))
            self.assertEqual(ckptune.load_plan(path), plan)


class TrainingConfigTest(unittest.TestCase):
    def config(self, **config):
        return ckptune.training_config(make_plan([], **config))

    def test_values(self):
        c = self.config(precision="fp32", optimizer="adamw", micro_batch=8, grad_accum=2, set_to_none=False)
        self.assertEqual((c.autocast_dtype, c.param_dtype), (None, torch.float32))
        self.assertIs(c.optimizer_class, torch.optim.AdamW)
        self.assertEqual(dict(c.optimizer_kwargs), {"weight_decay": 1e-2})
        self.assertEqual((c.micro_batch, c.grad_accum, c.set_to_none, c.grad_scaler), (8, 2, False, False))

        c = self.config(precision="bf16", optimizer="sgd")
        self.assertEqual((c.autocast_dtype, c.param_dtype), (torch.bfloat16, torch.float32))
        self.assertIs(c.optimizer_class, torch.optim.SGD)
        self.assertEqual(dict(c.optimizer_kwargs), {})

        c = self.config(precision="bf16-pure", optimizer="sgd-momentum")
        self.assertEqual((c.autocast_dtype, c.param_dtype), (None, torch.bfloat16))
        self.assertIs(c.optimizer_class, torch.optim.SGD)
        self.assertEqual(dict(c.optimizer_kwargs), {"momentum": 0.9})

        c = self.config(precision="fp16", optimizer="adam")
        self.assertEqual((c.autocast_dtype, c.param_dtype, c.grad_scaler), (torch.float16, torch.float32, True))
        self.assertIs(c.optimizer_class, torch.optim.Adam)
        self.assertEqual(dict(c.optimizer_kwargs), {})

    def test_optimizer_impl(self):
        for impl, kwargs in [("single", {"foreach": False}), ("foreach", {"foreach": True}),
                             ("fused", {"fused": True})]:
            with self.subTest(impl=impl):
                c = self.config(optimizer="adamw", optimizer_impl=impl)
                self.assertEqual(dict(c.optimizer_kwargs), {"weight_decay": 1e-2, **kwargs})
        with self.assertRaises(ValueError) as cm:
            self.config(optimizer_impl="vectorized")
        self.assertIn("'vectorized'", str(cm.exception))

    def test_the_config_builds_an_optimizer(self):
        c = self.config(optimizer="sgd-momentum", optimizer_impl="single")
        opt = c.optimizer_class([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **c.optimizer_kwargs)
        self.assertEqual(opt.defaults["momentum"], 0.9)
        self.assertFalse(opt.defaults["foreach"])

    def test_optimizers_torch_lacks_name_their_package(self):
        for optimizer, package in [("lion", "lion-pytorch"), ("adam8bit", "bitsandbytes"),
                                   ("adamw8bit", "bitsandbytes")]:
            with self.subTest(optimizer=optimizer):
                with self.assertRaises(ValueError) as cm:
                    self.config(optimizer=optimizer)
                self.assertIn(f"'{optimizer}' is not in torch.optim", str(cm.exception))
                self.assertIn(package, str(cm.exception))

    def test_unknown_values(self):
        for config, fragment in [({"precision": "fp64"}, "unknown precision 'fp64'"),
                                 ({"optimizer": "adagrad"}, "unknown optimizer 'adagrad'")]:
            with self.subTest(config=config), self.assertRaises(ValueError) as cm:
                self.config(**config)
            self.assertIn(fragment, str(cm.exception))

    def test_frozen(self):
        c = self.config()
        with self.assertRaises(dataclasses.FrozenInstanceError):
            c.micro_batch = 1
        with self.assertRaises(TypeError):
            c.optimizer_kwargs["lr"] = 1.0
        hash(c)


class ReadmeLoopTest(unittest.TestCase):
    """The training loop the repository's README shows runs as written."""

    def test_readme_loop_trains(self):
        readme = (HERE.parents[1] / "README.md").read_text()
        section = readme.split("## In your own PyTorch loop", 1)[1]
        code = section.split("```python\n", 1)[1].split("```", 1)[0]
        model, _ = build("tiny-resnet")
        torch.manual_seed(1)
        loader = [(torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))) for _ in range(4)]
        with tempfile.TemporaryDirectory() as d:
            for precision, accum in [("fp32", 1), ("bf16", 2)]:
                plan = make_plan(["layer1", "layer2"] if precision == "fp32" else [],
                                 precision=precision, micro_batch=2, grad_accum=accum)
                path = Path(d) / "plan.json"
                path.write_text(json.dumps(plan))
                fresh = copy.deepcopy(model)
                before = [p.detach().clone() for p in fresh.parameters()]
                scope = {"model": fresh, "loader": loader}
                cwd = Path.cwd()
                try:
                    os.chdir(d)
                    exec(code, scope)
                finally:
                    os.chdir(cwd)
                changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, fresh.parameters()))
                self.assertTrue(changed, f"{precision}: the loop trained nothing")


if __name__ == "__main__":
    unittest.main()
