"""Helpers for the original-LLaVA-layout tests: tiny checkpoints and a torch reference of LLaVA's splice."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

IMAGE_TOKEN_INDEX = -200


def tiny_llama(seed: int = 0, vocab: int = 64, rms_norm_eps: float = 1e-6):
    """A tiny random HF LlamaForCausalLM (eval, fp32) with widened norms/embeddings, and its flat config dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, rope_theta=1000.0, rms_norm_eps=rms_norm_eps,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    widen(model)
    flat = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    return model, flat


def widen(module: torch.nn.Module) -> None:
    """Random init leaves near-identity norms and tiny embeddings; widen them so tests see real signal."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ("norm" in name and name.endswith("weight")) or name.split(".")[-1] in ("ls1", "ls2"):
                p.uniform_(0.5, 1.5)
            elif "embed" in name and "patch_embedding" not in name:  # a patch conv stays at fan-in scale
                p.normal_(0, 1.0)


def save_checkpoint(folder, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """model.safetensors + config.json, as the original repos' save_pretrained would write them."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}


def reference_logits(lm, ids: list[int], features: torch.Tensor) -> np.ndarray:
    """LLaVA's prepare_inputs_labels_for_multimodal for one prompt: `ids` hold ONE -200 per image (as
    tokenizer_image_token gives them); the text between them is embedded and the images' features
    [n_images, T, H] are concatenated in between. -> logits [L_expanded, V]."""
    ids = torch.as_tensor(ids)
    cuts = [-1] + torch.where(ids == IMAGE_TOKEN_INDEX)[0].tolist() + [len(ids)]
    parts = []
    with torch.no_grad():
        for k in range(len(cuts) - 1):
            parts.append(lm.model.embed_tokens(ids[cuts[k] + 1:cuts[k + 1]]))
            if k < len(cuts) - 2:
                parts.append(features[k])
        return lm(inputs_embeds=torch.cat(parts)[None]).logits[0].float().numpy()


def expand(ids: list[int], per_image: int) -> np.ndarray:
    """One -200 per image -> our token stream: per_image copies of it. -> [1, L]."""
    return np.asarray([[t for i in ids for t in ([i] * per_image if i == IMAGE_TOKEN_INDEX else [i])]], np.int32)
