"""Fine-tuning examples in windows: whole examples packed together, and the policy for one that
is longer than a window.

A window holds `seq_len + 1` tokens (its inputs and, shifted by one, its targets). An example
cut across two windows would train its reply in the second without its prompt, so examples are
packed whole: each window is a run of consecutive examples that fits, and the targets after
its last example are masked (`TokenBatches`; under causal attention the tokens read past the
run change nothing before them). An example longer than a window cannot be whole; the
`LongExamples` policy decides (`fit_examples`), and the counts say how many it touched:

- truncate (the default): keep the end of its prompt and the start of its reply -- the whole
  reply if it fits beside half a window of prompt, else half a window of each;
- split: cut it into windows that share one token, so each target is trained once (a later
  window's reply then trains without its prompt, as plain text would);
- drop: leave it out.

The prompt is everything before the example's first trained token. It never touches a model
or a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierzero.config import LongExamples


@dataclass(frozen=True)
class Examples:
    """Token ids end to end, which are trained (0/1), and where each example starts: `bounds`
    holds every example's first offset, then the end (n + 1 entries)."""

    ids: np.ndarray
    trained: np.ndarray
    bounds: np.ndarray


@dataclass(frozen=True)
class Fitted:
    """What `fit_examples` did: `long` of the `examples` were longer than a window of `window`
    tokens, and each was truncated, split or dropped, as `policy` says."""

    policy: LongExamples
    examples: int
    long: int
    window: int


def fit_examples(examples: Examples, window: int, policy: LongExamples) -> tuple[Examples, Fitted]:
    """`examples` with every one longer than `window` tokens truncated, split or dropped."""
    bounds = examples.bounds
    long = np.flatnonzero(np.diff(bounds) > window)
    fitted = Fitted(policy, len(bounds) - 1, len(long), window)
    if not len(long):
        return examples, fitted
    firsts, lasts, previous = [], [], 0
    for i in long:
        firsts.append(bounds[previous:i])
        lasts.append(bounds[previous + 1 : i + 1])
        a, b = _kept(int(bounds[i]), int(bounds[i + 1]), examples.trained, window, policy)
        firsts.append(np.asarray(a, dtype=np.int64))
        lasts.append(np.asarray(b, dtype=np.int64))
        previous = i + 1
    firsts.append(bounds[previous:-1])
    lasts.append(bounds[previous + 1 :])
    first, last = np.concatenate(firsts), np.concatenate(lasts)
    index = _ranges(first, last)
    new_bounds = np.concatenate([[0], np.cumsum(last - first)]).astype(np.int64)
    return Examples(examples.ids[index], examples.trained[index], new_bounds), fitted


def _kept(
    start: int, end: int, trained: np.ndarray, window: int, policy: LongExamples
) -> tuple[list[int], list[int]]:
    """The token ranges that stand for one long example (first offsets, end offsets)."""
    if policy is LongExamples.DROP:
        return [], []
    if policy is LongExamples.SPLIT:
        firsts, lasts, a = [], [], start
        while True:
            b = min(a + window, end)
            firsts.append(a)
            lasts.append(b)
            if b == end:
                return firsts, lasts
            a = b - 1  # the next window's first input is this one's last target
    hits = np.flatnonzero(trained[start:end])
    prompt = int(hits[0]) if len(hits) else 0
    kept_prompt = min(prompt, max(window - (end - start - prompt), window // 2))
    a = start + prompt - kept_prompt
    return [a], [a + window]


def _ranges(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """The offsets of every range [first, last), concatenated, without a loop per range."""
    lengths = last - first
    ends = np.cumsum(lengths)
    return np.repeat(first - (ends - lengths), lengths) + np.arange(
        int(ends[-1]) if len(ends) else 0
    )


def pack(bounds: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows of whole consecutive examples, each at most `window` tokens (first fit in file
    order): their first offsets and the end of each one's last example."""
    firsts, lasts = [], []
    first = last = int(bounds[0])
    for end in bounds[1:].tolist():
        if end - first > window and last > first:
            firsts.append(first)
            lasts.append(last)
            first = last
        last = end
    if last > first:
        firsts.append(first)
        lasts.append(last)
    return np.asarray(firsts, dtype=np.int64), np.asarray(lasts, dtype=np.int64)
