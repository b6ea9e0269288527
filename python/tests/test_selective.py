"""Selective checkpointing in the companion (`ckptune.selective`, `checkpoint.selective` in a
plan): the `matmul` policy names the operators ckptune's runtime keeps (kernels/csrc/sac.cpp),
keeps exactly those of a real forward, `apply` runs the plan's selective modules under it with
gradients equal to the bit to plain training, and refuses a plan it cannot follow. Run from the
repository root:

    .venv/bin/python -m unittest python/tests/test_selective.py
"""

import copy
import re
import sys
import unittest
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the checkout's python/, so no install is needed

import ckptune  # noqa: E402
from ckptune.selective import MATMUL_OPS, policy_fn  # noqa: E402
from test_companion import build, gradients, make_plan  # noqa: E402

SAC_CPP = HERE.parents[1] / "kernels" / "csrc" / "sac.cpp"


def selective_plan(modules, selective, policy="matmul"):
    plan = make_plan(modules)
    plan["checkpoint"]["selective"] = {"policy": policy, "modules": list(selective)}
    return plan


class Ops(TorchDispatchMode):
    """Every operator (overload) that reaches the dispatch modes, below autograd, and how often
    the one named `count` ran: an operator selective checkpointing answers from its cache
    never reaches this mode, which sits below the checkpoint's own."""

    def __init__(self, count=None):
        super().__init__()
        self.funcs = set()
        self.counted, self.count = count, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.add(func)
        self.count += str(func._schema.name) == self.counted
        return func(*args, **(kwargs or {}))


class PolicyTest(unittest.TestCase):
    def test_the_companion_and_the_runtime_keep_the_same_operators(self):
        body = SAC_CPP.read_text().split("matmul_class()", 1)[1].split("};", 1)[0]
        self.assertEqual(set(re.findall(r'"(aten::[A-Za-z0-9_]+)"', body)), set(MATMUL_OPS))

    def test_a_forward_keeps_exactly_its_matrix_products_and_attention(self):
        model, _ = build("tiny-bert")
        mode = Ops()
        with mode:
            gradients("tiny-bert", model)
        policy = policy_fn("matmul")
        names = {str(f._schema.name) for f in mode.funcs}
        saved = {str(f._schema.name) for f in mode.funcs if policy(None, f) == CheckpointPolicy.MUST_SAVE}
        self.assertEqual(saved, names & MATMUL_OPS)
        self.assertIn("aten::addmm", saved)
        self.assertGreater(len(names), len(saved))


class ApplyTest(unittest.TestCase):
    def test_gradients_equal_to_the_bit_with_keep_selective_and_full_mixed(self):
        for selective in (["encoder.layer.0"], ["encoder.layer.0", "encoder.layer.1"]):
            with self.subTest(selective=selective):
                plain, _ = build("tiny-bert")
                ckpt = copy.deepcopy(plain)
                wrapped = ckptune.apply(ckpt.bert, selective_plan(["encoder.layer.0", "encoder.layer.1"], selective))
                self.assertEqual(wrapped, ["encoder.layer.0", "encoder.layer.1"])
                loss_a, grads_a = gradients("tiny-bert", plain)
                loss_b, grads_b = gradients("tiny-bert", ckpt)
                self.assertTrue(torch.equal(loss_a, loss_b))
                for k, g in grads_a.items():
                    self.assertTrue(torch.equal(g, grads_b[k]), f"gradient of {k} differs")

    def test_the_recompute_skips_the_kept_operators(self):
        # `addmm` (every Linear with a bias) runs in the forward only: the backward's products
        # are `mm`. Checkpointed whole, a layer's addmms run again in its recompute; selective,
        # the recompute takes them from what the forward kept.
        def addmms(selective):
            model, _ = build("tiny-bert")
            if selective is not None:
                ckptune.apply(model.bert, selective_plan(["encoder.layer.0"], selective))
            mode = Ops(count="aten::addmm")
            with mode:
                gradients("tiny-bert", model)
            return mode.count
        plain, full, sel = addmms(None), addmms([]), addmms(["encoder.layer.0"])
        self.assertGreater(full, plain)
        self.assertEqual(sel, plain)


class TransformersTest(unittest.TestCase):
    """On transformers' own LlamaForCausalLM (the suite's pinned transformers): its KV cache, on by
    default, makes a selective layer's recompute differ from its forward, so `apply` turns it off
    (with a warning); one layer whole and one selective, the gradients equal plain's bit for bit."""

    def test_llama_with_its_default_cache_trains_selective_bitwise(self):
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            self.fail("transformers missing: run with PYTHONPATH=$(scripts/corpus_packages)")
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")
        plain = LlamaForCausalLM(cfg).train()
        model = copy.deepcopy(plain)
        plan = selective_plan(["layers.0", "layers.1"], ["layers.1"])
        plan["model"] = {"prefix": "model."}
        with self.assertWarnsRegex(UserWarning, "use_cache=False"):
            self.assertEqual(ckptune.apply(model, plan), ["layers.0", "layers.1"])
        self.assertFalse(model.config.use_cache)
        root = ckptune.plan_root(model, plan)
        self.assertEqual([ckptune.selective_policy(root.get_submodule(f"layers.{i}")) for i in range(3)],
                         [None, "matmul", None])
        ids = torch.randint(0, 100, (2, 16))
        for m in (plain, model):
            torch.manual_seed(1)
            m(input_ids=ids, labels=ids).loss.backward()
        for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
            self.assertTrue(torch.equal(a.grad, b.grad), name)


class RefusalTest(unittest.TestCase):
    def test_unknown_policy(self):
        _, backbone = build("tiny-bert")
        with self.assertRaisesRegex(ValueError, "policy 'attention-core' is not one"):
            ckptune.apply(backbone, selective_plan(["encoder.layer.0"], ["encoder.layer.0"], "attention-core"))
        self.assertNotIn("forward", backbone.get_submodule("encoder.layer.0").__dict__)

    def test_selective_module_the_plan_does_not_checkpoint(self):
        _, backbone = build("tiny-bert")
        with self.assertRaisesRegex(ValueError, "runs encoder.layer.1 selective but does not checkpoint"):
            ckptune.apply(backbone, selective_plan(["encoder.layer.0"], ["encoder.layer.1"]))


if __name__ == "__main__":
    unittest.main()
