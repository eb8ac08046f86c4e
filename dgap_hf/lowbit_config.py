"""`LowBitConfig`: the validated options of a `LowBitCache` quantizer, and their JSON spec (recorded in artifacts).

The dataclass defaults are plain KIVI grouping (keys per channel, values per token, groups of 32, a 128-token
full-precision residual, no sinks, no rotation, uniform levels, no outliers): what a spec without the newer fields
means (artifacts before spec version 2). `LowBitConfig.default(precision)` gives the measured best options per
precision (`benchmarks/results/lowbit_quality.md`); `LowBitCache(config, "K2V2")` uses it, and the shipped DGAP
artifact was trained on it (since session 6).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hf_common.model_config import kv_geometry, text_config

from .precision import UnknownPrecisionError, format_precision, normalize_precision, parse_precision
from .quantize import ONE_BIT_MODES, check_bits, check_stat_dtype, group_mode
from .rotation import ROTATIONS, check_rotation

SPEC_VERSION = 2
RESIDUAL_WINDOW = 128  # the most recent full-precision tokens `stats()` reports apart from the quantized storage
LEVELS = ("uniform", "normal")
KEY_AXES = ("channel", "token")
ROTATE = ("kv", "k", "v")
# descriptive entries of a spec (written for readers, not options)
_PROSE = ("key_grouping", "value_grouping", "stat_dtype", "packing", "minmax", "sign", "sink", "normal", "rotation_doc",
          "outliers_doc", "spec_version", "key_bits", "value_bits", "group_size", "stat_dtypes_doc",
          "layer_key_bits_doc", "layer_value_bits_doc")


@dataclass(frozen=True)
class LowBitConfig:
    """Options of the `LowBitCache` quantizer (validated on construction).

    * `precision`: `"K<b>V<b>"`, bits 1, 2, 4 or 8.
    * `key_group_size`: tokens per key group (keys per channel); `value_group_size`: channels per value group
      (values per token; must divide head_dim). Multiples of 8 (whole packed bytes).
    * `key_axis`: `"channel"` (KIVI: keys per channel over `key_group_size` tokens) or `"token"` (keys like the
      values, per token over `value_group_size` channels, as rotation-based quantizers do; `key_group_size` then
      only sets how many tokens are quantized at a time).
    * `residual_length`: recent tokens always in full precision (the residual holds `residual_length` to
      `residual_length + key_group_size - 1` tokens; `stats()` counts any beyond 128 with the quantized storage).
    * `sink_length`: first tokens kept in full precision for good (attention sinks).
    * `one_bit_mode`: 1-bit groups, `"sign"` (mean +/- MAD) or `"minmax"`.
    * `levels`: `"uniform"` or `"normal"` (Lloyd-Max levels of a Gaussian) for 2- and 4-bit groups.
    * `rotation`: `"none"`, `"hadamard"` or `"random"` (seeded by `rotation_seed`), applied post-RoPE to the
      keys and/or values (`rotate`: `"kv"`, `"k"`, `"v"`) before quantization and undone on dequantization.
    * `pre_rope_keys`: keys turned back by their RoPE angle (the model's frequencies at the token's cache index)
      before quantization and forward again after (`dgap_hf.rope_frame`; needs the model config), then rotated:
      `True` in every layer, or a tuple of the layers that do it.
    * `key_outliers` / `value_outliers`: elements per group kept in `outlier_dtype` (dense-and-sparse).
    * `key_scale_dtype`, `key_zero_dtype`, `value_scale_dtype`, `value_zero_dtype`, `outlier_dtype`: formats of
      the group statistics, `"bfloat16"` or `"float8_e4m3fn"` (`dgap_hf.quantize`); a zero dtype `"none"` stores
      no zero-point (symmetric groups; Lloyd-Max or 1-bit sign groups only).
    * `layer_key_bits`: `((layer, bits), ...)` or `((layer, kv_head, bits), ...)`: key bits of some layers or KV
      heads other than the precision's (mixed precision: e.g. the few heads whose 2-bit keys cost the most at 4).
    * `layer_value_bits`: the same for the values (e.g. the few retrieval heads, whose values NIAH needs precise).
    * `head_dim`: when set, the head dimension the config is for (checked against the model).
    """

    precision: str = "K2V2"
    key_group_size: int = 32
    value_group_size: int = 32
    key_axis: str = "channel"
    residual_length: int = 128
    sink_length: int = 0
    one_bit_mode: str = "sign"
    levels: str = "uniform"
    rotation: str = "none"
    rotate: str = "kv"
    rotation_seed: int = 0
    pre_rope_keys: bool | tuple = False
    key_outliers: int = 0
    value_outliers: int = 0
    key_scale_dtype: str = "bfloat16"
    key_zero_dtype: str = "bfloat16"
    value_scale_dtype: str = "bfloat16"
    value_zero_dtype: str = "bfloat16"
    outlier_dtype: str = "bfloat16"
    layer_key_bits: tuple = ()
    layer_value_bits: tuple = ()
    head_dim: int | None = field(default=None)

    def __post_init__(self):
        object.__setattr__(self, "precision", format_precision(*parse_precision(self.precision)))
        for name in ("key_group_size", "value_group_size"):
            g = getattr(self, name)
            if not isinstance(g, int) or g <= 0 or g % 8:
                raise ValueError(f"{name} must be a positive multiple of 8 (whole packed bytes), not {g!r}")
        for name in ("residual_length", "sink_length", "key_outliers", "value_outliers", "rotation_seed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, not {getattr(self, name)!r}")
        self._check_pre_rope()
        if self.key_axis not in KEY_AXES:
            raise ValueError(f"key_axis must be one of {KEY_AXES}, not {self.key_axis!r}")
        if self.one_bit_mode not in ONE_BIT_MODES:
            raise ValueError(f"one_bit_mode must be one of {ONE_BIT_MODES}, not {self.one_bit_mode!r}")
        if self.levels not in LEVELS:
            raise ValueError(f"levels must be one of {LEVELS}, not {self.levels!r}")
        if self.rotate not in ROTATE:
            raise ValueError(f"rotate must be one of {ROTATE}, not {self.rotate!r}")
        check_rotation(self.rotation, self.head_dim)
        key_group = self.value_group_size if self.key_axis == "token" else self.key_group_size
        for name, g in (("key_outliers", key_group), ("value_outliers", self.value_group_size)):
            if getattr(self, name) >= min(g, 256):
                raise ValueError(f"{name}={getattr(self, name)} must be below the group size {g} (and 256)")
        for name in ("key_scale_dtype", "value_scale_dtype", "outlier_dtype"):
            check_stat_dtype(getattr(self, name), name)
        for name in ("key_zero_dtype", "value_zero_dtype"):
            check_stat_dtype(getattr(self, name), name, allow_none=True)
        for table in ("layer_key_bits", "layer_value_bits"):
            self._check_bits_table(table)
        table_bits = {e[-1] for e in self.layer_key_bits + self.layer_value_bits}
        if self.levels == "normal" and not {self.key_bits, self.value_bits, *table_bits} & {2, 4}:
            raise ValueError(f"levels='normal' applies to 2- and 4-bit groups; {self.precision} has none")
        for name, bits, table in (("key_zero_dtype", self.key_bits, self.layer_key_bits),
                                  ("value_zero_dtype", self.value_bits, self.layer_value_bits)):
            if getattr(self, name) == "none":
                for b in {bits} | {e[-1] for e in table}:
                    if group_mode(b, self.one_bit_mode, self.levels) == "minmax":
                        raise ValueError(f"{name}='none' (symmetric groups) needs Lloyd-Max levels "
                                         f"(levels='normal', 2 or 4 bits) or 1-bit sign groups; {b}-bit groups "
                                         f"here are min/max groups, which need their zero-point")
        if self.head_dim is not None:
            self.check_head_dim(self.head_dim)

    def _check_pre_rope(self) -> None:
        pr = self.pre_rope_keys
        if isinstance(pr, bool):
            return
        if isinstance(pr, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                 for x in pr):
            if len(set(pr)) != len(pr):
                raise ValueError(f"pre_rope_keys lists a layer twice: {sorted(pr)}")
            object.__setattr__(self, "pre_rope_keys", tuple(sorted(pr)) if pr else False)
            return
        raise ValueError(f"pre_rope_keys must be True, False or a tuple of layer indices, not {pr!r}")

    def pre_rope_in(self, layer_idx: int | None) -> bool:
        """Whether layer `layer_idx` quantizes pre-RoPE keys."""
        pr = self.pre_rope_keys
        return pr if isinstance(pr, bool) else layer_idx in pr

    def _check_bits_table(self, name: str) -> None:
        raw = getattr(self, name)
        items = list(raw.items()) if isinstance(raw, dict) else raw
        try:
            items = [tuple(p) for p in items]
        except TypeError:
            raise ValueError(f"{name} must be ((layer, bits) or (layer, kv_head, bits), ...), not {raw!r}") from None
        for e in items:
            if (len(e) not in (2, 3) or not all(isinstance(x, int) and not isinstance(x, bool) for x in e)
                    or min(e[:-1]) < 0):
                raise ValueError(f"{name} entries are (layer, bits) or (layer, kv_head, bits) integer "
                                 f"tuples with layer, kv_head >= 0, not {e!r}")
            check_bits(e[-1], f"{name} bits of {'layer %d' % e[0] if len(e) == 2 else 'layer %d head %d' % e[:2]}")
        places = [e[:-1] for e in items]
        if len(set(places)) != len(places):
            raise ValueError(f"{name} lists a layer or head twice: {sorted(places)}")
        whole = {e[0] for e in items if len(e) == 2}
        both = sorted(whole & {e[0] for e in items if len(e) == 3})
        if both:
            raise ValueError(f"{name} gives layers {both} both whole-layer and per-head bits; give one")
        object.__setattr__(self, name, tuple(sorted(items)))

    def for_layer(self, layer_idx: int | None) -> "LowBitConfig":
        """The config of one layer: its whole-layer `layer_key_bits` / `layer_value_bits` entries (if any) as the key
        / value bits; of the tables only this layer's per-head entries stay (`head_key_bits`, `head_value_bits`)."""
        if not self.layer_key_bits and not self.layer_value_bits:
            return self if isinstance(self.pre_rope_keys, bool) else self.replace(
                pre_rope_keys=self.pre_rope_in(layer_idx))
        kb = {e[0]: e[1] for e in self.layer_key_bits if len(e) == 2}.get(layer_idx, self.key_bits)
        vb = {e[0]: e[1] for e in self.layer_value_bits if len(e) == 2}.get(layer_idx, self.value_bits)
        own_k = tuple(e for e in self.layer_key_bits if len(e) == 3 and e[0] == layer_idx)
        own_v = tuple(e for e in self.layer_value_bits if len(e) == 3 and e[0] == layer_idx)
        levels = self.levels
        if not {kb, vb, *(e[-1] for e in own_k + own_v)} & {2, 4}:
            levels = "uniform"  # no 2/4-bit group left in this layer: the same quantizer (levels only apply there)
        return self.replace(precision=format_precision(kb, vb), layer_key_bits=own_k, layer_value_bits=own_v,
                            levels=levels, pre_rope_keys=self.pre_rope_in(layer_idx))

    def head_key_bits(self, layer_idx: int | None) -> dict[int, int]:
        """`{kv_head: bits}` of the per-head `layer_key_bits` entries of layer `layer_idx`."""
        return {e[1]: e[2] for e in self.layer_key_bits if len(e) == 3 and e[0] == layer_idx}

    def head_value_bits(self, layer_idx: int | None) -> dict[int, int]:
        """`{kv_head: bits}` of the per-head `layer_value_bits` entries of layer `layer_idx`."""
        return {e[1]: e[2] for e in self.layer_value_bits if len(e) == 3 and e[0] == layer_idx}

    def check_layers(self, num_layers: int, num_kv_heads: int | None = None) -> None:
        """Raise `ValueError` if `layer_key_bits` or `layer_value_bits` names a layer (or KV head) the model does not
        have."""
        if not isinstance(self.pre_rope_keys, bool) and self.pre_rope_keys[-1] >= num_layers:
            raise ValueError(f"pre_rope_keys names layer {self.pre_rope_keys[-1]}, but the model has {num_layers} "
                             f"layers (0..{num_layers - 1})")
        for name in ("layer_key_bits", "layer_value_bits"):
            table = getattr(self, name)
            bad = sorted({e[0] for e in table if e[0] >= num_layers})
            if bad:
                raise ValueError(f"{name} names layers {bad}, but the model has {num_layers} layers "
                                 f"(0..{num_layers - 1})")
            heads = sorted({e[1] for e in table if len(e) == 3})
            if num_kv_heads is not None and heads and heads[-1] >= num_kv_heads:
                raise ValueError(f"{name} names KV head {heads[-1]}, but the model has {num_kv_heads} KV heads")

    @property
    def key_bits(self) -> int:
        return parse_precision(self.precision)[0]

    @property
    def value_bits(self) -> int:
        return parse_precision(self.precision)[1]

    def rotates(self, which: str) -> bool:
        """Whether the `"k"`eys or `"v"`alues are rotated."""
        return self.rotation != "none" and which in self.rotate

    def check_head_dim(self, head_dim: int) -> None:
        """Raise `ValueError` if this config cannot quantize heads of `head_dim` channels."""
        if self.head_dim is not None and head_dim != self.head_dim:
            raise ValueError(f"this low-bit config (rotation {self.rotation!r}) is for head_dim {self.head_dim}, "
                             f"the model has head_dim {head_dim}")
        if head_dim % self.value_group_size:
            raise ValueError(f"values are quantized in groups of value_group_size={self.value_group_size} channels, "
                             f"but head_dim is {head_dim}; pick a group size that divides {head_dim}")
        check_rotation(self.rotation, head_dim)

    def replace(self, **changes) -> "LowBitConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def default(cls, precision: str, head_dim: int | None = None, model_config=None, **changes) -> "LowBitConfig":
        """The measured best options for `precision` (mixed precisions take those of their key bits), with
        `changes` on top. With `head_dim`, the defaults fit it: a value group that does not divide it shrinks to
        their common divisor, and a Hadamard rotation becomes a seeded random one when it is not a power of two.
        With `model_config` (head_dim is read from it), a model whose per-head key sensitivity was measured
        (`MEASURED_KEY_HEADS`: SmolLM2-135M) also gets its measured `layer_key_bits` at 2-bit keys, and a model
        with measured options for this very precision (`MEASURED_OPTIONS`: SmolLM2-135M at K2V2) gets those."""
        kb, vb = parse_precision(precision)
        base = dict(DEFAULTS.get(format_precision(kb, vb)) or DEFAULTS[format_precision(kb, kb)])
        if model_config is not None:
            head_dim = head_dim or kv_geometry(model_config).head_dim
            heads = MEASURED_KEY_HEADS.get(model_signature(model_config), {}).get(kb)
            if heads:
                base["layer_key_bits"] = heads
            base.update(MEASURED_OPTIONS.get(model_signature(model_config), {}).get(format_precision(kb, vb), {}))
        if head_dim is not None:
            g = base.get("value_group_size", cls.value_group_size)
            if head_dim % g:
                base["value_group_size"] = math.gcd(g, head_dim)
            if base.get("rotation") == "hadamard" and head_dim & (head_dim - 1):
                base["rotation"] = "random"
        return cls(**{**base, "precision": format_precision(kb, vb), **changes})

    # --- spec (JSON) ----------------------------------------------------------------------------------------------
    def to_spec(self) -> dict:
        """JSON description, read back by `from_spec` (plus descriptive entries for readers of the artifact)."""
        return {
            "spec_version": SPEC_VERSION, **dataclasses.asdict(self),
            "key_bits": self.key_bits, "value_bits": self.value_bits,
            # version-1 readers know one group size; written when keys and values share it
            **({"group_size": self.key_group_size} if self.key_group_size == self.value_group_size else {}),
            "key_grouping": ("per channel, groups of key_group_size tokens" if self.key_axis == "channel" else
                             "per token, groups of value_group_size channels (key_group_size tokens at a time)"),
            "value_grouping": "per token, groups of value_group_size channels",
            "stat_dtype": "bfloat16", "packing": "uint8, little-end first",
            "minmax": "asymmetric zero + q * scale, statistics rounded outward",
            "sign": "1 bit: mean +/- mean absolute deviation",
            "normal": "levels='normal': Lloyd-Max levels of N(0,1), zero/scale refitted by least squares",
            "sink": "the first sink_length tokens stay in the model dtype",
            "rotation_doc": "x @ R before quantization, x_hat @ R.T after (post-RoPE); R from rotation, "
                            "rotation_seed, head_dim; with pre_rope_keys the keys are first turned back by the "
                            "RoPE angle of their cache index (the model's frequencies) and forward after",
            "outliers_doc": "per group, the elements farthest from the mean kept in outlier_dtype with a uint8 index",
            "stat_dtypes_doc": "scale/zero formats: bfloat16 or float8_e4m3fn (saturating at +/-448); zero 'none': "
                               "symmetric groups",
            "layer_key_bits_doc": "[[layer, key bits] or [layer, kv_head, key bits], ...]: layers or heads whose "
                                  "keys use other bits than the precision's",
            "layer_value_bits_doc": "the same for the values",
        }

    @classmethod
    def from_spec(cls, spec: dict) -> "LowBitConfig":
        """Inverse of `to_spec`. A spec without `spec_version` (artifacts before it) is plain KIVI with one
        `group_size` and no sinks: missing options take the dataclass defaults, which are exactly that."""
        if not isinstance(spec, dict) or "precision" not in spec:
            raise ValueError(f"a low-bit quantizer spec is a dict with a 'precision', not {spec!r}")
        version = spec.get("spec_version", 1)
        if version not in (1, SPEC_VERSION):
            raise ValueError(f"unknown low-bit quantizer spec_version {version!r} (this package reads 1 and "
                             f"{SPEC_VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - names - set(_PROSE))
        if unknown:
            raise ValueError(f"unknown low-bit quantizer options {unknown} in the spec")
        kw = {k: v for k, v in spec.items() if k in names}
        if "group_size" in spec:  # version 1: one group size for keys and values
            kw.setdefault("key_group_size", spec["group_size"])
            kw.setdefault("value_group_size", spec["group_size"])
        cfg = cls(**kw)
        for name in ("key_bits", "value_bits"):
            if name in spec and check_bits(spec[name], name) != getattr(cfg, name):
                raise ValueError(f"the spec's {name}={spec[name]} contradicts its precision {cfg.precision}")
        return cfg

    @classmethod
    def from_artifact(cls, artifact, precision: str) -> "LowBitConfig":
        """The quantizer a `DGAPModel` artifact recorded for `precision` (what its detector and corrector were
        trained on): `LowBitCache(model.config, LowBitConfig.from_artifact(dgap_model, "K2V2"))`."""
        name = normalize_precision(precision)
        spec = (artifact.quantizer or {}).get(name)
        if spec is None:
            raise UnknownPrecisionError(f"the DGAP artifact records no quantizer for {name}; it has "
                                        f"{sorted(artifact.quantizer)}")
        return cls.from_spec(spec)


def model_signature(config) -> tuple:
    """What identifies a model's attention layout for `MEASURED_KEY_HEADS`: (model_type, layers, attention heads,
    KV heads, head_dim, hidden size, vocabulary) of its text config."""
    tc, geo = text_config(config), kv_geometry(config)
    return (getattr(tc, "model_type", None), tc.num_hidden_layers, tc.num_attention_heads, geo.num_kv_heads,
            geo.head_dim, tc.hidden_size, tc.vocab_size)


# The measured best options per precision (benchmarks/results/lowbit_sweep.md, selection on a 1K-token window; the
# defaults are then reported on held-out 2K-token windows in benchmarks/results/lowbit_quality.md). Keys in groups of
# 128 tokens and values in groups of 64 channels keep the statistics at 0.375 bits per element; residual_length 0
# keeps the full-precision residual within the 128-token window; four sink tokens and the Hadamard rotation help at
# every precision below 8 bits; Lloyd-Max ("normal") levels help at 2 bits, not at 4 (higher KL).
_F8 = "float8_e4m3fn"
_GROUPS = {"key_group_size": 128, "value_group_size": 64, "residual_length": 0}
DEFAULTS: dict[str, dict] = {
    "K1V1": {**_GROUPS, "sink_length": 4, "rotation": "hadamard"},
    # FP8 statistics (keys' scale and zero, values' scale) and symmetric value groups: 0.19 bits per element
    # saved at no measured cost (benchmarks/results/lowbit_sensitivity_4k.md), spent on 4-bit keys in the most
    # sensitive heads where the model's are measured (MEASURED_KEY_HEADS)
    "K2V2": {**_GROUPS, "sink_length": 4, "rotation": "hadamard", "levels": "normal", "key_scale_dtype": _F8,
             "key_zero_dtype": _F8, "value_scale_dtype": _F8, "value_zero_dtype": "none"},
    "K4V4": {**_GROUPS, "sink_length": 4, "rotation": "hadamard"},
    "K8V8": dict(_GROUPS),
}

# Per-head 4-bit keys at 2-bit key precision, per model (signature: `model_signature`). SmolLM2-135M-Instruct: the 27
# KV heads (of 90) whose 2-bit keys cost the most on the held-out 4K windows, each measured alone with every other
# head at full precision (`benchmarks/lowbit_sensitivity.py --probe heads`); layer 18 head 2 also carries multi-key
# NIAH. 0.30 bits per element; with the FP8 statistics the K2V2 default stays at 2.49 bits on 2K windows.
_SMOLLM2_HEADS = ((18, 2), (7, 2), (8, 0), (4, 0), (7, 1), (3, 2), (3, 1), (8, 2), (17, 1), (23, 0), (6, 2), (9, 0),
                  (6, 1), (20, 2), (5, 2), (5, 1), (23, 2), (5, 0), (9, 2), (24, 0), (24, 1), (24, 2), (10, 0),
                  (10, 1), (10, 2), (28, 2), (28, 1))
MEASURED_KEY_HEADS: dict[tuple, dict[int, tuple]] = {
    ("llama", 30, 9, 3, 64, 576, 49152): {2: tuple(sorted((layer, head, 4) for layer, head in _SMOLLM2_HEADS))},
}

# Measured options of one precision, per model, on top of the above. SmolLM2-135M-Instruct at K2V2 (session 11,
# benchmarks/results/issue14-status.md): the 27 key heads' 4-bit budget spent instead on the keys and values of the 8
# KV heads that carry multi-key retrieval (`benchmarks/lowbit_retrieval_heads.py`, ranked on other cases than those
# scored) plus the 11 most PPL-sensitive key heads of `_SMOLLM2_HEADS`, and pre-RoPE keys in layers 15-29 (in layers
# 0-14 they cost 1 point of 4K-window perplexity; in 15-29 0.1 point, while they lift the NIAH answers): multi-key NIAH
# 7.3 points below BF16 at 2K (96 cases) and at 8K (288 cases; the session-4 table: 10.4), 4K-window PPL +3.63% ->
# +3.87%, same 2.49 bits per element.
_SMOLLM2_RETRIEVAL = ((18, 2), (17, 1), (23, 0), (20, 2), (21, 2), (6, 0), (21, 0), (20, 1))
_SMOLLM2_K2V2_KEYS = _SMOLLM2_RETRIEVAL + tuple(h for h in _SMOLLM2_HEADS if h not in _SMOLLM2_RETRIEVAL)[:11]
MEASURED_OPTIONS: dict[tuple, dict[str, dict]] = {
    ("llama", 30, 9, 3, 64, 576, 49152): {"K2V2": {
        "layer_key_bits": tuple(sorted((layer, head, 4) for layer, head in _SMOLLM2_K2V2_KEYS)),
        "layer_value_bits": tuple(sorted((layer, head, 4) for layer, head in _SMOLLM2_RETRIEVAL)),
        "pre_rope_keys": tuple(range(15, 30)),
    }},
}
