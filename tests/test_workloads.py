"""slimcomm.train.workloads: the models (MLP, ConvNet, GPT) and the text corpus loader."""

import math
import os

import pytest
import torch

from slimcomm.train.workloads import models as M
from slimcomm.train.workloads import text as X


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------

def test_mlp_default_size_and_shape():
    m = M.build_mlp(784, (2048, 2048), 10)
    assert M.num_params(m) == 5_824_522
    assert M.build_mlp(5, (7,), 3)(torch.randn(4, 5)).shape == (4, 3)
    with pytest.raises(ValueError, match=r"hidden\[1\]"):
        M.build_mlp(5, (7, 0), 3)


def _gpt_params(v, t, layers, d):
    return v * d + t * d + layers * (12 * d * d + 13 * d) + 2 * d + d * v


@pytest.mark.parametrize("layers,d,heads", [(1, 16, 2), (2, 24, 3)])
def test_gpt_shapes_and_param_count(layers, d, heads):
    torch.manual_seed(0)
    g = M.GPT(vocab_size=11, block_size=9, n_layer=layers, n_embd=d, n_head=heads)
    assert M.num_params(g) == _gpt_params(11, 9, layers, d)
    idx = torch.randint(0, 11, (3, 9))
    out = g(idx)
    assert out.shape == (3, 9, 11) and out.dtype == torch.float32
    assert g(idx[:, :4]).shape == (3, 4, 11)
    assert g(idx.int()).shape == (3, 9, 11)
    assert g.head.bias is None and g.head.weight.data_ptr() != g.tok_emb.weight.data_ptr()  # untied


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gpt_is_causal(dropout):
    """Changing a token at position p changes no logit before p (and does change later ones)."""
    torch.manual_seed(1)
    g = M.GPT(vocab_size=13, block_size=12, n_layer=2, n_embd=16, n_head=2, dropout=dropout).eval()
    idx = torch.randint(0, 13, (2, 12))
    base = g(idx)
    for p in (0, 5, 11):
        changed = idx.clone()
        changed[:, p] = (changed[:, p] + 1) % 13
        out = g(changed)
        torch.testing.assert_close(out[:, :p], base[:, :p], rtol=0, atol=0)
        assert not torch.allclose(out[:, p:], base[:, p:])


def test_gpt_dropout_only_in_train_mode():
    torch.manual_seed(2)
    g = M.GPT(vocab_size=7, block_size=6, n_layer=1, n_embd=8, n_head=2, dropout=0.5)
    idx = torch.randint(0, 7, (2, 6))
    g.eval()
    assert torch.equal(g(idx), g(idx))
    g.train()
    assert not torch.equal(g(idx), g(idx))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(vocab_size=0), "vocab_size"),
    (dict(vocab_size=5, n_embd=10, n_head=3), "multiple of n_head"),
    (dict(vocab_size=5, dropout=1.0), "dropout"),
    (dict(vocab_size=5, n_layer=True), "n_layer"),
])
def test_gpt_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        M.GPT(**kwargs)


def test_gpt_bad_input():
    g = M.GPT(vocab_size=5, block_size=4, n_layer=1, n_embd=8, n_head=2)
    with pytest.raises(ValueError, match="block_size=4"):
        g(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="idx"):
        g(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="idx"):
        g(torch.zeros(3, dtype=torch.long))


def test_convnet_shapes_and_size():
    c = M.ConvNet()
    assert M.num_params(c) == 421_834
    assert c(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    small = M.ConvNet(num_classes=4, image_size=8, channels=(8, 16), hidden=12)
    assert small(torch.randn(3, 1, 8, 8)).shape == (3, 4)
    assert not any(True for _ in c.buffers())  # GroupNorm: no running statistics
    with pytest.raises(ValueError, match=r"x must be \[N, 1, 28, 28\]"):
        c(torch.randn(5, 784))
    with pytest.raises(ValueError, match="image_size 3"):
        M.ConvNet(image_size=3)
    with pytest.raises(ValueError, match="groups"):
        M.ConvNet(channels=(12,), groups=8)


# ---------------------------------------------------------------------------
# Text corpus
# ---------------------------------------------------------------------------

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
        "it was the age of foolishness. Caf\u00e9 \u00fcber na\u00efve. ") * 40


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT, encoding="utf-8")
    return str(p)


def test_char_tokens(text_file):
    c = X.load_corpus(text_file, "char")
    assert c.vocab == "".join(sorted(set(TEXT))) and c.vocab_size == len(set(TEXT))
    assert c.tokenizer == "char" and c.name == "corpus.txt"
    assert c.train.dtype == torch.int32 and c.num_tokens == len(TEXT)
    assert c.val.numel() == round(len(TEXT) * 0.05)
    assert c.decode(torch.cat([c.train, c.val])) == TEXT  # validation = the end of the stream
    assert int(c.train.max()) < c.vocab_size


def test_byte_tokens(text_file):
    c = X.load_corpus(text_file, "byte", val_fraction=0.1)
    raw = TEXT.encode("utf-8")
    assert c.vocab is None and c.vocab_size == 256 and c.num_tokens == len(raw) > len(TEXT)
    assert bytes(torch.cat([c.train, c.val]).tolist()) == raw
    assert c.decode(c.val) == raw[-c.val.numel():].decode("utf-8", errors="replace")


