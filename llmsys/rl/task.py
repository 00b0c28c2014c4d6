"""Countdown: make a target from given numbers with + - * /, each number exactly once, scored
by TinyZero's reward rules (a verifiable reward: a program checks the answer)."""

from __future__ import annotations

import ast
import functools
import itertools
import random
import re
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]
    target: int
    solutions: tuple[str, ...]  # every expression of the generator that reaches the target


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_WHITELIST = re.compile(r"^[\d+\-*/().\s]+$")
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def evaluate_expression(expr: str) -> float:
    """The value of an arithmetic expression of numbers, + - * /, unary minus and parentheses;
    anything else (names, calls, powers) raises ValueError. Parsed, never passed to eval."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError(f"not allowed in an answer: {ast.dump(node)[:60]}")

    return walk(ast.parse(expr.strip(), mode="eval"))


def countdown_reward(completion: str, numbers, target: float, format_score: float = 0.1, score: float = 1.0) -> float:
    """TinyZero's countdown rules: no ``<answer>...</answer>`` → 0; the last answer must use
    exactly the given numbers, each once, and only digits, + - * / ( ) . and spaces, else the
    format score; its value within 1e-5 of the target → ``score``, otherwise the format score."""
    answers = _ANSWER.findall(completion)
    if not answers:
        return 0.0
    expr = answers[-1].strip()
    if not _WHITELIST.match(expr) or sorted(int(n) for n in re.findall(r"\d+", expr)) != sorted(numbers):
        return format_score
    try:
        value = evaluate_expression(expr)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError):
        return format_score
    return score if abs(value - target) < 1e-5 else format_score


def _expressions(numbers: tuple[int, ...]):
    """Every expression using the numbers once each in the given order, with + - * and, for
    three numbers, both ways to bracket them (brackets written only where precedence needs them)."""
    if len(numbers) == 2:
        a, b = numbers
        yield from (f"{a}{op}{b}" for op in "+-*")
        return
    a, b, c = numbers
    for op1, op2 in itertools.product("+-*", repeat=2):
        yield f"{a}{op1}{b}{op2}{c}"  # precedence decides the grouping
        if op1 in "+-" and op2 == "*":
            yield f"({a}{op1}{b})*{c}"
        if op1 == "-" and op2 in "+-":
            yield f"{a}-({b}{op2}{c})"
        if op1 == "*" and op2 in "+-":
            yield f"{a}*({b}{op2}{c})"


@functools.lru_cache(maxsize=None)
def _all_problems(size: int, max_number: int, max_target: int) -> tuple[Problem, ...]:
    """Every (numbers, target) with its solutions, in a fixed order."""
    problems = []
    for numbers in itertools.product(range(1, max_number + 1), repeat=size):
        by_target = defaultdict(list)
        for perm in sorted(set(itertools.permutations(numbers))):
            for expr in _expressions(perm):
                by_target[evaluate_expression(expr)].append(expr)
        for target, exprs in sorted(by_target.items()):
            if 0 <= target <= max_target:
                problems.append(Problem(numbers, int(target), tuple(exprs)))
    return tuple(problems)


class Countdown:
    """Countdown: make ``target`` from ``numbers`` with + - * /, using each number exactly once.

    Problems are every (numbers, target) the generator reaches with two (and, if ``sizes``
    says so, three) numbers in 1..max_number and targets in 0..max_target. Two numbers suit
    the course's small policy; three are much harder for it. A fixed, seeded share of each
    size is held out (``test``). ``sample`` draws a size uniformly, then a problem.

    ``prompt(p)`` is the short form a character-level policy reads ("3,7,4:25", " 3,7:21"),
    ``chat_prompt(p)`` an instruction for a real instruction-following checkpoint."""

    def __init__(self, sizes: tuple[int, ...] = (2,), max_number: int = 9, max_target: int = 99,
                 test_fraction: float = 0.2, seed: int = 0):
        if not sizes or not set(sizes) <= {2, 3}:
            raise ValueError(f"sizes lists how many numbers a problem has, each 2 or 3; got {sizes!r}")
        if not 2 <= max_number <= 9:
            raise ValueError(f"max_number must be in 2..9 (numbers are single digits), got {max_number}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.sizes, self.max_number, self.max_target = tuple(sorted(set(sizes))), max_number, max_target
        rng = random.Random(seed)
        self.train_by_size, self.test_by_size = {}, {}
        for size in self.sizes:
            problems = list(_all_problems(size, max_number, max_target))
            rng.shuffle(problems)
            n_test = max(1, int(round(test_fraction * len(problems))))
            self.test_by_size[size], self.train_by_size[size] = problems[:n_test], problems[n_test:]
        self.train = [p for size in self.sizes for p in self.train_by_size[size]]
        self.test = [p for size in self.sizes for p in self.test_by_size[size]]

    def sample(self, n: int, generator: random.Random, split: str = "train") -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pools = self.train_by_size if split == "train" else self.test_by_size
        drawn = []
        for _ in range(n):
            pool = pools[generator.choice(self.sizes)]
            drawn.append(pool[generator.randrange(len(pool))])
        return drawn

    @property
    def prompt_width(self) -> int:
        return 2 * max(self.sizes) - 1 + 1 + len(str(self.max_target))

    def prompt(self, problem: Problem) -> str:
        """Numbers, a colon, the target, left-padded with spaces to one width, so that every
        prompt has the same length and a whole batch is sampled at once."""
        return (",".join(map(str, problem.numbers)) + f":{problem.target}").rjust(self.prompt_width)

    def chat_prompt(self, problem: Problem) -> str:
        nums = ", ".join(map(str, problem.numbers))
        return (f"Use the numbers {nums} once each, with + - * / and brackets, to make {problem.target}. "
                f"Think first, then give only the expression between <answer> and </answer>, "
                f"as in <answer>(2 + 3) * 4</answer>.\n")

    def reward(self, problem: Problem, completion: str) -> float:
        return countdown_reward(completion, problem.numbers, problem.target)

    def demonstration(self, problem: Problem, generator: random.Random, ramble_rate: float = 0.0,
                      max_ramble: int = 12) -> str:
        """A supervised completion: a correct answer in tags or, with probability ``ramble_rate``,
        an answerless ramble of 1..max_ramble dots (reward 0). Rambles give the policy a way to be
        wrong at any length, which is what the length normalization of GRPO acts on."""
        if generator.random() < ramble_rate:
            return "." * generator.randint(1, max_ramble)
        return f"<answer>{generator.choice(problem.solutions)}</answer>"
