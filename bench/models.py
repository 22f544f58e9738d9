"""The model suite shared by the demo, the benchmarks and the end-to-end tests.

Small, dependency-free definitions of the model families gpuautograd must cover: an MLP, a small
CNN, a GPT-style block (layer norm, causal attention, GELU MLP), a Llama-style block (RMSNorm
written as pow/mean/rsqrt, SiLU-gated MLP), a mixture-of-experts block (softmax + topk routing), an
LSTM language model and a message-passing GNN layer (scatter_reduce and index_add). Each `make_*`
returns (model, make_batch, loss_fn).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, d_out=10, dropout=0.1):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = self.drop(F.relu(self.fc1(x)))
        x = F.gelu(self.fc2(x), approximate="tanh")
        x = torch.tanh(x) + torch.sigmoid(x) * F.silu(x)
        return self.fc3(F.gelu(x))


class SmallCNN(nn.Module):
    def __init__(self, channels=3, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=1, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.conv3 = nn.Conv1d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.adaptive_avg_pool2d(x, (2, 2))
        x = torch.flatten(x, 2)  # (B, 16, 4): a 1-D signal per channel
        x = self.conv3(x).mean(-1)
        return self.head(torch.flatten(x, 1))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class ManualCausalSelfAttention(CausalSelfAttention):
    """The same attention written out: matmul, masked_fill, softmax (the nodes older GPTs use)."""

    def forward(self, x):
        B, T, C = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, h, C // h).permute(0, 2, 1, 3) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // h))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self, d_model=64, n_heads=4, manual_attention=False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        attn = ManualCausalSelfAttention if manual_attention else CausalSelfAttention
        self.attn = attn(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=96, d_model=64, n_heads=4, n_layers=2, max_len=64, manual_attention=False, checkpoint_blocks=False):
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks  # non-reentrant activation checkpointing per block
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, manual_attention) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return self.head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, d_model=64, n_heads=4, hidden=172):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = RMSNorm(d_model)
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = RMSNorm(d_model)
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class MoEBlock(nn.Module):
    """A token-choice mixture of experts: softmax router, top-k experts per token with renormalized
    weights, SiLU MLP experts, plus the usual load-balancing loss on the router's probabilities."""

    def __init__(self, d_model=32, n_experts=4, top_k=2, hidden=48, classes=10):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts)
        self.up = nn.ModuleList(nn.Linear(d_model, hidden) for _ in range(n_experts))
        self.down = nn.ModuleList(nn.Linear(hidden, d_model) for _ in range(n_experts))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x):
        tokens = self.norm(x.flatten(0, 1))
        probs = self.router(tokens).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(1, chosen, weights)  # (tokens, experts), k nonzero per row
        experts = torch.stack([down(F.silu(up(tokens))) for up, down in zip(self.up, self.down)], 1)
        mixed = tokens + (gates.unsqueeze(-1) * experts).sum(1)
        balance = (probs.mean(0) * gates.gt(0).to(probs.dtype).mean(0)).sum() * probs.shape[-1]
        return self.head(mixed).view(*x.shape[:2], -1), balance


class LSTMLanguageModel(nn.Module):
    """Embedding, a 2-layer LSTM, a linear head. On the CPU in float32 torch runs the LSTM as
    oneDNN's fused layer; in float64 it is matmuls, gates and unsafe_chunk."""

    def __init__(self, vocab=64, d_model=32, hidden=48, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.lstm = nn.LSTM(d_model, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        out, _ = self.lstm(self.tok(idx))
        return self.head(out)


class MessagePassingLayer(nn.Module):
    """One GNN layer over an edge list: messages from source nodes, aggregated at their targets by
    mean (scatter_reduce) and by sum (index_add), then a node update and a classifier."""

    def __init__(self, d_in=16, d_hidden=24, classes=5):
        super().__init__()
        self.message = nn.Linear(d_in, d_hidden)
        self.update = nn.Linear(d_in + 2 * d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, classes)

    def forward(self, x, src, dst):
        msg = F.relu(self.message(x[src]))
        index = dst.unsqueeze(1).expand_as(msg)
        base = torch.zeros(x.shape[0], msg.shape[1], dtype=msg.dtype, device=msg.device)
        mean = base.scatter_reduce(0, index, msg, "mean", include_self=False)
        total = base.index_add(0, dst, msg)
        h = torch.tanh(self.update(torch.cat([x, mean, total], 1)))
        return self.head(h)


class WaveformNet(nn.Module):
    """A small waveform-to-waveform model (two 1-d convolutions), the generator side of a vocoder."""

    def __init__(self, channels=8):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, channels, 5, padding=2), nn.Tanh(), nn.Conv1d(channels, 1, 5, padding=2))

    def forward(self, x):
        return self.net(x.unsqueeze(1)).squeeze(1)


