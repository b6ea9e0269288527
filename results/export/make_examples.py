"""Exports the three example models of results/export/README.md from plain-torch references:
a torchvision-style ViT (VisionTransformer's module names, small), a Hugging Face Llama-style
decoder (LlamaForCausalLM's module names, rotary embeddings computed in each attention, SDPA),
and a CNN with MobileNetV2-style depthwise stages and a DenseNet-style dense block.

    .venv/bin/python results/export/make_examples.py OUTDIR

Each is exported in training mode with a dynamic batch, as the README tells users to.
"""
import sys

import torch
from collections import OrderedDict
from torch import nn
from torch.export import Dim
import torch.nn.functional as F

class MLPBlock(nn.Sequential):
    def __init__(s, d, h):
        super().__init__(nn.Linear(d, h), nn.GELU(), nn.Dropout(0.0), nn.Linear(h, d), nn.Dropout(0.0))

class EncoderBlock(nn.Module):
    def __init__(s, heads, d, h):
        super().__init__()
        s.ln_1 = nn.LayerNorm(d); s.self_attention = nn.MultiheadAttention(d, heads, batch_first=True)
        s.dropout = nn.Dropout(0.1); s.ln_2 = nn.LayerNorm(d); s.mlp = MLPBlock(d, h)
    def forward(s, x):
        y = s.ln_1(x); y, _ = s.self_attention(y, y, y, need_weights=False); x = s.dropout(y) + x
        return x + s.mlp(s.ln_2(x))

class Encoder(nn.Module):
    def __init__(s, n, heads, d, h, seq):
        super().__init__()
        s.pos_embedding = nn.Parameter(torch.empty(1, seq, d).normal_(std=0.02)); s.dropout = nn.Dropout(0.1)
        s.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", EncoderBlock(heads, d, h)) for i in range(n)))
        s.ln = nn.LayerNorm(d)
    def forward(s, x):
        return s.ln(s.layers(s.dropout(x + s.pos_embedding)))

