"""Arithmetic word problems: the `word_problem` synthetic task's records.

Owns: the sentence templates (addition, subtraction, multiplication), the names and objects
they are filled with, and the longest prompt the task can produce. Does not own: record ids,
seeding or streaming (`data`), or checking answers (`rewards.math_answer` reads the last
number of a completion).
"""

from __future__ import annotations

import numpy as np

NAMES = (("Tom", "he"), ("Anna", "she"), ("Sam", "he"), ("Lily", "she"), ("Ben", "he"), ("Mia", "she"),
         ("Omar", "he"), ("Zoe", "she"))
OBJECTS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "stamps", "shells")
SUFFIX = " Answer with a single number."

# (operation, template); a >= b for subtraction so every answer is a non-negative integer
TEMPLATES = (
    ("+", "{Name} has {a} {obj}. {Pron} gets {b} more {obj}. How many {obj} does {Name} have now?"),
    ("+", "There are {a} {obj} in a box and {b} {obj} on the table. How many {obj} are there in all?"),
    ("-", "{Name} had {a} {obj} and gave {b} of them to a friend. How many {obj} does {Name} have left?"),
    ("-", "A shop had {a} {obj}. It sold {b} {obj}. How many {obj} does the shop have now?"),
    ("*", "{Name} buys {a} bags with {b} {obj} in each bag. How many {obj} does {Name} buy in total?"),
)


def _number(rng: np.random.Generator, lo: int, hi: int) -> int:
    n = int(rng.integers(lo, hi + 1))
    return int(rng.integers(10 ** (n - 1) if n > 1 else 1, 10 ** n))


def _fill(template: str, name: tuple[str, str], obj: str, a: int, b: int) -> str:
    return template.format(Name=name[0], Pron=name[1].capitalize(), obj=obj, a=a, b=b) + SUFFIX


def record(rng: np.random.Generator, min_digits: int, max_digits: int) -> tuple[str, str]:
    """(prompt, answer) drawn from `rng`; operands have min_digits..max_digits digits."""
    op, template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    name = NAMES[int(rng.integers(len(NAMES)))]
    obj = OBJECTS[int(rng.integers(len(OBJECTS)))]
    a, b = _number(rng, min_digits, max_digits), _number(rng, min_digits, max_digits)
    if op == "-" and a < b:
        a, b = b, a
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return _fill(template, name, obj, a, b), str(answer)


def longest_prompts(max_digits: int) -> list[str]:
    """Every template with every name and object and the largest operands: the longest prompt
    in tokens is among them for a tokenizer that does not merge across words and numbers."""
    big = int("9" * max_digits)
    return [_fill(t, name, obj, big, big) for _, t in TEMPLATES for name in NAMES for obj in OBJECTS]
