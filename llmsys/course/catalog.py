"""Every cached entry the course builds, by name: ``python -m llmsys zoo`` and the course runner.

The core owns the store (``llmsys.core.cache``) and the zoo's own models; each chapter that
derives an entry from them owns its build (the EAGLE head in ``llmsys.specdec.chat``, the
distilled student in ``llmsys.distill.chat``). This table, part of the course machinery,
names them all, so the core never imports a chapter.
"""

from __future__ import annotations

import functools

from llmsys.core import cache, pretrained, zoo
from llmsys.distill import addition
from llmsys.distill import chat as distill_chat
from llmsys.specdec import chat as specdec_chat

# name -> (build(force, progress), hash of a valid entry or None when it cannot be known yet)
ENTRIES = {
    **{name: (functools.partial(zoo.model_entry, name), functools.partial(zoo.model_hash, name)) for name in zoo.SPECS},
    pretrained.NAME: (pretrained.entry, pretrained.entry_hash),
    specdec_chat.NAME: (specdec_chat.entry, specdec_chat.entry_hash),
    distill_chat.NAME: (distill_chat.entry, distill_chat.entry_hash),
    addition.NAME: (lambda force, progress: addition.load_teacher(force=force, progress=progress), addition.spec_hash),
}
DEFAULT_BUILD = ("target", "draft", pretrained.NAME, specdec_chat.NAME, distill_chat.NAME, addition.NAME)


def names() -> list[str]:
    """Every entry ``build`` accepts."""
    return list(ENTRIES)


def build(names=None, force: bool = False, progress: bool = True) -> list[dict]:
    """Build the named entries (by default ``DEFAULT_BUILD``); valid cached ones are kept unless
    ``force``. Returns their ``status()`` rows."""
    names = list(DEFAULT_BUILD if names is None else [names] if isinstance(names, str) else names)
    unknown = [name for name in names if name not in ENTRIES]
    if unknown:
        raise ValueError(f"no entry named {', '.join(map(repr, unknown))}; choose from {', '.join(ENTRIES)}")
    zoo.tokenizer_entry(progress=progress)
    for name in names:
        ENTRIES[name][0](force=force, progress=progress)
    return [row for row in status() if row["name"] in names]


def status() -> list[dict]:
    """One row per entry: name, cached (a valid entry exists), params and, when known, held-out
    loss, bits per byte and build seconds. Builds nothing."""
    rows = []
    for name, (_, entry_hash) in ENTRIES.items():
        expected = entry_hash()
        manifest = cache.read_manifest(name, expected) if expected is not None else None
        metrics = manifest["metrics"] if manifest else {}
        params = zoo.SPECS[name].config.n_params() if name in zoo.SPECS else metrics.get("params")
        rows.append({"name": name, "cached": manifest is not None, "params": params,
                     "val_loss": metrics.get("val_loss"), "bits_per_byte": metrics.get("bits_per_byte"),
                     "build_seconds": metrics.get("build_seconds")})
    return rows


def report() -> str:
    """A plain-text table: the tokenizer and every entry."""
    lines = [f"llmsys zoo in {cache.entries_dir()}"]
    manifest = cache.read_manifest(zoo.TOKENIZER, zoo.tokenizer_hash())
    if manifest is None:
        lines.append("tokenizer: not built")
    else:
        m = manifest["metrics"]
        lines.append(f"tokenizer: byte-level BPE, {m['vocab_size']} tokens, {m['bytes_per_token']:.2f} bytes/token "
                     f"on {m['corpus_bytes']:,} bytes of pydoc_data.topics ({m['corpus_tokens']:,} tokens), "
                     f"built in {m['build_seconds']:.1f} s")
    lines.append(f"{'name':<16} {'cached':<7} {'params':>12} {'val loss':>9} {'bits/byte':>10} {'build s':>8}")

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"

    for row in status():
        lines.append(f"{row['name']:<16} {'yes' if row['cached'] else 'no':<7} {fmt(row['params'], ','):>12} "
                     f"{fmt(row['val_loss'], '.3f'):>9} {fmt(row['bits_per_byte'], '.3f'):>10} "
                     f"{fmt(row['build_seconds'], '.1f'):>8}")
    return "\n".join(lines)
