"""Evaluation tasks built from what ships with Python: deterministic, checkable by code.

* ``docstring_task()``, multiple choice: "which built-in / method / function does what this
  docstring says?", four real names from the same family, the right one checked by code
  (its docstring holds the summary, the distractors' do not).
* ``module_task()``, generative: "which standard-library module provides `name`?", with
  real names (answer checked by importing the named module) and made-up names that no
  listed module defines, for hallucination detection.

Every item has a fixed split: train (20%, few-shot examples), dev (40%, fitting e.g. a
temperature) and test (40%), chosen by a hash of the item's id, so a split never depends
on which other items exist. Sizes depend on the Python version (its docstrings);
``Task.sizes()`` states them.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import importlib
import inspect
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "dev", "test")
SPLIT_OF_DIGIT = ["train"] * 2 + ["dev"] * 4 + ["test"] * 4  # sha256(id) % 10 -> split


def split_of(item_id: str) -> str:
    return SPLIT_OF_DIGIT[int(hashlib.sha256(item_id.encode()).hexdigest(), 16) % 10]


@dataclass(frozen=True)
class MCItem:
    """One multiple-choice item: the prompt, the choices (continuations without the
    leading space) and the index of the right one."""

    id: str
    prompt: str
    choices: tuple[str, ...]
    gold: int
    split: str


@dataclass
class Task:
    name: str
    items: list
    description: str = ""

    def split(self, name: str) -> list:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return [item for item in self.items if item.split == name]

    def sizes(self) -> dict[str, int]:
        return {name: len(self.split(name)) for name in SPLITS}


# ---------------------------------------------------------------- docstring -> name (MC)

def _family_members():
    """(family description, owner object, public names) for every family of the task."""
    exceptions = [n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
                  and issubclass(getattr(builtins, n), BaseException)]
    functions = [n for n in dir(builtins) if inspect.isbuiltin(getattr(builtins, n)) and not n.startswith("_")]
    families = [("built-in function", builtins, functions), ("built-in exception", builtins, exceptions)]
    for kind in (str, list, dict, set, bytes):
        families.append((f"{kind.__name__} method", kind, [n for n in dir(kind) if not n.startswith("_")]))
    for module in ("math", "os.path", "itertools", "random", "statistics", "shutil", "string", "textwrap"):
        mod = importlib.import_module(module)
        names = [n for n in getattr(mod, "__all__", dir(mod)) if not n.startswith("_") and callable(getattr(mod, n, None))]
        families.append((f"function of the {module} module", mod, names))
    return families


def summary_of(obj) -> str | None:
    """The first line of a docstring that is a sentence, not a signature."""
    doc = inspect.getdoc(obj) or ""
    for line in doc.splitlines():
        line = line.strip()
        if line and "(" not in line.split(" ")[0] and "->" not in line:
            return line
    return None


def docstring_task(n_choices: int = 4) -> Task:
    """Which name does what this docstring says? Distractors are names of the same family."""
    items = []
    for family, owner, names in _family_members():
        summaries = {n: summary_of(getattr(owner, n)) for n in sorted(set(names))}
        # keep unambiguous items: a summary of 15+ characters that names neither the answer nor
        # another member, and is the summary of exactly one member
        counts = {}
        for s in summaries.values():
            counts[s] = counts.get(s, 0) + 1
        usable = sorted(n for n, s in summaries.items() if s and len(s) >= 15 and counts[s] == 1
                        and not re.search(rf"\b{re.escape(n)}\b", s, re.IGNORECASE))
        if len(usable) < n_choices:
            continue
        for name in usable:
            rng = random.Random(f"{family}:{name}")  # str seeds hash with sha512: same on every run
            choices = rng.sample([n for n in usable if n != name], n_choices - 1)
            gold = rng.randrange(n_choices)
            choices.insert(gold, name)
            item_id = f"{family}:{name}"
            prompt = f"Question: Which Python {family} is described as \"{summaries[name]}\"?\nAnswer:"
            items.append(MCItem(item_id, prompt, tuple(choices), gold, split_of(item_id)))
    return Task("docstring_mc", items, "which name does what this docstring says")


def verify_docstring_item(item: MCItem) -> bool:
    """True when the gold choice's docstring summary is the one in the prompt and no distractor's is."""
    family = item.id.split(":", 1)[0]
    owner = next(o for f, o, _ in _family_members() if f == family)
    quoted = item.prompt.split('"')[1]
    return [summary_of(getattr(owner, c)) == quoted for c in item.choices] == [i == item.gold for i in range(len(item.choices))]


# ---------------------------------------------------------------- which module provides it (generative)

KNOWN_MODULES = ("math", "os", "os.path", "json", "random", "re", "time", "itertools", "functools", "collections",
                 "shutil", "string", "statistics", "heapq", "bisect", "copy", "glob", "textwrap", "hashlib",
                 "base64", "pickle", "csv", "sys", "subprocess", "datetime", "operator", "struct", "zlib", "tempfile")


@dataclass(frozen=True)
class QAItem:
    id: str
    name: str  # the function asked about
    real: bool  # False: a made-up name no module in KNOWN_MODULES defines
    split: str

    @property
    def question(self) -> str:
        return (f"Which module of Python's standard library provides the function `{self.name}`? "
                "Answer with the module name only.")

    @property
    def answer_start(self) -> str:
        """How the answer begins: the model continues with the module's name."""
        return f"The function `{self.name}` is provided by the module `"


