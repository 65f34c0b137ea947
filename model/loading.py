"""Load transformers DiffusionGemma weights (state dict or safetensors) into :class:`DiffusionGemma`.

Names (transformers 5.24 ``DiffusionGemmaForBlockDiffusion``; a saved checkpoint holds the decoder stack, the
self-conditioning block, the encoder's ``layer_scalar`` buffers and the vision tower, because the encoder's
weights and ``lm_head`` are tied to the decoder's):

=========================================================  ====================================================
transformers                                               blockdiff.model
=========================================================  ====================================================
``model.decoder.<name>``                                   ``<name>`` (embed_tokens, layers.*, norm, self_conditioning.*)
``model.encoder.language_model.layers.{i}.layer_scalar``   ``layers.{i}.encoder_layer_scalar``
``model.encoder.language_model.<name>`` (other)            tied copy of ``<name>``: must equal it if both given
``lm_head.weight``                                         tied copy of ``embed_tokens.weight``: must equal it
``model.encoder.vision_tower.*``, ``model.encoder.embed_vision.*``   skipped (vision is out of scope)
=========================================================  ====================================================

A ``DiffusionGemmaModel`` state dict (keys starting ``encoder.`` / ``decoder.``) is accepted too.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

SKIPPED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
_DEC = "model.decoder."
_ENC = "model.encoder.language_model."
_MAX_LIST = 20


def _fmt(names) -> str:
    names = sorted(names)
    s = ", ".join(names[:_MAX_LIST])
    return s + (f", ... ({len(names) - _MAX_LIST} more)" if len(names) > _MAX_LIST else "")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return torch.equal(a.to(b.device, b.dtype), b)


def convert_hf_state_dict(state_dict, expected: dict[str, tuple[torch.Size, torch.dtype]]):
    """Map transformers names to ours and check them.

    Args:
        state_dict: mapping name -> tensor (transformers names; tensors may be lazy callables returning one).
        expected: our name -> (shape, dtype) of every parameter and persistent buffer.

    Returns:
        ``(tensors, skipped)``: our name -> tensor, and the sorted list of skipped (vision) names.

    Raises:
        ValueError: one message listing every missing, unexpected, mis-shaped, wrongly typed (an integer tensor
            for a float parameter, a value that is not a tensor) or untied-but-different tensor.
    """
    out: dict[str, torch.Tensor] = {}
    tied: dict[str, list[tuple[str, torch.Tensor]]] = {}
    unexpected, skipped, not_tensor, bad_dtype = [], [], [], []
    for key, t in state_dict.items():
        k = key
        if k.startswith(("encoder.", "decoder.")):
            k = "model." + k
        if k.startswith(SKIPPED_PREFIXES):
            skipped.append(key)
            continue
        if not isinstance(t, torch.Tensor) and callable(t):  # lazy entry: read only what is kept
            t = t()
        if not isinstance(t, torch.Tensor):
            not_tensor.append(f"{key}: {type(t).__name__}")
            continue
        if k.startswith(_DEC):
            ours = k[len(_DEC):]
            if ours in expected:
                out[ours] = t
                continue
        elif k.startswith(_ENC):
            name = k[len(_ENC):]
            if name.endswith(".layer_scalar"):
                ours = name[: -len("layer_scalar")] + "encoder_layer_scalar"
                if ours in expected:
                    out[ours] = t
                    continue
            elif name in expected and not name.startswith("self_conditioning."):
                tied.setdefault(name, []).append((key, t))
                continue
        elif k == "lm_head.weight":
            tied.setdefault("embed_tokens.weight", []).append((key, t))
            continue
        unexpected.append(key)

    missing, bad_shape, differ = [], [], []
    for name, (shape, _) in expected.items():
        if name not in out:
            copies = tied.get(name)
            if copies:  # only the tied (encoder / lm_head) copy was given: use it
                out[name] = copies[0][1]
            else:
                missing.append(_DEC + name if not name.endswith("encoder_layer_scalar")
                               else _ENC + name.replace("encoder_layer_scalar", "layer_scalar"))
                continue
        t = out[name]
        if tuple(t.shape) != tuple(shape):
            bad_shape.append(f"{name}: got {tuple(t.shape)}, expected {tuple(shape)}")
        want_float = expected[name][1].is_floating_point
        if t.is_floating_point() != want_float:
            bad_dtype.append(f"{name}: got {t.dtype}, expected a {'float' if want_float else 'non-float'} tensor")
    for name, copies in tied.items():
        if name in out and tuple(out[name].shape) == tuple(expected[name][0]):
            for key, t in copies:
                if not _same(t, out[name]):
                    differ.append(key)
    errors = []
    if missing:
        errors.append(f"missing tensors ({len(missing)}): {_fmt(missing)}")
    if unexpected:
        errors.append(f"unexpected tensors ({len(unexpected)}): {_fmt(unexpected)}")
    if bad_shape:
        errors.append(f"mis-shaped tensors ({len(bad_shape)}): {_fmt(bad_shape)}")
    if bad_dtype:
        errors.append(f"tensors of the wrong kind of dtype ({len(bad_dtype)}): {_fmt(bad_dtype)}")
    if not_tensor:
        errors.append(f"values that are not tensors ({len(not_tensor)}): {_fmt(not_tensor)}")
    if differ:
        errors.append(f"tied tensors that differ from the decoder's copy ({len(differ)}; untied encoder/decoder "
                      f"or lm_head weights are not supported): {_fmt(differ)}")
    if errors:
        raise ValueError("cannot load DiffusionGemma state dict: " + "; ".join(errors))
    return out, sorted(skipped)


def load_hf_state_dict(model, state_dict, *, device=None, dtype=None) -> list[str]:
    """Load a transformers DiffusionGemma state dict into ``model`` (which may live on the meta device).

    Tensors are cast to ``dtype`` (default: the model's parameter dtype, or the checkpoint's when the model
    is on the meta device and no dtype is given) and placed on ``device`` (default: the model's device, cpu
    for meta). Returns the skipped (vision) names.

    Raises:
        ValueError: see :func:`convert_hf_state_dict`.
    """
    expected = {n: (p.shape, p.dtype) for n, p in model.state_dict().items()}
    tensors, skipped = convert_hf_state_dict(state_dict, expected)
    ref = model.embed_tokens.weight
    if device is None:
        device = torch.device("cpu") if ref.is_meta else ref.device
    if dtype is None and not ref.is_meta:
        dtype = ref.dtype
    if dtype is None:
        dtype = tensors["embed_tokens.weight"].dtype
    final = {n: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for n, t in tensors.items()}
    model.load_state_dict(final, strict=True, assign=True)
    return skipped


def read_safetensors(path, device=None) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint: a file, or a folder with ``model.safetensors`` or
    ``model.safetensors.index.json`` (+ shards), read straight onto ``device`` (default cpu). Vision-tower
    tensors are not read (an empty placeholder keeps their names for the skipped list).

    Raises:
        FileNotFoundError: nothing loadable at ``path``.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            files = [os.path.join(path, fn) for fn in files]
        elif os.path.exists(single):
            files = [single]
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    elif os.path.exists(path):
        files = [path]
    else:
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    out: dict[str, torch.Tensor] = {}
    for fn in files:
        with safe_open(fn, framework="pt", device=str(device or "cpu")) as f:
            for k in f.keys():
                if k.startswith(SKIPPED_PREFIXES):
                    out[k] = torch.empty(0)  # listed as skipped, never read
                else:
                    out[k] = f.get_tensor(k)
    return out
