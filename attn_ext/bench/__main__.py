"""``python -m attn_ext.bench [args]``: same as ``attn-ext bench [args]``."""

import sys

from attn_ext.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
