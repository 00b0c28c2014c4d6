"""What pyproject.toml cannot say: the top-level ``kernels/`` folder installs as ``llmsys.kernels``.

``kernels/`` has no ``__init__.py`` (see llmsys/kernels.py), so package
discovery would not find it, and a top-level package of that name must never
be installed: it is mapped into ``llmsys`` here instead.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["llmsys*"]), "llmsys.kernels"], package_dir={"llmsys.kernels": "kernels"})
