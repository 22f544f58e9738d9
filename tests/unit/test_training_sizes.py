"""The training sizes of bench/sizes.py: their parameter counts against the published ones and a
formula written here from the configs, the registry, and the command line that selects them."""

import pytest
import torch

from bench.__main__ import main
from bench.sizes import SIZES, GPTConfig, Llama, LlamaConfig, build_gpt, count_params, get_size
from bench.training import modes_for

# GPT-2 small's released checkpoint and TinyLlama-1.1B's, as their model cards count them.
GPT2_SMALL_PARAMS = 124_439_808
TINYLLAMA_PARAMS = 1_100_048_384


def _gpt_formula(vocab, d, layers, max_len):
    # per layer: two layer norms, qkv and out projections with biases, the 4x MLP with biases
    layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab * d + max_len * d + layers * layer + 2 * d  # the head is the embedding


def _llama_formula(vocab, d, layers, heads, kv_heads, hidden):
    kv = kv_heads * d // heads
    layer = 2 * d + d * d + 2 * d * kv + d * d + 3 * d * hidden  # two norms, q, k+v, o, SwiGLU
    return vocab * d * 2 + layers * layer + d  # embedding, untied head, final norm


def test_gpt2_small_counts_124m():
    model = build_gpt(GPTConfig())
    assert model.head.weight is model.tok.weight
    assert count_params(model) == GPT2_SMALL_PARAMS == _gpt_formula(50257, 768, 12, 1024)
    assert SIZES["gpt2-small"].count(SIZES["gpt2-small"].config) == GPT2_SMALL_PARAMS


def test_llama_1b_counts_1_1b():
    with torch.device("meta"):  # 4.4 GB of float32 otherwise
        model = Llama(LlamaConfig())
    assert count_params(model) == TINYLLAMA_PARAMS == _llama_formula(32000, 2048, 22, 32, 4, 5632)
    assert SIZES["llama-1b"].count(SIZES["llama-1b"].config) == TINYLLAMA_PARAMS
    assert model.layers[0].attn.wk.weight.shape == (256, 2048)  # 4 KV heads of 64


@pytest.mark.parametrize("name", ["gpt2-small", "llama-1b"])
def test_shrunk_config_counts_follow_the_formula(name):
    size = get_size(name).with_config(n_layers=2, vocab=100)
    with torch.device("meta"):
        model = size.build(size.config)
    assert count_params(model) == size.count(size.config)


def test_registry():
    assert set(SIZES) == {"gpt2-small", "llama-1b"}
    for size in SIZES.values():
        assert set(size.shapes) == {"cpu", "cuda"}
        assert size.shapes["cpu"].batch == 1
        assert size.shapes["cuda"].seq <= size.config.max_len
    with pytest.raises(ValueError, match="unknown size"):
        get_size("gpt3")
    with pytest.raises(ValueError, match="longer than"):
        get_size("gpt2-small").make("cpu", torch.float32, 1, 2048)


def test_modes_and_steps():
    assert modes_for("measure", None) == [
        "eager",
        "gpuautograd:triton",
        "gpuautograd:cudagraph",
        "compiled-autograd",
        "compiled-autograd-cudagraphs",
    ]
    assert modes_for("plan", None) == ["eager", "plan", "plan-run"]
    assert modes_for("plan", ["plan"]) == ["eager", "plan"]  # eager is the reference, always
    with pytest.raises(ValueError, match="unknown mode"):
        modes_for("plan", ["gpuautograd:triton"])


def test_cli_rejects_bad_sizes_and_modes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--size", "gpt3"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["--size", "gpt2-small", "--device", "cpu", "--modes", "nope"])
    assert e.value.code == 2
    assert "unknown mode" in capsys.readouterr().err
