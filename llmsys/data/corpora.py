"""Document collections built from what ships with Python, for the data experiments.

* prose: paragraphs of the zoo corpus (``pydoc_data.topics``, English help text);
* code: chunks of the standard library's own top-level source files;
* planted near-duplicates: copies of documents with a share of their words edited, and
  exact copies, so a deduplicator's precision and recall can be measured;
* low-quality documents: word salad (a paragraph's words shuffled), boilerplate (a line
  repeated), symbol runs and fragments, for quality filters.
"""

from __future__ import annotations

import random
import re
import sysconfig
from pathlib import Path

from llmsys.core import zoo


def prose_documents(min_words: int = 40) -> list[str]:
    """Paragraphs of the corpus with at least ``min_words`` words, in corpus order, without repeats."""
    seen, out = set(), []
    for paragraph in re.split(r"\n\s*\n", zoo.corpus()):
        text = " ".join(paragraph.split())
        if len(text.split()) >= min_words and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def code_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def code_documents(lines_per_doc: int = 40, max_docs: int | None = None) -> list[str]:
    """Chunks of ``lines_per_doc`` lines of the standard library's top-level modules."""
    out = []
    for path in code_files():
        lines = path.read_text(errors="replace").splitlines()
        for start in range(0, len(lines) - lines_per_doc + 1, lines_per_doc):
            chunk = "\n".join(lines[start:start + lines_per_doc])
            if chunk.strip():
                out.append(chunk)
                if max_docs is not None and len(out) >= max_docs:
                    return out
    return out


def perturb(text: str, rate: float, rng: random.Random, vocabulary: list[str]) -> str:
    """Edit about ``rate`` of the words: each edit deletes, replaces or inserts a word."""
    out = []
    for word in text.split():
        if rng.random() >= rate:
            out.append(word)
            continue
        action = rng.randrange(3)
        if action == 1:
            out.append(rng.choice(vocabulary))
        elif action == 2:
            out += [word, rng.choice(vocabulary)]
    return " ".join(out)


def with_planted_duplicates(docs: list[str], n_near: int, n_exact: int, rate: float = 0.02,
                            seed: int = 0) -> tuple[list[str], set[tuple[int, int]]]:
    """``docs`` plus ``n_near`` edited copies and ``n_exact`` exact copies (with changed case and
    spacing) appended, and the planted pairs (original index, copy index)."""
    rng = random.Random(seed)
    vocabulary = sorted({w for d in docs for w in d.split()})
    out, planted = list(docs), set()
    for i in rng.sample(range(len(docs)), n_near + n_exact):
        copy = perturb(docs[i], rate, rng, vocabulary) if len(planted) < n_near else "  " + docs[i].upper()
        planted.add((i, len(out)))
        out.append(copy)
    return out, planted


def low_quality_documents(prose: list[str], n_each: int, seed: int = 0) -> dict[str, list[str]]:
    """Four kinds of junk, ``n_each`` of each, made from the prose so only quality differs."""
    rng = random.Random(seed)
    sources = rng.sample(prose, n_each)
    salad = []
    for text in sources:
        w = text.split()
        rng.shuffle(w)
        salad.append(" ".join(w))
    boilerplate = ["\n".join([text.split(".")[0] + "."] * 12) for text in sources]
    symbols = [" ".join(rng.choice(["#", "...", "|", "@@", "==>", "#!"]) + w for w in text.split()) for text in sources]
    fragments = [" ".join(text.split()[:12]) for text in sources]
    return {"word salad": salad, "boilerplate": boilerplate, "symbols": symbols, "fragment": fragments}
