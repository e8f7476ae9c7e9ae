"""Data pipeline: exact entropy of the Markov source, file formats, loader determinism, resume, DP sharding."""

import numpy as np
import pytest
import torch

from xmoe.train.data import build_dataset, load_tokens, tokenize_file
from xmoe.train.loader import TokenLoader
from xmoe.train.markov import MarkovSource


def _dense_reference(src: MarkovSource):
    """Plain-loop state transition matrix, eigen-solved stationary distribution, and entropies."""
    V, G = src.vocab, src.buckets
    T = np.zeros((G * V, G * V))
    for h in range(G):
        for b in range(V):
            for c in range(V):
                T[h * V + b, src.bucket_V[b] * V + c] += src.probs_CV[h * V + b, c]
    w, vecs = np.linalg.eig(T.T)
    pi = np.real(vecs[:, np.argmin(np.abs(w - 1))])
    pi /= pi.sum()
    rate = sum(pi[s] * -sum(p * np.log(p) for p in src.probs_CV[s] if p > 0) for s in range(G * V))
    marg = pi.reshape(G, V).sum(0)
    unigram = -sum(p * np.log(p) for p in marg if p > 0)
    joint = np.zeros((V, V))
    for h in range(G):
        for b in range(V):
            joint[b] += pi[h * V + b] * src.probs_CV[h * V + b]
    bigram = -sum(joint[b, c] * np.log(joint[b, c] / marg[b]) for b in range(V) for c in range(V) if joint[b, c] > 0)
    return T, pi, rate, unigram, bigram


@pytest.mark.parametrize(
    "kw",
    [
        dict(vocab=12, order=1),
        dict(vocab=12, buckets=3, branch=2, source_seed=5),
        dict(vocab=20, buckets=2, smooth=0.3, alpha=0.5),
    ],
)
def test_markov_exact_quantities_match_dense_reference(kw):
    src = MarkovSource(**kw)
    T, pi, rate, unigram, bigram = _dense_reference(src)
    assert np.allclose(T.sum(1), 1.0, atol=1e-12)
    np.testing.assert_allclose(src.pi_C, pi, rtol=0, atol=1e-12)
    np.testing.assert_allclose(src.pi_C @ T, src.pi_C, rtol=0, atol=1e-14)
    assert src.entropy_rate == pytest.approx(rate, abs=1e-10)
    assert src.unigram_entropy == pytest.approx(unigram, abs=1e-10)
    assert src.bigram_entropy == pytest.approx(bigram, abs=1e-10)
    assert src.entropy_rate <= src.bigram_entropy + 1e-12 <= src.unigram_entropy + 2e-12


def test_markov_samples_have_the_exact_entropy():
    src = MarkovSource()  # the default source
    V = src.vocab
    x = src.sample(seed=3, indices=np.arange(400), length=513)  # 400 x 512 predictions
    ctx = src.bucket_V[x[:, :-2]] * V + x[:, 1:-1]  # context of x[:, t + 1] for t >= 1, built here from scratch
    nll = -np.log(src.probs_CV[ctx, x[:, 2:]])
    assert nll.mean() == pytest.approx(src.entropy_rate, abs=0.015)  # standard error ~0.003
    freq = np.bincount(x.ravel(), minlength=V) / x.size
    assert np.abs(freq - src.marginal_V).sum() < 0.03
    assert -(freq * np.log(freq)).sum() == pytest.approx(src.unigram_entropy, abs=0.01)
    # First token of a sample ~ the stationary marginal; the first prediction's best loss is the bigram entropy.
    first = src.sample(seed=4, indices=np.arange(20000), length=2)
    assert np.abs(np.bincount(first[:, 0], minlength=V) / 20000 - src.marginal_V).sum() < 0.08
    pi_GN = src.pi_C.reshape(src.buckets, V)[:, first[:, 0]]  # P(bucket of the unseen x_{-1}, x_0)
    probs_GN = src.probs_CV.reshape(src.buckets, V, V)[:, first[:, 0], first[:, 1]]
    q = (pi_GN * probs_GN).sum(0) / pi_GN.sum(0)  # P(x_1 | x_0)
    assert -np.log(q).mean() == pytest.approx(src.bigram_entropy, abs=0.04)  # standard error ~0.009
    assert src.bigram_entropy - src.entropy_rate > 0.3  # attention has something to learn


