r"""The Zipf-PCFG synthetic language (docs/science.md section 6): a layered probabilistic context-free
grammar whose token frequencies inside each word class follow a Zipf law with exponent ``s``.

Structure (in the style of the cfg3 grammars of "Physics of Language Models"): a root, then ``depth - 1``
levels of ``width`` nonterminals; every nonterminal has 2-4 rules whose right-hand sides hold 2-3
symbols of the next level; the last level's right-hand sides are preterminal classes. The 20 classes
partition the vocabulary into contiguous ranges; inside class c, token j has rank :math:`\pi_c(j)` under
a fixed random permutation and

.. math::  P(j \mid c) \propto \pi_c(j)^{-s},

so ``s = 0`` is balanced and ``s = 1`` is Zipfian. With ``rule_s > 0`` the rules of each nonterminal
have probabilities :math:`\propto \text{rank}^{-\text{rule\_s}}`. The grammar's structure and ranks
come from ``seed``; ``s`` belongs to the sampler, so train (any s) and validation (s = 0) data share
one grammar. Sentences are joined by a separator token (id ``n_tokens``).

Sampling is vectorized level by level over many sentences at once: all symbols live in one table of
right-hand sides, a sentence stream starts as ``[root, SEP, root, SEP, ...]``, and each level expands
every symbol in one numpy gather (SEP rewrites to itself).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from curvlab.errors import CurvlabError
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_json

# 2: sealed (its content_digest, schema.sealed); 1: curvlab 0.2.0 and before, unsealed, still read
GRAMMAR_VERSION = 2
UNSEALED_GRAMMAR_VERSIONS = (1,)
SENTENCES_PER_CHUNK = 2048  # what Grammar.stream samples at once


@dataclass(frozen=True)
class Grammar:
    """A layered PCFG over ``n_tokens`` tokens in ``len(class_sizes)`` preterminal classes.

    Attributes:
        rules: ``rules[level][i]`` is the list of right-hand sides of nonterminal i of that level;
            entries index the next level's nonterminals, or classes after the last level.
        rule_probs: matching rule probabilities, each list summing to 1.
        class_sizes: tokens per class; class c owns ids ``sum(class_sizes[:c]) ...``.
        ranks: ``ranks[c][j]`` is the Zipf rank (1-based) of the class's j-th token.
        seed, rule_s: how it was made (informational).
    """

    rules: list[list[list[list[int]]]]
    rule_probs: list[list[list[float]]]
    class_sizes: list[int]
    ranks: list[list[int]]
    seed: int = 0
    rule_s: float = 0.0
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def n_tokens(self) -> int:
        return sum(self.class_sizes)

    @property
    def separator(self) -> int:
        """The separator token's id (one past the last word token)."""
        return self.n_tokens

    @property
    def vocab_size(self) -> int:
        """Tokens including the separator."""
        return self.n_tokens + 1

    @property
    def depth(self) -> int:
        return len(self.rules)

    def class_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.class_sizes)])

    def token_probabilities(self, c: int, s: float) -> np.ndarray:
        r""":math:`P(j \mid c) \propto \pi_c(j)^{-s}` over the class's tokens, in token order."""
        w = np.asarray(self.ranks[c], dtype=np.float64) ** (-s)
        return w / w.sum()

    def token_classes(self) -> np.ndarray:
        """The class of every word token id."""
        return np.repeat(np.arange(len(self.class_sizes)), self.class_sizes)

    # -- serialization ----------------------------------------------------------------------

    # by hand: the format's version under "version", and each level's rules and probabilities zipped per
    # non-terminal
    def to_dict(self) -> dict:
        return {
            "version": GRAMMAR_VERSION,
            "seed": self.seed,
            "rule_s": self.rule_s,
            "class_sizes": list(self.class_sizes),
            "ranks": [list(map(int, r)) for r in self.ranks],
            "levels": [
                [{"rules": rules, "probs": probs} for rules, probs in zip(level_rules, level_probs)]
                for level_rules, level_probs in zip(self.rules, self.rule_probs)
            ],
        }

    def save(self, path: str | Path) -> None:
        """Write the grammar as JSON, sealed (:func:`curvlab.util.schema.sealed`), atomically."""
        atomic_write_json(Path(path), schema.sealed(self.to_dict()))

    @classmethod
    def from_dict(cls, d: dict, source: str = "grammar") -> Grammar:
        try:
            if d.get("version") not in (GRAMMAR_VERSION, *UNSEALED_GRAMMAR_VERSIONS):
                raise CurvlabError(f"unsupported grammar version {d.get('version')!r} (expected {GRAMMAR_VERSION})")
            levels = d["levels"]
            g = cls(
                rules=[[[list(map(int, rhs)) for rhs in nt["rules"]] for nt in level] for level in levels],
                rule_probs=[[list(map(float, nt["probs"])) for nt in level] for level in levels],
                class_sizes=list(map(int, d["class_sizes"])),
                ranks=[list(map(int, r)) for r in d["ranks"]],
                seed=int(d.get("seed", 0)),
                rule_s=float(d.get("rule_s", 0.0)),
            )
        except (KeyError, TypeError, AttributeError, OverflowError) as e:  # (OverflowError: int() of an inf)
            raise CurvlabError(f"{source}: malformed grammar JSON ({type(e).__name__}: {e})") from e
        except ValueError as e:
            raise CurvlabError(f"{source}: {e}") from e
        g.validate(source)
        return g

    @classmethod
    def load(cls, path: str | Path) -> Grammar:
        """The grammar :meth:`save` wrote to ``path``; one of version 1 (curvlab 0.2.0 and before, which
        sealed none) is read without a seal, any other only with its own.

        Raises:
            CurvlabError: a missing file, invalid JSON, a seal its content doesn't match, no seal on a grammar
                of version 2, or a malformed grammar.
        """
        path = Path(path)
        d = schema.read_json(path, "a grammar")
        unsealed = isinstance(d, dict) and d.get("version") in UNSEALED_GRAMMAR_VERSIONS and schema.SEAL not in d
        d = d if unsealed else schema.unsealed(d, path, "grammar")
        if not isinstance(d, dict):
            raise CurvlabError(f"{path}: malformed grammar JSON (an object expected, found {type(d).__name__})")
        return cls.from_dict(d, str(path))

    def validate(self, source: str = "grammar") -> None:
        """Raise ``CurvlabError`` naming the problem: undefined or unreachable symbols, bad probabilities."""
        if not self.rules or len(self.rules[0]) != 1:
            raise CurvlabError(f"{source}: the first level must hold exactly one root nonterminal")
        n_classes = len(self.class_sizes)
        if n_classes == 0 or any(s <= 0 for s in self.class_sizes):
            raise CurvlabError(f"{source}: class sizes must be positive")
        if len(self.ranks) != n_classes or any(
            sorted(r) != list(range(1, n + 1)) for r, n in zip(self.ranks, self.class_sizes)
        ):
            raise CurvlabError(f"{source}: ranks must be a permutation of 1..size for every class")
        for level, (rules, probs) in enumerate(zip(self.rules, self.rule_probs)):
            below = len(self.rules[level + 1]) if level + 1 < self.depth else n_classes
            kind = "nonterminal" if level + 1 < self.depth else "class"
            used = set()
            if len(rules) != len(probs):
                raise CurvlabError(
                    f"{source}: level {level} has {len(rules)} rule lists but {len(probs)} probability lists"
                )
            for i, (rhs_list, p) in enumerate(zip(rules, probs)):
                if not rhs_list or len(rhs_list) != len(p):
                    raise CurvlabError(f"{source}: nonterminal {level}.{i} has no rules or mismatched probabilities")
                if any(x < 0 for x in p) or not math.isclose(sum(p), 1.0, rel_tol=1e-9):
                    raise CurvlabError(f"{source}: rule probabilities of nonterminal {level}.{i} don't sum to 1")
                for rhs in rhs_list:
                    if not rhs:
                        raise CurvlabError(f"{source}: nonterminal {level}.{i} has an empty right-hand side")
                    bad = [x for x in rhs if not 0 <= x < below]
                    if bad:
                        raise CurvlabError(f"{source}: nonterminal {level}.{i} uses undefined {kind} {bad[0]}")
                    used.update(rhs)
            if level + 1 < self.depth and len(used) != below:
                missing = sorted(set(range(below)) - used)
                raise CurvlabError(f"{source}: nonterminal {level + 1}.{missing[0]} is unreachable")

    # -- sampling ---------------------------------------------------------------------------

    def _expansion_tables(self):
        """One table for all symbols: ids [0, n_nt) are nonterminals level by level, then classes, then SEP."""
        if "rhs" not in self._tables:
            starts = np.cumsum([0] + [len(level) for level in self.rules])
            n_nt = int(starts[-1])
            n_classes = len(self.class_sizes)
            sep = n_nt + n_classes
            max_rules = max(len(r) for level in self.rules for r in level)
            max_len = max(len(rhs) for level in self.rules for r in level for rhs in r)
            rhs = np.full((sep + 1, max_rules, max_len), -1, dtype=np.int64)
            cdf = np.ones((sep + 1, max_rules))
            for level, (rules, probs) in enumerate(zip(self.rules, self.rule_probs)):
                offset = starts[level + 1] if level + 1 < self.depth else n_nt
                for i, (rhs_list, p) in enumerate(zip(rules, probs)):
                    sym = starts[level] + i
                    for r, right in enumerate(rhs_list):
                        rhs[sym, r, : len(right)] = np.asarray(right) + offset
                    cdf[sym, : len(p)] = np.cumsum(p)
                    cdf[sym, len(p) - 1 :] = np.inf  # guard against rounding: the last rule catches all
            rhs[sep, 0, 0] = sep
            cdf[sep, 0] = np.inf
            self._tables.update(rhs=rhs, cdf=cdf, n_nt=n_nt, sep=sep)
        t = self._tables
        return t["rhs"], t["cdf"], t["n_nt"], t["sep"]

    def _token_cdf(self, s: float) -> np.ndarray:
        """Per-class CDFs offset by the class index, concatenated: monotone, so one searchsorted samples all."""
        key = ("cdf", float(s))
        if key not in self._tables:
            parts = []
            for c in range(len(self.class_sizes)):
                cdf = np.cumsum(self.token_probabilities(c, s))
                cdf[-1] = 1.0
                parts.append(c + cdf)
            self._tables[key] = np.concatenate(parts)
        return self._tables[key]

    def sample_sentences(self, n: int, s: float, rng: np.random.Generator) -> np.ndarray:
        """``n`` sentences, each followed by the separator, as one int64 token stream."""
        if not (math.isfinite(s) and s >= 0):
            raise CurvlabError(f"the Zipf exponent s must be >= 0 and finite, got {s}")
        rhs, cdf, n_nt, sep = self._expansion_tables()
        symbols = np.empty(2 * n, dtype=np.int64)
        symbols[0::2], symbols[1::2] = 0, sep
        for _ in range(self.depth):
            u = rng.random(symbols.size)
            rule = (u[:, None] >= cdf[symbols]).sum(axis=1)
            expanded = rhs[symbols, rule].reshape(-1)
            symbols = expanded[expanded >= 0]
        is_sep = symbols == sep
        classes = symbols - n_nt
        tokens = np.full(symbols.size, self.separator, dtype=np.int64)
        words = ~is_sep
        offsets = self.class_offsets()
        c = classes[words]
        # class c's CDF occupies (c, c + 1] at token positions offsets[c]..: the index found is the token id
        position = np.searchsorted(self._token_cdf(s), c + rng.random(c.size), side="right")
        tokens[words] = np.minimum(position, offsets[c + 1] - 1)  # rounding can't spill into class c + 1
        return tokens

    def stream(
        self, n_tokens: int, s: float, seed: int, sentences_per_chunk: int = SENTENCES_PER_CHUNK
    ) -> Iterator[np.ndarray]:
        """Yield chunks of a token stream (sentences + separators) until ``n_tokens`` have been produced."""
        rng = np.random.default_rng(seed)
        produced = 0
        while produced < n_tokens:
            chunk = self.sample_sentences(sentences_per_chunk, s, rng)[: n_tokens - produced]
            produced += chunk.size
            yield chunk


