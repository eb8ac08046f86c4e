"""Paired FP / low-bit decoding traces (paper Sec. 4.1, "Offline supervision"), stored as top-M slices.

For each decoding step `t` (a row) a `TracePairs` keeps

* `fp_idx`, `fp_z`, `fp_z_lb`: the FP top-M token ids (by decreasing FP logit), their FP logits and their low-bit
  logits;
* `lb_idx`, `lb_z`, `lb_z_fp`: the low-bit top-M ids (by decreasing low-bit logit), their low-bit and FP logits;
* `fp_lse`, `lb_lse`, `fp_entropy`, `lb_entropy`: log-partition and entropy over the whole vocabulary;
* `target`, `fp_z_target`, `lb_z_target`: the true next token (teacher forcing; -1 when unknown) and its FP and
  low-bit logits (perplexity);
* `cross`: `sum_v p_fp(v) * z_lb(v)` over the whole vocabulary, so that `KL(p_fp || q)` of any distribution `q` that
  differs from the low-bit one only on its top-M slice is exact (`evaluation.py`);
* `doc`: a document id per row (train / validation splits by document).

That is enough for every label (`C_fp(alpha)`, coverage, local drift over `C u S`, `K_b` by Eq. 4, for any
`K_b <= M`), for the exact runtime features of the low-bit logits (`features.detector_features_from_top`) and for the
corrector targets (FP logits on the low-bit window). Files are safetensors (tensors) plus JSON metadata.

`collect_traces` runs one model with teacher forcing on the same prefix and target tokens with a `DynamicCache`
(FP reference) and one `LowBitCache` per precision, in lockstep, and reduces each step's logits to a `TracePairs`
row on the fly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

from .features import full_vocab_stats

_TENSORS = ("fp_idx", "fp_z", "fp_z_lb", "lb_idx", "lb_z", "lb_z_fp", "fp_lse", "lb_lse", "fp_entropy", "lb_entropy",
            "target", "fp_z_target", "lb_z_target", "cross", "doc")


@dataclass
class TracePairs:
    fp_idx: torch.Tensor
    fp_z: torch.Tensor
    fp_z_lb: torch.Tensor
    lb_idx: torch.Tensor
    lb_z: torch.Tensor
    lb_z_fp: torch.Tensor
    fp_lse: torch.Tensor
    lb_lse: torch.Tensor
    fp_entropy: torch.Tensor
    lb_entropy: torch.Tensor
    target: torch.Tensor
    fp_z_target: torch.Tensor
    lb_z_target: torch.Tensor
    cross: torch.Tensor
    doc: torch.Tensor
    vocab_size: int
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.fp_idx.shape[0]

    @property
    def top_m(self) -> int:
        return self.fp_idx.shape[1]

    @classmethod
    def from_logits(cls, fp_logits: torch.Tensor, lb_logits: torch.Tensor, top_m: int = 64,
                    meta: dict | None = None, targets: torch.Tensor | None = None,
                    doc: torch.Tensor | int = 0) -> "TracePairs":
        """Reduce paired full logits `[N, V]` (FP reference, low-bit) to top-M trace rows.

        `targets` `[N]`: the true next tokens (for perplexity), `doc`: document id(s) of the rows."""
        if fp_logits.shape != lb_logits.shape or fp_logits.dim() != 2:
            raise ValueError(f"paired logits must both be [N, V], got {tuple(fp_logits.shape)} and "
                             f"{tuple(lb_logits.shape)}")
        fp, lb = fp_logits.float(), lb_logits.float()
        m = min(top_m, fp.shape[-1])
        fp_z, fp_idx = fp.topk(m, -1)
        lb_z, lb_idx = lb.topk(m, -1)
        fp_lse, fp_h = full_vocab_stats(fp)
        lb_lse, lb_h = full_vocab_stats(lb)
        n = fp.shape[0]
        cross = ((fp.double() - fp_lse.double().unsqueeze(-1)).exp() * lb.double()).sum(-1).float()
        if targets is None:
            target = torch.full((n,), -1, dtype=torch.int64, device=fp.device)
            fp_t = torch.full((n,), float("nan"), device=fp.device)
            lb_t = fp_t.clone()
        else:
            target = targets.reshape(n).to(fp.device, torch.int64)
            if bool(((target < 0) | (target >= fp.shape[-1])).any()):
                raise ValueError(f"targets must be token ids in [0, {fp.shape[-1]})")
            fp_t, lb_t = fp.gather(-1, target[:, None])[:, 0], lb.gather(-1, target[:, None])[:, 0]
        doc = torch.as_tensor(doc, dtype=torch.int32, device=fp.device).expand(n).clone()
        return cls(fp_idx=fp_idx.to(torch.int32), fp_z=fp_z, fp_z_lb=lb.gather(-1, fp_idx),
                   lb_idx=lb_idx.to(torch.int32), lb_z=lb_z, lb_z_fp=fp.gather(-1, lb_idx),
                   fp_lse=fp_lse, lb_lse=lb_lse, fp_entropy=fp_h, lb_entropy=lb_h,
                   target=target, fp_z_target=fp_t, lb_z_target=lb_t, cross=cross, doc=doc,
                   vocab_size=int(fp.shape[-1]), meta=dict(meta or {}))

    @property
    def has_targets(self) -> bool:
        return bool((self.target >= 0).all()) if len(self) else False

    def _tensors(self) -> dict:
        return {n: getattr(self, n) for n in _TENSORS}

    def select(self, rows) -> "TracePairs":
        return TracePairs(**{n: t[rows] for n, t in self._tensors().items()}, vocab_size=self.vocab_size,
                          meta=dict(self.meta))

    def to(self, device) -> "TracePairs":
        return TracePairs(**{n: t.to(device) for n, t in self._tensors().items()}, vocab_size=self.vocab_size,
                          meta=dict(self.meta))

    @staticmethod
    def cat(parts: list["TracePairs"]) -> "TracePairs":
        if not parts:
            raise ValueError("nothing to concatenate")
        m = min(p.top_m for p in parts)
        if len({p.vocab_size for p in parts}) != 1:
            raise ValueError("traces of different vocabularies")
        out = {}
        for n in _TENSORS:
            ts = [getattr(p, n) for p in parts]
            out[n] = torch.cat([t[:, :m] if t.dim() == 2 else t for t in ts])
        return TracePairs(**out, vocab_size=parts[0].vocab_size, meta=dict(parts[0].meta))

    def split(self, val_fraction: float = 0.2, seed: int = 0) -> tuple["TracePairs", "TracePairs"]:
        """(train, validation) split by document: whole documents (`doc`) go to validation, in a seeded random order,
        until it holds about `val_fraction` of the rows. With a single document the rows are split at random."""
        g = torch.Generator().manual_seed(seed)
        docs = torch.unique(self.doc)
        n_val = int(round(len(self) * val_fraction))
        if len(docs) < 2:
            perm = torch.randperm(len(self), generator=g)
            return self.select(perm[n_val:]), self.select(perm[:n_val])
        val_docs, held = [], 0
        for d in docs[torch.randperm(len(docs), generator=g)]:
            if held >= n_val or len(val_docs) == len(docs) - 1:
                break
            val_docs.append(int(d))
            held += int((self.doc == d).sum())
        is_val = torch.isin(self.doc, torch.tensor(val_docs, dtype=self.doc.dtype))
        return self.select(~is_val), self.select(is_val)

    # --- files -------------------------------------------------------------------------------------------------
    def save(self, path) -> None:
        meta = {"vocab_size": str(self.vocab_size), "meta": json.dumps(self.meta)}
        save_file({n: t.contiguous() for n, t in self._tensors().items()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path) -> "TracePairs":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            md = f.metadata() or {}
        tensors = load_file(str(path))
        missing = [n for n in _TENSORS if n not in tensors]
        if missing or "vocab_size" not in md:
            raise ValueError(f"{path} is not a DGAP trace file (missing {missing or 'vocab_size'})")
        return cls(**{n: tensors[n] for n in _TENSORS}, vocab_size=int(md["vocab_size"]),
                   meta=json.loads(md.get("meta", "{}")))


@torch.no_grad()
def collect_traces(model, input_ids: torch.Tensor, precisions=("K1V1", "K2V2", "K4V4", "K8V8"), *,
                   prefix_len: int, steps: int, top_m: int = 64, cache_kwargs: dict | None = None,
                   meta: dict | None = None, doc_ids=None) -> dict[str, TracePairs]:
    """Paired teacher-forced traces of `model` on `input_ids` `[B, >= prefix_len + steps]` (no padding).

    Each run prefills `input_ids[:, :prefix_len]`, then feeds the true next tokens one at a time; the logits
    predicting tokens `prefix_len .. prefix_len + steps - 1` (the last prefill position and `steps - 1` decode steps)
    are recorded with those tokens as targets. `doc_ids` `[B]`: a document id per row (default 0). The FP run uses `DynamicCache(config=...)`; every precision gets its own `LowBitCache(...,
    **cache_kwargs)`. Returns `{precision: TracePairs}` with `B * steps` rows each (row order: step-major).
    """
    from transformers import DynamicCache

    from hf_common.model_config import cache_kwarg

    from .cache import LowBitCache
    from .models import base_model_info
    from .precision import normalize_precision

    precisions = [normalize_precision(p) for p in precisions]
    if input_ids.shape[1] < prefix_len + steps:
        raise ValueError(f"need {prefix_len + steps} tokens per row, got {input_ids.shape[1]}")
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    config = model.config
    caches = {"fp": DynamicCache(config=config)}
    caches.update({p: LowBitCache(config, p, **(cache_kwargs or {})) for p in precisions})
    rows: dict[str, list[TracePairs]] = {p: [] for p in precisions}
    logits = {}
    kw = cache_kwarg(model)
    docs = torch.zeros(ids.shape[0], dtype=torch.int32) if doc_ids is None else torch.as_tensor(doc_ids).int()
    docs = docs.to(device)
    for name, cache in caches.items():
        out = model(input_ids=ids[:, :prefix_len], use_cache=True, logits_to_keep=1, **{kw: cache})
        logits[name] = out.logits[:, -1].float()
    for t in range(steps):
        for p in precisions:
            rows[p].append(TracePairs.from_logits(logits["fp"], logits[p], top_m,
                                                  targets=ids[:, prefix_len + t], doc=docs))
        if t == steps - 1:
            break
        tok = ids[:, prefix_len + t:prefix_len + t + 1]
        for name, cache in caches.items():
            logits[name] = model(input_ids=tok, use_cache=True, **{kw: cache}).logits[:, -1].float()
    info = base_model_info(config)
    base = {"base_model": info.get("name", ""), "base_model_info": info,
            "prefix_len": prefix_len, "steps": steps, "rows_per_step": int(ids.shape[0])}
    base.update(meta or {})
    result = {}
    for p in precisions:
        tr = TracePairs.cat(rows[p])
        tr.meta = {**base, "precision": p, "quantizer": caches[p].quantizer_spec()}
        result[p] = tr
    return result
