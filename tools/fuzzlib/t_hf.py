"""`routepack.integrations.hf.capture` (a transformers model's routing recorded into a
`Window`) on the tiny random models of tests/test_integrations_hf.py (Qwen3-MoE, Mixtral,
OLMoE, DeepSeek-V3: dense layers among MoE ones, group-limited routing, a router bias),
built once per worker. Imported only when torch and transformers are.

* valid: ``input_ids`` ``[B, S]`` (1 to 4 rows of 1 to 12 tokens), an attention mask with left
  or right padding (every row keeps a real token) or none; checked: one sample a row, each
  sample as long as its real tokens, every MoE layer's counts summing to its tokens times
  top-k, no expert counted twice for a token, the window equal to the recorded ids counted
  again (`capture_routed` + `Window.from_routed_experts`);
* malformed: ids that are not a tensor, of a float or bool dtype, of 1 or 3 dimensions,
  outside the vocabulary, empty; masks of another shape, values other than 0/1, a row
  without real tokens, not a tensor; a model without MoE routers or not a module.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any, List

import numpy as np

from fuzzlib.engine import Case, Target, mixed
from fuzzlib.inputs import BAD_OBJECTS, pick

#: the families the cases draw from (their tiny models, tests/test_integrations_hf.py)
FAMILIES = ("Qwen3-MoE", "Mixtral", "OLMoE", "DeepSeek-V3")
_BUILT: dict = {}


def targets() -> List[Target]:
    """The ``hf.capture`` target, or none when torch or transformers is not importable."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        print("routepack.integrations.hf left out: torch or transformers is not importable", file=sys.stderr)
        return []
    return [
        Target(
            "hf.capture",
            "routepack.integrations.hf:capture",
            mixed((3, valid_case), (2, malformed_case)),
            weight=1,
            batch=16,
            names=("model", "input_ids", "attention_mask"),
        )
    ]


def _models() -> dict:
    if not _BUILT:
        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import test_integrations_hf as h
            import transformers as tf

            torch.set_num_threads(1)
            _BUILT.update({name: h.model(name) for name in FAMILIES})
            _BUILT["dense"] = tf.LlamaForCausalLM(tf.LlamaConfig(**h.COMMON)).eval()
        _BUILT["vocab"] = h.COMMON["vocab_size"]
    return _BUILT


def _batch(rng: np.random.Generator) -> tuple:
    """(input_ids [B, S] int64, attention mask [B, S] or None) with a real token in every row."""
    import torch

    b, s = int(rng.integers(1, 5)), int(rng.integers(1, 13))
    ids = torch.from_numpy(rng.integers(3, _models()["vocab"], size=(b, s))).long()
    if rng.random() < 0.3:
        return ids, None
    real = rng.integers(1, s + 1, size=b)
    mask = np.zeros((b, s), dtype=np.int64)
    left = rng.random() < 0.5
    for r, n in enumerate(real):
        if left:
            mask[r, s - n :] = 1
        else:
            mask[r, :n] = 1
    return ids, torch.from_numpy(mask)


def valid_case(rng: np.random.Generator) -> Case:
    import routepack as rp
    from routepack.integrations import hf

    name = FAMILIES[int(rng.integers(len(FAMILIES)))]
    model = _models()[name]
    ids, mask = _batch(rng)
    lens = (mask.sum(1) if mask is not None else torch_full(ids)).numpy()

    def check(w: Any) -> None:
        assert isinstance(w, rp.Window), f"returned {type(w).__name__}"
        assert w.num_samples == ids.shape[0] and np.array_equal(w.seq_lens, lens), (w.seq_lens, lens)
        k = w.top_k
        counts = w.expert_tokens.astype(np.int64)
        assert (counts <= lens[:, None, None]).all(), "an expert counted twice for a token"
        assert np.array_equal(counts.sum(2), np.repeat(lens[:, None], w.num_layers, 1) * k), "tokens x top-k"
        again = hf.capture_routed(model, ids, mask)
        assert w == rp.Window.from_routed_experts(again.routed, again.cu_seqlens, again.num_experts)

    return Case("valid", hf.capture, (model, ids, mask), check=check, expect="ok", note=f"{name} {tuple(ids.shape)}")


def torch_full(ids: Any) -> Any:
    import torch

    return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64)


def malformed_case(rng: np.random.Generator) -> Case:
    import torch
    from routepack.integrations import hf

    name = FAMILIES[int(rng.integers(len(FAMILIES)))]
    model = _models()[name]
    ids, mask = _batch(rng)
    b, s = ids.shape
    vocab = _models()["vocab"]
    flaws = [
        ("ids as a list", lambda: (model, ids.tolist(), mask)),
        ("ids as numpy", lambda: (model, ids.numpy(), mask)),
        ("float ids", lambda: (model, ids.float(), mask)),
        ("bool ids", lambda: (model, ids > 10, mask)),
        ("1-D ids", lambda: (model, ids[0], None)),
        ("3-D ids", lambda: (model, ids[None], None)),
        ("ids past the vocabulary", lambda: (model, ids + vocab, mask)),
        ("negative ids", lambda: (model, -ids, mask)),
        ("no tokens", lambda: (model, ids[:, :0], None)),
        ("no rows", lambda: (model, ids[:0], None)),
        ("mask of another shape", lambda: (model, ids, torch.ones(b, s + 1, dtype=torch.long))),
        ("mask of 2s", lambda: (model, ids, torch.full((b, s), 2))),
        ("a row without real tokens", lambda: (model, ids, _empty_row(mask, b, s))),
        ("mask not a tensor", lambda: (model, ids, pick(rng, BAD_OBJECTS[1:]))),
        ("a dense model", lambda: (_models()["dense"], ids, mask)),
        ("not a module", lambda: (pick(rng, BAD_OBJECTS), ids, mask)),
    ]
    note, make = flaws[int(rng.integers(len(flaws)))]
    return Case("malformed", hf.capture, make(), expect="error", note=f"{name}: {note}")


def _empty_row(mask: Any, b: int, s: int) -> Any:
    import torch

    out = torch.ones(b, s, dtype=torch.long) if mask is None else mask.clone()
    out[int(b) - 1] = 0
    return out
