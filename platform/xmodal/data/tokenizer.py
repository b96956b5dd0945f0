"""BERT-style uncased WordPiece tokenizer (the `tokenizers` library), fixed-length encoding for the store.

Sentences are tokenised once at ingest into [CLS] w1 ... wn [SEP] [PAD]... of exactly `max_seq_len`
ids, so the batch builder never tokenises. The vocabulary is either a given BERT `vocab.txt` or one
trained on the corpus; either way it is saved as `vocab.txt` in the store and must put [PAD] at id 0
(the model's embedding uses padding_idx=0 and the attention mask is `ids != 0`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from xmodal.base.errors import UserError

if TYPE_CHECKING:
    from xmodal.data.location import Location

SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
VOCAB_FILE = "vocab.txt"


class TokenizerError(UserError):
    """A bad vocabulary file; the message names the file and what was expected."""


class WordPieceTokenizer:
    """Fixed-length WordPiece encoder/decoder; ids are int32 (S, max_seq_len)."""

    def __init__(self, tokenizer: Tokenizer, max_seq_len: int, source: str = "<trained>"):
        if max_seq_len < 3:
            raise TokenizerError(f"max_seq_len={max_seq_len}: need at least 3 ([CLS] word [SEP])")
        self._tok = tokenizer
        self.max_seq_len = max_seq_len
        self.source = source
        vocab = tokenizer.get_vocab()
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise TokenizerError(f"{source}: vocabulary lacks the special token(s) {', '.join(missing)}; "
                                 f"a BERT vocab.txt has all of {', '.join(SPECIAL_TOKENS)}")
        self.special_ids: dict[str, int] = {t: vocab[t] for t in SPECIAL_TOKENS}
        # Registered as special (ids unchanged): "[MASK]" in text stays one token, decode skips them.
        tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
        if self.special_ids["[PAD]"] != 0:
            raise TokenizerError(f"{source}: [PAD] has id {self.special_ids['[PAD]']}, expected 0 "
                                 "(line 1 of vocab.txt)")
        self.pad_id = 0
        self.unk_id = self.special_ids["[UNK]"]
        self.cls_id = self.special_ids["[CLS]"]
        self.sep_id = self.special_ids["[SEP]"]
        self.mask_id = self.special_ids["[MASK]"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", self.cls_id), ("[SEP]", self.sep_id)])
        tokenizer.enable_truncation(max_length=max_seq_len)
        tokenizer.enable_padding(length=max_seq_len, pad_id=0, pad_token="[PAD]")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    # ----------------------------------------------------------------- construction

    @staticmethod
    def _pipeline(model: models.Model) -> Tokenizer:
        tok = Tokenizer(model)
        # BERT uncased: clean control chars, split CJK, lower-case and strip accents.
        tok.normalizer = normalizers.BertNormalizer(lowercase=True, clean_text=True, handle_chinese_chars=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        return tok

    @classmethod
    def from_vocab(cls, vocab_file: str | Path | Location, max_seq_len: int) -> WordPieceTokenizer:
        """From a vocab.txt: a local path, or a store's `Location` (read through its file system)."""
        p = Path(vocab_file) if isinstance(vocab_file, str) else vocab_file
        if not p.is_file():
            raise TokenizerError(f"{p}: vocabulary file does not exist")
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); expected a BERT vocab.txt, "
                                 "one token a line") from None
        if not lines:
            raise TokenizerError(f"{p}: vocabulary file is empty")
        vocab: dict[str, int] = {}
        for i, line in enumerate(lines):
            token = line.rstrip("\n")
            if token in vocab:
                raise TokenizerError(f"{p}: line {i + 1}: token {token!r} repeats line {vocab[token] + 1}")
            vocab[token] = i
        model = models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100)
        return cls(cls._pipeline(model), max_seq_len, source=str(p))

    @classmethod
    def train(cls, sentences: Iterable[str], max_seq_len: int, vocab_size: int = 30522,
              length: int | None = None) -> WordPieceTokenizer:
        """Train a WordPiece vocabulary on the corpus (specials first, so [PAD]=0 ... [MASK]=4).
        `sentences` is streamed (any iterable; `length` is its size if known)."""
        tok = cls._pipeline(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=1,
                                            special_tokens=list(SPECIAL_TOKENS), show_progress=False)
        tok.train_from_iterator(sentences, trainer, length=length)
        return cls(tok, max_seq_len)

    def save(self, directory: str | Path) -> Path:
        """Write `vocab.txt` (one token a line, line number = id)."""
        vocab = self._tok.get_vocab()
        tokens = [""] * len(vocab)
        for t, i in vocab.items():
            tokens[i] = t
        p = Path(directory) / VOCAB_FILE
        p.write_text("\n".join(tokens) + "\n", encoding="utf-8")
        return p

    # ----------------------------------------------------------------- use

    def encode(self, sentences: Sequence[str]) -> tuple[np.ndarray, int]:
        """-> (ids (S, max_seq_len) int32, number of sentences that were truncated)."""
        if not sentences:
            return np.zeros((0, self.max_seq_len), np.int32), 0
        enc = self._tok.encode_batch(list(sentences), add_special_tokens=True)
        ids = np.array([e.ids for e in enc], dtype=np.int32)  # (S, T)
        truncated = sum(1 for e in enc if e.overflowing)
        return ids, truncated

    def encode_batches(self, batches: Iterable[Sequence[str]], total: int) -> tuple[np.ndarray, int]:
        """`encode` over `total` sentences given a batch at a time, into one preallocated array (only
        one batch's Python strings and encodings exist at a time)."""
        ids = np.zeros((total, self.max_seq_len), np.int32)
        done = truncated = 0
        for batch in batches:
            part, cut = self.encode(batch)
            if done + len(part) > total:
                raise ValueError(f"encode_batches: more than total={total} sentences")
            ids[done:done + len(part)] = part
            done, truncated = done + len(part), truncated + cut
        if done != total:
            raise ValueError(f"encode_batches: {done} sentences, expected total={total}")
        return ids, truncated

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Token ids -> text without special tokens (WordPiece pieces joined)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
