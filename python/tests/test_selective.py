"""Selective checkpointing in the companion (`ckptune.selective`, `checkpoint.selective` in a
plan): the `matmul` policy names the operators ckptune's runtime keeps (kernels/csrc/sac.cpp),
keeps exactly those of a real forward; the `attention` policy keeps no tensor of the attention
score's shape and recomputes the attention kernels; `apply` runs the plan's selective modules
under either, or each module under its own policy in a plan mixing them, with gradients equal
to the bit to plain training (on the references and on transformers' BERT, GPT-2 and Llama,
eager and SDPA attention), and refuses a plan it cannot follow. Run from the repository root:

    .venv/bin/python -m unittest python/tests/test_selective.py
"""

import copy
import re
import sys
import unittest
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the checkout's python/, so no install is needed

import ckptune  # noqa: E402
from ckptune.selective import ATTENTION_KERNELS, FACTORIES, MATMUL_OPS, POLICIES, policy_fn  # noqa: E402
from test_companion import build, gradients, make_plan  # noqa: E402

SAC_CPP = HERE.parents[1] / "kernels" / "csrc" / "sac.cpp"


def selective_plan(modules, selective, policy="matmul"):
    plan = make_plan(modules)
    plan["checkpoint"]["selective"] = {"policy": policy, "modules": list(selective)}
    return plan


def mixed_plan(modules, by_policy):
    """A plan running each module of `by_policy` ({policy: [modules]}) selective under that
    policy, as a plan mixing policies writes `checkpoint.selective`: a list, one entry per policy."""
    plan = make_plan(modules)
    plan["checkpoint"]["selective"] = [{"policy": p, "modules": list(ms)} for p, ms in by_policy.items()]
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
    def test_the_companion_and_the_runtime_name_the_same_operators(self):
        def named(function):
            body = SAC_CPP.read_text().split(function + "()", 1)[1].split("};", 1)[0]
            return set(re.findall(r'"(aten::[A-Za-z0-9_]+)"', body))
        self.assertEqual(named("attention_kernels"), set(ATTENTION_KERNELS))
        self.assertEqual(named("factories"), set(FACTORIES))
        self.assertEqual(named("matrix_products") | named("attention_kernels"), set(MATMUL_OPS))

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


