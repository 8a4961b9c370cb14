"""Qwen2 with ``use_sliding_window`` over the paged cache against HF transformers float32, on tiny
random-weight models whose window (6) is smaller than the prompt (13 tokens).

HF's rule decides which layers slide (``max_window_layers``, or an explicit ``layer_types``); the
model runs with the torch backend on a NaN-filled cache with shuffled blocks, the prompt in two
chunks (the second after a cached prefix), then 32 greedy decode steps. Where every layer slides,
each step's block table has the blocks out of the window replaced by block 0 (NaN, never
written), as the KV manager frees them: reading one would show as a non-finite logit.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from paged.backends.torch_attention import TorchAttentionBackend
from paged.core.attention import AttentionLayout, kv_sliding_window
from paged.core.errors import ModelLoadError
from paged.core.loading import loader
from paged.core.utils import cdiv
from paged.models.qwen2 import Qwen2ForCausalLM, sliding_layers

from helpers.batch import make_batch
from helpers.windowed_attention import dead_blocks

ATOL, RTOL = 1e-4, 1e-4
BLOCK_SIZE = 4
WINDOW = 6
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, num_hidden_layers=4)
VARIANTS = {  # name: (config kwargs, which layers slide by HF's rule)
    "upper-layers-slide": (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
                           [False, False, True, True]),
    "every-layer-slides": (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0), [True] * 4),
    "layer-types": (dict(use_sliding_window=True, sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
                    [True, False, True, False]),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = {}
    for i, (name, (kwargs, _)) in enumerate(VARIANTS.items()):
        config = transformers.Qwen2Config(**BASE, **kwargs)
        config.architectures = ["Qwen2ForCausalLM"]
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        randomize_(hf, seed=200 + i)
        hf.eval()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = (hf, path)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_sliding_layers_follow_hf(hf_models, name):
    hf, path = hf_models[name]
    config = loader.load_hf_config(path)
    assert sliding_layers(config) == VARIANTS[name][1]
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [
        WINDOW if s else None for s in VARIANTS[name][1]]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_and_32_decodes_match_hf(hf_models, name):
    hf, path = hf_models[name]
    config = loader.load_hf_config(path)
    layout = AttentionLayout(4, 4, 2, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(layout)
    model = loader.build_model(path, config, Qwen2ForCausalLM, backend, torch.float32, "cpu")
    windows = [layer.self_attn.attn_settings.sliding_window for layer in model.model.layers]
    assert windows == [WINDOW if s else None for s in VARIANTS[name][1]]
    every_layer_slides = all(VARIANTS[name][1])
    # the KV manager frees blocks behind the window only when every layer slides
    assert kv_sliding_window(model, 4) == (WINDOW if every_layer_slides else None)

    rng = random.Random(name)
    prompt = [rng.randrange(3, 256) for _ in range(13)]
    new_tokens = 32
    num_blocks = cdiv(len(prompt) + new_tokens, BLOCK_SIZE) + 4
    blocks = list(range(1, num_blocks))
    random.Random(1).shuffle(blocks)
    caches = backend.allocate_kv_cache(num_blocks)
    for k, v in caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))

    def step(ids: list[int], computed: int) -> torch.Tensor:
        table = blocks[: cdiv(computed + len(ids), BLOCK_SIZE)]
        if every_layer_slides:  # the blocks out of the window are freed: block 0 (NaN) in their place
            table = [0 if j < dead_blocks(computed, WINDOW, BLOCK_SIZE) else b for j, b in enumerate(table)]
        batch = make_batch([table], [computed], [len(ids)], BLOCK_SIZE)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.arange(computed, computed + len(ids)), caches,
                           backend.build_metadata(batch))
            return model.compute_logits(hidden)

    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    got = torch.cat([step(prompt[:5], 0), step(prompt[5:], 5)])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)

    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(got[-1].argmax()))
        got = step(ids[-1:], len(ids) - 1)
    ids.append(int(got[-1].argmax()))
    with torch.no_grad():
        hf_full = hf(torch.tensor([ids[:-1]])).logits[0, -1]
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens + 1, do_sample=False,
                               min_new_tokens=new_tokens + 1, pad_token_id=0)[0].tolist()
    torch.testing.assert_close(got[-1], hf_full, atol=ATOL, rtol=RTOL)
    assert ids == expected


def test_windowless_config_is_not_a_window(hf_models):
    """Without use_sliding_window HF ignores sliding_window: so does paged."""
    config = transformers.Qwen2Config(**BASE, use_sliding_window=False, sliding_window=4, max_window_layers=0)
    assert sliding_layers(config) == [False] * 4


def test_bad_window_is_a_clear_error():
    layout = AttentionLayout(4, 4, 2, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    config = transformers.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    config.sliding_window = -3
    with pytest.raises(ModelLoadError, match=r"sliding_window=-3"):
        Qwen2ForCausalLM(config, TorchAttentionBackend(layout), torch.float32, "cpu")
    config.sliding_window = WINDOW
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ModelLoadError, match=r"layer_types=.*'chunked_attention'"):
        Qwen2ForCausalLM(config, TorchAttentionBackend(layout), torch.float32, "cpu")
