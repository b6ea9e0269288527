"""`ckptune.apply` and `ckptune.plan_root` on real Hugging Face task models: a plan's names are
the backbone's (`encoder.layer.0`), the user's model is the task model around it
(`BertForSequenceClassification.bert`, `GPT2LMHeadModel.transformer`, a LightningModule's
`self.model`), and the plan is applied there without a manual `get_submodule`.

Needs transformers: `PYTHONPATH=$(scripts/corpus_packages) .venv/bin/python -m unittest
discover -s python/tests -p test_plan_root.py`; skipped without it.
"""

import os
import sys
import unittest

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ckptune  # noqa: E402

try:
    import transformers
except ImportError:  # pragma: no cover - the corpus packages provide it
    transformers = None


def plan_for(modules, checkpointed, prefix):
    """A plan document as `ckptune plan -o` writes its fields apply reads: the backbone's module
    names, the checkpointed ones as an anchored alternation, the recorded prefix."""
    regex = "|".join(m.replace(".", r"\.") for m in checkpointed) or "(?!)"
    return {
        "format": ckptune.FORMAT,
        "model": {"modules": list(modules), "prefix": prefix,
                  "blocks": [{"name": m, "candidate": True} for m in checkpointed]},
        "checkpoint": {"regex": regex, "modules": list(checkpointed)},
        "config": {"precision": "fp32", "optimizer": "adamw", "micro_batch": 2, "grad_accum": 1,
                   "set_to_none": True},
    }


def tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3,
                                  num_attention_heads=2, intermediate_size=64, num_labels=2,
                                  max_position_embeddings=32)
    return transformers.BertForSequenceClassification(cfg)


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)


def backbone_names(model, prefix):
    p = prefix.rstrip(".")
    return [n for n, _ in model.get_submodule(p).named_modules() if n]


def bert_loss(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 16), generator=g)
    return model(input_ids=ids, labels=torch.tensor([0, 1])).loss


def grads(model, loss_of):
    model.train()  # dropout on: the recompute must draw the same masks
    torch.manual_seed(2)
    loss_of(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class Lit(nn.Module):
    """The shape of a LightningModule that keeps the network as `self.model`."""

    def __init__(self, model):
        super().__init__()
        self.model = model


@unittest.skipIf(transformers is None, "needs transformers (PYTHONPATH=$(scripts/corpus_packages))")
class PlanRootTest(unittest.TestCase):
    def test_bert_task_model_gets_the_backbone_plan_with_equal_gradients(self):
        plain = tiny_bert()
        plan = plan_for(backbone_names(plain, "bert."), ["encoder.layer.0", "encoder.layer.2"], "bert.")
        wrapped_model = tiny_bert()
        wrapped = ckptune.apply(wrapped_model, plan)
        self.assertEqual(wrapped, ["encoder.layer.0", "encoder.layer.2"])
        self.assertIn("forward", wrapped_model.bert.encoder.layer[2].__dict__)
        self.assertIs(ckptune.plan_root(wrapped_model, plan), wrapped_model.bert)
        want, got = grads(plain, bert_loss), grads(wrapped_model, bert_loss)
        self.assertEqual(want.keys(), got.keys())
        for n in want:
            self.assertTrue(torch.equal(want[n], got[n]), n)

    def test_gpt2_lm_head_model_gets_the_transformer_plan(self):
        model = tiny_gpt2()
        plan = plan_for(backbone_names(model, "transformer."), ["h.1"], "transformer.")
        self.assertEqual(ckptune.apply(model, plan), ["h.1"])
        self.assertIn("forward", model.transformer.h[1].__dict__)
        self.assertIs(ckptune.plan_root(model, plan), model.transformer)

    def test_the_backbone_itself_still_takes_the_plan(self):
        model = tiny_bert()
        plan = plan_for(backbone_names(model, "bert."), ["encoder.layer.1"], "bert.")
        self.assertEqual(ckptune.apply(model.bert, plan), ["encoder.layer.1"])

    def test_a_lightning_module_holding_the_task_model(self):
        lit = Lit(tiny_bert())
        plan = plan_for(backbone_names(lit.model, "bert."), ["encoder.layer.0"], "bert.")
        self.assertEqual(ckptune.apply(lit, plan), ["encoder.layer.0"])
        self.assertIn("forward", lit.model.bert.encoder.layer[0].__dict__)
        self.assertIs(ckptune.plan_root(lit, plan), lit.model.bert)

    def test_a_plan_that_checkpoints_nothing_finds_its_root_by_its_blocks(self):
        model = tiny_bert()
        plan = plan_for(backbone_names(model, "bert."), [], "bert.")
        plan["model"]["blocks"] = [{"name": "encoder.layer.0", "candidate": True}]
        self.assertEqual(ckptune.apply(model, plan), [])
        self.assertIs(ckptune.plan_root(model, plan), model.bert)
        # A snippet's PLAN has no blocks: the recorded prefix alone.
        del plan["model"]["blocks"]
        self.assertIs(ckptune.plan_root(model, plan), model.bert)
        self.assertIs(ckptune.plan_root(Lit(model), plan), model.bert)

    def test_another_tree_is_refused_with_the_closest_names_and_nothing_wrapped(self):
        model = tiny_bert()
        names = backbone_names(model, "bert.") + ["encoder.layer.7"]
        plan = plan_for(names, ["encoder.layer.7"], "bert.")
        with self.assertRaises(ValueError) as e:
            ckptune.apply(model, plan)
        msg = str(e.exception)
        self.assertIn("matches no module of this model, but the plan checkpoints encoder.layer.7", msg)
        self.assertIn("closest module names: bert.encoder.layer.", msg)
        with self.assertRaises(ValueError) as e:
            ckptune.plan_root(model, plan)
        self.assertIn("closest module names", str(e.exception))
        self.assertFalse(any("forward" in m.__dict__ for m in model.modules()))

    def test_two_backbones_are_refused_naming_both(self):
        class Pair(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = tiny_bert(), tiny_bert()

        pair = Pair()
        plan = plan_for(backbone_names(pair.a, "bert."), ["encoder.layer.0"], "bert.")
        with self.assertRaises(ValueError) as e:
            ckptune.apply(pair, plan)
        self.assertIn("a.bert, b.bert", str(e.exception))
        self.assertFalse(any("forward" in m.__dict__ for m in pair.modules()))


if __name__ == "__main__":
    unittest.main()