class Kept(TorchDispatchMode):
    """Above a selective checkpoint's own mode: every tensor the checkpoint's policy keeps in the
    forward, as (operator, output shapes). It holds what it keeps, as the checkpoint's cache
    does: the policy knows a kept output by its storage, and a storage freed here could come back
    as a later call's (a dropout mask's, written in place), which the policy would take as kept."""

    def __init__(self, policy):
        super().__init__()
        self.policy, self.kept, self.held = policy_fn(policy), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ctx = torch.utils.checkpoint.SelectiveCheckpointContext(is_recompute=False, op_output=out)
        if self.policy(ctx, func, *args, **(kwargs or {})) == CheckpointPolicy.MUST_SAVE:
            shapes = [tuple(x.shape) for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
            self.kept.append((str(func._schema.name), shapes))
            self.held.append(out)
        return out


class AttentionPolicyTest(unittest.TestCase):
    def test_the_attention_policy_keeps_no_score_and_every_projection(self):
        # tiny-bert: 2 heads of 16 over a sequence of 16 would make q, k, v score-shaped too; the
        # forward here runs at sequence 12 so that only the scores are [..., s, s].
        model, _ = build("tiny-bert")
        mode = Kept("attention")
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
        with mode:
            model.bert(ids, torch.ones(2, 12, dtype=torch.long))
        names = [n for n, _ in mode.kept]
        shapes = [s for _, ss in mode.kept for s in ss]
        self.assertFalse([s for s in shapes if len(s) >= 3 and s[-1] == s[-2]], mode.kept)
        self.assertFalse(set(names) & set(ATTENTION_KERNELS))
        self.assertNotIn("aten::native_dropout", names)
        self.assertNotIn("aten::_softmax", names)
        self.assertIn("aten::addmm", names)  # q, k, v, the output projection, the MLP
        self.assertIn("aten::native_layer_norm", names)


class ApplyTest(unittest.TestCase):
    def test_gradients_equal_to_the_bit_with_keep_selective_and_full_mixed(self):
        # The embeddings write their sum in place (`embeddings += position_embeddings`), which the
        # `attention` policy keeps.
        planned = ["embeddings", "encoder.layer.0", "encoder.layer.1"]
        for policy, selective in [(p, s) for p in POLICIES
                                  for s in (["encoder.layer.0"], planned)]:
            with self.subTest(policy=policy, selective=selective):
                plain, _ = build("tiny-bert")
                ckpt = copy.deepcopy(plain)
                wrapped = ckptune.apply(ckpt.bert, selective_plan(planned, selective, policy))
                self.assertEqual(wrapped, planned)
                self.assert_same_step(plain, ckpt)

    def assert_same_step(self, plain, ckpt):
        """tiny-BERT's loss and every gradient, bitwise, from `plain` and from `ckpt`."""
        loss_a, grads_a = gradients("tiny-bert", plain)
        loss_b, grads_b = gradients("tiny-bert", ckpt)
        self.assertTrue(torch.equal(loss_a, loss_b))
        for k, g in grads_a.items():
            self.assertTrue(torch.equal(g, grads_b[k]), f"gradient of {k} differs")

    def test_each_module_runs_under_its_own_policy_bitwise(self):
        planned = ["embeddings", "encoder.layer.0", "encoder.layer.1"]
        for by_policy in ({"matmul": ["encoder.layer.0"], "attention": ["encoder.layer.1"]},
                          {"attention": ["embeddings", "encoder.layer.0"], "matmul": ["encoder.layer.1"]}):
            with self.subTest(by_policy=by_policy):
                plain, _ = build("tiny-bert")
                ckpt = copy.deepcopy(plain)
                self.assertEqual(ckptune.apply(ckpt.bert, mixed_plan(planned, by_policy)), planned)
                want = {m: p for p, ms in by_policy.items() for m in ms}
                self.assertEqual({m: ckptune.selective_policy(ckpt.bert.get_submodule(m)) for m in planned},
                                 {m: want.get(m) for m in planned})
                self.assert_same_step(plain, ckpt)

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
    """On transformers' own models (the suite's pinned transformers), under each policy and each
    attention implementation: one layer whole and one selective, the gradients equal plain's bit
    for bit. LlamaForCausalLM's KV cache, on by default, makes a selective layer's recompute differ
    from its forward, so `apply` turns it off (with a warning)."""

    def _transformers(self):
        try:
            import transformers
        except ImportError:
            self.fail("transformers missing: run with PYTHONPATH=$(scripts/corpus_packages)")
        return transformers

    def _check_bitwise(self, plain, model, ids, **extra):
        for m in (plain, model):
            torch.manual_seed(1)
            m(input_ids=ids, labels=ids, **extra).loss.backward()
        for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
            self.assertTrue(torch.equal(a.grad, b.grad), name)

    def test_llama_with_its_default_cache_trains_selective_bitwise(self):
        tf = self._transformers()
        for policy in POLICIES:
            for attention in ("sdpa", "eager"):
                with self.subTest(policy=policy, attention=attention):
                    torch.manual_seed(0)
                    cfg = tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1, attn_implementation=attention)
                    plain = tf.LlamaForCausalLM(cfg).train()
                    model = copy.deepcopy(plain)
                    plan = selective_plan(["layers.0", "layers.1"], ["layers.1"], policy)
                    plan["model"] = {"prefix": "model."}
                    with self.assertWarnsRegex(UserWarning, "use_cache=False"):
                        self.assertEqual(ckptune.apply(model, plan), ["layers.0", "layers.1"])
                    self.assertFalse(model.config.use_cache)
                    root = ckptune.plan_root(model, plan)
                    self.assertEqual([ckptune.selective_policy(root.get_submodule(f"layers.{i}")) for i in range(3)],
                                     [None, policy, None])
                    self._check_bitwise(plain, model, torch.randint(0, 100, (2, 12)))

    def test_llama_with_policies_mixed_per_layer_trains_bitwise(self):
        tf = self._transformers()
        for attention in ("sdpa", "eager"):
            with self.subTest(attention=attention):
                torch.manual_seed(0)
                cfg = tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=2, num_key_value_heads=1, attn_implementation=attention,
                                     use_cache=False)
                plain = tf.LlamaForCausalLM(cfg).train()
                model = copy.deepcopy(plain)
                plan = mixed_plan(["layers.0", "layers.1", "layers.2"],
                                  {"attention": ["layers.0"], "matmul": ["layers.2"]})
                plan["model"] = {"prefix": "model."}
                self.assertEqual(ckptune.apply(model, plan), ["layers.0", "layers.1", "layers.2"])
                root = ckptune.plan_root(model, plan)
                self.assertEqual([ckptune.selective_policy(root.get_submodule(f"layers.{i}")) for i in range(3)],
                                 ["attention", None, "matmul"])
                self._check_bitwise(plain, model, torch.randint(0, 100, (2, 12)))

    def test_bert_and_gpt2_train_selective_bitwise_with_dropout(self):
        tf = self._transformers()
        models = {
            "bert": (lambda a: tf.BertForMaskedLM(tf.BertConfig(
                vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                attn_implementation=a)), "bert.", "encoder.layer"),
            "gpt2": (lambda a: tf.GPT2LMHeadModel(tf.GPT2Config(
                vocab_size=100, n_embd=32, n_layer=3, n_head=2, n_positions=32, attn_implementation=a)),
                "transformer.", "h"),
        }
        for (name, (make, prefix, layers)), policy, attention in [
                (m, p, a) for m in models.items() for p in POLICIES for a in ("sdpa", "eager")]:
            with self.subTest(model=name, policy=policy, attention=attention):
                torch.manual_seed(0)
                plain = make(attention).train()
                if hasattr(plain.config, "use_cache"):
                    plain.config.use_cache = False
                model = copy.deepcopy(plain)
                plan = selective_plan([f"{layers}.0", f"{layers}.1"], [f"{layers}.1"], policy)
                plan["model"] = {"prefix": prefix}
                self.assertEqual(ckptune.apply(model, plan), [f"{layers}.0", f"{layers}.1"])
                self._check_bitwise(plain, model, torch.randint(0, 100, (2, 12)))


