"""Regenerate the bundled byte-level tokenizer in ``recipes/configs/tokenizer/``.

256 byte tokens (GPT-2 style byte-to-unicode alphabet, no merges) followed by three
special tokens: ``<|endoftext|>`` (eos and pad), ``<|im_start|>``, ``<|im_end|>``.
Needs no network; the output is byte-for-byte deterministic.

    python recipes/configs/make_tokenizer.py
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

OUT_DIR = Path(__file__).resolve().parent / "tokenizer"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with an empty merge list: every byte is one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Order the alphabet by the byte each symbol stands for, so token id == byte value.
    byte_to_symbol = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(byte_to_symbol.values())
    vocab = {byte_to_symbol[b]: b for b in range(256)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """The standard reversible byte -> printable unicode mapping used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def main() -> None:
    tokenizer = build_tokenizer()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(OUT_DIR))
    print(f"wrote {OUT_DIR} (vocab size {len(tokenizer)})")


if __name__ == "__main__":
    main()