def make_grammar(
    seed: int = 0,
    n_tokens: int = 4412,
    n_classes: int = 20,
    depth: int = 7,
    width: int = 3,
    min_rules: int = 2,
    max_rules: int = 4,
    min_rhs: int = 2,
    max_rhs: int = 3,
    rule_s: float = 0.0,
) -> Grammar:
    """A random layered grammar, deterministic in ``seed`` (defaults: docs/science.md section 6).

    Every next-level symbol is used by some rule (no unreachable symbols): after drawing the rules,
    any symbol left out replaces a random entry of a rule of the level above, at a place that is
    not the only use of another symbol.
    """
    if not (n_classes >= 1 and n_tokens >= n_classes and depth >= 1 and width >= 1):
        raise CurvlabError("need n_tokens >= n_classes >= 1, depth >= 1 and width >= 1")
    if not (1 <= min_rules <= max_rules and 1 <= min_rhs <= max_rhs):
        raise CurvlabError("need 1 <= min_rules <= max_rules and 1 <= min_rhs <= max_rhs")
    if not (math.isfinite(rule_s) and rule_s >= 0):
        raise CurvlabError(f"rule_s must be >= 0 and finite, got {rule_s}")
    rng = np.random.default_rng(seed)
    sizes = [1] + [width] * (depth - 1)
    rules, probs = [], []
    for level, n_here in enumerate(sizes):
        below = sizes[level + 1] if level + 1 < depth else n_classes
        level_rules = [
            [
                rng.integers(0, below, rng.integers(min_rhs, max_rhs + 1)).tolist()
                for _ in range(rng.integers(min_rules, max_rules + 1))
            ]
            for _ in range(n_here)
        ]
        _cover(level_rules, below, rng)
        rules.append(level_rules)
        level_probs = []
        for r in level_rules:
            w = np.arange(1, len(r) + 1, dtype=np.float64) ** (-rule_s)
            w = w[rng.permutation(len(r))]
            level_probs.append((w / w.sum()).tolist())
        probs.append(level_probs)
    base, extra = divmod(n_tokens, n_classes)
    class_sizes = [base + (1 if c < extra else 0) for c in range(n_classes)]
    ranks = [(rng.permutation(n) + 1).tolist() for n in class_sizes]
    g = Grammar(rules=rules, rule_probs=probs, class_sizes=class_sizes, ranks=ranks, seed=seed, rule_s=rule_s)
    g.validate()
    return g


