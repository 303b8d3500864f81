"""Benchmark states: synthetic tensors of a given total size, or the shapes of a named model."""

from __future__ import annotations

import torch

# name -> (layers, hidden, ffn, vocab)
MODELS = {
    "gpt-tiny": (2, 64, 256, 500),  # tests and smoke runs (vocab 500: uneven FSDP shards)
    "gpt-125m": (12, 768, 3072, 50304),
    "gpt-350m": (24, 1024, 4096, 50304),
    "gpt-1b": (24, 2048, 8192, 50304),
    "gpt-1b-narrow": (24, 64, 256, 512),  # gpt-1b's tensor count at 3 MB: per-save overhead
    "gpt-7b": (32, 4096, 11008, 32000),
}


def model_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a GPT-style decoder (weights and biases, tied embeddings)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    layers, h, ffn, vocab = MODELS[name]
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, h), "pos.weight": (2048, h)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "ln1.weight": (h,),
                p + "ln1.bias": (h,),
                p + "attn.qkv.weight": (3 * h, h),
                p + "attn.qkv.bias": (3 * h,),
                p + "attn.proj.weight": (h, h),
                p + "attn.proj.bias": (h,),
                p + "ln2.weight": (h,),
                p + "ln2.bias": (h,),
                p + "mlp.fc1.weight": (ffn, h),
                p + "mlp.fc1.bias": (ffn,),
                p + "mlp.fc2.weight": (h, ffn),
                p + "mlp.fc2.bias": (h,),
            }
        )
    shapes.update({"ln_f.weight": (h,), "ln_f.bias": (h,)})
    return shapes


def synthetic_shapes(
    total_bytes: int, count: int, dtype: torch.dtype
) -> dict[str, tuple[int, ...]]:
    """`count` 1-D tensors whose sizes spread over two orders of magnitude and sum to about
    `total_bytes` (real state mixes large matrices with small vectors)."""
    if count < 1 or total_bytes < count:
        raise ValueError("need at least one tensor and one byte per tensor")
    esize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    weights = torch.exp(torch.rand(count, generator=gen, dtype=torch.float64) * 4.6)  # 1x .. 100x
    numels = (weights / weights.sum() * (total_bytes // esize)).floor().long().clamp(min=1)
    numels[0] += max(0, total_bytes // esize - int(numels.sum()))
    return {f"t{i:05d}": (int(n),) for i, n in enumerate(numels)}


def make_state(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    """Allocates and fills the tensors (random-ish bytes, so compression has no free ride)."""
    state = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=dtype, device=device)
        t.view(-1).view(torch.uint8).random_() if t.numel() else None
        state[name] = t
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
