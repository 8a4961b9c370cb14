"""Random but valid GGUF blocks of every type ``paged.core.loading.gguf_blocks`` reads: random
code bits, float16 scale fields of a chosen size (so the weights have the magnitude of a real
layer's), and gguf's own dequantization of them as the reference."""

from __future__ import annotations

import numpy as np
import torch

from paged.core.loading import gguf_blocks
from paged.core.quantization import BlockScales

# byte offsets of each type's float16 fields in a block (ggml's block structs)
F16_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q2_k": [80, 82],
              "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}
# |W| <~ d * (largest code x largest sub-scale): the float16 fields' size for weights of ~1/sqrt(K)
_CODE_SPAN = {"q4_0": 8, "q4_1": 15, "q5_0": 16, "q5_1": 31, "q8_0": 127, "q2_k": 45, "q3_k": 128,
              "q4_k": 945, "q5_k": 1953, "q6_k": 4064}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, size: float | None = None) -> np.ndarray:
    """Raw blocks ``[rows, bytes per row]`` uint8 of ``kind``; weights of about ``size``
    (default ``1 / sqrt(cols)``)."""
    rng = np.random.default_rng(seed)
    t = gguf_blocks.TYPES[kind]
    n = rows * cols // t.super_block
    blocks = rng.integers(0, 256, (n, t.block_bytes), dtype=np.uint8)
    scale = (size or cols**-0.5) * 2.0 / _CODE_SPAN[kind]
    for at in F16_FIELDS[kind]:
        d = (scale * rng.uniform(0.5, 1.5, n) * rng.choice([-1, 1], n)).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def gguf_dequantized(blocks: np.ndarray, kind: str, rows: int, cols: int) -> np.ndarray:
    """gguf's own float32 dequantization (the independent reference)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    return gguf.quants.dequantize(blocks, qtype).reshape(rows, cols).astype(np.float32)


def block_scales(blocks: np.ndarray, kind: str, rows: int, cols: int) -> BlockScales:
    """What ``paged.core.loading.quantize.load_block_scales`` hands a method for these blocks."""
    d = gguf_blocks.decode_blocks(blocks, kind.upper(), (rows, cols))
    t = gguf_blocks.TYPES[kind]
    as_torch = {f: torch.from_numpy(np.ascontiguousarray(getattr(d, f))) for f in
                ("scale", "offset", "super_scale", "super_offset", "scale_codes", "offset_codes")}
    return BlockScales(kind, block=t.group, super_block=t.super_block,
                       stored_codes=torch.from_numpy(np.ascontiguousarray(d.codes)), **as_torch)


# ---- a whole tiny Llama GGUF of mixed block types ------------------------------------------------

# one type per tensor, as a Q4_K_M-like file mixes them (every type is used at least once)
TINY_TYPES = {
    "token_embd": "q6_k", "output": "q8_0",
    "attn_q": "q4_k", "attn_k": "q5_k", "attn_v": "q6_k", "attn_output": "q4_0",
    "ffn_gate": "q5_0", "ffn_up": "q5_1", "ffn_down": "q4_1",
}
TINY_TYPES_LAYER_1 = {"attn_q": "q3_k", "attn_k": "q2_k", "ffn_down": "q8_0"}
TINY_CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tiny_quantized_gguf(path, hidden: int = 256, intermediate: int = 512, layers: int = 2, seed: int = 0) -> None:
    """A 2-layer Llama (4 heads of 64, 2 KV heads) whose 2-D tensors are random blocks of the
    types above (norms float32): what llama.cpp writes for a K-quant mix, readable by
    transformers' own GGUF loading (``from_pretrained(..., gguf_file=...)``) as the reference."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // 4)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (vocab - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(TINY_CHAT_TEMPLATE)
    kv = 2 * hidden // 4
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (intermediate, hidden), "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate)}

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        blocks = random_blocks(kind, rows, cols, seed=int(rng.integers(1 << 30)))
        w.add_tensor(name, blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, kind.upper()))

    add("token_embd.weight", TINY_TYPES["token_embd"], vocab, hidden)
    for i in range(layers):
        for short, (rows, cols) in shapes.items():
            kind = (TINY_TYPES_LAYER_1 if i == 1 else {}).get(short, TINY_TYPES[short])
            add(f"blk.{i}.{short}.weight", kind, rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    add("output.weight", TINY_TYPES["output"], vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
