"""scripts/bert_differences.py reads the moment labels of a sweep and of a sharded plan: each kind
of label lands on the holders docs/memory-model.md names (BERT-base's sizes at micro-batch 4,
sequence 128, as results/fsdp runs it)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import bert_differences as bd  # noqa: E402

CKPT = ["encoder.layer.1", "encoder.layer.2", "encoder.layer.4", "encoder.layer.6", "encoder.layer.10"]
ADDITIVE, BOOL = 4 * 128 * 4, 4 * 128 * 128


class MaskTest(unittest.TestCase):
    def mask(self, moment, ckpt=(), attention="sdpa"):
        return bd.mask_bytes(moment, list(ckpt), attention, 4, 128)

    def test_nothing_checkpointed_pytorch_frees_both_masks_with_the_forward(self):
        for m in ("rank 0: prefetch encoder.layer.10 (encoder.layer.11 pre-backward)",
                  "first micro-step: backward encoder.layer.11", "loss", "rank 1: copy-out encoder.layer.3 (pre-backward)",
                  "rank 0: reduce-scatter encoder.layer.5", "prefetch encoder.layer.11 (root pre-backward)"):
            self.assertEqual(self.mask(m), -(ADDITIVE + BOOL), m)

    def test_a_checkpointed_layer_keeps_the_bool_mask_until_its_backward(self):
        self.assertEqual(self.mask("rank 0: backward encoder.layer.10", CKPT), -ADDITIVE)
        self.assertEqual(self.mask("backward encoder.layer.1", CKPT), -ADDITIVE)
        self.assertEqual(self.mask("backward encoder.layer.0", CKPT), -(ADDITIVE + BOOL))
        self.assertEqual(self.mask("loss", CKPT), -ADDITIVE)

    def test_eager_attention_has_the_additive_mask_alone(self):
        self.assertEqual(self.mask("backward encoder.layer.11", attention="eager"), -ADDITIVE)
        self.assertEqual(self.mask("backward encoder.layer.10", CKPT, attention="eager"), 0)

    def test_from_the_end_of_backward_on_and_before_the_forward_neither_holds_one(self):
        for m in ("optimizer step", "rank 2: optimizer", "end of backward", "rank 0: reduce-scatter <root>",
                  "all-gather <root>", "copy-out <root>"):
            self.assertEqual(self.mask(m, CKPT), 0, m)

    def test_forward_moments_hold_both_but_sdpa_builds_its_mask_after_the_embeddings(self):
        self.assertEqual(self.mask("first micro-step: forward encoder.layer.3"), -ADDITIVE)
        self.assertEqual(self.mask("rank 0: all-gather encoder.layer.3"), -ADDITIVE)
        self.assertEqual(self.mask("first micro-step: forward embeddings"), -(ADDITIVE + BOOL))
        self.assertEqual(self.mask("forward embeddings", attention="eager"), 0)


class BiasTest(unittest.TestCase):
    def test_only_a_checkpointed_layers_own_backward_in_fp32(self):
        self.assertEqual(bd.bias_bytes("rank 0: backward encoder.layer.10", CKPT, "fp32", 768), -3072)
        self.assertEqual(bd.bias_bytes("backward encoder.layer.11", CKPT, "fp32", 768), 0)
        self.assertEqual(bd.bias_bytes("recompute encoder.layer.10", CKPT, "fp32", 768), 0)
        self.assertEqual(bd.bias_bytes("reduce-scatter encoder.layer.10", CKPT, "fp32", 768), 0)
        self.assertEqual(bd.bias_bytes("backward encoder.layer.10", CKPT, "bf16", 768), 0)
        self.assertEqual(bd.bias_bytes("backward pooler", ["pooler"], "fp32", 768), 0)


if __name__ == "__main__":
    unittest.main()