def stft_magnitude(x, n_fft: int, hop: int):
    """|STFT| with a Hann window: frames by unfold (torch.stft's own framing is an as_strided view,
    whose backward only the native walker can see through), then rfft."""
    window = torch.hann_window(n_fft, dtype=x.dtype, device=x.device)
    return torch.fft.rfft(x.unfold(-1, n_fft, hop) * window).abs()


def multi_resolution_stft_loss(pred, target, resolutions=((32, 8), (64, 16))):
    """The vocoder loss: spectral convergence plus log-magnitude distance, at several resolutions."""
    loss = 0.0
    for n_fft, hop in resolutions:
        p = stft_magnitude(pred, n_fft, hop).clamp_min(1e-3)
        t = stft_magnitude(target, n_fft, hop).clamp_min(1e-3)
        # (the log distance squared: the usual L1 flips its sign where two runs differ by rounding)
        loss = loss + torch.linalg.vector_norm(t - p) / torch.linalg.vector_norm(t) + F.mse_loss(p.log(), t.log())
    return loss


class SpectralConv2d(nn.Module):
    """A Fourier layer's spectral convolution: rfft2, the low modes mixed across channels by complex
    weights (a complex parameter), zero-padded back, irfft2."""

    def __init__(self, channels, modes):
        super().__init__()
        self.modes = modes
        scale = 1.0 / (channels * channels)
        self.weight = nn.Parameter(scale * torch.randn(channels, channels, modes, modes, dtype=torch.complex64))

    def forward(self, x):
        h, w = x.shape[-2:]
        m = self.modes
        low = torch.fft.rfft2(x)[..., :m, :m]
        mixed = torch.einsum("bixy,ioxy->boxy", low, self.weight)
        return torch.fft.irfft2(F.pad(mixed, (0, w // 2 + 1 - m, 0, h - m)), s=(h, w))


class FourierNeuralOperator(nn.Module):
    """FNO-2d: lift, Fourier layers (spectral convolution plus a 1x1 linear path, GELU), project."""

    def __init__(self, channels=8, modes=4, layers=2):
        super().__init__()
        self.lift = nn.Linear(3, channels)
        self.spectral = nn.ModuleList(SpectralConv2d(channels, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(channels, channels, 1) for _ in range(layers))
        self.project = nn.Linear(channels, 1)

    def forward(self, a):  # a: (batch, h, w, 3) -> (batch, h, w)
        x = self.lift(a).permute(0, 3, 1, 2)
        for spectral, pointwise in zip(self.spectral, self.pointwise):
            x = F.gelu(spectral(x) + pointwise(x))
        return self.project(x.permute(0, 2, 3, 1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# Model factories: (model, make_batch(generator) -> inputs tuple, loss_fn(model, *inputs) -> loss)


def make_mlp(dtype=torch.float32, device="cpu", batch=16):
    model = MLP().to(device, dtype)

    def make_batch(g):
        x = torch.randn(batch, 32, generator=g).to(device, dtype)
        y = torch.randint(0, 10, (batch,), generator=g).to(device)
        return x, y

    return model, make_batch, lambda m, x, y: F.cross_entropy(m(x), y)


def make_cnn(dtype=torch.float32, device="cpu", batch=4):
    model = SmallCNN().to(device, dtype)

    def make_batch(g):
        x = torch.randn(batch, 3, 16, 16, generator=g).to(device, dtype)
        y = torch.randint(0, 10, (batch,), generator=g).to(device)
        return x, y

    return model, make_batch, lambda m, x, y: F.cross_entropy(m(x), y)


def make_gpt(dtype=torch.float32, device="cpu", batch=2, seq=32, d_model=64, n_layers=2, manual_attention=False, checkpoint_blocks=False):
    model = TinyGPT(d_model=d_model, n_layers=n_layers, max_len=seq, manual_attention=manual_attention, checkpoint_blocks=checkpoint_blocks)
    model = model.to(device, dtype)

    def make_batch(g):
        idx = torch.randint(0, 96, (batch, seq + 1), generator=g).to(device)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    return model, make_batch, lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten())


def make_llama(dtype=torch.float32, device="cpu", batch=2, seq=32, d_model=64):
    model = LlamaBlock(d_model=d_model).to(device, dtype)

    def make_batch(g):
        return (torch.randn(batch, seq, d_model, generator=g).to(device, dtype),)

    return model, make_batch, lambda m, x: m(x).float().pow(2).mean()


def make_moe(dtype=torch.float32, device="cpu", batch=2, seq=16, d_model=32):
    model = MoEBlock(d_model=d_model).to(device, dtype)

    def make_batch(g):
        x = torch.randn(batch, seq, d_model, generator=g).to(device, dtype)
        y = torch.randint(0, 10, (batch, seq), generator=g).to(device)
        return x, y

    def loss_fn(m, x, y):
        logits, balance = m(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.01 * balance

    return model, make_batch, loss_fn


def make_lstm_lm(dtype=torch.float32, device="cpu", batch=2, seq=16, d_model=32):
    model = LSTMLanguageModel(d_model=d_model).to(device, dtype)

    def make_batch(g):
        idx = torch.randint(0, 64, (batch, seq + 1), generator=g).to(device)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    return model, make_batch, lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten())


def make_gnn(dtype=torch.float32, device="cpu", nodes=40, edges=160):
    model = MessagePassingLayer().to(device, dtype)

    def make_batch(g):
        x = torch.randn(nodes, 16, generator=g).to(device, dtype)
        src = torch.randint(0, nodes, (edges,), generator=g).to(device)
        dst = torch.randint(0, nodes, (edges,), generator=g).to(device)
        y = torch.randint(0, 5, (nodes,), generator=g).to(device)
        return x, src, dst, y

    return model, make_batch, lambda m, x, src, dst, y: F.cross_entropy(m(x, src, dst), y)


def make_stft_loss(dtype=torch.float32, device="cpu", batch=2, samples=256):
    model = WaveformNet().to(device, dtype)

    def make_batch(g):
        t = torch.linspace(0, 1, samples)
        target = torch.sin(2 * math.pi * 13 * t) + 0.1 * torch.randn(batch, samples, generator=g)
        return torch.randn(batch, samples, generator=g).to(device, dtype), target.to(device, dtype)

    return model, make_batch, lambda m, x, y: multi_resolution_stft_loss(m(x), y)


def _complex_of(dtype):
    """The complex dtype a model of real `dtype` keeps its complex weights in (complex64 below float64)."""
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def make_fno(dtype=torch.float32, device="cpu", batch=2, size=16):
    model = FourierNeuralOperator().to(device)
    for p in model.parameters():  # Module.to(dtype) would drop a complex weight's imaginary part
        p.data = p.data.to(_complex_of(dtype) if p.is_complex() else dtype)

    def make_batch(g):
        grid = torch.randn(batch, size, size, 3, generator=g)
        return grid.to(device, dtype), grid.sum(-1).sin().to(device, dtype)

    return model, make_batch, lambda m, a, u: F.mse_loss(m(a), u)


SUITE = {
    "mlp": make_mlp,
    "cnn": make_cnn,
    "gpt": make_gpt,
    "gpt-manual-attn": lambda **kw: make_gpt(manual_attention=True, **kw),
    "llama": make_llama,
    "moe": make_moe,
    "lstm-lm": make_lstm_lm,
    "gnn": make_gnn,
    "stft-loss": make_stft_loss,
    "fno": make_fno,
}

# Models outside the suite (the suite's loops and tests expect graphs without opaque nodes):
# gpt with each block checkpointed, whose checkpointed nodes run opaque.
CHECKPOINTED = {
    "gpt-ckpt": lambda **kw: make_gpt(checkpoint_blocks=True, **kw),
}
