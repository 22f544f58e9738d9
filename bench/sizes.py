"""Training sizes: models at the sizes people train on one GPU, for `python -m bench --size NAME`.

- `gpt2-small`: GPT-2 small (12 layers, d_model 768, 12 heads, seq 1024, vocab 50257, LM head
  tied to the token embedding): 124,439,808 parameters, as the released checkpoint has.
- `llama-1b`: a TinyLlama-1.1B-shaped Llama (22 layers, d_model 2048, 32 heads over 4 KV heads,
  SwiGLU hidden 5632, rotary, RMSNorm, vocab 32000, untied head): 1,100,048,384 parameters.

Plain torch modules; GPT-2 reuses the blocks of bench/models.py. Each size knows its default
batch and sequence per device: on CUDA what fills an H200 in bf16, on the CPU what plans in minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .models import RMSNorm, TinyGPT


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    max_len: int = 1024


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    d_model: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 4
    n_layers: int = 22
    hidden: int = 5632
    max_len: int = 2048
    rope_base: float = 10000.0


class GPT2(TinyGPT):
    def __init__(self, cfg: GPTConfig):
        super().__init__(vocab=cfg.vocab, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers, max_len=cfg.max_len)
        self.tie()

    def tie(self) -> None:
        """GPT-2 ties its LM head to the token embedding (again after to_empty(), which unties)."""
        self.head.weight = self.tok.weight


def build_gpt(cfg: GPTConfig) -> nn.Module:
    return GPT2(cfg)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the half-split form (Llama's rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GQAttention(nn.Module):
    """Causal attention with grouped KV heads: each KV head serves n_heads / n_kv_heads query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = self.n_heads // self.n_kv  # KV heads repeated by expand + reshape: no enable_gqa needed
        k, v = (t[:, :, None].expand(B, self.n_kv, group, T, self.head_dim).reshape(B, self.n_heads, T, self.head_dim) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.d_model, eps=1e-5), GQAttention(cfg)
        self.norm2 = RMSNorm(cfg.d_model, eps=1e-5)
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden, cfg.d_model, bias=False)  # down

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, eps=1e-5)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head_dim, self.rope_base = cfg.d_model // cfg.n_heads, cfg.rope_base
        # buffers, not parameters: they follow .to(device, dtype) and get no gradient
        self.register_buffer("cos", torch.empty(cfg.max_len, self.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.max_len, self.head_dim), persistent=False)
        self.reset_rotary()

    def reset_rotary(self) -> None:
        """Fill the rotary tables in float32."""
        inv_freq = self.rope_base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = torch.outer(torch.arange(self.cos.shape[0], dtype=torch.float32), inv_freq).repeat(1, 2)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, idx):
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def gpt_params(cfg: GPTConfig) -> int:
    """The parameter count by formula (the head is the embedding, counted once)."""
    d = cfg.d_model
    per_layer = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab * d + cfg.max_len * d + cfg.n_layers * per_layer + 2 * d


def llama_params(cfg: LlamaConfig) -> int:
    d, kv = cfg.d_model, cfg.n_kv_heads * (cfg.d_model // cfg.n_heads)
    per_layer = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * cfg.hidden
    return 2 * cfg.vocab * d + cfg.n_layers * per_layer + d


@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int


@dataclass(frozen=True)
class Size:
    name: str
    config: object
    build: Callable[[object], nn.Module]
    count: Callable[[object], int]  # the parameter count by formula
    shapes: dict[str, Shape] = field(default_factory=dict)  # device -> default batch and sequence
    description: str = ""
    # CPU steps (bench/training_plan.py) left out unless asked for by --modes, with why
    cpu_left_out: dict[str, str] = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return self.config.vocab

    def with_config(self, **changes) -> Size:
        """The same size with some config fields changed (tests shrink the layers and the vocab)."""
        return replace(self, config=replace(self.config, **changes))

    def make(self, device: str, dtype: torch.dtype, batch: int, seq: int, seed: int = 0):
        """(model, make_batch(generator) -> (inputs, targets), loss_fn(model, inputs, targets))."""
        if seq > self.config.max_len:
            raise ValueError(f"{self.name}: seq {seq} is longer than its max_len {self.config.max_len}")
        torch.manual_seed(seed)
        with torch.device("meta"):  # no default init: _init draws every value once, on the device
            model = self.build(self.config)
        model = model.to_empty(device=device)
        if hasattr(model, "tie"):
            model.tie()
        _init(model, seed)
        if hasattr(model, "reset_rotary"):
            model.reset_rotary()
        model = model.to(dtype)
        vocab = self.vocab

        def make_batch(g):
            idx = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
            return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

        def loss_fn(m, x, y):
            return F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())

        return model, make_batch, loss_fn


def _init(model: nn.Module, seed: int) -> None:
    """GPT-2's init (normal 0.02, zero biases, unit norms), drawn on the parameters' device (1.1B
    draws on the CPU take tens of seconds; on a GPU, milliseconds)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


# Default shapes, estimated (no GPU run yet). CUDA: bf16 autocast on an H200 (about 139 GiB), with
# headroom for modes that hold more than eager (compiled graphs' pools, a plan's arena).
# gpt2-small at 32 x 1024 = 32k tokens: ~1.5 GB of saved activations per layer (fp32 residual and
# norms, bf16 matmul inputs, 4x MLP), 12 layers ~18 GB, plus the logits of 32k tokens x 50257 in
# bf16 and fp32, log-softmax and gradient (~23 GB): about 45 GB with weights and AdamW state.
# llama-1b at 6 x 2048 = 12k tokens: fp32 weights, gradients and AdamW state 17.6 GB, ~2 GB of
# activations per layer x 22, logits of 12k x 32000 (~5 GB with their fp32 copies): about 65 GB.
# CPU: batch 1, fp32; llama-1b at seq 256 so that the plan's run stays in minutes and the process
# under ~16 GB (weights, eager's and the plan's gradients: 3 x 4.4 GB).
SIZES: dict[str, Size] = {
    "gpt2-small": Size(
        "gpt2-small",
        GPTConfig(),
        build_gpt,
        gpt_params,
        {"cuda": Shape(32, 1024), "cpu": Shape(1, 1024)},
        "GPT-2 small: 12 layers, d_model 768, 12 heads, vocab 50257, tied head (124M)",
    ),
    "llama-1b": Size(
        "llama-1b",
        LlamaConfig(),
        Llama,
        llama_params,
        {"cuda": Shape(6, 2048), "cpu": Shape(1, 256)},
        "Llama 1.1B: 22 layers, d_model 2048, 32 heads / 4 KV heads, SwiGLU 5632, rotary, vocab 32000",
        {
            "plan-run": "left out by default at 1.1B parameters: it took over 20 GB of RSS (fp32 weights, eager's gradients, "
            "the plan's gradients, the bound plan's static copies of the weight gradients; 4.4 GB each); --modes plan-run runs it"
        },
    ),
}


def get_size(name: str) -> Size:
    try:
        return SIZES[name]
    except KeyError:
        raise ValueError(f"unknown size {name!r}; known: {', '.join(SIZES)}") from None


def count_params(model: nn.Module) -> int:
    """Distinct parameters (a tied weight once), as model.parameters() yields them."""
    return sum(p.numel() for p in model.parameters())
