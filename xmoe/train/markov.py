"""The synthetic Markov source behind ``--data markov``: a seeded sparse chain whose entropy rate, unigram and
bigram entropies are computed exactly, so a run's log shows how far its loss is from the best possible.
"""

from __future__ import annotations

import numpy as np

# Legend (this file's own): N samples, T positions in a sample, V vocab, G hash buckets, C contexts (= G * V),
# K successors per context.


_U_BITS = 53  # numpy's float64 uniforms are integer multiples of 2**-53


def _check_options(
    vocab: int, order: int, buckets: int | None, branch: int, alpha: float, smooth: float, source_seed: int
) -> int:
    """The source's options in range, naming the bad one; returns the number of buckets (the order's default)."""
    if vocab < 2:
        raise ValueError(f"markov vocab ({vocab}) must be >= 2")
    if order not in (1, 2):
        raise ValueError(f"markov order ({order}) must be 1 or 2 (order 2 hashes the older token)")
    if order == 1 and buckets not in (None, 1):
        raise ValueError(f"markov buckets ({buckets}) only applies to order 2; drop it or set order=2")
    buckets = (2 if order == 2 else 1) if buckets is None else buckets
    if not 1 <= buckets <= vocab:
        raise ValueError(f"markov buckets ({buckets}) must be in [1, vocab={vocab}]")
    if not 1 <= branch <= vocab:
        raise ValueError(f"markov branch ({branch}) must be in [1, vocab={vocab}]")
    if buckets * vocab * vocab > 2**22:  # 2**23 already takes ~13 s to build
        raise ValueError(
            f"markov buckets * vocab**2 ({buckets * vocab * vocab}) must be <= 2**22; lower vocab or buckets"
        )
    if not alpha > 0:
        raise ValueError(f"markov alpha ({alpha}) must be > 0")
    if not 0 < smooth <= 1:
        raise ValueError(f"markov smooth ({smooth}) must be in (0, 1]; it keeps the chain irreducible")
    if source_seed < 0:
        raise ValueError(f"markov source_seed ({source_seed}) must be >= 0")
    return buckets


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Entropy in nats along ``axis``, with 0 log 0 = 0."""
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis)


class MarkovSource:
    """Seeded sparse Markov source over ``vocab`` tokens whose entropy rate is computed exactly.

    order=1: x_{t+1} ~ P[x_t]. order=2: x_{t+1} ~ P[bucket[x_{t-1}] * vocab + x_t], where ``bucket`` hashes a
    token into one of ``buckets`` (default 2) classes, so the next token also depends on a few bits of the
    token before the current one, which a model can only read with attention. Each of the C = buckets * vocab
    contexts has ``branch`` likely successors with Dirichlet(alpha) weights, mixed with ``smooth`` uniform
    mass, which makes the chain irreducible and aperiodic: pi is unique and power iteration converges.

    The state (bucket[x_{t-1}], x_t) is an ordinary Markov chain on C states, so with pi its stationary
    distribution: entropy_rate = sum_s pi_s H(P[s]); unigram_entropy = H(token marginal), the best loss
    without context; bigram_entropy = H(x_{t+1} | x_t), the best loss from the current token alone.

    Defaults chosen by a sweep (300 steps, batch 16 x 128, AdamW 3e-3, dense 4-layer transformer): unigram
    4.06, bigram 1.75, entropy rate 1.18 nats; a 1.8M-parameter model ends 0.035 above the floor, a 0.8M
    one 0.20 above (0.016 after 600 steps). vocab 256 / 4 buckets left a 0.8-1.2 nat gap at 300 steps.
    """

    def __init__(
        self,
        vocab: int = 64,
        order: int = 2,
        buckets: int | None = None,
        branch: int = 4,
        alpha: float = 1.0,
        smooth: float = 0.01,
        source_seed: int = 0,
    ) -> None:
        buckets = _check_options(vocab, order, buckets, branch, alpha, smooth, source_seed)
        self.vocab, self.order, self.buckets = vocab, order, buckets
        self.options = dict(
            vocab=vocab,
            order=order,
            buckets=buckets,
            branch=branch,
            alpha=alpha,
            smooth=smooth,
            source_seed=source_seed,
        )
        V, G = vocab, buckets
        rng = np.random.default_rng([source_seed, V, G, branch])
        # Balanced hash: every bucket gets vocab / G tokens.
        self.bucket_V = rng.permutation(V) % G
        succ_CK = rng.random((G * V, V)).argsort(axis=1)[:, :branch]
        w_CK = rng.dirichlet(np.full(branch, alpha), size=G * V)
        probs_CV = np.full((G * V, V), smooth / V)
        np.put_along_axis(probs_CV, succ_CK, smooth / V + (1 - smooth) * w_CK, axis=1)
        self.probs_CV = probs_CV / probs_CV.sum(1, keepdims=True)
        self.pi_C = self._stationary()

        self._entropies()
        # Sampling tables: cumulative rows, last entry +inf so rounding never runs past the end.
        self._cdf_CV = np.cumsum(self.probs_CV, axis=1)
        self._cdf_CV[:, -1] = np.inf
        self._cdf_pi_C = np.cumsum(self.pi_C)
        self._cdf_pi_C[-1] = np.inf
        self._walk: tuple | None = None  # sample's lookup tables, made on first use (_walk_tables)

    def _entropies(self) -> None:
        """Exact entropies, all float64 nats: the entropy rate, the unigram's and the bigram's."""
        G, V = self.buckets, self.vocab
        self.entropy_rate = float(self.pi_C @ _entropy(self.probs_CV))
        pi_GV = self.pi_C.reshape(G, V)
        self.marginal_V = pi_GV.sum(0)
        self.unigram_entropy = float(_entropy(self.marginal_V))
        joint_VV = np.einsum("gb,gbc->bc", pi_GV, self.probs_CV.reshape(G, V, V))  # P(x_t=b, x_{t+1}=c)
        self.bigram_entropy = float(_entropy(joint_VV.ravel()) - self.unigram_entropy)

    def _stationary(self, tol: float = 1e-14, max_iter: int = 10_000) -> np.ndarray:
        """pi_C with pi P = pi, by power iteration in float64 on the C-state chain (~80 iterations: the
        smoothing makes every state reachable from every other in two steps)."""
        G, V = self.buckets, self.vocab
        probs_GVV = self.probs_CV.reshape(G, V, V)
        onehot_GV = (self.bucket_V[None, :] == np.arange(G)[:, None]).astype(np.float64)
        pi_GV = np.full((G, V), 1.0 / (G * V))
        for _ in range(max_iter):
            # State (h, b) emits c and moves to (bucket[b], c).
            flow_VV = np.einsum("hb,hbc->bc", pi_GV, probs_GVV)
            new_GV = onehot_GV @ flow_VV
            new_GV /= new_GV.sum()
            done = np.abs(new_GV - pi_GV).sum() < tol
            pi_GV = new_GV
            if done:
                return pi_GV.ravel()
        raise RuntimeError(f"stationary distribution did not converge in {max_iter} iterations")

    def loss_floor(self, seq_len: int) -> float:
        """Least expected mean loss over a window's seq_len predictions: the first prediction sees only
        x_0 (bigram entropy), the rest see their full context (entropy rate). Equal to the entropy rate
        for order 1."""
        return (self.bigram_entropy + (seq_len - 1) * self.entropy_rate) / seq_len

    def _walk_tables(self) -> tuple[np.ndarray, np.ndarray, int, int] | None:
        """``sample``'s lookup tables, made on first use: (keys, first, shift, steps), or None where the chain's
        cumulative rows are too crowded for them (then ``sample`` compares whole rows).

        numpy's float64 uniforms are integer multiples of 2**-53, so cdf <= u exactly when
        ceil(cdf * 2**53) <= u * 2**53 (both exact in float64): keys (C * V,) int64 holds the rows' cumulative
        sums so scaled (the +inf of each row's end as 2**53, above every u). Row c's range of u is cut into
        2**bits buckets; first (C * 2**bits,) int64 holds c * V + the count of row c's keys <= the bucket's
        start, and at most ``steps`` keys lie inside a bucket, so the count for u is at most ``steps``
        comparisons past it. The fewest bits (8-16, a table of at most 2**22 entries) that leave one step."""
        if self._walk is None:
            C, V = self._cdf_CV.shape
            cdf = np.ceil(np.ldexp(self._cdf_CV, _U_BITS))
            cdf[:, -1] = 2.0**_U_BITS
            keys_CV = cdf.astype(np.int64)
            row_C = np.arange(C, dtype=np.int64)[:, None]
            for bits in range(8, 17):
                # key <= b * 2**shift exactly when (key - 1) >> shift < b: a cumulative count per bucket
                shift = _U_BITS - bits
                slot_CV = row_C * ((1 << bits) + 1) + ((keys_CV - 1) >> shift) + 1
                count_CB = np.cumsum(np.bincount(slot_CV.ravel(), minlength=C * ((1 << bits) + 1)).reshape(C, -1), 1)
                steps = int(np.diff(count_CB, axis=1).max())
                if steps <= 1 or C << (bits + 1) > 2**22:
                    break
            first = (count_CB[:, :-1] + row_C * V).ravel()
            self._walk = (keys_CV.ravel(), first, shift, steps) if steps <= 4 else ()
        return self._walk or None

    def sample(self, seed: int, indices: np.ndarray, length: int) -> np.ndarray:
        """(N, length) int64: sample i is a stationary stretch drawn from uniforms of rng (seed, i) only, so it
        does not depend on which other samples are drawn with it."""
        u_NT = np.stack([np.random.default_rng([seed, int(i)]).random(length) for i in indices])
        state_N = np.searchsorted(self._cdf_pi_C, u_NT[:, 0], side="right")  # (h, x_0) ~ pi
        # Inverse-CDF draws from each sample's context row, vectorized over the N samples: the count of the row's
        # cumulative sums <= u, by lookup (_walk_tables) or by comparing the whole row; (T, N) arrays, so that
        # each position's loads and stores are contiguous.
        tables = self._walk_tables()
        out_TN = np.empty((length, len(indices)), dtype=np.int64)
        out_TN[0] = state_N % self.vocab
        if tables is None:
            uf_TN = np.ascontiguousarray(u_NT.T)
            for t in range(1, length):
                (self._cdf_CV[state_N] <= uf_TN[t, :, None]).sum(1, out=out_TN[t])
                state_N = self.bucket_V[out_TN[t - 1]] * self.vocab + out_TN[t]
            return np.ascontiguousarray(out_TN.T)
        keys, first, shift, steps = tables
        u_TN = np.ascontiguousarray(np.ldexp(u_NT, _U_BITS).astype(np.int64).T)
        in_row_TN = u_TN >> shift  # each u's bucket within its row
        # idx = c * V + x_t (c the context of x_t, itself bucket(x_{t-2}) * V + x_{t-1}) names both of the
        # next context's tokens: next_CV[idx] is the first bucket of that context's row
        C, V = self._cdf_CV.shape
        next_CV = (self.bucket_V[np.arange(C) % V].astype(np.int64)[:, None] * V + np.arange(V)) << (_U_BITS - shift)
        next_CV = next_CV.ravel()
        idx_TN = np.empty_like(u_TN)
        bucket_N = state_N.astype(np.int64) << (_U_BITS - shift)  # the first bucket of each sample's row
        for t in range(1, length):
            idx_N = first.take(bucket_N + in_row_TN[t], out=idx_TN[t])
            for _ in range(steps):
                idx_N += keys.take(idx_N) <= u_TN[t]
            bucket_N = next_CV.take(idx_N)
        out_TN[1:] = idx_TN[1:] % V
        return np.ascontiguousarray(out_TN.T)
