"""Arithmetic sequences: the `sequence` synthetic task's records ("12, 19, 26, 33," -> "40").

A continuation task a small base model already half-knows (Gemma 3 270M continues about a
third of them right), so a few GRPO steps can move it. Owns: the ranges of first term, step
and shown terms, and the longest prompt. Does not own: record ids, seeding or streaming
(`data`), or checking answers (`rewards.first_number`).
"""

from __future__ import annotations

import numpy as np

TERMS = 4  # terms shown; the answer is the next one
STEPS = (2, 9)  # the common difference, inclusive; increasing sequences only


def record(rng: np.random.Generator, min_digits: int, max_digits: int) -> tuple[str, str]:
    """(prompt, answer) drawn from `rng`; the first term has min_digits..max_digits digits."""
    n = int(rng.integers(min_digits, max_digits + 1))
    first = int(rng.integers(10 ** (n - 1) if n > 1 else 1, 10 ** n))
    step = int(rng.integers(STEPS[0], STEPS[1] + 1))
    terms = [first + i * step for i in range(TERMS + 1)]
    return ", ".join(map(str, terms[:TERMS])) + ",", str(terms[TERMS])


def longest_prompts(max_digits: int) -> list[str]:
    """The largest first term with the largest step: no prompt has more characters."""
    big = 10 ** max_digits - 1
    return [", ".join(str(big + i * STEPS[1]) for i in range(TERMS)) + ","]
