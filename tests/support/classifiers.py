"""Tiny sequence classifiers built without a pad token (as Llama, Mistral and GPT-2 ship), and a padded batch:
the tutorials' `model.config.pad_token_id = tokenizer.pad_token_id`, after splitting, in both engines."""

from __future__ import annotations

import torch
import transformers as T

from .hf_configs import VOCAB

PAD = 5  # a token id the batches use for padding only
NAMES = ("llama", "mistral", "gpt2", "bert")


def classifier_config(name: str):
    sizes = dict(vocab_size=VOCAB, num_labels=3)
    if name == "gpt2":
        return T.GPT2Config(n_layer=2, n_positions=64, n_embd=72, n_head=9, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **sizes)
    common = dict(num_hidden_layers=2, max_position_embeddings=64, intermediate_size=88, **sizes)
    if name == "llama":
        return T.LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, **common)
    if name == "mistral":
        return T.MistralConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, **common)
    if name == "bert":
        return T.BertConfig(hidden_size=72, num_attention_heads=9, pad_token_id=None, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **common)
    raise ValueError(f"no classifier config for {name!r}; one of {NAMES}")


def classifier(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return T.AutoModelForSequenceClassification.from_config(classifier_config(name)).eval()


def padded_batch(generator: torch.Generator) -> dict:
    """Two sequences, the second right-padded with PAD (a decoder classifier pools the last token before the
    first PAD)."""
    ids = torch.randint(PAD + 1, VOCAB, (2, 7), generator=generator)
    ids[1, 4:] = PAD
    return {"input_ids": ids, "attention_mask": (ids != PAD).long()}
