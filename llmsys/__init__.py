"""llmsys: the companion library of a course on LLM training and inference.

Notebooks, labs and tests import from here. The shared core is ``device``,
``model``, ``tokenizer``, ``zoo``, ``accounting``, ``ledger`` and ``dist``;
each chapter has its own module on top of it.
"""

__version__ = "0.1.0"