class ViT(nn.Module):  # torchvision VisionTransformer, small
    def __init__(s, image=32, patch=8, n=4, heads=4, d=64, h=128, classes=10):
        super().__init__()
        s.patch = patch; s.d = d
        s.conv_proj = nn.Conv2d(3, d, patch, patch); s.class_token = nn.Parameter(torch.zeros(1, 1, d))
        s.encoder = Encoder(n, heads, d, h, (image // patch) ** 2 + 1); s.heads = nn.Sequential(nn.Linear(d, classes))
    def forward(s, x):
        n = x.shape[0]
        x = s.conv_proj(x).reshape(n, s.d, -1).permute(0, 2, 1)
        x = torch.cat([s.class_token.expand(n, -1, -1), x], dim=1)
        return s.heads(s.encoder(x)[:, 0])

class RMSNorm(nn.Module):
    def __init__(s, d, eps=1e-6):
        super().__init__(); s.weight = nn.Parameter(torch.ones(d)); s.eps = eps
    def forward(s, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return s.weight * (x.float() * torch.rsqrt(v + s.eps)).to(x.dtype)

def rotate_half(x):
    a, b = x.chunk(2, dim=-1); return torch.cat((-b, a), dim=-1)

class Attn(nn.Module):
    def __init__(s, d, heads):
        super().__init__(); s.h = heads; s.hd = d // heads
        s.q_proj = nn.Linear(d, d, bias=False); s.k_proj = nn.Linear(d, d, bias=False); s.v_proj = nn.Linear(d, d, bias=False); s.o_proj = nn.Linear(d, d, bias=False)
    def forward(s, x):
        b, t, d = x.shape
        q = s.q_proj(x).view(b, t, s.h, s.hd).transpose(1, 2); k = s.k_proj(x).view(b, t, s.h, s.hd).transpose(1, 2); v = s.v_proj(x).view(b, t, s.h, s.hd).transpose(1, 2)
        pos = torch.arange(t, device=x.device, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, s.hd, 2, device=x.device, dtype=torch.float32) / s.hd))
        f = torch.outer(pos, inv); emb = torch.cat((f, f), dim=-1); cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin; k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return s.o_proj(o.transpose(1, 2).reshape(b, t, d))

class MLP(nn.Module):
    def __init__(s, d, h):
        super().__init__(); s.gate_proj = nn.Linear(d, h, bias=False); s.up_proj = nn.Linear(d, h, bias=False); s.down_proj = nn.Linear(h, d, bias=False)
    def forward(s, x): return s.down_proj(F.silu(s.gate_proj(x)) * s.up_proj(x))

class Layer(nn.Module):
    def __init__(s, d, heads, h):
        super().__init__(); s.input_layernorm = RMSNorm(d); s.self_attn = Attn(d, heads); s.post_attention_layernorm = RMSNorm(d); s.mlp = MLP(d, h)
    def forward(s, x):
        x = x + s.self_attn(s.input_layernorm(x)); return x + s.mlp(s.post_attention_layernorm(x))

class Model(nn.Module):
    def __init__(s, vocab, d, heads, h, n):
        super().__init__(); s.embed_tokens = nn.Embedding(vocab, d); s.layers = nn.ModuleList([Layer(d, heads, h) for _ in range(n)]); s.norm = RMSNorm(d)
    def forward(s, ids):
        x = s.embed_tokens(ids)
        for l in s.layers: x = l(x)
        return s.norm(x)

class Llama(nn.Module):  # Hugging Face LlamaForCausalLM layout, small; rotary computed per attention
    def __init__(s, vocab=256, d=64, heads=4, h=172, n=4):
        super().__init__(); s.model = Model(vocab, d, heads, h, n); s.lm_head = nn.Linear(d, vocab, bias=False)
    def forward(s, ids): return s.lm_head(s.model(ids))

class DW(nn.Module):
    def __init__(s, c, e):
        super().__init__()
        s.conv = nn.Sequential(nn.Conv2d(c, c*e, 1, bias=False), nn.BatchNorm2d(c*e), nn.ReLU6(inplace=True),
                               nn.Conv2d(c*e, c*e, 3, padding=1, groups=c*e, bias=False), nn.BatchNorm2d(c*e), nn.ReLU6(inplace=True),
                               nn.Conv2d(c*e, c, 1, bias=False), nn.BatchNorm2d(c))
    def forward(s, x): return x + s.conv(x)

class DenseLayer(nn.Module):
    def __init__(s, c, g):
        super().__init__(); s.norm1 = nn.BatchNorm2d(c); s.relu1 = nn.ReLU(inplace=True); s.conv1 = nn.Conv2d(c, g, 3, padding=1, bias=False)
    def forward(s, x): return torch.cat([x, s.conv1(s.relu1(s.norm1(x)))], 1)

class CNN(nn.Module):  # MobileNetV2-style depthwise stages, then a DenseNet-style dense block
    def __init__(s):
        super().__init__()
        s.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True))
        s.features = nn.Sequential(*[DW(16, 4) for _ in range(4)])
        s.denseblock = nn.Sequential(*[DenseLayer(16 + 8*i, 8) for i in range(4)])
        s.pool = nn.AdaptiveAvgPool2d(1); s.classifier = nn.Linear(48, 10)
    def forward(s, x): return s.classifier(torch.flatten(s.pool(s.denseblock(s.features(s.stem(x)))), 1))

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
torch.manual_seed(0)
for name, m, a in [("vit", ViT(), torch.randn(2, 3, 32, 32)), ("llama", Llama(), torch.randint(0, 256, (2, 32))), ("cnn", CNN(), torch.randn(2, 3, 32, 32))]:
    ep = torch.export.export(m.train(), (a,), dynamic_shapes=({0: Dim("batch")},))
    torch.export.save(ep, f"{OUT}/{name}.pt2"); print(name, "ok")
