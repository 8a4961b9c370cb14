"""The bfloat16 CPU path end to end, against HF transformers in bfloat16 on the default model.

This is the path behind the README's bfloat16 figures: oneDNN-prepacked linear weights and the
fused C++ decode kernel, prompts batched together by the engine. The test first checks that the
path really is that one (every linear layer packed, the kernel loaded), then compares, token by
token, the engine's logits with HF's on the same context and the greedy ids.

Tolerance: bfloat16 keeps 8 bits of mantissa, and the engine and HF round at different points
(packed GEMMs, fused attention): the worst of a row's 49152 logits differs by up to 3.7% of the
row's largest magnitude (measured over these 32 positions; the relative RMS error reached 3.6%,
so HF bfloat16 is no closer than that to us). 5% is the bound; skipping a whole layer gives
about 47%. The 2% the issue suggested does not hold between two bfloat16 implementations. Greedy ids must be equal
until a position where HF's own top two logits are within that bound of each other (a bfloat16
tie, where either choice is right); the contexts differ after it, so comparison stops there.
"""

from __future__ import annotations

import pytest
import torch

from paged import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Q: What is 12 times 12?\nA:",
]
MAX_NEW = 8
LOGIT_TOL = 0.05  # worst single logit, as a share of the row's largest |logit|
MIN_COMPARED = 0.75  # of all generated positions compared before a tie ends a prompt's comparison

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_bf16(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16)
    return model.eval()


def hf_greedy_and_logits(model, prompt_ids: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy ids (one prompt, no padding) and the float32 logits of every generated position."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences[0, len(prompt_ids) :].tolist()
    return ids, torch.stack([row[0].float() for row in out.logits])


def test_bfloat16_engine_matches_hf_bfloat16(default_model_dir, hf_bf16):
    from paged.models.layers import Linear, ParallelLMHead

    llm = LLM(default_model_dir, device="cpu", attention="torch", dtype="bfloat16", quantization="none",
              max_num_seqs=8)
    runner = llm.engine.core.runner
    # The real path: bfloat16 weights, every linear layer and the LM head prepacked, kernel loaded.
    assert runner.dtype == torch.bfloat16
    linears = [m for m in runner.model.modules() if isinstance(m, (Linear, ParallelLMHead))]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert runner.backend._kernel is not None, "the C++ decode kernel did not load"

    # The logits the sampler receives, per request, in sampling order (batched as the engine runs).
    logits_by_request: dict[str, list[torch.Tensor]] = {}
    sample = runner.sampler.sample

    def recording_sample(logits, requests):
        for row, request in zip(logits, requests):
            logits_by_request.setdefault(request.request_id, []).append(row.float().clone())
        return sample(logits, requests)

    runner.sampler.sample = recording_sample
    tokenizer = llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert runner.backend._kernel is not None

    compared = total = 0
    worst = worst_rms = 0.0
    for prompt, output in zip(PROMPTS, outputs):
        ours = output.outputs[0].token_ids
        ours_logits = torch.stack(logits_by_request[output.request_id])
        expected, hf_logits = hf_greedy_and_logits(hf_bf16, tokenizer(prompt)["input_ids"], MAX_NEW)
        assert len(ours) == len(expected) == len(ours_logits) == MAX_NEW
        total += MAX_NEW
        for k in range(MAX_NEW):
            ref = hf_logits[k]
            scale = ref.abs().max()
            diff = ours_logits[k] - ref
            err = float(diff.abs().max() / scale)
            rms = float(diff.norm() / ref.norm())
            worst, worst_rms = max(worst, err), max(worst_rms, rms)
            assert err < LOGIT_TOL, f"{prompt!r} token {k}: logits differ by {err:.2%} of max |logit|"
            compared += 1
            if ours[k] != expected[k]:
                top2 = ref.topk(2).values
                gap = float((top2[0] - top2[1]) / scale)
                assert gap < 2 * LOGIT_TOL, (
                    f"{prompt!r} token {k}: {ours[k]} != HF {expected[k]} and HF's top two are "
                    f"{gap:.2%} apart (not a bfloat16 tie)"
                )
                break  # different contexts from here on
    assert compared >= MIN_COMPARED * total, f"only {compared} of {total} positions compared (too many ties)"
    print(f"bfloat16 vs HF: {compared}/{total} positions compared, worst logit error {worst:.2%} of max, {worst_rms:.2%} RMS")
    llm.shutdown()
