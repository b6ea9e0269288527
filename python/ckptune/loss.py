"""A causal language model's loss in chunks of tokens, for plans whose config has `loss_chunks`.

`chunked_causal_lm_loss(hidden, weight, labels, chunks)` is Hugging Face's `ForCausalLMLoss` of
`lm_head(hidden)` (labels padded with -100 and shifted by one, mean cross entropy over the
labelled tokens), computed so that the `[tokens, vocab]` logits and their gradient exist for one
chunk of tokens at a time instead of for the whole batch.

It is an autograd Function whose forward runs each chunk's head, cross entropy and gradients
(`torch.autograd.grad` with respect to the chunk's hidden states and the head's weight) and frees
them before the next chunk, and whose backward only scales the two summed gradients in place.
ckptune's runtime runs these operators in this order, so its measured peak is this function's.
The alternative, `torch.utils.checkpoint` around each chunk, computes each chunk's logits twice
(forward, then the recompute) and leaves the order in which the engine frees each chunk's
recomputed tensors and sums the hidden states' gradient (a split's backward holds every
chunk's gradient, then concatenates them) to the engine: more time, and bytes the runtime
could only imitate.
"""

import torch
from torch.nn import functional as F

IGNORE_INDEX = -100


class _ChunkedCausalLmLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunks):
        # Every statement below has its twin in runtime/src/exec/chunked_loss.rs: keep them so.
        shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous().view(-1)
        flat = hidden.detach().view(-1, hidden.shape[-1])
        grad_hidden = torch.empty_like(flat)
        grad_weight = None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        start = 0
        wants_weight = weight.requires_grad
        with torch.enable_grad():
            for rows, targets in zip(flat.chunk(chunks), shift.chunk(chunks)):
                rows = rows.detach().requires_grad_()
                # Views, which autocast does not cache (it caches casts of leaves that require grad):
                # each chunk's casts die with the chunk, cache or no cache.
                loss = F.cross_entropy(F.linear(rows.view_as(rows), weight.view_as(weight)).float(), targets,
                                       ignore_index=IGNORE_INDEX, reduction="sum")
                grads = torch.autograd.grad(loss, (rows, weight) if wants_weight else (rows,))
                total += loss.detach()
                del loss
                grad_hidden[start:start + len(rows)].copy_(grads[0])
                start += len(rows)
                if wants_weight:
                    if grad_weight is None:
                        grad_weight = grads[1]
                    else:
                        grad_weight += grads[1]
                del rows, grads
        count = (shift != IGNORE_INDEX).sum()
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.hidden_shape = hidden.shape
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        factor = grad_output / count
        grad_hidden.mul_(factor)
        if grad_weight is not None:
            grad_weight.mul_(factor)
        return grad_hidden.view(ctx.hidden_shape), grad_weight, None, None


def chunked_causal_lm_loss(hidden, weight, labels, chunks):
    """Mean next-token cross entropy of `hidden @ weight.T` against `labels`, in `chunks` chunks.

    hidden: `[batch, seq, hidden]`, the model's last hidden states (after the final norm);
    weight: `[vocab, hidden]`, the LM head's weight (`model.lm_head.weight`; tied or not);
    labels: `[batch, seq]` token ids, unshifted (as Hugging Face's `labels`), -100 for ignored.
    The tokens of the batch, flattened, are split with `torch.chunk` (chunks of
    ceil(tokens / chunks)). Equal to `ForCausalLMLoss(lm_head(hidden), labels)` up to rounding,
    with the same gradients; its gradients are computed during the forward, so call it where the
    loss will be back-propagated (under `torch.no_grad()` it computes the loss alone).
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks {chunks!r} must be a positive integer")
    if hidden.dim() < 2 or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} plus a hidden "
                         f"dimension")
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        return _loss_only(hidden, weight, labels, chunks)
    return _ChunkedCausalLmLoss.apply(hidden, weight, labels, chunks)


def _loss_only(hidden, weight, labels, chunks):
    """The same loss without gradients (evaluation), chunk by chunk."""
    with torch.no_grad():
        shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous().view(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows, targets in zip(flat.chunk(chunks), shift.chunk(chunks)):
            total += F.cross_entropy(F.linear(rows, weight).float(), targets, ignore_index=IGNORE_INDEX,
                                     reduction="sum")
        return total / (shift != IGNORE_INDEX).sum()
