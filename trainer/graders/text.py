"""The string graders: ``string_check`` and ``text_similarity``'s metrics, in the standard library.

Each metric is the reference implementation's definition, and ``tests/unit/trainer/graders``
checks it against that implementation's numbers:

- ``fuzzy_match``: rapidfuzz's ``fuzz.ratio / 100``, the normalised Indel similarity
  ``2 * LCS(a, b) / (len(a) + len(b))`` over characters (1 for two empty strings).
- ``bleu``: sacrebleu's ``sentence_bleu(input, [reference]).score / 100``: its ``13a`` tokenizer,
  n-grams up to 4, ``exp`` smoothing, effective order, brevity penalty.
- ``gleu``: NLTK's ``sentence_gleu([reference.split()], input.split())``: matched n-grams of order
  1 to 4 over the larger of the two n-gram totals (the smaller of precision and recall).
- ``rouge_1`` ... ``rouge_5``, ``rouge_l``: rouge-score's F-measure
  (``RougeScorer([...], use_stemmer=False)``, target = reference, prediction = input): lower-cased,
  everything but ``a-z0-9`` a separator.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence


def string_check(operation: str, text: str, reference: str) -> float:
    if operation == "eq":
        return float(text == reference)
    if operation == "ne":
        return float(text != reference)
    if operation == "like":
        return float(reference in text)
    assert operation == "ilike", operation
    return float(reference.lower() in text.lower())


def similarity(metric: str, text: str, reference: str) -> float:
    if metric == "fuzzy_match":
        return fuzzy_ratio(text, reference)
    if metric == "bleu":
        return sentence_bleu(text, reference)
    if metric == "gleu":
        return sentence_gleu(text, reference)
    if metric == "rouge_l":
        return rouge_l(text, reference)
    assert metric.startswith("rouge_") and metric[-1].isdigit(), metric
    return rouge_n(text, reference, int(metric[-1]))


def lcs_length(a: Sequence[object], b: Sequence[object]) -> int:
    """The longest common subsequence's length, bit-parallel (Allison and Dix, 1986): one big-int
    word per element of ``b``, so two 10,000-character texts take milliseconds, not a 10^8 table."""
    if not a or not b:
        return 0
    masks: dict[object, int] = {}
    for i, element in enumerate(a):
        masks[element] = masks.get(element, 0) | (1 << i)
    full = (1 << len(a)) - 1
    row = full
    for element in b:
        matches = row & masks.get(element, 0)
        row = ((row + matches) | (row - matches)) & full
    return len(a) - bin(row).count("1")


def fuzzy_ratio(text: str, reference: str) -> float:
    total = len(text) + len(reference)
    return 1.0 if total == 0 else 2 * lcs_length(text, reference) / total


def _ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


_13A = [(re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "), (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),
        (re.compile(r"([\.,])([^0-9])"), r" \1 \2"), (re.compile(r"([0-9])(-)"), r"\1 \2 ")]


def tokenize_13a(line: str) -> list[str]:
    """sacrebleu's default tokenizer (mteval-v13a): punctuation split off, numbers kept whole."""
    line = line.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in line:
        line = line.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    line = f" {line} "
    for pattern, replacement in _13A:
        line = pattern.sub(replacement, line)
    return line.split()


def sentence_bleu(text: str, reference: str, max_order: int = 4) -> float:
    hypothesis, target = tokenize_13a(text), tokenize_13a(reference)
    if not hypothesis:
        return 0.0
    counts = []
    for n in range(1, max_order + 1):
        hyp, ref = _ngrams(hypothesis, n), _ngrams(target, n)
        counts.append((sum((hyp & ref).values()), sum(hyp.values())))
    if not any(correct for correct, _ in counts):
        return 0.0  # sacrebleu's early stop: no n-gram matched
    log_sum, order, smooth = 0.0, 0, 1.0
    for n, (correct, total) in enumerate(counts, start=1):
        if total == 0:
            break
        order = n
        if correct == 0:
            smooth *= 2
            precision = 1.0 / (smooth * total)
        else:
            precision = correct / total
        log_sum += math.log(precision)
    brevity = 1.0 if len(hypothesis) >= len(target) else math.exp(1 - len(target) / len(hypothesis))
    return brevity * math.exp(log_sum / order)


def sentence_gleu(text: str, reference: str, max_order: int = 4) -> float:
    hypothesis, target = text.split(), reference.split()
    matches = predicted = expected = 0
    for n in range(1, max_order + 1):
        hyp, ref = _ngrams(hypothesis, n), _ngrams(target, n)
        predicted += sum(hyp.values())
        expected += sum(ref.values())
        matches += sum((hyp & ref).values())
    return matches / max(predicted, expected) if max(predicted, expected) else 0.0


def rouge_tokens(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _f_measure(overlap: int, predicted: int, expected: int) -> float:
    if not overlap:
        return 0.0
    precision, recall = overlap / predicted, overlap / expected
    return 2 * precision * recall / (precision + recall)


def rouge_n(text: str, reference: str, n: int) -> float:
    hyp, ref = _ngrams(rouge_tokens(text), n), _ngrams(rouge_tokens(reference), n)
    return _f_measure(sum((hyp & ref).values()), sum(hyp.values()), sum(ref.values()))


def rouge_l(text: str, reference: str) -> float:
    hypothesis, target = rouge_tokens(text), rouge_tokens(reference)
    return _f_measure(lcs_length(target, hypothesis), len(hypothesis), len(target))
