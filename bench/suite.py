"""The benchmark's model list: the shared suite of bench/models.py (with a second GPT size) and,
when transformers is installed, transformers models built from small configs (no weights are
downloaded: the models are initialized at random).

Every factory returns (model, make_batch(generator) -> inputs tuple, loss_fn(model, *inputs)).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .models import make_cnn, make_gnn, make_gpt, make_llama, make_lstm_lm, make_mlp, make_moe


@dataclass(frozen=True)
class BenchModel:
    name: str
    factory: Callable
    description: str


def _hf_factory(kind: str, dtype=torch.float32, device="cpu", batch=2, seq=32, vocab=256):
    """A transformers causal/masked LM from a small config; the loss is the model's own (labels = inputs)."""
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "bert":
        config = transformers.BertConfig(
            vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=seq
        )
        model = transformers.BertForMaskedLM(config)
    else:
        raise ValueError(f"unknown transformers model {kind!r}; known: gpt2, llama, bert")
    model = model.to(device, dtype).train()

    def make_batch(g):
        return (torch.randint(0, vocab, (batch, seq), generator=g).to(device),)

    return model, make_batch, lambda m, ids: m(input_ids=ids, labels=ids).loss


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def bench_models(include_transformers: bool = True) -> list[BenchModel]:
    models = [
        BenchModel("mlp", make_mlp, "3 Linear layers, ReLU/GELU/tanh/sigmoid/SiLU, dropout; batch 16"),
        BenchModel("cnn", make_cnn, "Conv2d + BatchNorm + pooling + Conv1d; batch 4 of 3x16x16"),
        BenchModel("gpt", make_gpt, "GPT-style, 2 blocks, d_model 64, seq 32, batch 2, SDPA attention"),
        BenchModel(
            "gpt-medium",
            functools.partial(make_gpt, d_model=256, seq=128, batch=4, n_layers=2),
            "GPT-style, 2 blocks, d_model 256, seq 128, batch 4, SDPA attention",
        ),
        BenchModel(
            "gpt-manual-attn",
            functools.partial(make_gpt, manual_attention=True),
            "the small GPT with attention written as matmul/masked_fill/softmax",
        ),
        BenchModel("llama", make_llama, "Llama-style block: RMSNorm, SDPA, SiLU-gated MLP; d_model 64, seq 32"),
        BenchModel("moe", make_moe, "mixture of experts: softmax + top-2 routing over 4 SiLU experts; d_model 32, 2x16 tokens"),
        BenchModel("lstm-lm", make_lstm_lm, "LSTM language model: embedding, 2-layer LSTM (oneDNN on the CPU), head; seq 16, batch 2"),
        BenchModel("gnn", make_gnn, "message-passing layer: scatter_reduce mean + index_add over 160 edges of 40 nodes"),
    ]
    if include_transformers and transformers_available():
        for kind, text in (("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM"), ("bert", "BertForMaskedLM")):
            models.append(
                BenchModel(
                    f"hf-{kind}",
                    functools.partial(_hf_factory, kind),
                    f"transformers {text} from a config: 2 layers, hidden 64, seq 32, batch 2, random init",
                )
            )
    return models