def _compared_walk(src, seed, indices, length):
    """The markov walk by float64 comparison of each context's whole cumulative row, one position at a time."""
    u_NT = np.stack([np.random.default_rng([seed, int(i)]).random(length) for i in indices])
    cdf_CV = np.cumsum(src.probs_CV, axis=1)[:, :-1]  # a row's last sum (1 up to rounding) never compared
    out_NT = np.empty(u_NT.shape, dtype=np.int64)
    state_N = np.searchsorted(np.cumsum(src.pi_C)[:-1], u_NT[:, 0], side="right")  # (h, x_0) ~ pi
    out_NT[:, 0] = state_N % src.vocab
    for t in range(1, length):
        out_NT[:, t] = (cdf_CV[state_N] <= u_NT[:, t, None]).sum(1)
        state_N = src.bucket_V[out_NT[:, t - 1]] * src.vocab + out_NT[:, t]
    return out_NT


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"order": 1},
        {"vocab": 7, "branch": 2},
        {"vocab": 2, "order": 1, "branch": 1, "smooth": 1.0},
        {"vocab": 256, "buckets": 4},
    ],  # the last: rows too crowded for the lookup tables, compared whole
)
@pytest.mark.parametrize("length", [1, 2, 300])
def test_markov_walk_matches_the_compared_walk(kw, length):
    src = MarkovSource(**kw)
    assert (src._walk_tables() is None) == (kw.get("vocab") == 256)  # lookup tables, or whole rows compared
    got = src.sample(seed=5, indices=np.arange(40, 137), length=length)
    assert got.shape == (97, length) and got.dtype == np.int64
    np.testing.assert_array_equal(got, _compared_walk(src, 5, np.arange(40, 137), length))


def test_markov_dataset_fields_and_options():
    ds = build_dataset("markov", seq_len=128)
    assert ds.vocab_size == 64 and ds.epoch_size is None
    assert ds.entropy_rate < ds.loss_floor < ds.bigram_entropy < ds.unigram_entropy < np.log(64)
    assert ds.loss_floor == pytest.approx((ds.bigram_entropy + 127 * ds.entropy_rate) / 128)
    one = build_dataset("markov:order=1, vocab=32", seq_len=16, vocab_size=100)
    assert one.vocab_size == 100 and one.source.vocab == 32
    assert one.entropy_rate == pytest.approx(one.bigram_entropy, abs=1e-12) == pytest.approx(one.loss_floor)
    assert "entropy rate" in ds.describe()


def _loader_batches(loader, n):
    return [next(loader) for _ in range(n)]


def _token_file(tmp_path, n=1000, dtype=np.int32):
    path = tmp_path / "tok.npy"
    np.save(path, (np.arange(n) % 997).astype(dtype))
    return str(path)


@pytest.fixture(params=["markov", "npy"])
def spec(request, tmp_path):
    return "markov" if request.param == "markov" else _token_file(tmp_path, n=300)


def test_loader_is_deterministic_and_seeded(spec):
    make = lambda seed: TokenLoader(build_dataset(spec, seq_len=16, seed=seed), global_batch_size=8)  # noqa: E731
    a, b, c = _loader_batches(make(0), 6), _loader_batches(make(0), 6), _loader_batches(make(1), 6)
    for (xa, ya), (xb, yb) in zip(a, b, strict=False):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (8, 16) and xa.dtype == torch.int64
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=False))


def test_resume_gives_the_same_next_batches(spec):
    ds = build_dataset(spec, seq_len=16, seed=2)  # npy: 18 windows, so 6 batches of 8 cross two epochs
    full = _loader_batches(TokenLoader(ds, 8), 9)
    first = TokenLoader(ds, 8)
    _loader_batches(first, 4)
    state = first.state_dict()
    for world_size in (1, 2):  # resuming on another data-parallel size keeps the global stream
        ranks = [TokenLoader(build_dataset(spec, seq_len=16, seed=2), 8, r, world_size) for r in range(world_size)]
        for loader in ranks:
            loader.load_state_dict(state)
        for x_full, _ in full[4:]:
            assert torch.equal(torch.cat([next(loader)[0] for loader in ranks]), x_full)


