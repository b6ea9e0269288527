"""`ckptune_harness.eager`, the PyTorch side of `ckptune verify --pytorch`: it follows the plan's config
(optimizer implementation, precision, accumulation, set_to_none) and refuses, before running
anything, what it cannot follow. Needs a checkout (the meter compiles kernels/csrc/shim.cpp).

    .venv/bin/python -m unittest discover -s python/tests
"""

import sys
import unittest
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from ckptune_harness import eager  # noqa: E402
from ckptune_harness.plans import regex_plan  # noqa: E402
from ckptune_harness.reference import matching  # noqa: E402


def plan(modules, **config):
    doc = regex_plan("^(?:" + "|".join(m.replace(".", r"\.") for m in modules) + ")$" if modules else "",
                           modules, micro_batch=2)
    doc["config"].update(config)
    return doc


class RunTest(unittest.TestCase):
    def test_follows_the_plans_config(self):
        r = eager.run("tiny-bert", plan(["encoder.layer.1"], precision="bf16", optimizer="sgd-momentum",
                                        optimizer_impl="foreach", grad_accum=2, set_to_none=False),
                      seq=16, steps=3, warmup=1, threads=1)
        self.assertEqual(r["format"], "ckptune.pytorch-run/1")
        self.assertEqual(r["modules"], ["encoder.layer.1"])
        self.assertEqual((r["precision"], r["optimizer"]), ("bf16", "sgd-momentum"))
        self.assertEqual(r["optimizer_class"], "torch.optim.sgd.SGD")
        self.assertIs(r["optimizer_kwargs"]["foreach"], True)
        self.assertEqual(r["optimizer_kwargs"]["momentum"], 0.9)
        self.assertEqual((r["micro_batch"], r["grad_accum"], r["set_to_none"], r["seq"]), (2, 2, False, 16))
        self.assertEqual(len(r["steps"]), 3)
        self.assertEqual(r["peak_bytes"], max(s["peak_bytes"] for s in r["steps"][1:]))
        # Gradients zeroed in place stay allocated between steps: the level at a step's start
        # after the first is above the first step's (which had none yet).
        self.assertGreater(r["steps"][1]["start_bytes"], r["steps"][0]["start_bytes"])

    def test_runs_decoders_whose_backbone_has_no_config(self):
        # GPT-2's `transformer` and Llama's `model` carry no config; the model around them does.
        for name, layer in [("tiny-gpt2", "h.1"), ("tiny-llama", "model.layers.1")]:
            with self.subTest(name=name):
                r = eager.run(name, plan([layer]), seq=16, steps=2, warmup=1, threads=1)
                self.assertEqual((r["modules"], r["seq"]), ([layer], 16))
                self.assertGreater(r["peak_bytes"], r["steps"][-1]["start_bytes"])

    def test_without_a_sequence_length_a_decoder_runs_at_its_positions(self):
        # tiny-gpt2 has 32 positions: min(128, 32), read from the model around `transformer`.
        r = eager.run("tiny-gpt2", plan(["h.0"]), steps=2, warmup=1, threads=1)
        self.assertEqual(r["seq"], 32)

    def test_refuses_names_that_differ_and_configs_torch_cannot_run(self):
        for name, doc, fragment in [
            ("tiny-gpt2", plan(["encoder.layer.0"]), "matches no module of this model"),
            ("tiny-bert", plan(["encoder.layer.0"], precision="fp16"), "runs on CUDA only"),
            ("tiny-bert", plan(["encoder.layer.0"], optimizer="lion"), "not in torch.optim"),
            ("resnet9", plan([]), "has no plain-torch reference"),
        ]:
            with self.subTest(name=name, fragment=fragment), self.assertRaises(ValueError) as cm:
                eager.run(name, doc, steps=2, warmup=1, threads=1)
            self.assertIn(fragment, str(cm.exception))

    def test_matching_is_a_full_match_over_the_backbones_names(self):
        self.assertEqual(matching("tiny-bert", r"encoder\.layer\.\d"), ["encoder.layer.0", "encoder.layer.1"])
        self.assertEqual(matching("tiny-resnet", "layer1"), ["layer1"])
        self.assertEqual(matching("tiny-resnet", ""), [])


