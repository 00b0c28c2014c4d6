"""llmsys: the companion library of a course on LLM training and inference.

Notebooks, labs and tests import from here. The shared core is ``device``,
``model``, ``tokenizer``, ``zoo``, ``accounting``, ``ledger`` and ``dist``;
each chapter has its own module on top of it.
"""

__version__ = "0.1.0"

# Choose compiled Triton or its interpreter before anything can import triton:
# torch's dispatch modes (FlopCounterMode, ...) import it through torch._dynamo,
# and triton fixes the mode of its own helpers at that first import.
from llmsys.core.device import configure_triton as _configure_triton

_configure_triton()