@pytest.mark.parametrize("world_size", [1, 2])
def test_batches_drawn_ahead_equal_batches_drawn_one_at_a_time(spec, world_size, monkeypatch):
    """The loader draws PREFETCH_ROWS rows per dataset call; its batches equal those of a loader that draws one
    batch per call (across epochs, per rank, after a state loaded in the middle of what was drawn ahead)."""
    import xmoe.train.loader as data

    ds = build_dataset(spec, seq_len=16, seed=3)  # npy: 18 windows, so the batches cross epochs
    calls = []
    draw = TokenLoader._draw
    monkeypatch.setattr(TokenLoader, "_draw", lambda self, pos: calls.append(len(pos)) or draw(self, pos))
    monkeypatch.setattr(data, "PREFETCH_ROWS", 1)  # whole batches, one per call
    singly = [_loader_batches(TokenLoader(ds, 8, r, world_size), 11) for r in range(world_size)]
    monkeypatch.setattr(data, "PREFETCH_ROWS", 16)
    calls.clear()
    ahead = [TokenLoader(ds, 8, r, world_size) for r in range(world_size)]
    for r, loader in enumerate(ahead):
        got = _loader_batches(loader, 11)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, singly[r], strict=True))
    per_call = 16 // (8 // world_size)  # batches per draw: 11 batches take ceil(11 / per_call) draws
    assert calls == [16] * (world_size * -(-11 // per_call))
    resumed = TokenLoader(ds, 8, 0, world_size)
    next(resumed)  # draws ahead from step 0
    state = ahead[0].state_dict()
    state["samples_seen"] = 5 * 8  # step 5, not where what it drew ahead begins
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed)[0], singly[0][5][0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_concatenate_to_the_global_batch(spec, world_size):
    ds = build_dataset(spec, seq_len=16, seed=7)
    whole = _loader_batches(TokenLoader(ds, 8), 7)
    ranks = [TokenLoader(ds, 8, rank=r, world_size=world_size) for r in range(world_size)]
    for x_full, y_full in whole:
        parts = [next(loader) for loader in ranks]
        assert all(x.shape == (8 // world_size, 16) for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), x_full)
        assert torch.equal(torch.cat([y for _, y in parts]), y_full)


def test_file_windows_cover_each_epoch_once_with_a_moving_shift(tmp_path):
    path = tmp_path / "ramp.npy"
    np.save(path, np.arange(1000, dtype=np.int64))  # token value = its position
    ds = build_dataset(str(path), seq_len=16, seed=1)
    assert ds.epoch_size == 999 // 16 == 62 and ds.vocab_size == 1000
    shifts, orders = set(), []
    for epoch in range(4):
        x = ds.samples(epoch, np.arange(62))
        np.testing.assert_array_equal(x, x[:, :1] + np.arange(17))  # contiguous windows
        starts = np.sort(x[:, 0])
        shift = starts[0]
        assert 0 <= shift <= 999 - 62 * 16
        np.testing.assert_array_equal(starts, shift + 16 * np.arange(62))
        shifts.add(int(shift))
        orders.append(tuple(x[:, 0] - shift))
    assert len(set(orders)) == 4 and len(shifts) > 1
    # The loader walks epoch 0's order then epoch 1's; batch 4 does not divide 62, so one batch straddles.
    stream = torch.cat([x for x, _ in _loader_batches(TokenLoader(ds, 4), 31)])
    expected = np.concatenate([ds.samples(0, np.arange(62)), ds.samples(1, np.arange(62))])[:, :-1]
    np.testing.assert_array_equal(stream.numpy(), expected)


def test_npy_and_bin_round_trips(tmp_path):
    data = np.random.default_rng(0).integers(0, 70000, size=500)
    np.save(tmp_path / "a.npy", data.astype(np.int32))
    data16 = data % 60000
    data16.astype("<u2").tofile(tmp_path / "b.bin")
    data.astype("<u4").tofile(tmp_path / "c.bin")
    data.astype("<u4").tofile(tmp_path / "d.bin")
    (tmp_path / "d.bin.dtype").write_text("uint32\n")
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "a.npy")), data)
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "b.bin")), data16)  # inferred uint16
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "c.bin"), dtype="uint32"), data)
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "c.bin"), vocab_size=70000), data)  # inferred uint32
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "d.bin")), data)  # sidecar
    ds = build_dataset(str(tmp_path / "d.bin"), seq_len=10, vocab_size=70000, seed=4)
    assert ds.epoch_size == 49 and ds.vocab_size == 70000
    windows = np.lib.stride_tricks.sliding_window_view(data, 11)
    for row in ds.samples(0, np.arange(49)):  # every sample is a contiguous slice of the file
        assert (windows == row).all(1).any()


def test_text_round_trips(tmp_path):
    text = "héllo wörld, the quick brown fox\n" * 40
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    ds = build_dataset(str(tmp_path / "t.txt"), seq_len=32)
    assert ds.vocab_size == 256 and ds.entropy_rate is None
    np.testing.assert_array_equal(ds.tokens, raw)
    assert tokenize_file(str(tmp_path / "t.txt"), str(tmp_path / "t.npy")) == len(raw)
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), raw)
    assert not (tmp_path / "t.npy.tmp").exists()
    np.testing.assert_array_equal(build_dataset(str(tmp_path / "t.npy"), seq_len=32).tokens, raw)
    with pytest.raises(ValueError, match=r"must end in \.npy"):
        tokenize_file(str(tmp_path / "t.txt"), str(tmp_path / "t.bin"))


