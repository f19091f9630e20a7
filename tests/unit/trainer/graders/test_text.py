"""string_check and the text_similarity metrics against the reference implementations' numbers.

The expected values were computed with sacrebleu 2.6.0 (``sentence_bleu(input, [reference]).score
/ 100``), NLTK 3.10.4 (``sentence_gleu([reference.split()], input.split())``), rouge-score 0.1.2
(``RougeScorer(["rouge1".."rouge5", "rougeL"], use_stemmer=False).score(reference, input)``,
F-measure) and rapidfuzz 3.14.6 (``fuzz.ratio(input, reference) / 100``), on 2026-11-27; none of
them is a dependency of ftq."""

from __future__ import annotations

import pytest

from trainer.graders.text import lcs_length, similarity, string_check, tokenize_13a

CAT = ("The cat sat on the mat.", "The cat is sitting on the mat.")
PARIS = ("Paris is the capital of France, isn't it?", "The capital of France is Paris.")
FOX = ("the quick brown fox jumps over the lazy dog", "the quick brown dog jumps over the lazy fox")
PRICE = ("It costs 3.50 dollars, e.g. 12-3.", "it costs $3.50, e.g. 12-3!")
REVERSED = ("a b c d e f", "f e d c b a")

REFERENCE = {
    CAT: {"fuzzy_match": 0.830189, "bleu": 0.423837, "gleu": 0.409091, "rouge_1": 0.769231, "rouge_2": 0.545455,
          "rouge_3": 0.222222, "rouge_4": 0.0, "rouge_5": 0.0, "rouge_l": 0.769231},
    PARIS: {"fuzzy_match": 0.694444, "bleu": 0.177474, "gleu": 0.153846, "rouge_1": 0.8, "rouge_2": 0.461538,
            "rouge_3": 0.363636, "rouge_4": 0.222222, "rouge_5": 0.0, "rouge_l": 0.533333},
    FOX: {"fuzzy_match": 0.906977, "bleu": 0.459661, "gleu": 0.6, "rouge_1": 1.0, "rouge_2": 0.625,
          "rouge_3": 0.428571, "rouge_4": 0.166667, "rouge_5": 0.0, "rouge_l": 0.777778},
    PRICE: {"fuzzy_match": 0.779661, "bleu": 0.59146, "gleu": 0.111111, "rouge_1": 0.941176, "rouge_2": 0.8,
            "rouge_3": 0.615385, "rouge_4": 0.363636, "rouge_5": 0.0, "rouge_l": 0.941176},
    REVERSED: {"fuzzy_match": 0.454545, "bleu": 0.127033, "gleu": 0.333333, "rouge_1": 1.0, "rouge_2": 0.0,
               "rouge_3": 0.0, "rouge_4": 0.0, "rouge_5": 0.0, "rouge_l": 0.166667},
    ("x", ""): dict.fromkeys(("fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_l"), 0.0),
    ("hello", "hello"): {"fuzzy_match": 1.0, "bleu": 1.0, "gleu": 1.0, "rouge_1": 1.0, "rouge_2": 0.0, "rouge_l": 1.0},
}


class TestStringCheck:
    @pytest.mark.parametrize(("operation", "text", "reference", "expected"), [
        ("eq", "Paris", "Paris", 1.0), ("eq", "Paris", "paris", 0.0), ("eq", "Paris ", "Paris", 0.0),
        ("ne", "Paris", "paris", 1.0), ("ne", "Paris", "Paris", 0.0),
        ("like", "It is Paris.", "Paris", 1.0), ("like", "It is paris.", "Paris", 0.0),
        ("ilike", "It is PARIS.", "paris", 1.0), ("ilike", "It is Rome.", "paris", 0.0),
    ])
    def test_each_operation(self, operation: str, text: str, reference: str, expected: float) -> None:
        assert string_check(operation, text, reference) == expected


class TestSimilarity:
    @pytest.mark.parametrize(("pair", "metric"), [(pair, metric) for pair, row in REFERENCE.items() for metric in row])
    def test_the_reference_implementations_number(self, pair: tuple[str, str], metric: str) -> None:
        assert similarity(metric, *pair) == pytest.approx(REFERENCE[pair][metric], abs=1e-6)

    def test_fuzzy_match_by_hand(self) -> None:
        # LCS("kitten", "sitting") = "ittn", 4: 2 * 4 / (6 + 7)
        assert similarity("fuzzy_match", "kitten", "sitting") == pytest.approx(8 / 13)
        assert similarity("fuzzy_match", "", "") == 1.0

    def test_bit_parallel_lcs_is_the_table_lcs(self) -> None:
        import random

        rng = random.Random(0)
        for _ in range(200):
            a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
            b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
            table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
            for i, x in enumerate(a):
                for j, y in enumerate(b):
                    table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
            assert lcs_length(a, b) == table[-1][-1], (a, b)

    def test_long_texts_are_fast(self) -> None:
        import time

        a, b = "abcdefghij" * 2000, "bcdefghija" * 2000
        started = time.monotonic()
        assert 0.9 < similarity("fuzzy_match", a, b) <= 1.0
        assert time.monotonic() - started < 5

    def test_13a_splits_punctuation_but_not_decimals(self) -> None:
        # sacrebleu's Tokenizer13a()("It costs $3.50, e.g. 12-3!").split() gives the same list
        assert tokenize_13a("It costs $3.50, e.g. 12-3!") == ["It", "costs", "$", "3.50", ",", "e", ".", "g", ".",
                                                                "12", "-", "3", "!"]
