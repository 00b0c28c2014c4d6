"""A model as a server sees it: weights, text in and out, a chat format and stop tokens.

``smollm2`` is the real chat model (its own tokenizer and chat template, stopping at
``<|im_end|>``); the zoo's small models (``tiny``, ``draft``, ``target``) speak through
the zoo's byte-level BPE tokenizer, with chats rendered as plain ``role: content``
lines and no end-of-turn token (they stop at max_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmsys.core.model import Transformer


@dataclass
class ServedModel:
    name: str
    model: Transformer
    tokenizer: object
    stop_ids: tuple[int, ...]

    @property
    def chat_template(self) -> bool:
        return hasattr(self.tokenizer, "apply_chat_template")

    def encode(self, text: str) -> list[int]:
        if self.chat_template:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The conversation's tokens with the assistant's turn opened."""
        if self.chat_template:
            from llmsys.core.pretrained import chat_ids

            return chat_ids(self.tokenizer, messages)[0].tolist()
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")

    def decode(self, ids: list[int]) -> str:
        ids = [t for t in ids if t not in self.stop_ids]
        if self.chat_template:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids)


def load_served(name: str, dtype="bf16", context: int | None = None, device=None) -> ServedModel:
    """The model ``name`` (anything ``zoo.load`` takes) ready to serve in ``dtype`` (a torch.dtype
    or "bf16"/"fp32"), with at most ``context`` tokens."""
    from llmsys.core import zoo

    model = zoo.load(name, device=device, dtype=dtype, max_seq_len=context)
    if name in zoo.SPECS:
        return ServedModel(name, model, zoo.tokenizer(), ())
    tok = zoo.tokenizer(name)
    return ServedModel(name, model, tok, (tok.convert_tokens_to_ids("<|im_end|>"),) if name == zoo.PRETRAINED
                       else tuple(t for t in (tok.eos_token_id,) if t is not None))

