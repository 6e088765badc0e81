"""A seeded English-like text source whose entropy rate is known exactly.

Words belong to eight grammatical classes with fixed, unique lowercase spellings built from syllables.
A document is a chain of events, each depending only on the previous word (a Markov chain over words):

    doc start    -> first word w ~ start(w)                         emits Cap(w)
    word w       -> next word w' ~ P(w' | w)                        emits " " + w'
                 -> end of sentence, probability end_prob[class(w)] emits "."
    after "."    -> end of document, probability doc_end_prob      (the next BOS)
                 -> new sentence, first word w ~ start(w)           emits " " + Cap(w)

P(w' | w) = (1 - end) * A[class(w), class(w')] * ((1 - lam) * Zipf_class(w') + lam * collocates_w(w')):
a grammar over classes, Zipf word frequencies inside a class, and a few preferred successors per word.

The text determines the event sequence (spellings are unique and lowercase; only sentence starts are
capitalized; "." and " " are unambiguous), so -log2 P(text) is the code length of the events. With
v = expected visits to each state per document (absorbing-chain fundamental matrix),
    entropy rate = sum_s v_s H(row_s) / sum_s v_s E[bytes emitted from s]      (bits per UTF-8 byte),
the limit of (total code length) / (total bytes) over many documents -- exactly what bits per byte
measures when documents are separated by BOS and the BOS after a document is a scored target.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

# class name, lexicon size, syllables per word (min, max), spelling suffixes (one drawn per word, "" = none)
CLASSES = [
    ("det", 10, (1, 1), [""]),
    ("pron", 12, (1, 1), [""]),
    ("prep", 20, (1, 1), [""]),
    ("conj", 8, (1, 1), [""]),
    ("adv", 80, (1, 2), ["ly"]),
    ("adj", 200, (1, 2), ["", "", "", "ous", "ful", "al", "y"]),
    ("noun", 600, (1, 2), ["", "", "", "", "er", "ness", "tion"]),
    ("verb", 300, (1, 2), ["", "", "", "ed", "s"]),
]
DET, PRON, PREP, CONJ, ADV, ADJ, NOUN, VERB = range(len(CLASSES))
# class grammar A[c, c'] (rows renormalized) and the chance a sentence ends after a word of class c
GRAMMAR = {
    DET: {ADJ: 0.35, NOUN: 0.65},
    PRON: {VERB: 0.8, ADV: 0.2},
    PREP: {DET: 0.7, PRON: 0.15, NOUN: 0.15},
    CONJ: {DET: 0.5, PRON: 0.4, NOUN: 0.1},
    ADV: {VERB: 0.3, DET: 0.2, PREP: 0.3, ADJ: 0.2},
    ADJ: {ADJ: 0.12, NOUN: 0.88},
    NOUN: {VERB: 0.6, PREP: 0.25, CONJ: 0.15},
    VERB: {DET: 0.4, PREP: 0.2, ADV: 0.15, PRON: 0.1, ADJ: 0.15},
}
END_PROB = {NOUN: 0.3, VERB: 0.12, ADV: 0.2, PRON: 0.05}
START = {DET: 0.5, PRON: 0.3, NOUN: 0.1, ADV: 0.1}
ONSETS = "b c d f g h j k l m n p r s t v w z b d g k l m n p r s t br st th sh ch".split()
VOWELS = "a e i o u a e i o u ai ea oo ou".split()
CODAS = ["", "", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng"]
ZIPF_EXPONENT, ZIPF_OFFSET = 1.0, 2.5


@dataclass
class DemoSource:
    words: list[str]             # all words, lowercase, unique
    word_class: np.ndarray       # class of each word
    next_word: np.ndarray        # [W, W + 1]: P(next word | word), last column: end of sentence
    start: np.ndarray            # [W]: first word of a sentence
    doc_end_prob: float          # P(document ends | a sentence just ended)

    @property
    def n_words(self) -> int:
        return len(self.words)


def _spell(rng: np.random.Generator, syllables: tuple[int, int], suffixes: list[str], taken: set[str]) -> str:
    while True:
        n = int(rng.integers(syllables[0], syllables[1] + 1))
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(n))
        word += rng.choice(suffixes)
        if word not in taken and len(word) >= 2:
            taken.add(word)
            return word


def _zipf(lengths: list[int], rng: np.random.Generator, exponent: float = ZIPF_EXPONENT) -> np.ndarray:
    """Zipf weights over words, the largest to the shortest spellings (ties broken at random)."""
    weights = 1.0 / (np.arange(len(lengths)) + ZIPF_OFFSET) ** exponent
    order = np.lexsort((rng.random(len(lengths)), np.array(lengths)))
    p = np.empty(len(lengths))
    p[order] = weights / weights.sum()
    return p


def build_source(seed: int = 0, collocation_weight: float = 0.35, collocates: int = 3,
                 mean_sentences_per_doc: float = 12.0) -> DemoSource:
    """The source for `seed`: lexicon spellings, Zipf weights and collocates are drawn from it."""
    rng = np.random.default_rng([seed, 0xD3E0])
    words, classes, taken = [], [], set()
    for c, (_, size, syllables, suffixes) in enumerate(CLASSES):
        for _ in range(size):
            words.append(_spell(rng, syllables, suffixes, taken))
            classes.append(c)
    word_class = np.array(classes)
    members = [np.flatnonzero(word_class == c) for c in range(len(CLASSES))]
    # like English, frequent words are short: the k-th shortest spelling gets the k-th largest weight
    zipf = [_zipf([len(words[w]) for w in m], rng) for m in members]
    n = len(words)
    next_word = np.zeros((n, n + 1))
    for w in range(n):
        c = word_class[w]
        end = END_PROB.get(c, 0.0)
        grammar = GRAMMAR[c]
        total = sum(grammar.values())
        for c2, weight in grammar.items():
            row = (1 - collocation_weight) * zipf[c2]
            picks = rng.choice(len(members[c2]), size=min(collocates, len(members[c2])), replace=False)
            row[picks] += collocation_weight / len(picks)
            next_word[w, members[c2]] += (1 - end) * weight / total * row
        next_word[w, n] = end
    start = np.zeros(n)
    for c, weight in START.items():
        start[members[c]] = weight * zipf[c]
    start /= start.sum()
    return DemoSource(words, word_class, next_word, start, 1.0 / mean_sentences_per_doc)


def _entropy_bits(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def entropy_rate(src: DemoSource) -> dict:
    """Exact expected code length and bytes per document, and their ratio (bits per byte)."""
    n = src.n_words
    lengths = np.array([len(w) for w in src.words], dtype=np.float64)
    # transient states: 0..n-1 words, n = document start, n + 1 = just after "."
    q = np.zeros((n + 2, n + 2))
    q[:n, :n] = src.next_word[:, :n]
    q[:n, n + 1] = src.next_word[:, n]
    q[n, :n] = src.start
    q[n + 1, :n] = (1 - src.doc_end_prob) * src.start
    visits = np.linalg.solve((np.eye(n + 2) - q).T, np.eye(n + 2)[n])
    bits = np.array([_entropy_bits(src.next_word[w]) for w in range(n)]
                    + [_entropy_bits(src.start),
                       _entropy_bits(np.append((1 - src.doc_end_prob) * src.start, src.doc_end_prob))])
    emitted = np.concatenate([src.next_word[:, :n] @ (1 + lengths) + src.next_word[:, n] * 1,  # " w" or "."
                              [src.start @ lengths, (1 - src.doc_end_prob) * (src.start @ (1 + lengths))]])
    doc_bits, doc_bytes = float(visits @ bits), float(visits @ emitted)
    return {"bits_per_doc": doc_bits, "bytes_per_doc": doc_bytes, "bits_per_byte": doc_bits / doc_bytes,
            "words_per_doc": float(visits[:n].sum())}


class Sampler:
    """Draws documents; the per-state cumulative rows are plain lists so each draw is one bisect."""

    def __init__(self, src: DemoSource):
        self.src = src
        self.cum_next = [np.cumsum(row).tolist() for row in src.next_word]
        self.cum_start = np.cumsum(src.start).tolist()
        self.capitalized = [w.capitalize() for w in src.words]

    @staticmethod
    def _draw(cum: list[float], u: float) -> int:
        return min(bisect.bisect_right(cum, u * cum[-1]), len(cum) - 1)

    def documents(self, n_docs: int, rng: np.random.Generator) -> list[str]:
        src, n = self.src, self.src.n_words
        uniforms = _uniform_stream(rng)
        docs = []
        for _ in range(n_docs):
            w = self._draw(self.cum_start, next(uniforms))
            parts = [self.capitalized[w]]
            while True:
                nxt = self._draw(self.cum_next[w], next(uniforms))
                if nxt < n:
                    parts.append(" " + src.words[nxt])
                    w = nxt
                    continue
                parts.append(".")
                if next(uniforms) < src.doc_end_prob:
                    break
                w = self._draw(self.cum_start, next(uniforms))
                parts.append(" " + self.capitalized[w])
            docs.append("".join(parts))
        return docs


def _uniform_stream(rng: np.random.Generator):
    while True:
        yield from rng.random(1 << 16).tolist()


def code_length_bits(src: DemoSource, text: str, index: dict[str, int] | None = None) -> float:
    """-log2 P(document) under the source, parsed back from its text (end of document included).
    Raises ValueError if the text cannot have come from the source."""
    index = index if index is not None else {w: i for i, w in enumerate(src.words)}
    n, bits, prev = src.n_words, 0.0, None
    tokens = text.split(" ")
    for i, token in enumerate(tokens):
        ends = token.endswith(".")
        word = token[:-1] if ends else token
        if prev is None:  # a sentence starts: its first word is capitalized
            w = index.get(word[:1].lower() + word[1:]) if word[:1].isupper() else None
            p = src.start[w] if w is not None else 0.0
        else:
            w = index.get(word)
            p = src.next_word[prev, w] if w is not None else 0.0
        if p <= 0:
            raise ValueError(f"text is not from this source: {token!r} (word {i}) is impossible here")
        bits -= math.log2(p)
        prev = w
        if ends:
            last = i == len(tokens) - 1
            bits -= math.log2(src.next_word[w, n]) + math.log2(src.doc_end_prob if last else 1 - src.doc_end_prob)
            prev = None
    if prev is not None:
        raise ValueError("text is not from this source: a document must end with \".\"")
    return bits