def test_corpus_errors(tmp_path, text_file):
    with pytest.raises(FileNotFoundError, match="--text-file"):
        X.load_corpus(str(tmp_path / "missing.txt"))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("na\u00efve caf\u00e9 text".encode("latin-1") * 10)
    with pytest.raises(ValueError, match="--tokens byte"):
        X.load_corpus(str(latin), "char")
    assert X.load_corpus(str(latin), "byte").vocab_size == 256
    with pytest.raises(ValueError, match="--tokens"):
        X.load_corpus(text_file, "word")
    with pytest.raises(ValueError, match="val_fraction"):
        X.load_corpus(text_file, val_fraction=0.9)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="0 tokens"):
        X.load_corpus(str(empty))


def test_missing_fortunes_names_apt_get(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y fortunes") as ei:
        X.load_corpus(None, fortunes_dir=str(tmp_path / "nowhere"))
    assert "--text-file" in str(ei.value)


def test_fortunes_format(tmp_path):
    """Entries split at lone '%' lines, overstriking removed, *.dat / *.u8 skipped, fixed shuffle."""
    d = tmp_path / "fortunes"
    d.mkdir()
    (d / "alpha").write_bytes(b"First entry.\n%\nSecond _\x08u_\x08n_\x08d_\x08e_\x08rlined.\n%\n")
    (d / "beta").write_text("Third, with\n\ntwo paragraphs.\n%\n   \n%\nFourth.\n")
    (d / "alpha.dat").write_bytes(b"\x00\x01BINARY")
    (d / "beta.u8").write_text("SHOULD NOT APPEAR")
    text = X.read_fortunes(str(d))
    assert "SHOULD NOT" not in text and "BINARY" not in text and "%" not in text and "\x08" not in text
    for entry in ("First entry.", "Second underlined.", "Third, with\n\ntwo paragraphs.", "Fourth."):
        assert entry in text
    assert text.count("\n\n") == 3 + 1 and text.endswith(".\n")  # 3 entry separators + 1 paragraph break
    assert X.read_fortunes(str(d)) == text  # deterministic order


@pytest.mark.skipif(not os.path.isdir(X.FORTUNES_DIR), reason="Debian's fortunes package is not installed")
def test_real_fortunes_corpus():
    c = X.load_corpus(None, "char")
    assert c.name == "fortunes" and c.num_tokens > 1_000_000
    assert 60 <= c.vocab_size <= 400 and "e" in c.vocab
    assert c.val.numel() == round(c.num_tokens * 0.05)
    b = X.load_corpus(None, "byte")
    assert b.vocab_size == 256 and b.num_tokens >= c.num_tokens


def test_train_windows_disjoint_shards_and_determinism():
    tokens = torch.arange(1000, dtype=torch.int32)  # a token's value is its position
    T, B, W = 7, 5, 3
    state = torch.random.get_rng_state()
    spans = []
    for rank in range(W):
        w = X.TrainWindows(tokens, T, B, rank, W, seed=4)
        again = X.TrainWindows(tokens, T, B, rank, W, seed=4)
        lo, hi = rank * (1000 // W), (rank + 1) * (1000 // W)
        seen = set()
        for _ in range(30):
            x, y = w.next_batch()
            x2, y2 = again.next_batch()
            assert torch.equal(x, x2) and torch.equal(y, y2)
            assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
            assert x.is_contiguous() and y.is_contiguous()
            assert torch.equal(y, x + 1)  # y is x shifted by one token, windows are contiguous
            assert int(x.min()) >= lo and int(y.max()) < hi
            seen.update(x[:, 0].tolist())
        spans.append(seen)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is never touched
    assert len(spans[0]) > 20  # windows are random, not a fixed start
    other_seed = X.TrainWindows(tokens, T, B, 0, W, seed=5).next_batch()[0]
    assert not torch.equal(other_seed, X.TrainWindows(tokens, T, B, 0, W, seed=4).next_batch()[0])


def test_train_windows_errors():
    tokens = torch.arange(20, dtype=torch.int32)
    with pytest.raises(ValueError, match="--block-size 10"):
        X.TrainWindows(tokens, 10, 2, 0, 2)
    with pytest.raises(ValueError, match="rank"):
        X.TrainWindows(tokens, 3, 2, 2, 2)
    with pytest.raises(ValueError, match="batch_size"):
        X.TrainWindows(tokens, 3, 0, 0, 2)


def test_validation_batches_fixed():
    val = torch.arange(500, 800, dtype=torch.int32)
    vb = X.validation_batches(val, 9, 4, 5)
    again = X.validation_batches(val.clone(), 9, 4, 5)
    assert len(vb) == 5
    for (x, y), (x2, y2) in zip(vb, again):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert x.shape == (4, 9) and x.dtype == torch.int64 and torch.equal(y, x + 1)
    starts = torch.cat([x[:, 0] for x, _ in vb])
    assert int(starts[0]) == 500 and int(starts[-1]) == 800 - 10  # evenly spaced over the whole split
    assert starts.unique().numel() == 20
    with pytest.raises(ValueError, match="--block-size 400"):
        X.validation_batches(val, 400, 4, 5)
    with pytest.raises(ValueError, match="num_batches"):
        X.validation_batches(val, 9, 4, 0)


def test_gpt_learns_the_toy_corpus(text_file):
    """A few AdamW steps on the loader's windows bring the loss below the uniform log(V)."""
    c = X.load_corpus(text_file, "char")
    torch.manual_seed(0)
    g = M.GPT(c.vocab_size, block_size=16, n_layer=1, n_embd=32, n_head=2)
    opt = torch.optim.AdamW(g.parameters(), lr=3e-3)
    w = X.TrainWindows(c.train, 16, 8, 0, 1, seed=0)
    for _ in range(40):
        x, y = w.next_batch()
        loss = torch.nn.functional.cross_entropy(g(x).reshape(-1, c.vocab_size), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < math.log(c.vocab_size) - 0.5