def generation_footprint(
    tokens: int, val_tokens: int, shard_tokens: int, depth: int = 7, width: int = 3
) -> tuple[int, int]:
    """The bytes of memory and of disk that generating a data directory of :func:`make_grammar`'s grammar
    (default rules) takes at the least, for refusing a size the machine can't hold before starting.

    Memory: a chunk of sentences being expanded (75 bytes a token measured; a sentence averages 2.5^depth
    tokens, each right-hand side holding 2-3 symbols), the grammar's tables (about 1 kB a nonterminal) and
    the shard being filled (int64, copied as it grows). Disk: 2 bytes a token (uint16 shards) and at least
    a block per shard file.
    """
    chunk = 75 * SENTENCES_PER_CHUNK * 2.5**depth
    shard = 16 * min(shard_tokens, max(tokens, val_tokens))
    memory = int(chunk + 1000 * depth * width + shard)
    files = -(-tokens // shard_tokens) + -(-val_tokens // shard_tokens)
    return memory, 2 * (tokens + val_tokens) + 4096 * files


def _cover(level_rules: list[list[list[int]]], below: int, rng: np.random.Generator) -> None:
    """Make every symbol in range(below) appear in some right-hand side, by replacing surplus entries."""
    for _ in range(10 * below):
        counts = np.bincount([x for r in level_rules for rhs in r for x in rhs], minlength=below)
        missing = np.flatnonzero(counts == 0)
        if missing.size == 0:
            return
        slots = [
            (i, j, k)
            for i, r in enumerate(level_rules)
            for j, rhs in enumerate(r)
            for k, x in enumerate(rhs)
            if counts[x] > 1
        ]
        if not slots:
            level_rules[rng.integers(len(level_rules))].append([int(missing[0])])
            continue
        i, j, k = slots[rng.integers(len(slots))]
        level_rules[i][j][k] = int(missing[0])
    raise CurvlabError("could not make every symbol reachable; increase rules per nonterminal")


def zipf_exponent_fit(counts: np.ndarray) -> float:
    r"""The exponent s of a rank-frequency law :math:`f \propto r^{-s}`: least squares of
    :math:`\log f` on :math:`\log r` over the nonzero counts sorted in decreasing order."""
    f = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    f = f[f > 0]
    if f.size < 2:
        return float("nan")
    r = np.arange(1, f.size + 1)
    slope = np.polyfit(np.log(r), np.log(f), 1)[0]
    return float(-slope)


def count_stats(counts: np.ndarray, grammar: Grammar) -> dict:
    """Token count, unigram entropy (bits), sentence count and per-class fitted Zipf exponents, from
    the token counts of a stream (``np.bincount(tokens, minlength=grammar.vocab_size)``)."""
    total = int(counts.sum())
    p = counts[counts > 0] / max(total, 1)
    offsets = grammar.class_offsets()
    exponents = [zipf_exponent_fit(counts[offsets[c] : offsets[c + 1]]) for c in range(len(grammar.class_sizes))]
    return {
        "tokens": total,
        "sentences": int(counts[grammar.separator]),
        "entropy_bits": float(-(p * np.log2(p)).sum()),
        "zipf_exponent_mean": float(np.nanmean(exponents)),
        "zipf_exponent_per_class": exponents,
    }
