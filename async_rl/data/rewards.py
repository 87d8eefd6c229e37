"""Reward functions: (completion text, reference answer) -> float in [0, 1].

Owns: the registry of named rewards, loading a user reward given as
`module:function`, the default reward of each synthetic task, and the answer
extraction and normalisation for math answers. Does not own: decoding tokens to text
(`tokenizer`), group advantages (`learner`), or when rewards are computed (the pump).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from fractions import Fraction
from typing import Callable, Optional

import numpy as np

from async_rl.config import ConfigError
from async_rl.usercode import load_callable

RewardFn = Callable[[str, str], float]

_REGISTRY: dict[str, RewardFn] = {}
_TASK_REWARDS = {"reverse": "reverse", "addition": "addition", "word_problem": "math_answer", "lookup": "exact_match",
                 "recall": "digits", "sequence": "first_number"}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn
    return deco


def registered() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def _positional(out: str, target: str) -> float:
    n = max(len(out), len(target))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(out, target)) / n


@register_reward("none")
def no_reward(completion: str, answer: str) -> float:
    """Every completion scores 0: training learns from learner.distill alone."""
    return 0.0


@register_reward("reverse")
@register_reward("digits")
def reverse_reward(completion: str, answer: str) -> float:
    """Fraction of positions right, counted from the left; extra or missing characters cost,
    and a missing one half a position more than a wrong one (at floor 0). Were stopping short
    as good as guessing, a policy not yet telling two prompt lengths apart would learn to stop
    after the shorter one's answer, and the longer prompts would never be answered in full."""
    out, target = completion.strip(), answer.strip()
    missing = max(0, len(target) - len(out))
    return max(0.0, _positional(out, target) - 0.5 * missing / max(len(target), 1))


@register_reward("addition")
def addition_reward(completion: str, answer: str) -> float:
    """Like `reverse` but right-aligned, so the units digit is compared with the units digit."""
    return _positional(completion.strip()[::-1], answer.strip()[::-1])


@register_reward("exact_match")
def exact_match_reward(completion: str, answer: str) -> float:
    return float(" ".join(completion.split()) == " ".join(answer.split()))


# --- math answers ---------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = r"-?\\[dt]?frac\s*(?:\{[^{}]*\}|\d)\s*(?:\{[^{}]*\}|\d)"
# A sign counts only where it cannot be a binary minus ("10-5" ends in 5, not -5).
_SIGN = r"(?:(?<![\w)\]}])[-+])?"
_NUMBER = _SIGN + r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|\.\d+)"
_LAST_ANSWER = re.compile(f"{_FRAC}|{_NUMBER}")
_FRAC_PARTS = re.compile(r"^(-?)\\frac\s*(\{[^{}]*\}|\d)\s*(\{[^{}]*\}|\d)$")
_PLAIN_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?$")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (nested braces allowed); None if none is closed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a solution: the last \\boxed{} if any, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    found = _LAST_ANSWER.findall(text.replace("\u2212", "-"))
    return found[-1] if found else None


def _normalise(s: str) -> str:
    s = s.strip().replace("\u2212", "-")
    s = re.sub(r"\\text\{\s*\\?%\s*\}", "%", s)
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    for tok in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", "\\%", "%", "{,}"):
        s = s.replace(tok, "" if tok != "{,}" else ",")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", " ", s).strip()
    s = s.rstrip(".").strip()
    # A comma between digit groups is a thousands separator, not a list.
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    if s.startswith("+"):
        s = s[1:].strip()
    return s


def _braced(part: str) -> str:
    return part[1:-1].strip() if part.startswith("{") else part


def parse_number(s: str) -> Optional[Fraction]:
    """An exact value for an integer, decimal, a/b or \\frac{a}{b} (after normalisation)."""
    s = _normalise(s).replace(" ", "")
    while s.startswith("(") and s.endswith(")") or s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    m = _FRAC_PARTS.match(s)
    if m:
        num, den = parse_number(_braced(m.group(2))), parse_number(_braced(m.group(3)))
        if num is None or den is None or den == 0:
            return None
        return -num / den if m.group(1) else num / den
    if s.count("/") == 1:
        a, b = s.split("/")
        num, den = parse_number(a), parse_number(b)
        return None if num is None or den is None or den == 0 else num / den
    if _PLAIN_NUMBER.match(s.lower()):
        try:
            return Fraction(s.lower())
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _reference_answer(ref: str) -> str:
    if "####" in ref:  # GSM8K-style solutions end with "#### <answer>"
        return ref.rsplit("####", 1)[1]
    boxed = last_boxed(ref)
    return ref if boxed is None else boxed


