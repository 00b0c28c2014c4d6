"""Tokenizers for the RL task: one token per character for the course's small policy, and the
same interface over a transformers tokenizer for a real checkpoint."""

from __future__ import annotations


class CharTokenizer:
    """One token per character, plus a few whole-word special tokens. Enough for a task whose
    text is digits and operators; a policy this small learns much faster over 24 symbols than
    over a 1024-token BPE vocabulary."""

    SPECIALS = ("<eos>", "<answer>", "</answer>")

    def __init__(self, chars: str = "0123456789+-*/() ,.:"):
        if len(set(chars)) != len(chars):
            raise ValueError(f"chars has duplicates: {chars!r}")
        self.tokens = list(self.SPECIALS) + list(chars)
        self.ids = {tok: i for i, tok in enumerate(self.tokens)}
        self.eos_id = self.ids["<eos>"]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in self.SPECIALS if text.startswith(s, i)), None)
            piece = special or text[i]
            if piece not in self.ids:
                raise ValueError(f"character {piece!r} at position {i} of {text!r} is not in the vocabulary "
                                 f"{''.join(self.tokens[len(self.SPECIALS):])!r}")
            ids.append(self.ids[piece])
            i += len(piece)
        return ids

    def decode(self, ids) -> str:
        return "".join(self.tokens[int(i)] for i in ids)


class HFTokenizer:
    """The same interface over a transformers tokenizer, for a real checkpoint from a local folder."""

    def __init__(self, hf_tokenizer):
        if hf_tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; GRPO needs one to know where a completion ends")
        self.hf = hf_tokenizer
        self.eos_id = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)