class RefusalTest(unittest.TestCase):
    def test_unknown_policy(self):
        _, backbone = build("tiny-bert")
        with self.assertRaisesRegex(ValueError, "policy 'attention-core' is not one"):
            ckptune.apply(backbone, selective_plan(["encoder.layer.0"], ["encoder.layer.0"], "attention-core"))
        self.assertNotIn("forward", backbone.get_submodule("encoder.layer.0").__dict__)

    def test_a_module_under_two_policies(self):
        _, backbone = build("tiny-bert")
        plan = mixed_plan(["encoder.layer.0"], {"matmul": ["encoder.layer.0"], "attention": ["encoder.layer.0"]})
        with self.assertRaisesRegex(ValueError, "runs encoder.layer.0 selective under two policies"):
            ckptune.apply(backbone, plan)
        self.assertNotIn("forward", backbone.get_submodule("encoder.layer.0").__dict__)

    def test_selective_module_the_plan_does_not_checkpoint(self):
        _, backbone = build("tiny-bert")
        with self.assertRaisesRegex(ValueError, "runs encoder.layer.1 selective but does not checkpoint"):
            ckptune.apply(backbone, selective_plan(["encoder.layer.0"], ["encoder.layer.1"]))


if __name__ == "__main__":
    unittest.main()
