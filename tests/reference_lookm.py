"""Independent NumPy float64 reference of LOOK-M eq. 4-12 and its baselines.

Written straight from the equations with plain loops (small sizes only); imports nothing from
lookm_jax. Results are per (row b, KV head h): sorted kept positions and the kept keys/values.
"""

from __future__ import annotations

import math

import numpy as np


def attention_probs(q, k, valid):
    """P[b, hq, i, j] = softmax_j over {j <= i, valid j} of q_i.k_j / sqrt(D); 0 rows for padding i."""
    b_, hq, length, d = q.shape
    g = hq // k.shape[1]
    p = np.zeros((b_, hq, length, length))
    for b in range(b_):
        for h in range(hq):
            for i in range(length):
                if not valid[b, i]:
                    continue
                js = [j for j in range(i + 1) if valid[b, j]]
                logits = np.array([q[b, h, i] @ k[b, h // g, j] / math.sqrt(d) for j in js], np.float64)
                e = np.exp(logits - logits.max())
                p[b, h, i, js] = e / e.sum()
    return p


def _group_mean(x, hkv):
    b_, hq = x.shape[:2]
    return x.reshape(b_, hkv, hq // hkv, *x.shape[2:]).mean(2)


def attention_scores(q, k, valid):
    """Eq. 4: A_s[j] = sum_i P[i, j], mean over the query heads of each KV group. [B, Hkv, L]."""
    return _group_mean(attention_probs(q, k, valid).sum(2), k.shape[1])


def reconstruction_maxima(q, k, valid, second):
    """KVzip: R[b, hq, j] = max over the second copy's queries i (second[b, i]) of P[b, hq, i, j]. [B, Hq, L]."""
    return np.where(second[:, None, :, None], attention_probs(q, k, valid), 0.0).max(2)


def doubled(q, k, valid):
    """q [B, Hq, L, D], k [B, Hkv, L, D], valid [B, L] right-padded -> (q2, k2, valid2, second) over 2L: each
    row's tokens, a copy of them, then padding, as `reconstruction.doubled_prompt` lays out a prefill."""
    length = k.shape[2]
    n = np.asarray(valid).sum(-1)[:, None]  # [B, 1]
    index = np.arange(2 * length)[None]  # [1, 2L]
    valid2, second = index < 2 * n, (index >= n) & (index < 2 * n)
    source = np.clip(np.where(index < n, index, index - n), 0, length - 1)[:, None, :, None]  # [B, 1, 2L, 1]
    copy = [np.where(valid2[:, None, :, None], np.take_along_axis(np.asarray(x), source, axis=2), 0) for x in (q, k)]
    return copy[0], copy[1], valid2, second


def reconstruction_scores(q, k, valid, second, length):
    """The reconstruction maxima of the first `length` tokens, max over each KV group's query heads. [B, Hkv, length]."""
    r = reconstruction_maxima(q, k, valid, second)[..., :length]
    return r.reshape(r.shape[0], k.shape[1], -1, length).max(2)


def shares(scores, valid):
    """Each row and head's scores over its valid tokens divided by their total, 0 at padding. [B, Hkv, L]."""
    scores = np.where(valid[:, None, :], scores, 0.0)
    return scores / scores.sum(-1, keepdims=True)


def mean_std(q, k, valid):
    """RoCo: mean and std of P[i, j] over the valid queries i >= j, per head, then group mean."""
    p = attention_probs(q, k, valid)
    b_, hq, length, _ = p.shape
    mean = np.zeros((b_, hq, length))
    std = np.zeros((b_, hq, length))
    for b in range(b_):
        for h in range(hq):
            for j in range(length):
                seen = [p[b, h, i, j] for i in range(j, length) if valid[b, i]]
                if valid[b, j]:
                    mean[b, h, j] = np.mean(seen)
                    std[b, h, j] = np.std(seen)
    return _group_mean(mean, k.shape[1]), _group_mean(std, k.shape[1])


def recent_positions(valid_row, m):
    """The last m valid positions of a row."""
    idx = [j for j in range(len(valid_row)) if valid_row[j]]
    return idx[max(0, len(idx) - m):] if m > 0 else []


def window_scores(q, k, valid, window, m, kernel_size, pooling):
    """SnapKV: votes of the last `window` valid queries to the non-recent keys, pooled per query head."""
    p = attention_probs(q, k, valid)
    b_, hq, length, _ = p.shape
    out = np.zeros((b_, hq, length))
    half = kernel_size // 2
    for b in range(b_):
        rows = [i for i in range(length) if valid[b, i]]
        obs = rows[max(0, len(rows) - window[b]):] if window[b] else []
        recent = set(recent_positions(valid[b], m[b]))
        for h in range(hq):
            votes = np.array([sum(p[b, h, i, j] for i in obs) if valid[b, j] and j not in recent else 0.0
                              for j in range(length)])
            padded = np.concatenate([np.zeros(half), votes, np.zeros(half)])
            win = [padded[j:j + kernel_size] for j in range(length)]
            out[b, h] = [w.max() if pooling == "max" else w.sum() / kernel_size for w in win]
    return _group_mean(out, k.shape[1])


def image_quota_count(quota, n, candidates, images):
    """Ranked slots reserved for image tokens: floor(quota * N), or floor(N * images / candidates)."""
    if quota == "proportional":
        return n * images // max(candidates, 1)
    return math.floor(quota * n)


def row_candidates(valid_row, is_image_row, m_b, n_sink):
    """One row's valid positions, its recent window (M), the rest (the candidates), the first n_sink of
    them (sinks), the remaining pool, and the pool's image positions."""
    idx = [j for j in range(len(valid_row)) if valid_row[j]]
    recent = recent_positions(valid_row, m_b)
    rest = [j for j in idx if j not in recent]
    sinks = rest[:n_sink]
    pool = [j for j in rest if j not in sinks]
    return idx, recent, rest, sinks, pool, [j for j in pool if is_image_row[j]]


def text_window(valid, is_image, m, n):
    """Per-row (M, N) lists with the recent window cut to the valid tokens after the row's last image
    token, the slots it gives up ranked instead."""
    windows, ranked = [], []
    for b, (m_b, n_b) in enumerate(zip(m, n)):
        images = [j for j in range(len(valid[b])) if valid[b, j] and is_image[b, j]]
        tail = sum(1 for j in range(len(valid[b])) if valid[b, j] and (not images or j > images[-1]))
        windows.append(min(m_b, tail))
        ranked.append(n_b + m_b - windows[-1])
    return windows, ranked


def picture_of(is_image_row):
    """{position: its picture} for every image token: pictures are runs of consecutive image tokens,
    numbered from 1 in reading order."""
    pictures, number = {}, 0
    for j, image in enumerate(is_image_row):
        if image:
            number += j == 0 or not is_image_row[j - 1]
            pictures[j] = number
    return pictures


def reserved_images(head_scores, pool, image_pool, quota, n_b, pictures=None):
    """The image quota's reserved slots of one head: its best image tokens of the pool (ties: lower
    position); none without a quota. pictures ({position: picture}, picture balance): taken in
    rounds, each picture's best of the pool, then each one's second best, ... (a round by score)."""
    if quota is None:
        return []
    count = image_quota_count(quota, n_b, len(pool), len(image_pool))
    best_first = sorted(image_pool, key=lambda j: (-float(head_scores[j]), j))
    if pictures is None:
        return best_first[:count]
    seen = {}
    round_of = {}
    for j in best_first:  # a picture's t-th best is in round t
        round_of[j] = seen.get(pictures[j], 0)
        seen[pictures[j]] = round_of[j] + 1
    return sorted(best_first, key=lambda j: (round_of[j], -float(head_scores[j]), j))[:count]


def adaptive_ranked(scores, valid, is_image, m, n, *, groups, head_floor, text_prior, n_sink=0, image_quota=None,
                    picture_balance=False):
    """AdaKV: {(b, h): ranked slots of head h}. Per row and group of heads, each head first gets its
    F = min(floor(head_floor N), C) best candidates (C outside the recent window), then the group's
    H_g (min(N, C) - F) remaining slots go to the best of all its heads' other candidates, ranked by
    class (sink > quota-reserved image > text under text-prior > other), score (sinks: 0), head, position."""
    b_, h_, _ = scores.shape
    hg = h_ // groups
    out = {}
    for b in range(b_):
        _, _, rest, sinks, pool, image_pool = row_candidates(valid[b], is_image[b], m[b], n_sink)
        pictures = picture_of(is_image[b]) if picture_balance else None
        floor = min(math.floor(head_floor * n[b]), len(rest))
        for g in range(groups):
            entries = []
            for h in range(g * hg, (g + 1) * hg):
                reserved = reserved_images(scores[b, h], pool, image_pool, image_quota, n[b], pictures)

                def key(j, h=h, reserved=reserved):
                    cls = 3 if j in sinks else 2 if j in reserved else 1 if text_prior and not is_image[b, j] else 0
                    return (-cls, 0.0 if j in sinks else -float(scores[b, h, j]), h, j)

                entries += sorted(key(j) for j in rest)[floor:]
                out[b, h] = floor
            for entry in sorted(entries)[:hg * (min(n[b], len(rest)) - floor)]:
                out[b, entry[2]] += 1
    return out


def select(scores, valid, is_image, m, n, *, text_prior, n_sink=0, keep_all_text=False, image_quota=None,
           picture_balance=False, head_n=None):
    """Eq. 5-8 for every (b, h): sorted kept positions (recent M + top N; ties: lower position).
    With an image quota, the best floor(q N) image tokens outside the window and the sinks rank
    right after the sinks, above every text token. head_n: {(b, h): N of the head} (AdaKV) instead of N."""
    b_, h_, _ = scores.shape
    kept = {}
    for b in range(b_):
        idx, recent, rest, sinks, pool, image_pool = row_candidates(valid[b], is_image[b], m[b], n_sink)
        pictures = picture_of(is_image[b]) if picture_balance else None
        for h in range(h_):
            a = {j: float(scores[b, h, j]) for j in idx}
            reserved = reserved_images(scores[b, h], pool, image_pool, image_quota, n[b], pictures)
            if text_prior:  # eq. 5
                top = max(a.values())
                a = {j: s + top if not is_image[b, j] else s for j, s in a.items()}
            for j in reserved:  # above every text score (<= 2 max), in their own score order
                a[j] += 10.0 * (1.0 + abs(top if text_prior else max(a.values())))
            for j in sinks:
                a[j] = math.inf
            ranked = sorted(rest, key=lambda j: (-a[j], j))
            chosen = set(recent) | set(ranked[:n[b] if head_n is None else head_n[b, h]])
            if keep_all_text:
                chosen |= {j for j in rest if not is_image[b, j]} | set(sinks)
            kept[b, h] = sorted(chosen)
    return kept


def merge(keys, values, kept, valid, mode, similarity_filter=False, is_image=None):
    """Eq. 9-12: fold each evicted pair into its most cosine-similar kept pair (same head).

    averaged: (k_c + sum k_e) / (1 + n); pivotal: (k_c + sum (k_e + k_c) / 2) / (1 + n);
    weighted: (k_c + sum cos_e k_e) / (1 + n). Returns {(b, h): (kept_keys, kept_values, tokens per slot)}.
    With `is_image` [B, L], a pair merges only into a kept pair of its own modality (none: not merged).
    """
    out = {}
    b_, h_, length, _ = keys.shape
    assign = {}
    for b in range(b_):
        for h in range(h_):
            ks = kept[b, h]
            evicted = [j for j in range(length) if valid[b, j] and j not in ks]
            pairs = []
            for e in evicted:
                cos = [keys[b, h, e] @ keys[b, h, c] / (np.linalg.norm(keys[b, h, e]) * np.linalg.norm(keys[b, h, c]))
                       if is_image is None or is_image[b, c] == is_image[b, e] else -np.inf for c in ks]
                best = int(np.argmax(cos)) if ks and max(cos) > -np.inf else None
                pairs.append((e, best, cos[best] if best is not None else None))
            assign[b, h] = pairs
    for b in range(b_):
        if similarity_filter:
            heads = [assign[b, h] for h in range(h_)]
            m_t = [np.mean([heads[h][t][2] for h in range(h_)]) for t in range(len(heads[0]))]
            passes = [mt >= np.mean(m_t) for mt in m_t] if m_t else []
        for h in range(h_):
            ks = kept[b, h]
            kk = keys[b, h, ks].astype(np.float64)
            vv = values[b, h, ks].astype(np.float64)
            num_k, num_v, cnt = kk.copy(), vv.copy(), np.ones(len(ks))
            for t, (e, c, cos) in enumerate(assign[b, h]):
                if c is None or (similarity_filter and not passes[t]):
                    continue
                ke, ve = keys[b, h, e].astype(np.float64), values[b, h, e].astype(np.float64)
                if mode == "averaged":
                    num_k[c] += ke
                    num_v[c] += ve
                elif mode == "pivotal":
                    num_k[c] += (ke + kk[c]) / 2
                    num_v[c] += (ve + vv[c]) / 2
                else:
                    num_k[c] += cos * ke
                    num_v[c] += cos * ve
                cnt[c] += 1
            out[b, h] = (num_k / cnt[:, None], num_v / cnt[:, None], cnt)
    return out


def budget(alpha, length):
    return math.floor(alpha * length)


def layer_ranked(n, n_max, layer, num_layers, weights):
    """Layer `layer`'s ranked slots when the uniform budget ranks n (n_max for a full bucket): its
    share of num_layers * n by cumulative floors of the weights' running sums, capped at its share of
    n_max. weights: "pyramid" (PyramidKV, beta 20: linear from 2 - 1/20 to 1/20) or a list."""
    if weights == "pyramid":
        weights = [2 - 1 / 20 - i * (2 - 2 / 20) / (num_layers - 1) for i in range(num_layers)]

    def share(total):
        running = [sum(weights[:i]) / sum(weights) for i in range(num_layers + 1)]
        return math.floor(running[layer + 1] * num_layers * total + 1e-9) - math.floor(running[layer] * num_layers * total + 1e-9)

    return min(share(n), share(n_max))


def run_method(name, params, q, k, v, is_image, valid, layer=None, doubled=None):
    """Reference of a registry method: {(b, h): (positions, keys, values)}, and the slots' log token
    counts last with size_aware. layer: (index, count) for a per-layer split. doubled: (q, k, valid,
    second) of the prompt encoded twice over, for scores="reconstruction"."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    valid, is_image = np.asarray(valid), np.asarray(is_image)
    b_, h_, length, _ = k.shape
    lens = valid.sum(-1)
    if name == "full":
        kept = {(b, h): [j for j in range(length) if valid[b, j]] for b in range(b_) for h in range(h_)}
        return {key: (pos, k[key[0], key[1], pos], v[key[0], key[1], pos]) for key, pos in kept.items()}
    m = [budget(params.get("alpha_recent", 0.1), L) for L in lens]
    n = [budget(params.get("alpha_important", 0.1), L) for L in lens]
    text_prior, mode, n_sink = False, None, 0
    if name == "streamingllm":
        n_sink = params.get("n_sink", 4)
        total = [a + c for a, c in zip(m, n)]
        n = [min(n_sink, t) for t in total]
        m = [t - s for t, s in zip(total, n)]
        scores = np.zeros(k.shape[:3])
    elif name == "h2o":
        scores = attention_scores(q, k, valid)
    elif name == "roco":
        mean, std = mean_std(q, k, valid)
        scores = mean + params.get("std_weight", 0.0) * std
    elif name in ("snapkv", "pyramidkv", "adakv"):
        w = params.get("window", 32)
        window = m if w is None else [w] * b_
        scores = window_scores(q, k, valid, window, m, params.get("kernel_size", 7), params.get("pooling", "max"))
    elif name in ("lookm", "lookm_quota"):
        if name == "lookm_quota":
            params = {"image_quota": 0.5, "picture_balance": True, "text_window": True, "scores": "split", **params}
        kind = params.get("scores", "attention")
        scores = attention_scores(q, k, valid) if kind != "reconstruction" else None
        if kind != "attention":
            reconstruction = reconstruction_scores(*(np.asarray(x, np.float64) for x in doubled[:2]), *doubled[2:],
                                                   length)
        if kind == "reconstruction":
            scores = reconstruction
        elif kind == "split":  # text by eq. 4; image tokens by shares of the reconstruction maxima and the window's votes
            w = params.get("reconstruction_weight", 0.75)
            votes = window_scores(q, k, valid, [32] * b_, [0] * b_, 7, "max")
            image = w * shares(reconstruction, valid) + (1 - w) * shares(votes, valid)
            scores = np.where(is_image[:, None, :], image, scores)
        text_prior = params.get("text_prior", True)
        mode = params.get("merge", "pivotal" if name == "lookm" else None)
        n_sink = params.get("n_sink", 0)
    else:
        raise ValueError(name)
    split = params.get("layer_split", "pyramid" if name == "pyramidkv" else "uniform")
    if split != "uniform":
        n_max = budget(params.get("alpha_important", 0.1), length)
        n = [layer_ranked(x, n_max, *layer, split) for x in n]
    if params.get("text_window", False):
        m, n = text_window(valid, is_image, m, n)
    head_n = None
    if params.get("head_split", "adaptive" if name == "adakv" else "uniform") == "adaptive":
        head_n = adaptive_ranked(scores, valid, is_image, m, n, groups=params.get("head_groups") or 1,
                                 head_floor=params.get("head_floor", 0.2), text_prior=text_prior, n_sink=n_sink,
                                 image_quota=params.get("image_quota"),
                                 picture_balance=params.get("picture_balance", False))
    kept = select(scores, valid, is_image, m, n, text_prior=text_prior, n_sink=n_sink,
                  keep_all_text=params.get("keep_all_text", False), image_quota=params.get("image_quota"),
                  picture_balance=params.get("picture_balance", False), head_n=head_n)
    if mode is None:
        return {key: (pos, k[key[0], key[1], pos], v[key[0], key[1], pos]) for key, pos in kept.items()}
    same = params.get("merge_scope", "any") == "same_modality"
    merged = merge(k, v, kept, valid, mode, params.get("similarity_filter", False), is_image if same else None)
    if params.get("size_aware", False):
        return {key: (pos, *merged[key][:2], np.log(merged[key][2])) for key, pos in kept.items()}
    return {key: (pos, *merged[key][:2]) for key, pos in kept.items()}


# --- test inputs and comparison ------------------------------------------------------------------


def make_inputs(seed, *, batch=2, hq=4, hkv=2, length=24, dim=8, lengths=None, p_image=0.6):
    """Random float32 q [B,Hq,L,D], k/v [B,Hkv,L,D]; right-padded valid rows; random modality."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, hq, length, dim)).astype(np.float32)
    k = rng.normal(size=(batch, hkv, length, dim)).astype(np.float32)
    v = rng.normal(size=(batch, hkv, length, dim)).astype(np.float32)
    if lengths is None:
        lengths = [length] + list(rng.integers(1, length + 1, size=batch - 1))
    valid = np.arange(length)[None, :] < np.asarray(lengths)[:, None]
    is_image = rng.random((batch, length)) < p_image
    return q, k, v, is_image, valid


def pool_slots(out, num_heads):
    """A pooled (head-adaptive) result's slots of each head: {(b, h): indices into its group's pool},
    after checking the pool's layout (each head's run contiguous, in head order, empties last)."""
    heads = np.asarray(out.heads)
    b_, groups, size = heads.shape
    hg = num_heads // groups
    slots = {}
    for b in range(b_):
        for g in range(groups):
            row = list(heads[b, g])
            filled = [x for x in row if x >= 0]
            assert filled == sorted(filled) and row == filled + [-1] * (size - len(filled)), row
            for local in range(hg):
                slots[b, g * hg + local] = (g, [i for i in range(size) if row[i] == local])
    return slots


def check_against(out, ref, atol=1e-5):
    """A CompressedKV-like result agrees with a {(b, h): (positions, keys, values[, log counts])}
    reference; without log counts in the reference, the result has none either. A pooled result
    (``out.heads``) is compared head by head through its pool."""
    positions, mask = np.asarray(out.positions), np.asarray(out.mask)
    keys, values = np.asarray(out.keys), np.asarray(out.values)
    if getattr(out, "heads", None) is not None:
        num_heads = max(h for _, h in ref) + 1
        empty = np.asarray(out.heads) < 0
        np.testing.assert_array_equal(mask, ~empty)
        np.testing.assert_array_equal(positions[empty], -1)
        np.testing.assert_array_equal(keys[empty], 0)
        for (b, h), (g, slots) in pool_slots(out, num_heads).items():
            pos, kk, vv, *log_counts = ref[b, h]
            np.testing.assert_array_equal(positions[b, g, slots], pos, err_msg=f"kept positions, row {b} head {h}")
            np.testing.assert_allclose(keys[b, g, slots], kk, atol=atol, rtol=atol)
            np.testing.assert_allclose(values[b, g, slots], vv, atol=atol, rtol=atol)
            if log_counts:
                np.testing.assert_allclose(np.asarray(out.log_counts)[b, g, slots], log_counts[0], atol=atol, rtol=atol)
            else:
                assert out.log_counts is None
        return
    for (b, h), (pos, kk, vv, *log_counts) in ref.items():
        if not log_counts:
            assert out.log_counts is None
        else:
            counts = np.asarray(out.log_counts)
            np.testing.assert_allclose(counts[b, h][mask[b, h]], log_counts[0], atol=atol, rtol=atol)
            np.testing.assert_array_equal(counts[b, h][~mask[b, h]], 0)
        got = positions[b, h][mask[b, h]]
        np.testing.assert_array_equal(got, pos, err_msg=f"kept positions, row {b} head {h}")
        np.testing.assert_array_equal(positions[b, h][~mask[b, h]], -1)
        np.testing.assert_allclose(keys[b, h][mask[b, h]], kk, atol=atol, rtol=atol)
        np.testing.assert_allclose(values[b, h][mask[b, h]], vv, atol=atol, rtol=atol)
        np.testing.assert_array_equal(keys[b, h][~mask[b, h]], 0)
