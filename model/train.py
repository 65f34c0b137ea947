"""Train a small DiffusionGemma (this project's model code) on the Python standard library's own sources.

The command is ``blockdiff train`` (:mod:`blockdiff.integration.cli`: it adds the evaluation by generation,
:func:`blockdiff.integration.evaluate.evaluate_generation`, which drives the harness this package must not import):

    blockdiff train --smoke --out /tmp/smoke                                                  # CPU, < 60 s
    source bench/device_env.sh && python3 -m blockdiff.integration.cli train --out $OUT/stdlib-byte --minutes 8  # H200

``--minutes`` defaults to 8: the device tool runs one command for at most 10 minutes, and corpus loading (~1 s),
CUDA start-up and the held-out evaluation must fit beside the training. ``$OUT`` returns at most 8 files; a run
writes 5.

Objective (uniform-noise discrete diffusion over canvases that follow a clean prefix):

* data: the stdlib's ``.py`` files (``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded), byte-level
  tokens (:class:`blockdiff.model.tokenizer.ByteTokenizer`, vocab 259), each file framed by bos / eos. Split by
  file, deterministically: a file is held out iff ``crc32(relative path) % 20 == 0`` (~5 %).
* an example is a window of ``P + CL`` tokens at a random offset: a clean prefix of ``P`` tokens (``P`` drawn per
  batch from ``[prefix_min, prefix]`` so short prompts are in distribution) and a canvas of ``CL`` tokens.
* noise: ``t ~ U(0, 1)`` per example; every canvas token is independently replaced by a uniform random id in
  ``[0, V)`` with probability ``t`` (D3PM's uniform transition, Austin et al. 2021, arXiv:2107.03006; the
  sampler's renoising draws the same uniform ids, docs/ARCHITECTURE.md "Sampler semantics" rule 5).
* model: the encoder pass (causal) over the prefix and the decoder pass (bidirectional, reads the prefix K/V)
  over the noisy canvas, with the model's own layers and weights.
* loss: cross-entropy of the canvas logits (softcapped, as served) against the clean canvas, over every canvas
  position (with uniform noise the model cannot tell which positions were replaced, and the sampler asks it to
  denoise every position).
* self-conditioning (Chen, Zhang, Hinton 2022, "Analog Bits", arXiv:2208.04202, sec. 3.2; transformers 5.24
  ``DiffusionGemmaDecoderModel.forward``: ``self_conditioning_mask`` "Useful for training, where
  self-conditioning is enabled per example with some probability"): a no-grad decoder pass with zero
  self-conditioning gives logits z; with probability ``self_cond_prob`` (0.5) per example the graded pass gets
  ``softmax(z) @ E * sqrt(hidden)`` (:meth:`DiffusionGemma.soft_embedding`, transformers' soft embedding), else
  zero.

Training path: the served forward (:meth:`DiffusionGemma.forward`) writes a paged KV cache in place and runs a
varlen attention backend; it is built for inference (in-place cache writes, no autograd through the cache). For
training, :func:`dense_forward` runs the *same* layers and weights over a dense ``[B, P + CL]`` batch: prefix rows
as encoder rows (``E[ids] * sqrt(hidden)``, ``encoder_layer_scalar``), canvas rows as decoder rows (self-
conditioning block, ``layer_scalar``), one SDPA call per layer with the mask of the two passes from
:func:`blockdiff.attention.build_mask` (prefix rows: causal over the prefix; canvas rows: bidirectional over
prefix + canvas with ``ctx = P``, the decoder pass's window rule). ``tests/model/test_train.py`` checks it against
the served forward (reference backend, paged cache, prefill then denoise) to fp32 rounding. MoE runs the
``"loop"`` implementation (autograd-safe; ``grouped_mm`` is the inference path).

Default config (:func:`default_train_config`): hidden 256, 6 layers (sliding W = 63 / full alternating), 4 query
heads, intermediate 256, 4 experts top-2 x 64, vocab 259, canvas 32, prefix 16-64 tokens (drawn per batch):
4.12 M parameters, 8.2 MB of bf16 safetensors, batch 1024 windows. Training this model is launch-bound on a GPU
(thousands of small kernels per step, the loop MoE's host syncs), hence the large batch (more tokens per step) and a
cosine schedule over the wall-clock budget rather than over an estimated step count. The shipped checkpoint's run
and its measured throughput: ``model/checkpoints/README.md`` and the checkpoint's ``train_log.json``.

Outputs in ``--out``: ``model.safetensors`` (transformers names, so :meth:`DiffusionGemma.load_safetensors`
loads the folder), ``config.json``, ``tokenizer.json``, ``loss.png``, ``train_log.json`` (losses, throughput,
held-out evaluation).
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from blockdiff.attention import BACKENDS, build_mask

from .config import DiffusionGemmaConfig, finite_real, show_real, tiny_config
from .modeling import DiffusionGemma
from .layers import rope_cos_sin
from .loading import check_device, hf_name
from .tokenizer import ByteTokenizer

HELD_OUT_MOD = 20


# ---------------------------------------------------------------------------------------------- configs
def default_train_config(**overrides) -> DiffusionGemmaConfig:
    """The shipped model: hidden 256, 6 layers alternating sliding (W = 63) / full, 4 query heads, sliding
    layers 2 KV heads x 64, full layers 1 KV head x 128, intermediate 256, 4 experts top-2 x 64, vocab 259
    (byte tokenizer), canvas 32: 4,116,888 parameters (8.2 MB in bf16)."""
    n = overrides.pop("num_hidden_layers", 6)
    kw = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=256, intermediate_size=256, num_hidden_layers=n,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
              num_global_key_value_heads=1, num_experts=4, top_k_experts=2, moe_intermediate_size=64,
              sliding_window=64, max_position_embeddings=4096, canvas_length=32,
              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
              pad_token_id=ByteTokenizer.pad_token_id, eos_token_id=ByteTokenizer.eos_token_id,
              bos_token_id=ByteTokenizer.bos_token_id)
    kw["layer_types"][-1] = "full_attention"
    kw.update(overrides)
    return DiffusionGemmaConfig(**kw)


def smoke_config(**overrides) -> DiffusionGemmaConfig:
    """The tiny CPU config of ``--smoke`` (:func:`blockdiff.model.tiny_config` with vocab 259, canvas 8)."""
    kw = dict(vocab_size=ByteTokenizer.vocab_size, canvas_length=8, eos_token_id=ByteTokenizer.eos_token_id)
    kw.update(overrides)
    return tiny_config(**kw)


class CorpusError(ValueError):
    """The training corpus (``TrainArgs.corpus``) holds no text, or too little for one example."""


@dataclass
class TrainArgs:
    """Settings of one :func:`train` run, checked on construction (:meth:`problems`).

    Raises:
        TypeError / ValueError: the first field breaking its rule (named, with the rule and the value).
    """

    out: str
    minutes: float = 8.0
    max_steps: int | None = None
    batch_size: int = 1024
    prefix: int = 64
    prefix_min: int = 16
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    self_cond_prob: float = 0.5
    log_every: int = 50
    seed: int = 0
    device: str = "cpu"
    smoke: bool = False
    corpus: str | None = None
    eval_prompts: int = 8
    eval_prompt_len: int = 48
    eval_canvases: int = 2
    eval_steps: int = 16
    attn_backend: str = "reference"

    def __post_init__(self):
        probs = self.problems()
        if probs:
            kind, _, msg = probs[0]
            raise kind(msg)

    def problems(self, paths: bool = False) -> list[tuple[type, str, str]]:
        """Every field breaking its rule: :func:`train_args_problems`."""
        return train_args_problems(self, paths)


def train_args_problems(self, paths: bool = False) -> list[tuple[type, str, str]]:
    """Every field of ``self`` breaking its rule, as ``(TypeError | ValueError, field, message)`` (the message
    starts with the field name). ``self``: a :class:`TrainArgs`, or any object with its attributes (the CLI checks
    the user's values before ``--smoke`` caps them). ``paths=True`` also checks the file system and the machine
    (:func:`train` does, before any work): ``out`` not a file, ``corpus`` an existing file or folder, ``device`` a
    device torch parses and this machine has (:func:`blockdiff.model.loading.check_device`).

    Rules: ``out`` a non-empty path; ``minutes`` finite > 0; ``max_steps`` None or an int >= 1; ``batch_size``,
    ``log_every``, ``eval_prompt_len``, ``eval_canvases`` ints >= 1;
    ``prefix_min`` an int >= 0 and ``prefix >= prefix_min``; ``warmup_steps``, ``eval_prompts`` ints >= 0;
    ``eval_steps`` in [1, 2**14); ``seed`` in [0, 2**63); ``lr`` finite > 0; ``weight_decay`` finite >= 0;
    ``min_lr_frac`` and ``self_cond_prob`` in [0, 1]; ``smoke`` a bool; ``device`` a str; ``corpus`` None
    or a path; ``attn_backend`` one of blockdiff.attention's backends."""
    out: list[tuple[type, str, str]] = []

    def bad(kind, name, rule):
        out.append((kind, name, f"{name} must be {rule}, got {show_real(getattr(self, name))}"))

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_real(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not isinstance(self.out, (str, os.PathLike)) or not os.fspath(self.out):
        bad(TypeError if not isinstance(self.out, (str, os.PathLike)) else ValueError, "out", "a non-empty path")
    elif paths and os.path.exists(self.out) and not os.path.isdir(self.out):
        bad(ValueError, "out", "a folder (it is a file)")
    for name, lo in (("batch_size", 1), ("log_every", 1), ("eval_prompt_len", 1), ("eval_canvases", 1),
                     ("prefix_min", 0), ("prefix", 0), ("warmup_steps", 0), ("eval_prompts", 0)):
        v = getattr(self, name)
        if not is_int(v):
            bad(TypeError, name, f"an int >= {lo}")
        elif v < lo:
            bad(ValueError, name, f"an int >= {lo}")
    if is_int(self.prefix) and is_int(self.prefix_min) and 0 <= self.prefix_min and 0 <= self.prefix < self.prefix_min:
        bad(ValueError, "prefix", f">= prefix_min ({self.prefix_min}): P is drawn from [prefix_min, prefix]")
    if self.max_steps is not None and (not is_int(self.max_steps) or self.max_steps < 1):
        bad(TypeError if not is_int(self.max_steps) else ValueError, "max_steps", "None or an int >= 1")
    if not is_int(self.eval_steps) or not 1 <= self.eval_steps < 2 ** 14:
        bad(TypeError if not is_int(self.eval_steps) else ValueError, "eval_steps", "an int in [1, 2**14)")
    if not is_int(self.seed) or not 0 <= self.seed < 2 ** 63:
        bad(TypeError if not is_int(self.seed) else ValueError, "seed", "an int in [0, 2**63)")
    for name, rule, ok in (("minutes", "a finite number > 0", lambda v: v > 0),
                           ("lr", "a finite number > 0", lambda v: v > 0),
                           ("weight_decay", "a finite number >= 0", lambda v: v >= 0),
                           ("min_lr_frac", "a number in [0, 1]", lambda v: 0 <= v <= 1),
                           ("self_cond_prob", "a number in [0, 1] (a probability)", lambda v: 0 <= v <= 1)):
        v = getattr(self, name)
        if not is_real(v):
            bad(TypeError, name, rule)
        elif not (finite_real(v) and ok(v)):
            bad(ValueError, name, rule)
    if not isinstance(self.smoke, bool):
        bad(TypeError, "smoke", "True or False")
    if not isinstance(self.device, str):
        bad(TypeError, "device", "a str ('cpu', 'cuda', 'cuda:N')")
    elif paths:  # the machine too: a CUDA device that is not here failed after the corpus loaded (AssertionError)
        try:
            check_device(self.device, "device")
        except ValueError as e:
            out.append((ValueError, "device", str(e)))
    if self.corpus is not None:
        if not isinstance(self.corpus, (str, os.PathLike)):
            bad(TypeError, "corpus", "None or a path")
        elif paths and not os.path.exists(self.corpus):
            bad(ValueError, "corpus", "None (the stdlib) or an existing folder of .py files or text file")
    if self.attn_backend not in BACKENDS + ("auto",):  # blockdiff.attention's registry, read, never copied
        bad(ValueError, "attn_backend", "one of " + ", ".join(repr(b) for b in BACKENDS + ("auto",)))
    return out


# ---------------------------------------------------------------------------------------------- corpus
def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted relative paths of the ``.py`` files under ``root`` (default: the stdlib), ``site-packages`` and
    ``__pycache__`` excluded."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out)


def is_held_out(rel_path: str) -> bool:
    """Deterministic split by file: held out iff ``crc32(path) % 20 == 0`` (~5 % of the files)."""
    return zlib.crc32(rel_path.replace(os.sep, "/").encode()) % HELD_OUT_MOD == 0


def load_corpus(root: str | None = None, tokenizer: ByteTokenizer | None = None, max_bytes: int | None = None):
    """Token streams ``(train, held_out)``, int16 numpy arrays; every file is ``bos + bytes + eos``.

    Args:
        root: a folder of ``.py`` files (default: the stdlib) or a single text file (then it is split 95/5 by
            position; used by the smoke test).
        max_bytes: stop reading after this many bytes (None: all).

    Raises:
        CorpusError: no text found (a ValueError).
    """
    tok = tokenizer or ByteTokenizer()
    if root is not None and os.path.isfile(root):
        with open(root, "rb") as f:
            data = f.read()
        ids = np.concatenate([[tok.bos_token_id], tok.encode_bytes(data), [tok.eos_token_id]]).astype(np.int16)
        cut = max(1, int(len(ids) * 0.95))
        return ids[:cut], ids[cut:]
    base = root or sysconfig.get_paths()["stdlib"]
    parts = {False: [], True: []}
    total = 0
    for rel in stdlib_files(base):
        try:
            with open(os.path.join(base, rel), "rb") as f:
                data = f.read()
        except OSError:
            continue
        parts[is_held_out(rel)].append(np.concatenate(
            [[tok.bos_token_id], tok.encode_bytes(data), [tok.eos_token_id]]).astype(np.int16))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if not parts[False]:
        raise CorpusError(f"no .py text found under {base}")
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int16)  # noqa: E731
    return cat(parts[False]), cat(parts[True])


def sample_batch(stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch_size, length]`` int64 windows of ``stream`` (1-D int64) at uniform random offsets."""
    if stream.numel() < length + 1:
        raise ValueError(f"corpus ({stream.numel()} tokens) shorter than one example ({length} tokens)")
    off = torch.randint(0, stream.numel() - length, (batch_size,), generator=generator)
    idx = off[:, None] + torch.arange(length)[None, :]
    return stream[idx]


def add_uniform_noise(canvas: torch.Tensor, vocab_size: int, generator: torch.Generator, t: torch.Tensor | None = None):
    """Uniform-noise corruption: each token replaced by a uniform id in ``[0, V)`` with probability ``t``
    (``t ~ U(0, 1)`` per example unless given). The draws come from the CPU ``generator`` (deterministic for a
    seed) and are moved to ``canvas``'s device without reading the canvas back (no host sync).

    Args:
        canvas: ``[B, CL]`` int64 clean tokens (any device).
        t: ``[B]`` float replacement probabilities in [0, 1] (CPU), or None.

    Returns:
        ``(noisy [B, CL] int64 on canvas's device, t [B] fp32 on the CPU)``.

    Raises:
        ValueError: ``canvas`` not 2-D; ``t`` not ``[B]`` (a ``[B, 1]`` t broadcast to a ``[B, B, CL]`` "canvas", a
            ``[1]`` one gave every row row 0's rate and returned a t of one entry).
    """
    if canvas.dim() != 2:
        raise ValueError(f"canvas must be [B, CL], got shape {tuple(canvas.shape)}")
    B, CL = canvas.shape
    if t is None:
        t = torch.rand(B, generator=generator)
    elif not isinstance(t, torch.Tensor) or tuple(t.shape) != (B,):
        raise ValueError(f"t must be a [B={B}] tensor of replacement probabilities, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    replace = torch.rand(B, CL, generator=generator) < t[:, None]
    rnd = torch.randint(0, vocab_size, (B, CL), generator=generator)
    dev = canvas.device
    return torch.where(replace.to(dev), rnd.to(dev), canvas), t


# ---------------------------------------------------------------------------------------------- dense path
def training_masks(model: DiffusionGemma, prefix_len: int, canvas_length: int, device) -> dict:
    """Per layer type, the ``[P + CL, P + CL]`` bool mask of the encoder pass (prefix rows: causal over the
    prefix) stacked on the decoder pass (canvas rows: bidirectional over prefix + canvas, ``ctx = P``), both
    from :func:`blockdiff.attention.build_mask` with the layer's window and the config's bidirectional window."""
    cfg = model.config
    P, CL = prefix_len, canvas_length
    out = {}
    for lt in set(cfg.layer_types):
        W = cfg.window_size if lt == "sliding_attention" else None
        enc = build_mask(P, P, causal=True, window_size=W, device=device) if P else torch.zeros(0, 0, dtype=torch.bool)
        enc = torch.cat([enc.to(device), torch.zeros(P, CL, dtype=torch.bool, device=device)], 1)
        dec = build_mask(CL, P + CL, causal=False, window_size=W, bidirectional_window=cfg.bidirectional_window,
                         device=device)
        out[lt] = torch.cat([enc, dec.to(device)], 0)
    return out


def _prefix_len(prefix_len) -> int:
    """``prefix_len`` as an int; a float (2.5 was read as 2) or a bool (True as 1) is a TypeError, not a silent
    other prefix."""
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, numbers.Integral):
        raise TypeError(f"prefix_len must be an int, got {type(prefix_len).__name__} ({prefix_len!r})")
    return int(prefix_len)


def dense_forward(model: DiffusionGemma, ids: torch.Tensor, prefix_len: int, self_cond: torch.Tensor | None = None,
                  masks: dict | None = None) -> torch.Tensor:
    """Training-mode forward: encoder pass over the prefix + decoder pass over the canvas, densely.

    Args:
        ids: ``[B, P + CL]`` int64: a clean prefix of ``P = prefix_len`` tokens, then the (noisy) canvas.
        self_cond: ``[B, CL, hidden]`` soft embeddings (``softmax(z) @ E * sqrt(hidden)``) or None (zero).
        masks: from :func:`training_masks` (built when None).

    Returns:
        canvas logits ``[B, CL, V]`` fp32 (fp64 for a float64 model), softcapped as :meth:`DiffusionGemma.forward` returns them.

    Raises:
        TypeError: ``prefix_len`` not an int (a bool included).
        ValueError: bad shapes; more positions (``P + CL``) than the config's ``max_position_embeddings``.
    """
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64 [B, P + CL], got {ids.dtype} {tuple(ids.shape)}")
    B, L = ids.shape
    P = _prefix_len(prefix_len)
    CL = L - P
    if not 0 <= P < L:
        raise ValueError(f"prefix_len must be in [0, {L}), got {prefix_len}")
    cfg = model.config
    if L > cfg.max_position_embeddings:  # positions [0, L): RoPE past the config's range (served nowhere)
        raise ValueError(f"ids: P + CL = {L} positions exceed the config's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    hs = cfg.hidden_size
    if self_cond is not None and tuple(self_cond.shape) != (B, CL, hs):
        raise ValueError(f"self_cond must be [B={B}, CL={CL}, hidden={hs}], got {tuple(self_cond.shape)}")
    dev = ids.device
    dtype = model.embed_tokens.weight.dtype
    if masks is None:
        masks = training_masks(model, P, CL, dev)
    h = model.embed_input_ids(ids)  # [B, L, hs]
    hd = h[:, P:]
    if self_cond is not None:
        hd = hd + model.self_conditioning.signal(self_cond.to(hd.dtype))
    hd = model.self_conditioning.post_norm(hd)
    h = torch.cat([h[:, :P], hd.to(h.dtype)], 1).reshape(B * L, hs)
    is_dec = (torch.arange(L, device=dev) >= P).repeat(B)[:, None]
    positions = torch.arange(L, device=dev, dtype=torch.int64).repeat(B)
    cs = {lt: rope_cos_sin(positions, model._device_inv_freq(lt, dev), dtype) for lt in model._inv_freq}
    for layer in model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = a.qkv(x, *cs[a.layer_type], is_dec)
        q = q.view(B, L, a.num_heads, a.head_dim).transpose(1, 2)
        rep = a.num_heads // a.num_kv_heads
        k = k.view(B, L, a.num_kv_heads, a.head_dim).transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.view(B, L, a.num_kv_heads, a.head_dim).transpose(1, 2).repeat_interleave(rep, dim=1)
        dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        o = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), attn_mask=masks[a.layer_type], scale=1.0)
        o = a.out(o.transpose(1, 2).reshape(B * L, a.num_heads * a.head_dim), is_dec)
        h = h + layer.post_attention_layernorm(o)
        h = layer.feed_forward(h, "loop")
        h = h * torch.where(is_dec, layer.layer_scalar, layer.encoder_layer_scalar)
    h = model.norm(h.view(B, L, hs)[:, P:])
    logits = F.linear(h, model.embed_tokens.weight)
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    cap = cfg.final_logit_softcapping
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def diffusion_loss(model: DiffusionGemma, batch: torch.Tensor, prefix_len: int, generator: torch.Generator,
                   self_cond_prob: float = 0.5, masks: dict | None = None, t: torch.Tensor | None = None):
    """One training loss: noise the canvas (uniform), optional self-conditioning pass, canvas cross-entropy.

    Args:
        batch: ``[B, P + CL]`` clean windows (on the model's device).
        generator: CPU generator for t, the noise and the self-conditioning coin (deterministic given a seed).

    Returns:
        scalar loss (nats per canvas token, fp32).
    """
    dev = batch.device
    P = _prefix_len(prefix_len)
    clean = batch[:, P:]
    noisy, t = add_uniform_noise(clean, model.config.vocab_size, generator, t)
    ids = torch.cat([batch[:, :P], noisy], 1)
    use_sc = torch.rand(batch.shape[0], generator=generator) < self_cond_prob
    sc = None
    if bool(use_sc.any()):
        with torch.no_grad():
            z = dense_forward(model, ids, P, None, masks)
            sc = model.soft_embedding(z) * use_sc.to(dev, torch.float32)[:, None, None]
    logits = dense_forward(model, ids, P, sc, masks)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), clean.reshape(-1))


# ---------------------------------------------------------------------------------------------- checkpoint
def hf_state_dict(model: DiffusionGemma, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' DiffusionGemma names (``model.decoder.*``; the encoder's own tensors,
    its ``layer_scalar`` buffers and, with ``attention_bias``, its attention biases, as
    ``model.encoder.language_model.layers.{i}.*``: :func:`blockdiff.model.loading.hf_name`), as contiguous
    CPU tensors of ``dtype`` -- what :func:`blockdiff.model.loading.convert_hf_state_dict` maps back."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        out[hf_name(name)] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def save_checkpoint(model: DiffusionGemma, out: str, tokenizer: ByteTokenizer, dtype=torch.bfloat16) -> str:
    """Write ``model.safetensors``, ``config.json`` and ``tokenizer.json`` to the folder ``out``; returns the
    safetensors path. Load with ``DiffusionGemma.load_safetensors(out)``."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "model.safetensors")
    save_file(hf_state_dict(model, dtype), path, metadata={"format": "pt", "source": "blockdiff.model.train"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f, indent=2)
    # safetensors writes 0600; give the weights the JSON files' (umask) mode, as blockdiff.model.export does
    os.chmod(path, os.stat(os.path.join(out, "config.json")).st_mode & 0o777)
    tokenizer.save(out)
    return path


def plot_loss(log: list[dict], path: str, title: str) -> str:
    """PNG of training loss (per log interval) and held-out loss against steps."""
    # matplotlib only to draw: the Agg backend must be chosen before pyplot is imported (no display needed)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    steps = [r["step"] for r in log if "loss" in r]
    ax.plot(steps, [r["loss"] for r in log if "loss" in r], label="train (canvas CE, t ~ U(0,1))")
    ev = [r for r in log if "held_out_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["held_out_loss"] for r in ev], "o-", label="held-out")
    ax.axhline(math.log(ByteTokenizer.vocab_size), color="gray", ls=":", lw=0.8, label="log V (uniform)")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / canvas token")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, prefix_len: int, canvas_length: int, *, batches: int = 4,
                  batch_size: int = 64, seed: int = 1234, self_cond_prob: float = 0.0) -> float:
    """Mean canvas cross-entropy (nats / token) on held-out windows, fixed seed (comparable across steps)."""
    g = torch.Generator().manual_seed(seed)
    dev = model.embed_tokens.weight.device
    masks = training_masks(model, prefix_len, canvas_length, dev)
    tot = 0.0
    for _ in range(batches):
        b = sample_batch(stream, batch_size, prefix_len + canvas_length, g).to(dev)
        with _autocast(dev):
            tot += float(diffusion_loss(model, b, prefix_len, g, self_cond_prob, masks))
    return tot / batches


# ---------------------------------------------------------------------------------------------- training
def eval_max_model_len(prompt_len: int, canvases: int, canvas_length: int) -> int:
    """The ``max_model_len`` of the evaluation's harness (:func:`blockdiff.integration.evaluate.evaluate_generation`
    builds it with this): a prompt, its ``canvases`` canvases and one more canvas of room."""
    return prompt_len + (canvases + 1) * canvas_length


def train_config(args: "TrainArgs", config: DiffusionGemmaConfig | None = None) -> DiffusionGemmaConfig:
    """The config :func:`train` trains: ``config``, else :func:`smoke_config` with ``args.smoke``, else
    :func:`default_train_config`."""
    return config or (smoke_config() if args.smoke else default_train_config())


def position_problems(args: "TrainArgs", cfg: DiffusionGemmaConfig) -> list[tuple[type, str, str]]:
    """``(ValueError, field, message)`` for each position a run of ``args`` on ``cfg`` would pass the config's
    ``max_position_embeddings`` at: its training windows (``prefix + canvas_length``: :func:`dense_forward`
    refuses them, RoPE there being outside the range the checkpoint serves) or, with an evaluation, its harness's
    :func:`eval_max_model_len` (which failed after the whole run, before train_log.json was written). :func:`train`
    raises the first before training; ``blockdiff train`` reports them by flag."""
    CL, limit = cfg.canvas_length, cfg.max_position_embeddings
    out = []
    if args.prefix + CL > limit:
        out.append((ValueError, "prefix", f"prefix ({args.prefix}) + canvas_length ({CL}) = {args.prefix + CL} "
                                          f"training positions exceed the config's max_position_embeddings ({limit})"))
    need = eval_max_model_len(args.eval_prompt_len, args.eval_canvases, CL)
    if args.eval_prompts > 0 and need > limit:
        out.append((ValueError, "eval_prompt_len",
                    f"eval_prompt_len ({args.eval_prompt_len}) + (eval_canvases ({args.eval_canvases}) + 1) x "
                    f"canvas_length ({CL}) = {need} evaluation positions exceed the config's "
                    f"max_position_embeddings ({limit}); lower them or set eval_prompts = 0"))
    return out


def _autocast(dev):
    dev = torch.device(dev)
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(args: TrainArgs, config: DiffusionGemmaConfig | None = None, stream=None, *,
          evaluate: Callable[..., dict] | None = None) -> dict:
    """Train, save and evaluate (see the module docstring). Returns the ``train_log.json`` dict.

    Args:
        args: the run's settings. config: the model config (default :func:`default_train_config`, or
            :func:`smoke_config` with ``args.smoke``). stream: where progress lines go (None: ``sys.stdout`` at the
            call, not at import).
        evaluate: evaluation by generation, run on the saved checkpoint when ``args.eval_prompts > 0``:
            ``evaluate(model, tokenizer, held_out, *, num_prompts, prompt_len, canvases, max_denoising_steps,
            seed, attn_backend, device) -> dict`` (recorded as ``"eval"``); ``blockdiff train`` passes
            :func:`blockdiff.integration.evaluate.evaluate_generation` (it drives the harness, which this
            package does not import).

    Raises:
        ValueError: ``args.eval_prompts > 0`` without ``evaluate`` (checked before training); the config's
            vocabulary is not the byte tokenizer's; ``prefix + canvas_length`` or the evaluation's
            :func:`eval_max_model_len` beyond the config's ``max_position_embeddings`` (checked before training).
        CorpusError: the corpus is missing, holds no text, or fewer tokens than one example (a ValueError).
        TypeError / ValueError: a field of ``args`` breaking its rule (:meth:`TrainArgs.problems`), ``out`` a file.
    """
    for kind, name, msg in args.problems(paths=True)[:1]:  # fields changed after construction; the paths
        raise (CorpusError if name == "corpus" and kind is ValueError else kind)(msg)
    if args.eval_prompts > 0 and evaluate is None:
        raise ValueError(f"args.eval_prompts = {args.eval_prompts} needs evaluate= (e.g. "
                         "blockdiff.integration.evaluate.evaluate_generation); set eval_prompts = 0 to skip it")
    stream = sys.stdout if stream is None else stream
    p = lambda *a: print(*a, file=stream, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tok = ByteTokenizer()
    cfg = train_config(args, config)
    if cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"config.vocab_size ({cfg.vocab_size}) != tokenizer vocab ({tok.vocab_size})")
    CL = cfg.canvas_length
    for kind, _, msg in position_problems(args, cfg)[:1]:
        raise kind(msg)
    train_ids, held = load_corpus(args.corpus, tok)
    p(f"corpus: {len(train_ids):,} train tokens, {len(held):,} held-out tokens ({args.corpus or 'stdlib'})")
    if len(train_ids) <= args.prefix + CL:
        raise CorpusError(f"the corpus ({args.corpus or 'stdlib'}) has {len(train_ids)} training tokens, fewer "
                          f"than one example (prefix {args.prefix} + canvas {CL} + 1)")
    train_t = torch.from_numpy(train_ids.astype(np.int64))
    held_t = torch.from_numpy(held.astype(np.int64)) if len(held) > args.prefix + CL + 1 else train_t
    if held_t is train_t:
        p("note: held-out stream too short; held-out loss uses the train stream")
    train_t_dev = train_t.to(dev)
    model = DiffusionGemma(cfg, seed=args.seed, moe_impl="loop").to(dev).train()
    n_params = sum(t.numel() for t in model.parameters())
    p(f"model: {n_params:,} parameters ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab "
      f"{cfg.vocab_size}, canvas {CL}, prefix {args.prefix_min}-{args.prefix}); device {dev}")
    decay = [t for n, t in model.named_parameters() if t.dim() >= 2]
    no_decay = [t for n, t in model.named_parameters() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=dev.type == "cuda")
    g = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60.0
    max_steps = args.max_steps if args.max_steps is not None else 10 ** 9
    # cosine schedule: over max_steps when given, else over the wall-clock budget (fraction of budget_s elapsed).
    # (A step-count estimate from the first steps undershot on the H200: warm-up steps ran at 4 steps/s, later ones
    # at 7, so the schedule reached its floor at 60 % of the run.)
    mask_cache: dict = {}
    log: list[dict] = []
    step = 0
    t0 = time.perf_counter()
    while step < max_steps:
        elapsed = time.perf_counter() - t0
        if args.max_steps is None and elapsed >= budget_s:
            break
        if step < args.warmup_steps:
            lr = args.lr * (step + 1) / args.warmup_steps
        else:
            if args.max_steps is not None:
                frac = (step - args.warmup_steps) / max(1, max_steps - args.warmup_steps)
            else:
                frac = elapsed / budget_s
            frac = min(1.0, max(0.0, frac))
            lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
        for gr in opt.param_groups:
            gr["lr"] = lr
        P = int(torch.randint(args.prefix_min, args.prefix + 1, (1,), generator=g))
        if P not in mask_cache:
            mask_cache[P] = training_masks(model, P, CL, dev)
        off = torch.randint(0, train_t.numel() - (P + CL), (args.batch_size,), generator=g).to(dev)
        batch = train_t_dev[off[:, None] + torch.arange(P + CL, device=dev)[None, :]]
        with _autocast(dev):
            loss = diffusion_loss(model, batch, P, g, args.self_cond_prob, mask_cache[P])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or args.smoke:
            rec = {"step": step, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(gn),
                   "elapsed_s": time.perf_counter() - t0}
            log.append(rec)
            if not args.smoke or step % 5 == 0:
                p(f"step {step:>6}  loss {rec['loss']:.4f}  lr {lr:.2e}  grad {rec['grad_norm']:.2f}  "
                  f"{rec['elapsed_s']:.0f} s")
        if not args.smoke and step % (args.log_every * 20) == 0:
            model.eval()
            hl = held_out_loss(model, held_t, args.prefix, CL)
            model.train()
            log.append({"step": step, "held_out_loss": hl})
            p(f"step {step:>6}  held-out loss {hl:.4f}")
    train_s = time.perf_counter() - t0
    model.eval()
    hl = held_out_loss(model, held_t, args.prefix, CL, batches=2 if args.smoke else 8,
                       batch_size=8 if args.smoke else 64)
    log.append({"step": step, "held_out_loss": hl})
    os.makedirs(args.out, exist_ok=True)
    ckpt = save_checkpoint(model, args.out, tok)
    png = plot_loss(log, os.path.join(args.out, "loss.png"),
                    f"DiffusionGemma {n_params / 1e6:.2f} M params, byte-level stdlib, {step} steps, {train_s / 60:.1f} min")
    p(f"trained {step} steps in {train_s:.1f} s ({step / max(train_s, 1e-9):.2f} steps/s); held-out loss {hl:.4f}; "
      f"checkpoint {ckpt} ({os.path.getsize(ckpt) / 1e6:.2f} MB); plot {png}")
    # the args as train_log.json holds them: out / corpus may be os.PathLike (TrainArgs takes them), which json.dump
    # refuses (a TypeError after the whole run, leaving a truncated train_log.json)
    args_json = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in vars(args).items()}
    result = {"config": cfg.to_dict(), "args": args_json, "num_parameters": n_params, "steps": step,
              "train_seconds": train_s, "steps_per_second": step / max(train_s, 1e-9),
              "tokens_per_step": args.batch_size * (args.prefix + args.prefix_min) // 2 + args.batch_size * CL,
              "final_held_out_loss": hl, "log": log, "checkpoint_bytes": os.path.getsize(ckpt),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__}
    if args.eval_prompts > 0:
        ev_model = DiffusionGemma.load_safetensors(args.out, device=dev,
                                                   dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
        ev_model.eval()
        from_held = len(held) > 4 * args.eval_prompt_len  # else the prompts come from the train stream
        ev = evaluate(ev_model, tok, held if from_held else train_ids,
                                 num_prompts=args.eval_prompts, prompt_len=args.eval_prompt_len,
                                 canvases=args.eval_canvases, max_denoising_steps=args.eval_steps, seed=args.seed,
                                 attn_backend=args.attn_backend, device=dev)
        result["eval"] = ev
        src = "held-out prompts" if from_held else "prompts (from the train stream: no held-out split)"
        p(f"eval: {ev['num_prompts']} {src} of {ev['prompt_len']} tokens: {ev['tokens_per_forward']:.3f} "
          f"tokens committed per forward pass ({ev['tokens_per_request_pass']:.3f} per request row), "
          f"{ev['tokens_per_denoise_step']:.3f} per denoise row, "
          f"{ev['denoise_steps_per_canvas']:.2f} denoising steps per canvas (cap {ev['max_denoising_steps']})")
        if ev.get("requests_failed"):  # NaN / +inf logits: the rates above count only the other requests
            p(f"eval: WARNING: {ev['requests_failed']} of {ev['num_prompts']} requests failed (non-finite logits: the "
              f"checkpoint diverged); the figures above count only the others")
        s = ev["samples"][0]
        p(f"sample prompt:     {s['prompt']!r}\nsample completion: {s['completion']!r}")
    result["total_seconds"] = time.perf_counter() - t_start
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(json_finite(result), f, indent=1, allow_nan=False)
    return result


def json_finite(x):
    """``x`` with every non-finite float (a diverged loss, a rate with nothing under it: NaN / +-inf) replaced by
    None, so that ``json.dump`` writes standard JSON (``null``) instead of the ``NaN`` / ``Infinity`` tokens strict
    parsers (JavaScript's ``JSON.parse``, ``jq``) refuse. Dicts, lists and tuples are copied; the returned dict
    (:func:`train`'s) keeps its NaNs, only the file has ``null``. The bench records' rule (``bench/common.py``)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_finite(v) for v in x]
    return x


def smoke_args(args: TrainArgs) -> TrainArgs:
    """``blockdiff train --smoke``: ``args`` cut down to a CPU run of under a minute (at most 20 steps unless
    ``max_steps`` is set, batch <= 8, prefix 8-16, 2 warm-up steps, lr 3e-3, <= 2 evaluation prompts of 12
    tokens, one canvas, <= 4 denoising steps; corpus default: the stdlib's ``json`` package)."""
    corpus = args.corpus if args.corpus is not None else os.path.join(sysconfig.get_paths()["stdlib"], "json")
    return dataclasses.replace(
        args, smoke=True, device="cpu", max_steps=args.max_steps or 20, batch_size=min(args.batch_size, 8),
        prefix=min(args.prefix, 16), prefix_min=min(args.prefix_min, 8), warmup_steps=2, lr=3e-3,
        eval_prompts=min(args.eval_prompts, 2), eval_prompt_len=12, eval_canvases=1,
        eval_steps=min(args.eval_steps, 4), corpus=corpus)


if __name__ == "__main__":
    sys.exit("blockdiff.model.train is the training library; run it with `blockdiff train --out FOLDER ...` "
             "(or python3 -m blockdiff.integration.cli train ...), which also evaluates by generation through "
             "the harness")
