"""Prompt tokenisers from local files only: the shipped tiny tokenizer, one trained here, and a
SentencePiece model; BOS, right padding, mask, truncation; clear errors; no network."""

from __future__ import annotations

import socket

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from phyai_edge.adapters.tokenizer import PromptTokenizer

PROMPT = "Task: pick up the red cube, State: 12 255 0;\nAction: "


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a tokenizer tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_shipped_tiny_tokenizer(tiny_tokenizer_path):
    tok = PromptTokenizer(tiny_tokenizer_path)
    raw = Tokenizer.from_file(str(tiny_tokenizer_path))
    assert tok.bos_id == raw.token_to_id("<bos>") == 2
    assert tok.pad_id == raw.token_to_id("<pad>") == 0
    assert tok.vocab_size <= 1024  # fits the tiny preset's embedding
    plain = raw.encode(PROMPT, add_special_tokens=False).ids
    out = tok(PROMPT, 64)
    n = len(plain) + 1
    assert out.ids[:n] == [2, *plain]
    assert out.ids[n:] == [0] * (64 - n)
    assert out.mask == [True] * n + [False] * (64 - n)
    assert not out.truncated
    # state digits are single tokens, and "12" and "1 2" tokenise differently
    assert [raw.id_to_token(i).lstrip("\u2581") for i in tok.encode_plain("255")] == ["2", "5", "5"]
    assert tok.encode_plain("State: 12;") != tok.encode_plain("State: 1 2;")


def test_truncation_is_flagged(tiny_tokenizer_path):
    tok = PromptTokenizer(tiny_tokenizer_path)
    full_len = len(tok.encode_plain(PROMPT)) + 1
    out = tok(PROMPT, full_len - 3)
    assert out.truncated and len(out.ids) == full_len - 3 and all(out.mask)
    assert out.ids[0] == tok.bos_id
    exact = tok(PROMPT, full_len)
    assert not exact.truncated and all(exact.mask)


def test_padding_and_truncation_saved_in_the_file_are_ignored(tiny_tokenizer_path, tmp_path):
    """transformers writes the padding and truncation of its last call into tokenizer.json on
    save_pretrained (LeRobot saves its processor's tokenizer after training called it with
    padding="max_length", truncation=True, max_length=200). Honoured, they would hand the pads
    back as text (unmasked) and cut the prompt at the file's length."""
    plain = PromptTokenizer(tiny_tokenizer_path)
    raw = Tokenizer.from_file(str(tiny_tokenizer_path))
    short = len(plain.encode_plain(PROMPT)) - 4
    raw.enable_truncation(max_length=short)
    raw.enable_padding(length=short, pad_id=plain.pad_id, pad_token="<pad>")
    (tmp_path / "tok").mkdir()
    raw.save(str(tmp_path / "tok" / "tokenizer.json"))
    saved = PromptTokenizer(tmp_path / "tok")
    for text, n in ((PROMPT, 64), ("place it", 64), (PROMPT, 12)):
        assert saved(text, n) == plain(text, n)
    assert saved.count(PROMPT) == plain.count(PROMPT) == short + 5


def _train(tmp_path, specials):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([PROMPT, "place it in the bowl"] * 5,
                            trainers.WordLevelTrainer(special_tokens=specials))
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder, tok


def test_tokenizer_trained_here_loaded_from_a_folder(tmp_path):
    folder, raw = _train(tmp_path, ["[UNK]", "[PAD]", "[BOS]"])
    tok = PromptTokenizer(folder)  # a directory: finds tokenizer.json in it
    assert tok.path == folder / "tokenizer.json"
    assert (tok.bos_id, tok.pad_id) == (raw.token_to_id("[BOS]"), raw.token_to_id("[PAD]")) == (2, 1)
    out = tok("place it in the bowl", 8)
    words = ["place", "it", "in", "the", "bowl"]
    assert out.ids == [2, *[raw.token_to_id(w) for w in words], 1, 1]
    assert out.mask == [True] * 6 + [False] * 2


def test_tokenizer_without_bos_is_an_error(tmp_path):
    folder, _ = _train(tmp_path, ["[UNK]", "[PAD]"])
    with pytest.raises(ValueError, match="none of the tokens"):
        PromptTokenizer(folder)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        PromptTokenizer(tmp_path / "nope.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"expected one of tokenizer\.json, tokenizer\.model"):
        PromptTokenizer(tmp_path / "empty")


def test_sentencepiece_model(tmp_path, monkeypatch):
    """tokenizer.model works with the optional `sentencepiece` package and, without it, fails
    with an error saying what to install (both branches run where the package is installed)."""
    import builtins
    import io

    (tmp_path / "absent").mkdir()
    (tmp_path / "absent" / "tokenizer.model").write_bytes(b"not used")
    real_import = builtins.__import__

    def no_spm(name, *a, **k):
        if name == "sentencepiece":
            raise ImportError("No module named 'sentencepiece'")
        return real_import(name, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(builtins, "__import__", no_spm)
        with pytest.raises(ImportError, match=r"phyai-edge\[sentencepiece\]"):
            PromptTokenizer(tmp_path / "absent")
    try:
        import sentencepiece as spm
    except ImportError:
        return  # CI installs only [test]; the error path above is what such an install gets
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([PROMPT, "place it in the bowl", "fold the towel"] * 20), model_writer=buf,
        vocab_size=40, model_type="bpe", pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2,
    )
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    tok = PromptTokenizer(tmp_path)
    assert (tok.bos_id, tok.pad_id) == (2, 0)
    out = tok("fold the towel", 30)
    assert out.ids[0] == 2 and out.mask[0] and not out.mask[-1] and out.ids[-1] == 0
    assert out.ids[1 : sum(out.mask)] == tok.encode_plain("fold the towel")
