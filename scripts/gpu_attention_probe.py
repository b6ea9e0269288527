"""What torch.nn.functional.scaled_dot_product_attention allocates on a GPU, forward and backward,
and what it saves for backward, recorded by the caching allocator's history; the source of
kernels/tests/fixtures/efficient_attention_h200.json (reduced to names, sizes and events), which
models/src/sdpa_tests.rs holds the meta device's CUDA attention to.

    python3 scripts/gpu_attention_probe.py OUT.json      # on a machine with a GPU
"""
import json, sys, torch, torch.nn.functional as F
dev = torch.device("cuda", 0)
out = []
def history(fn):
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000, context=None)
    r = fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    ev = [(e["action"], e["size"], e["addr"]) for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    return r, ev
def case(name, dtype, B, H, S, D, mask, causal, p, separate=True):
    torch.manual_seed(0)
    x = [torch.randn(B, S, H * D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)]
    q, k, v = [t.view(B, S, H, D).transpose(1, 2) for t in x]
    m = None
    if mask:
        pad = torch.ones(B, S, dtype=torch.bool, device=dev); pad[1::2, S - S // 4:] = False
        m = (torch.ones((), dtype=torch.bool, device=dev) & (torch.arange(S, device=dev).view(1,1,S,1) >= 0)) & pad.view(B,1,1,S)
        m = m.expand(B, -1, S, S)
    choice = torch._fused_sdp_choice(q, k, v, m, p, causal)
    o, fwd = history(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, is_causal=causal))
    gf = o.grad_fn
    saved = {a: (tuple(getattr(gf, a).shape), str(getattr(gf, a).dtype), getattr(gf, a).device.type) for a in dir(gf) if a.startswith("_saved_") and torch.is_tensor(getattr(gf, a, None))}
    scalars = {a: repr(getattr(gf, a)) for a in dir(gf) if a.startswith("_saved_") and not torch.is_tensor(getattr(gf, a, None))}
    g = torch.randn_like(o)
    _, bwd = history(lambda: o.backward(g))
    out.append(dict(name=name, dtype=str(dtype), shape=[B,H,S,D], mask=mask, causal=causal, p=p, choice=int(choice), grad_fn=type(gf).__name__,
                    out_shape=list(o.shape), out_stride=list(o.stride()), saved=saved, scalars=scalars, fwd=fwd, bwd=bwd,
                    q_grad_stride=list(x[0].grad.stride())))
    print(name, choice, type(gf).__name__, "fwd", [(a, s) for a, s, _ in fwd], "\n   bwd", [(a, s) for a, s, _ in bwd], "\n   saved", saved, scalars, flush=True)
case("bert-fp32-mask", torch.float32, 16, 12, 512, 64, True, False, 0.1)
case("bert-fp32-nomask", torch.float32, 16, 12, 512, 64, False, False, 0.1)
case("bert-fp32-mask-p0", torch.float32, 16, 12, 512, 64, True, False, 0.0)
case("llama-fp32-causal", torch.float32, 2, 32, 1024, 64, False, True, 0.0)
case("llama-fp32-mask", torch.float32, 2, 32, 1024, 64, True, False, 0.0)
case("bert-fp32-s100", torch.float32, 4, 12, 100, 64, True, False, 0.1)
case("bert-bf16-mask", torch.bfloat16, 16, 12, 512, 64, True, False, 0.1)
case("llama-bf16-causal", torch.bfloat16, 2, 32, 1024, 64, False, True, 0.0)
case("llama-bf16-mask", torch.bfloat16, 2, 32, 1024, 64, True, False, 0.0)
case("tiny-fp32-mask", torch.float32, 4, 2, 32, 16, True, False, 0.1)
json.dump(out, open(sys.argv[1], "w"))
