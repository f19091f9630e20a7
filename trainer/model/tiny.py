"""Tiny random-weight causal LMs with a locally trained tokenizer, for tests and the quickstart.

Nothing is downloaded: the model comes from a transformers config class (hidden 64, 2 layers,
a few heads) with random weights from a fixed seed, and the tokenizer is a byte-level BPE trained
here with the `tokenizers` library on ``trainer/data/corpus.txt`` (plain English the repo ships).
Both are written with ``save_pretrained`` so ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)`` load them like any hub checkpoint. Building one takes about
a second on a laptop CPU.

The chat template is a small Jinja template without generation markers, on purpose: the data
code must find assistant tokens by rendering prefixes, which is what real templates need too.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "qwen3", "mistral", "gemma", "gpt_oss", "qwen3_moe")

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # ids 0..5 in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_HIDDEN = 64
_LAYERS = 2
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 16


def corpus_text() -> str:
    """The plain-English text the tokenizer is trained on (about 300 KB, shipped with the package)."""
    return (
        resources.files("trainer.data")
        .joinpath("corpus.txt")
        .read_text(encoding="utf-8")
    )


def build_tokenizer(vocab_size: int = 512) -> Any:
    """Train a byte-level BPE on the shipped corpus and wrap it as a transformers fast tokenizer.

    Deterministic: the same corpus and vocab size give the same merges. Special tokens get ids
    0..5 (pad, bos, eos, then the three role markers); ``bos`` is prepended by the post-processor
    like Llama's tokenizer does.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(
            f"vocab_size: must be >= 300 (256 bytes + special tokens + merges), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_config(
    arch: str, vocab_size: int, pad_id: int, bos_id: int, eos_id: int
) -> Any:
    """A transformers config of ``arch`` at toy size (hidden 64, 2 layers, 4 heads, 2 KV heads)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "max_position_embeddings": 4096,
        "pad_token_id": pad_id,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=4096)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=_HEAD_DIM)
    if arch == "gemma":
        return transformers.GemmaConfig(**common, head_dim=_HEAD_DIM)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=_HEAD_DIM,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        )
    if arch == "gpt_oss":
        # A sliding window shorter than the test samples, so packing is checked against it too.
        common["intermediate_size"] = _HIDDEN
        return transformers.GptOssConfig(
            **common,
            head_dim=_HEAD_DIM,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise ValueError(f"arch: {arch!r} is not one of {', '.join(ARCHITECTURES)}")


def build_tiny_model(
    arch: str = "llama", seed: int = 0, vocab_size: int = 512
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``: a random-weight ``arch`` causal LM (float32) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(vocab_size)
    config = build_config(
        arch,
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, tokenizer


def make_tiny_model(
    directory: str | Path, arch: str = "llama", seed: int = 0, vocab_size: int = 512
) -> Path:
    """Build a tiny model and save model + tokenizer to ``directory`` (created if missing)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_tiny_model(arch, seed=seed, vocab_size=vocab_size)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