class PytorchBehaviourTest(unittest.TestCase):
    """What PyTorch itself does that results/pytorch-peaks relies on to explain its differences
    from ckptune's predictions, measured with the counting allocator."""

    def test_checkpoint_keeps_saved_wrapped_numbers_until_backward(self):
        from torch.utils.checkpoint import checkpoint

        from ckptune_harness import meter as meter_mod

        meter = meter_mod.Meter(meter_mod.build())
        x = torch.randn(64, requires_grad=True)

        def f(t):
            return (t * 3.0) / 2.0  # mul and div each save their 8-byte wrapped number

        def held(fn):
            before = meter.current()
            y = fn()
            return meter.current() - before - y.numel() * y.element_size()

        with torch.no_grad():
            self.assertEqual(held(lambda: f(x)), 0)
        # Saved-tensor hooks (which drop what a checkpointed forward saves) skip wrapped numbers.
        self.assertEqual(held(lambda: checkpoint(f, x, use_reentrant=False)), 16)

    def test_checkpoint_frees_a_linears_input_before_its_bias_gradient_whole_or_selective(self):
        """A Linear's backward (`AddmmBackward0`) computes the input's gradient and the weight's
        (an `mm` over the saved input), then the bias's (a `sum`). A plain graph holds the saved
        input until the node is done, so the bias gradient is allocated on top of everything the
        `mm` had. `torch.utils.checkpoint`, whole or selective, hands the node its recomputed
        input by unpacking it and keeps no reference itself, so the input is freed after its last
        use, the `mm`, and the `sum` lands that much lower: a backward peaking there is one bias
        gradient lower in PyTorch than in ckptune's recompute, a plain graph (docs/memory-model.md,
        "Where exactness needs care"). That holds for an input the selective cache kept (a
        LayerNorm's output under `attention`, which its recompute takes from the cache) as for one
        it recomputes (GELU's), under either policy."""
        from torch.utils.checkpoint import checkpoint
        from torch.utils._python_dispatch import TorchDispatchMode

        from ckptune.selective import context_fn
        from ckptune_harness import meter as meter_mod

        meter = meter_mod.Meter(meter_mod.build())
        torch.manual_seed(0)
        n, d = 24, 8
        first, last = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        norm = torch.nn.LayerNorm(4 * d)
        feeds = {"gelu": lambda h: torch.nn.functional.gelu(first(h)), "norm": lambda h: norm(first(h))}
        runs = {
            "plain": lambda f, x: f(x),
            "whole": lambda f, x: checkpoint(f, x, use_reentrant=False),
            "matmul": lambda f, x: checkpoint(f, x, use_reentrant=False, context_fn=context_fn("matmul"),
                                              early_stop=False),
            "attention": lambda f, x: checkpoint(f, x, use_reentrant=False, context_fn=context_fn("attention"),
                                                 early_stop=False),
        }

        class Levels(TorchDispatchMode):
            """The meter's level after each operator of the backward, with the node running it."""

            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                node = torch._C._current_autograd_node()
                self.ops.append((func, node.name() if node is not None else None, meter.current()))
                return out

        def bias_step(feed, run):
            """The level the last Linear's bias gradient (`sum`) adds to the level after its weight
            gradient (`mm`)."""
            x = torch.randn(n, d, requires_grad=True)
            y = run(lambda h: last(feeds[feed](h)), x)
            with Levels() as levels:
                y.sum().backward()
            ops = levels.ops
            at = next(i for i, (f, node, _) in enumerate(ops)
                      if f is torch.ops.aten.sum.dim_IntList and node == "AddmmBackward0")
            mm = max(i for i in range(at) if ops[i][0] is torch.ops.aten.mm.default)
            return ops[at][2] - ops[mm][2]

        bias, linear_input = d * 4, n * 4 * d * 4
        for feed in feeds:
            for name, run in runs.items():
                with self.subTest(feed=feed, run=name):
                    freed = 0 if name == "plain" else linear_input
                    self.assertEqual(bias_step(feed, run), bias - freed)

    def test_a_boundary_view_casts_as_a_layer_output_and_a_plain_leaf_does_not(self):
        """A BERT layer under bf16 autocast reading ckptune's block input (runtime/src/exec/
        boundary.rs: a view of the detached output, made to require grad), the previous layer's
        output (what the reference's layer reads) and a plain leaf that requires grad (a boundary
        that is no view). Autocast caches the cast of a leaf that requires grad and is no view:
        the plain leaf's three projections share one cached cast, which a no-grad forward keeps
        while the region is open, where an output is cast anew by each projection and, without
        grad, kept by none; with grad the three casts are saved, two more than the shared one.
        With the cache off the three inputs allocate alike. The boundary view allocates what the
        output does, to the byte, with the cache on and off, and its input and weight gradients
        are the output's bit for bit (the projections' gradients summed in f32), where with the
        cache on the plain leaf's input gradient differs (summed in bf16 through its one cast)."""
        from ckptune_harness import meter as meter_mod
        from ckptune_harness import reference

        meter = meter_mod.Meter(meter_mod.build())
        ref = reference.load()
        torch.manual_seed(0)
        model, _ = ref.build("tiny-bert", "sdpa")
        layer = model.bert.encoder.layer[0].eval()  # no dropout: the runs allocate alike
        config = model.bert.config
        batch, seq, hidden = 2, 16, config.hidden_size
        cast = batch * seq * hidden * 2  # one bf16 cast of the layer's input
        ids = torch.randint(config.vocab_size, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, seq - 4:] = 0
        with torch.no_grad():
            h = model.bert.embeddings(ids)
            m = ref.sdpa_mask(mask, seq, False, h.device)
        grad_out = torch.randn(batch, seq, hidden)

        def run(kind, grad, cache):
            start = h.detach()
            if kind == "leaf":
                x = start.requires_grad_(True)
            elif kind == "view":
                x = start.view_as(start).requires_grad_(True)
            else:
                start.requires_grad_(True)
                x = start * 1.0  # an output, as the previous layer's is
            layer.zero_grad(set_to_none=True)
            meter.reset_peak()
            before = meter.current()
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16,
                                                              cache_enabled=cache):
                y = layer(x, m)[0]
                held = meter.current() - before
                peak = meter.peak() - before
            grads = []
            if grad:
                y.backward(grad_out.to(y.dtype))
                grads = [start.grad if kind == "output" else x.grad] + [p.grad for p in layer.parameters()]
            del y
            return held, peak, grads

        for grad in (False, True):
            for cache in (True, False):
                with self.subTest(grad=grad, cache=cache):
                    leaf_held, leaf_peak, leaf_grads = run("leaf", grad, cache)
                    view_held, view_peak, view_grads = run("view", grad, cache)
                    out_held, out_peak, out_grads = run("output", grad, cache)
                    self.assertEqual((view_held, view_peak), (out_held, out_peak))
                    for a, b in zip(view_grads, out_grads):
                        self.assertTrue(torch.equal(a, b))
                    if not cache:  # nothing cached: any input casts alike
                        self.assertEqual((leaf_held, leaf_peak), (out_held, out_peak))
                    elif grad:
                        self.assertEqual(out_held - leaf_held, 2 * cast)
                        self.assertEqual(out_peak - leaf_peak, 2 * cast)
                        # The shared cast sums the projections' input gradients in bf16.
                        self.assertFalse(torch.equal(leaf_grads[0], out_grads[0]))
                    else:
                        self.assertEqual(leaf_held - out_held, cast)

    def test_checkpoint_recomputes_from_the_saved_input_not_a_leaf(self):
        """Autocast would cache a leaf's cast: the recompute's input is the forward's own tensor."""
        from torch.utils.checkpoint import checkpoint

        seen = []

        def f(t):
            seen.append(t.is_leaf)
            return (t * t).sum()  # saves t: the backward recomputes

        x = torch.randn(4, requires_grad=True) * 1.0
        checkpoint(f, x, use_reentrant=False).backward()
        self.assertEqual(seen, [False, False])


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