def math_equal(pred: str, ref: str) -> bool:
    a, b = parse_number(pred), parse_number(ref)
    if a is None and "=" in pred:  # "x = 5"
        a = parse_number(pred.rsplit("=", 1)[1])
    if a is not None and b is not None:
        return a == b
    return _normalise(pred).replace(" ", "") == _normalise(ref).replace(" ", "")


@register_reward("math_answer")
def math_answer_reward(completion: str, answer: str) -> float:
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    return float(math_equal(pred, _reference_answer(answer)))


@register_reward("first_number")
def first_number_reward(completion: str, answer: str) -> float:
    """1 when the completion's first number is the answer: a base model continuing a list
    writes the next item, then more (" 40, 47, 54"), and only the first is asked for."""
    found = _LAST_ANSWER.search(completion.replace("\u2212", "-"))
    return float(found is not None and math_equal(found.group(0), _reference_answer(answer)))


# --- lookup ----------------------------------------------------------------------------

def as_real(r) -> float | None:
    """A reward value as a float, or None unless it is a real number (bool and str are not)."""
    if isinstance(r, np.ndarray) and r.shape == () and r.dtype.kind in "iuf":
        r = r.item()
    if isinstance(r, (bool, np.bool_)) or not isinstance(r, numbers.Real):
        return None
    return float(r)


def refused(raw, bound: float) -> str | None:
    """Why `raw` cannot be a reward (None when it can): a reward is a real number, finite,
    with |reward| <= `bound` (rollout.reward_max_abs). A Python float of 1e200 is finite, but
    inf in float32 on the device: the loss would be NaN."""
    r = as_real(raw)
    if r is None:
        return f"{raw!r} ({type(raw).__name__}), not a real number"
    if not math.isfinite(r):
        return f"{r!r}, not a finite number"
    if abs(r) > bound:
        return f"{r!r}, outside rollout.reward_max_abs={bound:g} (|reward| must be <= {bound:g})"
    return None


def _checked(name: str, fn: RewardFn) -> RewardFn:
    @functools.wraps(fn)
    def wrapper(completion: str, answer: str) -> float:
        raw = fn(completion, answer)
        r = as_real(raw)
        if r is None:
            raise ValueError(f"reward {name!r} returned {raw!r} ({type(raw).__name__}), expected a float in [0, 1]")
        # Clamping would hide a broken reward; stop instead.
        if not (math.isfinite(r) and 0.0 <= r <= 1.0):
            raise ValueError(f"reward {name!r} returned {r!r}, expected a float in [0, 1]")
        return r
    return wrapper


def get_reward(name: str) -> RewardFn:
    """A registered reward by name, or `module:function` imported from the Python path."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        raise ConfigError(f"rollout.reward={name!r}: unknown reward (registered: "
                          f"{', '.join(registered())}; or give module:function)")
    fn = load_callable(f"rollout.reward={name!r}", name)
    return _checked(name, fn)


def task_reward(task: str) -> str:
    """The default reward name of a synthetic task."""
    if task not in _TASK_REWARDS:
        raise ConfigError(f"data.task={task!r}: no default reward (tasks: {', '.join(_TASK_REWARDS)})")
    return _TASK_REWARDS[task]


def reward_for_config(cfg, held_out: bool = False) -> tuple[str, RewardFn]:
    """(name, function) for `rollout.reward`, defaulting to the synthetic task's reward.
    `held_out`: the reward evaluation scores with, the task's own where training uses none."""
    name = cfg.rollout.reward
    if held_out and name == "none":
        name = ""
    if not name:
        if cfg.data.source != "synthetic":
            raise ConfigError(f"rollout.reward is required for data.source={cfg.data.source} "
                              f"(e.g. math_answer, exact_match, or module:function)")
        name = task_reward(cfg.data.task)
    return name, get_reward(name)
