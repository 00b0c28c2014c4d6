"""The shared core every chapter builds on.

``device`` (device, dtype, backend, Triton mode), ``cache`` (the locked, hashed, atomic
entry store), ``model`` (the Llama decoder with its KV cache), ``tokenizer`` (byte-level
BPE), ``zoo`` (the course's own models and the one loader), ``pretrained`` (the real chat
model's entry), ``accounting`` (memory, FLOP and communication formulas), ``ledger`` (the
running table of techniques, whose rows are ``techniques``), ``dist`` (launching ranks),
``comm`` (the one-tensor collectives and the byte counter), ``timing`` and ``measure``.

The core never imports a chapter package (tests/test_layout.py walks the import graph).
"""
