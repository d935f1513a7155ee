"""GRPO's reward functions, TRL's way: ``f(prompts, completions, **columns) -> list[float | None]``, one reward per
completion, the dataset's other columns (``solution`` ...) passed by name; None means "cannot score this one" (left
out of the group's mean, advantage 0). A config names them by import path (``module.function``); ``score`` sums
their weighted rewards per completion (TRL's ``nansum(rewards * reward_weights)``).

Shipped: ``math_answer_reward`` (math-verify against the ``solution`` column), ``think_format_reward`` (reasoning in
``<think>...</think>``, then the answer) and ``digits_reward`` (the toy task of ``tiny_grpo.yaml``).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

RewardFunction = Callable[..., Sequence[Optional[float]]]


def load_reward_function(path: str) -> RewardFunction:
    """The callable at import path ``path`` (``package.module.function``), or a ValueError saying what is wrong."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"reward function {path!r} is not an import path; write it as package.module.function,"
                         " e.g. recipes.posttrain.rewards.math_answer_reward")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward function {path!r}: module {module_name!r} does not import ({err}); check the"
                         " spelling and that its package is installed or on PYTHONPATH") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"reward function {path!r}: {module_name!r} has no callable {name!r}; choose one of"
                         f" {', '.join(n for n, v in vars(module).items() if inspect.isfunction(v)) or 'none'}")
    return function


def score(functions: Sequence[RewardFunction], weights: Sequence[float], prompts: list[Any], completions: list[Any],
          columns: dict[str, list[Any]], names: Optional[Sequence[str]] = None) -> Tensor:
    """Rewards [len(completions), len(functions)] as float32 (None -> NaN); ValueError if a function returns a
    number of rewards other than one per completion. ``columns`` holds the dataset's other columns, one value per
    completion."""
    names = names or [getattr(f, "__name__", repr(f)) for f in functions]
    table = []
    for function, name in zip(functions, names):
        rewards = list(function(prompts=prompts, completions=completions, **columns))
        if len(rewards) != len(completions):
            raise ValueError(f"reward function {name} returned {len(rewards)} rewards for {len(completions)}"
                             " completions; it must return one float (or None) per completion, in order")
        table.append([math.nan if r is None else float(r) for r in rewards])
    return torch.tensor(table, dtype=torch.float32).T.reshape(len(completions), len(functions))


def total_reward(per_function: Tensor, weights: Sequence[float]) -> Tensor:
    """Each completion's weighted sum of its rewards [n] (NaN rewards left out; NaN where every one is NaN)."""
    weighted = per_function * torch.tensor(list(weights), dtype=per_function.dtype)
    total = weighted.nansum(dim=1)
    return total.masked_fill(per_function.isnan().all(dim=1), math.nan)


def _text(completion: Any) -> str:
    """A completion's text: the string itself, or a conversational completion's first message's content."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def math_answer_reward(completions: list[Any], solution: list[str], **columns: Any) -> list[Optional[float]]:
    """1.0 when math-verify finds the completion's answer (``\\boxed{}`` first, then any LaTeX) equal to the
    ``solution`` column's, else 0.0; None where the solution itself does not parse (that prompt is not scored)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    answer_config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                           boxed_match_priority=0, try_extract_without_anchor=False)]
    rewards: list[Optional[float]] = []
    for completion, gold in zip(completions, solution, strict=True):
        gold_parsed = parse(gold)
        if not gold_parsed:
            rewards.append(None)
            continue
        answer = parse(_text(completion), extraction_config=answer_config, extraction_mode="first_match")
        rewards.append(1.0 if verify(gold_parsed, answer) else 0.0)
    return rewards


_THINK_THEN_ANSWER = re.compile(r"^<think>(?!.*<think>).*?</think>\s*\S.*$", re.DOTALL)


def think_format_reward(completions: list[Any], **columns: Any) -> list[float]:
    """1.0 when the completion reasons inside one ``<think>...</think>`` at its start and then answers, else 0.0."""
    return [1.0 if _THINK_THEN_ANSWER.match(_text(c)) else 0.0 for c in completions]


def digits_reward(completions: list[Any], **columns: Any) -> list[float]:
    """The toy task's verifiable reward: the share of the completion's non-space characters that are digits (0.0
    for an empty completion). A model that starts from random weights scores about 0.02 and can learn it in
    minutes."""
    rewards = []
    for completion in completions:
        characters = [ch for ch in _text(completion) if not ch.isspace()]
        rewards.append(sum(ch.isdigit() for ch in characters) / len(characters) if characters else 0.0)
    return rewards
