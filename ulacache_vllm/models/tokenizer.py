"""Builds the tiny models' tokenizer locally: byte-level BPE trained on the embedded corpus.

No hub access is needed. The vocabulary is padded with reserved tokens to exactly the
model's ``vocab_size`` so every id the model can emit decodes.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .corpus import CORPUS

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *CHAT_TOKENS]  # ids 0..6, fixed: configs refer to 0/1/2

# Turns end with <|end|>; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Keep the byte-level offsets right; no BOS is added here (the chat template adds it,
    # and vLLM adds it for plain prompts through add_bos_token below).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus does not change the merges' order, only the counts; it lets
    # min_frequency=2 admit words that appear once.
    tok.train_from_iterator(CORPUS.splitlines() * 2, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int):
    """Return a ``PreTrainedTokenizerFast`` whose ``len()`` is exactly ``vocab_size``."""
    from transformers import PreTrainedTokenizerFast

    tok = _train(vocab_size)
    n = tok.get_vocab_size()
    if n > vocab_size:
        raise ValueError(f"trained vocabulary {n} exceeds vocab_size {vocab_size}")
    # Pad with reserved special tokens so the model's whole output range decodes.
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - n)])
    assert tok.get_vocab_size() == vocab_size
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    return fast


def save_tokenizer(outdir: str | Path, vocab_size: int) -> dict[str, int]:
    """Write tokenizer files into ``outdir``; return the special token ids."""
    fast = build_tokenizer(vocab_size)
    fast.save_pretrained(str(outdir))
    return {
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.pad_token_id,
    }