def _module_functions() -> dict[str, list[str]]:
    out = {}
    for module in KNOWN_MODULES:
        mod = importlib.import_module(module)
        out[module] = sorted(n for n in getattr(mod, "__all__", dir(mod)) if not n.startswith("_")
                             and (inspect.isfunction(getattr(mod, n, None)) or inspect.isbuiltin(getattr(mod, n, None))))
    return out


def defined_anywhere(name: str) -> bool:
    return any(hasattr(importlib.import_module(m), name) for m in KNOWN_MODULES) or hasattr(builtins, name)


@functools.cache
def stdlib_usage() -> dict[tuple[str, str], int]:
    """How often the standard library's own top-level source calls ``module.name(`` for the known
    modules' functions: a measure of how familiar a function is, from text that ships with Python."""
    functions = _module_functions()
    pattern = re.compile(r"\b(" + "|".join(re.escape(m) for m in sorted(KNOWN_MODULES, key=len, reverse=True))
                         + r")\.([A-Za-z_]\w*)\(")
    counts: dict[tuple[str, str], int] = {}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for module, name in pattern.findall(path.read_text(errors="replace")):
            if name in functions[module]:
                counts[module, name] = counts.get((module, name), 0) + 1
    return counts


def module_task(n_real: int = 60, n_fake: int = 60, seed: int = 0) -> Task:
    """The ``n_real`` functions the standard library itself calls most often (``os.path.join``,
    ``re.compile``...), and made-up names built from pieces of real ones (``dumps`` + ``tree``
    -> ``dumpstree``) that no module in ``KNOWN_MODULES`` defines."""
    functions = _module_functions()
    rng = random.Random(seed)
    usage = sorted(stdlib_usage().items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = []
    for (_, name), _ in usage:  # a name defined by two modules (os.stat) is asked once
        if name not in chosen and len(chosen) < n_real:
            chosen.append(name)
    pieces = sorted({p for names in functions.values() for n in names for p in n.split("_")
                     if re.fullmatch(r"[a-z]{3,}", p)})
    fakes = set()
    while len(fakes) < n_fake:
        a, b = rng.sample(pieces, 2)
        name = a + rng.choice(["", "_"]) + b
        if not defined_anywhere(name):
            fakes.add(name)
    items = [QAItem(f"real:{n}", n, True, split_of(f"real:{n}")) for n in chosen]
    items += [QAItem(f"fake:{n}", n, False, split_of(f"fake:{n}")) for n in sorted(fakes)]
    return Task("module_qa", items, "which standard-library module provides this function")


def parse_module(answer: str) -> str:
    """The module an answer names: the first known module mentioned, else the first dotted word."""
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]|[A-Za-z_]", answer)
    for word in words:
        parts = word.split(".")
        for end in range(len(parts), 0, -1):  # the longest known prefix: os.path.join -> os.path
            if ".".join(parts[:end]) in KNOWN_MODULES:
                return ".".join(parts[:end])
    return words[0] if words else ""


def _resolve(module: str):
    """The module object for a known name (``os.path`` and ``posixpath`` are one object); other
    names stay strings: a model's answer is never imported unless it is a known module."""
    module = {"posixpath": "os.path", "ntpath": "os.path"}.get(module, module)
    return importlib.import_module(module) if module in KNOWN_MODULES else module


def same_answer(a: str, b: str) -> bool:
    """Two answers mean the same when they name the same module."""
    return _resolve(parse_module(a)) is _resolve(parse_module(b)) or parse_module(a) == parse_module(b)


def is_correct(item: QAItem, answer: str) -> bool:
    """Checked by code: the named module is a known one and defines the name (no real module
    defines a made-up name, so every answer to a made-up name is a hallucination)."""
    module = parse_module(answer)
    return module in KNOWN_MODULES and hasattr(importlib.import_module(module), item.name)
