"""`ckptune.chunked_causal_lm_loss` against the reference language models' own loss
(models/fixtures/reference.py: `lm_head` and `ForCausalLMLoss`): the loss and every gradient
equal to rounding, for chunk counts that divide the tokens and one that does not, tied and untied
heads, fp32 and bf16 autocast; and `training_config`'s `loss_chunks`. Run from the repository
root:

    .venv/bin/python -m unittest discover -s python/tests
"""

import sys
import unittest
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# test_companion's set-up puts the checkout's python/ on the path and takes one thread.
from test_companion import make_plan, reference  # noqa: E402, I001

import ckptune  # noqa: E402

# Chunks sum the same products in another order (per chunk, then the chunks; the gradients
# scaled by 1/tokens after the sum), so results agree to rounding: within this fraction of the
# largest element, in fp32, and in bf16 autocast (8 bits of mantissa in every matmul).
TOLERANCE = {None: 1e-5, torch.bfloat16: 2e-2}


def _batch(vocab, batch=2, seq=16):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(vocab, (batch, seq), generator=gen)
    labels = torch.randint(vocab, (batch, seq), generator=gen)
    labels[0, 3:6] = -100  # ignored tokens, as a user's padding would be
    return ids, labels, torch.ones(batch, seq, dtype=torch.long)


def _run(name, chunks, dtype):
    """The loss and the named gradients of one step of the reference `name`."""
    torch.manual_seed(0)
    model, _ = reference.build(name)
    model.eval()  # no dropout: both runs see the same activations
    base = getattr(model, "transformer", None) or model.model
    ids, labels, mask = _batch(model.config.vocab_size)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None, cache_enabled=False):
        if chunks is None:
            loss = model(ids, labels, attention_mask=mask)[1]
        else:
            hidden = base(ids, mask)
            loss = ckptune.chunked_causal_lm_loss(hidden, model.lm_head.weight, labels, chunks)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


class ChunkedLossTest(unittest.TestCase):
    def test_equals_the_whole_loss_and_its_gradients(self):
        for name in ["tiny-gpt2", "tiny-llama", "tiny-qwen2"]:  # tied, untied, tied
            for dtype, tol in TOLERANCE.items():
                whole, plain = _run(name, None, dtype)
                for chunks in [1, 4, 7]:  # 32 tokens: 7 chunks of 5, the last of 2
                    with self.subTest(model=name, dtype=dtype, chunks=chunks):
                        loss, grads = _run(name, chunks, dtype)
                        self.assertLessEqual(abs(loss - whole), tol * abs(whole))
                        self.assertEqual(plain.keys(), grads.keys())
                        for n, g in plain.items():
                            scale = g.abs().max().item()
                            self.assertLessEqual((g - grads[n]).abs().max().item(), tol * scale, n)

    def test_frozen_head_and_no_grad(self):
        torch.manual_seed(0)
        hidden = torch.randn(2, 8, 16, requires_grad=True)
        weight = torch.randn(50, 16)  # frozen: no gradient is computed for it
        labels = torch.randint(50, (2, 8))
        ref_hidden = hidden.detach().clone().requires_grad_()
        logits = (ref_hidden @ weight.T).view(-1, 50)
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
        expected = torch.nn.functional.cross_entropy(logits, shift, ignore_index=-100)
        expected.backward()
        loss = ckptune.chunked_causal_lm_loss(hidden, weight, labels, 3)
        loss.backward()
        self.assertAlmostEqual(loss.item(), expected.item(), places=5)
        torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            self.assertAlmostEqual(ckptune.chunked_causal_lm_loss(hidden, weight, labels, 3).item(),
                                   expected.item(), places=5)

    def test_bad_arguments(self):
        hidden, weight, labels = torch.randn(2, 8, 16), torch.randn(50, 16), torch.randint(50, (2, 8))
        with self.assertRaisesRegex(ValueError, "chunks 0"):
            ckptune.chunked_causal_lm_loss(hidden, weight, labels, 0)
        with self.assertRaisesRegex(ValueError, r"hidden \(2, 8, 16\) must be labels \(2, 7\)"):
            ckptune.chunked_causal_lm_loss(hidden, weight, labels[:, :7], 2)


class TrainingConfigTest(unittest.TestCase):
    def plan(self, **config):
        return make_plan([], **config)

    def test_loss_chunks(self):
        self.assertEqual(ckptune.training_config(self.plan()).loss_chunks, 1)  # plans before the choice
        self.assertEqual(ckptune.training_config(self.plan(loss_chunks=8)).loss_chunks, 8)
        with self.assertRaisesRegex(ValueError, "loss_chunks 0"):
            ckptune.training_config(self.plan(loss_chunks=0))


if __name__ == "__main__":
    unittest.main()
