"""Sentencepiece BPE tokenizer for the tuner model: identity normalisation, no dummy prefix (add_space_prefix=False).

Pieces never span a whitespace boundary (split_by_whitespace), so ` name=value` pairs tokenise the same alone
as inside a completion, which the inference search relies on; and llama.cpp's SPM tokenizer reproduces it.
"""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece as spm

BOS, EOS, UNK = 1, 2, 0


def train_tokenizer(corpus: list[str], vocab_size: int = 512, seed_pieces: list[str] | None = None) -> bytes:
    """Train on the corpus lines; returns the serialized ModelProto. Shrinks the vocab if the corpus is too small."""
    last_err = None
    for vs in sorted({vocab_size, vocab_size * 7 // 8, vocab_size * 3 // 4, 384, 352, 320}, reverse=True):
        buf = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(corpus), model_writer=buf, model_type="bpe", vocab_size=vs,
                character_coverage=1.0, normalization_rule_name="identity", add_dummy_prefix=False,
                remove_extra_whitespaces=False, split_by_whitespace=True, split_digits=False, byte_fallback=True,
                split_by_unicode_script=False, split_by_number=False,
                unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_id=-1, max_sentence_length=4096, num_threads=2,
                user_defined_symbols=seed_pieces or [], minloglevel=2, hard_vocab_limit=True,
                input_sentence_size=0, shuffle_input_sentence=False,
            )
            return buf.getvalue()
        except RuntimeError as e:  # "Vocabulary size too high"
            last_err = e
    raise RuntimeError(f"sentencepiece training failed: {last_err}")


def load(proto: bytes) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_proto=proto)


def save(proto: bytes, path: Path) -> None:
    Path(path).write_bytes(proto)
