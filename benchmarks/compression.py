"""Compression report on real SmolLM2-135M-Instruct KV: calibration text A vs held-out text B.

Text A is the GNU Coding Standards and GNU maintainers' guide (Debian package gnu-standards), text B the Debian
Reference (package debian-reference-en): real English prose installed offline. Writes
benchmarks/results/compression.json and .md. Same as `gaac-hf report --calib-text ... --heldout-text ...`.

    apt-get install -y gnu-standards debian-reference-en && python benchmarks/compression.py
"""

import sys

from gaac_hf.cli import main
from gaac_hf.corpus import DEBIAN_REFERENCE, GNU_STANDARDS

if __name__ == "__main__":
    main(["report", "--calib-text", *GNU_STANDARDS, "--heldout-text", *DEBIAN_REFERENCE, *sys.argv[1:]])
