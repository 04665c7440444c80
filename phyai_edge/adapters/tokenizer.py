"""Prompt tokenisers loaded from local files only (never a hub).

`tokenizer.json` (Hugging Face `tokenizers`) is preferred; a SentencePiece `tokenizer.model`
works too when the optional `sentencepiece` package is installed. The beginning-of-sequence
token is prepended explicitly, so behaviour does not depend on a file's post-processor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from phyai_edge.extras import install_hint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass
class Tokenized:
    ids: list[int]
    mask: list[bool]
    truncated: bool


class PromptTokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            found = [path / f for f in TOKENIZER_FILES if (path / f).exists()]
            if not found:
                raise FileNotFoundError(
                    f"no tokenizer in {path}: expected one of {', '.join(TOKENIZER_FILES)} "
                    "(copy the PaliGemma tokenizer files into the checkpoint folder or pass --tokenizer)"
                )
            path = found[0]
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        self.path = path
        if path.suffix == ".json":
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path))
            # A tokenizer.json can carry padding and truncation switched on: transformers writes
            # the settings of its last call into it on save_pretrained, and LeRobot saves its
            # processor's tokenizer (pretrained_model/tokenizer/) after training called it with
            # padding="max_length", truncation=True. Left on, `encode` would return the pads as
            # text (unmasked) and cut the text at its own length; `__call__` pads and cuts itself.
            self._tok.no_padding()
            self._tok.no_truncation()
            self._kind = "hf"
            self.bos_id = self._special_id(["<bos>", "<s>", "[BOS]"])
            self.pad_id = self._special_id(["<pad>", "[PAD]"], default=0)
            # The text vocabulary only: Hugging Face's PaliGemma tokenizer.json adds `<image>` at
            # 257152, one past the 257152 rows PI0.5 embeds. Counting it would refuse the very
            # tokenizer LeRobot trains with; a prompt that spells it out is refused in `encode_plain`.
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=False)
            self._beyond = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()
                            if i >= self.vocab_size}
        else:
            try:
                import sentencepiece as spm
            except ImportError as exc:
                raise ImportError(
                    f"{path} is a SentencePiece model: {install_hint('sentencepiece')}, or provide a tokenizer.json"
                ) from exc
            self._tok = spm.SentencePieceProcessor(model_file=str(path))
            self._kind = "sp"
            self.bos_id = self._tok.bos_id()
            self.pad_id = max(self._tok.pad_id(), 0)
            self.vocab_size = self._tok.get_piece_size()
            self._beyond = {}

    def _special_id(self, names: list[str], default: int | None = None) -> int:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        if default is not None:
            return default
        raise ValueError(f"tokenizer {self.path} has none of the tokens {names}")

    def encode_plain(self, text: str | tuple[str, ...]) -> list[int]:
        """`text`'s ids without BOS. A tuple is encoded piece by piece and joined (openpi tokenises
        the answer marker on its own: `encode(task) + encode("\\n")`, which need not equal
        `encode(task + "\\n")`). ValueError where the text spells out an added token past the text
        vocabulary (`vocab_size`): its id has no row in the model's embedding, and an index past it
        fails on the device, or on a GPU leaves the CUDA context unusable."""
        if isinstance(text, tuple):
            return [i for piece in text for i in self.encode_plain(piece)]
        if self._kind == "hf":
            ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        else:
            ids = list(self._tok.encode(text))
        if self._beyond and ids and max(ids) >= self.vocab_size:
            bad = sorted({self._beyond.get(i, str(i)) for i in ids if i >= self.vocab_size})
            raise ValueError(f"the prompt holds {', '.join(map(repr, bad))}: a special token of {self.path.name} "
                             f"outside its {self.vocab_size}-token text vocabulary, which the model has no "
                             "embedding for")
        return ids

    def count(self, text: str | tuple[str, ...]) -> int:
        """The tokens `__call__` gives `text` before any truncation (BOS included)."""
        return 1 + len(self.encode_plain(text))

    def __call__(self, text: str | tuple[str, ...], max_len: int) -> Tokenized:
        """BOS + text (a tuple: its pieces, each encoded on its own), right-padded to max_len;
        truncated (and flagged) if longer."""
        ids = [self.bos_id, *self.encode_plain(text)]
        truncated = len(ids) > max_len
        ids = ids[:max_len]
        n = len(ids)
        return Tokenized(ids + [self.pad_id] * (max_len - n), [True] * n + [False] * (max_len - n), truncated)


def write_tokenizer_info(path: Path, tok: PromptTokenizer) -> None:
    path.write_text(json.dumps({"file": tok.path.name, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id}))
