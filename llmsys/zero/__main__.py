"""``python -m llmsys.zero`` / ``torchrun --nproc-per-node=N -m llmsys.zero``: see ``llmsys.zero.cli``."""

from llmsys.zero.cli import main

if __name__ == "__main__":
    main()
