"""What `gaac_hf` and `dgap_hf` both need, importable without torch and without registering the `"gaac"` attention.

* `hf_common.model_config`: what a KV cache reads of a transformers model (text config, layer types, KV head shape,
  the model's identity, the forward's cache keyword);
* `hf_common.artifacts`: the Hub-format artifacts shipped in the wheel, and the check that a path-like artifact
  argument exists;
* `hf_common.console`: the `gaac-hf` and `dgap-hf` command lines (argument parsing only; each command runs from its
  package's `cli` module).
* `hf_common.cache_layers`: what `GAACCache` and `LowBitCache` share (the layer list of full-attention layers and
  stock layers, the row-selection methods, the byte tallies); the one module here that imports torch and
  transformers at import, so only the cache modules import it;
* `hf_common.testing`: tiny model configs for the tests and benchmarks of both packages.

It lives outside `gaac_hf` because importing anything under `gaac_hf` runs `gaac_hf/__init__.py`, which registers
the `"gaac"` attention (and so imports torch and transformers).
"""

__version__ = "0.1.0"  # the gaac-hf distribution's version (pyproject.toml reads it from here)
