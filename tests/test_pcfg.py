import json
from functools import cache

import numpy as np
import pytest
from scipy.stats import chisquare

from curvlab.data.dataset import generate_pcfg_dataset, parse_count, read_stats, unigram_plateau_nats
from curvlab.data.pcfg import Grammar, make_grammar, zipf_exponent_fit


def derivable(grammar: Grammar, classes: list[int]) -> bool:
    """A recognizer written for the test: can the root derive this class sequence? Memoized
    top-down search over (level, nonterminal, span), independent of the vectorized sampler."""
    n = len(classes)

    @cache
    def derives(level: int, sym: int, i: int, j: int) -> bool:
        return any(matches(level, tuple(rhs), i, j) for rhs in grammar.rules[level][sym])

    @cache
    def matches(level: int, rhs: tuple, i: int, j: int) -> bool:
        if not rhs:
            return i == j
        first, rest = rhs[0], rhs[1:]
        if level + 1 == grammar.depth:  # the right-hand side holds classes: one position each
            return i < j and classes[i] == first and matches(level, rest, i + 1, j)
        return any(
            derives(level + 1, first, i, k) and matches(level, rest, k, j) for k in range(i + 1, j - len(rest) + 1)
        )

    return derives(0, 0, 0, n)


def sentences(tokens: np.ndarray, sep: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(tokens == sep)
    return [tokens[a + 1 : b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


def test_every_sampled_sentence_is_derivable():
    g = make_grammar(seed=3, depth=4, n_tokens=60, n_classes=5)
    tokens = g.sample_sentences(40, s=1.0, rng=np.random.default_rng(0))
    token_class = g.token_classes()
    sents = sentences(tokens, g.separator)
    assert len(sents) == 40
    for sent in sents:
        assert derivable(g, [int(token_class[t]) for t in sent])
    # and the recognizer can say no: a reversed sentence is (almost surely) not in the language
    rejected = sum(not derivable(g, [int(token_class[t]) for t in s[::-1]]) for s in sents[:10])
    assert rejected > 0


def test_s0_is_uniform_inside_each_class():
    g = make_grammar(seed=0)
    tokens = np.concatenate(list(g.stream(400_000, s=0.0, seed=1)))
    counts = np.bincount(tokens, minlength=g.vocab_size)
    offsets = g.class_offsets()
    for c in range(len(g.class_sizes)):
        obs = counts[offsets[c] : offsets[c + 1]]
        if obs.sum() > 20 * obs.size:  # enough draws for the chi-square approximation
            assert chisquare(obs).pvalue > 1e-4


def test_s1_gives_zipf_exponent_near_one():
    g = make_grammar(seed=0)
    tokens = np.concatenate(list(g.stream(1_000_000, s=1.0, seed=1)))
    counts = np.bincount(tokens, minlength=g.vocab_size)
    offsets = g.class_offsets()
    big = [c for c in range(20) if counts[offsets[c] : offsets[c + 1]].sum() > 20_000]
    fits = [zipf_exponent_fit(counts[offsets[c] : offsets[c + 1]]) for c in big]
    assert len(big) >= 5
    assert abs(np.mean(fits) - 1.0) < 0.1
    # the empirical probability follows the rank law the grammar states
    c = big[0]
    p = counts[offsets[c] : offsets[c + 1]] / counts[offsets[c] : offsets[c + 1]].sum()
    assert np.abs(p - g.token_probabilities(c, 1.0)).max() < 0.01


def test_same_seed_same_bytes_and_json_round_trip(tmp_path):
    a = make_grammar(seed=5, rule_s=0.7)
    b = make_grammar(seed=5, rule_s=0.7)
    assert a == b
    ta = np.concatenate(list(a.stream(50_000, 1.0, seed=2)))
    tb = np.concatenate(list(b.stream(50_000, 1.0, seed=2)))
    assert ta.tobytes() == tb.tobytes()
    a.save(tmp_path / "g.json")
    c = Grammar.load(tmp_path / "g.json")
    assert c == a and c.to_dict() == a.to_dict()
    assert np.concatenate(list(c.stream(50_000, 1.0, seed=2))).tobytes() == ta.tobytes()
    assert make_grammar(seed=6) != a


def test_rule_s_skews_rule_probabilities():
    g = make_grammar(seed=0, rule_s=1.0)
    probs = sorted(g.rule_probs[0][0], reverse=True)
    assert probs[0] / probs[1] == pytest.approx(2.0)


def test_dataset_directory_and_stats(tmp_path):
    out = tmp_path / "d"
    stats = generate_pcfg_dataset(out, s=1.0, tokens="300k", val_tokens="30k", shard_tokens="100k", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "grammar.json", "stats.json", "train_000000.bin", "train_000001.bin", "train_000002.bin", "val_000000.bin",
    ]  # fmt: skip
    assert stats["train"]["tokens"] == 300_000 and stats["val"]["tokens"] == 30_000
    assert stats["val"]["s"] == 0.0 and stats["vocab_size"] == 4413
    assert read_stats(out) == stats
    assert (
        generate_pcfg_dataset(out, s=1.0, tokens="300k", val_tokens="30k", shard_tokens="100k", progress=False) == stats
    )
    with pytest.raises(ValueError, match="another config"):
        generate_pcfg_dataset(out, s=0.5, tokens="300k", val_tokens="30k", progress=False)


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="s must be >= 0"):
        make_grammar().sample_sentences(3, -0.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match=">= 0"):
        generate_pcfg_dataset(tmp_path / "x", s=-1.0, progress=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="not a count"):
        parse_count("lots")
    good = make_grammar(seed=0).to_dict()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: corrupt JSON"):
        Grammar.load(tmp_path / "bad.json")
    broken = json.loads(json.dumps(good))
    del broken["levels"]
    with pytest.raises(ValueError, match="malformed"):
        Grammar.from_dict(broken)
    undefined = json.loads(json.dumps(good))
    undefined["levels"][1][0]["rules"][0][0] = 99
    with pytest.raises(ValueError, match="undefined nonterminal 99"):
        Grammar.from_dict(undefined)
    unreachable = json.loads(json.dumps(good))
    level0 = unreachable["levels"][0][0]["rules"]
    used = {x for rhs in level0 for x in rhs}
    for rhs in level0:
        rhs[:] = [min(used)] * len(rhs)
    with pytest.raises(ValueError, match="unreachable"):
        Grammar.from_dict(unreachable)


def test_unigram_plateau_is_the_cross_entropy_under_training_frequencies(tmp_path):
    opts = {"n_tokens": 200}
    same = generate_pcfg_dataset(tmp_path / "s0", s=0.0, tokens="40k", val_tokens="20k", val_s=0.0,
                                 grammar_options=opts, progress=False)  # fmt: skip
    generate_pcfg_dataset(tmp_path / "s1", s=1.0, tokens="40k", val_tokens="20k", val_s=0.0,
                          grammar_options=opts, progress=False)  # fmt: skip
    h_val = same["val"]["entropy_bits"] * np.log(2)
    at0, at1 = unigram_plateau_nats(tmp_path / "s0"), unigram_plateau_nats(tmp_path / "s1")
    # Gibbs: a cross-entropy is at least the entropy; with the same distribution it is close to it
    assert h_val <= at0 < h_val + 0.02
    # trained on skewed frequencies, the plateau on balanced validation data sits well above
    assert at1 > at0 + 0.2