def test_hf_tokenizer_text_matches_whole_file_encoding(tmp_path):
    import tokenizers  # a declared test dependency: missing, this test fails rather than skips

    words = [f"w{i}" for i in range(300)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)}, "[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    rng = np.random.default_rng(0)
    vocab = np.array(words + ["zzz"])  # "zzz" is out of vocabulary
    text = "\n".join(" ".join(row) for row in vocab[rng.integers(0, len(vocab), size=(30000, 12))]) + "\n"
    (tmp_path / "c.txt").write_text(text)  # > 1 MiB: several chunks
    expected = tok.encode(text).ids
    ds = build_dataset(str(tmp_path / "c.txt"), seq_len=64, tokenizer=str(tmp_path / "tok.json"))
    assert ds.vocab_size == 301
    np.testing.assert_array_equal(ds.tokens, expected)
    n = tokenize_file(str(tmp_path / "c.txt"), str(tmp_path / "c.npy"), tokenizer=str(tmp_path / "tok.json"))
    assert n == len(expected) and np.load(tmp_path / "c.npy").dtype == np.uint16
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), expected)


def test_errors_name_the_problem(tmp_path):
    def raises(exc, match, spec, **kw):
        with pytest.raises(exc, match=match):
            build_dataset(str(spec), **{"seq_len": 16, **kw})

    raises(FileNotFoundError, "nope.npy", tmp_path / "nope.npy")
    raises(FileNotFoundError, "markov", "markvo")
    (tmp_path / "x.csv").write_text("1,2,3")
    raises(ValueError, "extension '.csv'", tmp_path / "x.csv")
    raises(ValueError, "bad markov option 'foo=1'", "markov:foo=1")
    raises(ValueError, "bad markov option 'vocab'", "markov:vocab")
    raises(ValueError, "not a valid int", "markov:vocab=x")
    raises(ValueError, "order", "markov:order=3")
    raises(ValueError, "only applies to order 2", "markov:order=1,buckets=4")
    raises(ValueError, "smooth", "markov:smooth=0")
    raises(ValueError, r"vocab_size \(10\)", "markov", vocab_size=10)
    raises(ValueError, "seq_len", "markov", seq_len=0)
    (tmp_path / "e.bin").write_bytes(b"")
    raises(ValueError, "empty", tmp_path / "e.bin")
    np.save(tmp_path / "e.npy", np.zeros(0, dtype=np.int64))
    raises(ValueError, "empty", tmp_path / "e.npy")
    (tmp_path / "e.txt").write_text("")
    raises(ValueError, "empty", tmp_path / "e.txt")
    np.save(tmp_path / "short.npy", np.arange(16))
    raises(ValueError, "fewer than seq_len", tmp_path / "short.npy")
    np.save(tmp_path / "big.npy", np.arange(100))
    raises(ValueError, "token 99 >= vocab_size", tmp_path / "big.npy", vocab_size=50)
    np.save(tmp_path / "neg.npy", np.arange(100) - 1)
    raises(ValueError, "negative", tmp_path / "neg.npy")
    np.save(tmp_path / "f.npy", np.zeros(100, dtype=np.float32))
    raises(ValueError, "float32", tmp_path / "f.npy")
    np.save(tmp_path / "2d.npy", np.zeros((10, 10), dtype=np.int64))
    raises(ValueError, "2-D", tmp_path / "2d.npy")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    raises(ValueError, "multiple of 2", tmp_path / "odd.bin")
    np.arange(1, 100, dtype="<u4").tofile(tmp_path / "u32.bin")
    raises(ValueError, "reads like uint32", tmp_path / "u32.bin")
    raises(ValueError, "'int8'", tmp_path / "u32.bin", dtype="int8")
    (tmp_path / "ok.txt").write_text("some text " * 10)
    raises(FileNotFoundError, "tok.json", tmp_path / "ok.txt", tokenizer=str(tmp_path / "tok.json"))
    ds = build_dataset("markov", seq_len=8)
    with pytest.raises(ValueError, match="multiple of world_size"):
        TokenLoader(ds, 6, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        TokenLoader(ds, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seed"):
        TokenLoader(build_dataset("markov", seq_len=8, seed=1), 8).load_state_dict(TokenLoader(ds, 8).state_dict())
