"""Load transformers DiffusionGemma weights (state dict or safetensors) into :class:`DiffusionGemma`.

Names (transformers 5.24 ``DiffusionGemmaForBlockDiffusion``; a saved checkpoint holds the decoder stack, the
self-conditioning block, the encoder's own tensors -- its ``layer_scalar`` buffers and, with ``attention_bias``, its
attention biases -- and the vision tower, because the encoder's weights and ``lm_head`` are tied to the decoder's).
``E = model.encoder.language_model.``; ``{p}`` is ``q_proj``, ``k_proj``, ``v_proj`` or ``o_proj``:

===============================================  ================================================================
transformers                                     blockdiff.model
===============================================  ================================================================
``model.decoder.<name>``                         ``<name>`` (embed_tokens, layers.*, norm, self_conditioning.*)
``E layers.{i}.layer_scalar``                    ``layers.{i}.encoder_layer_scalar``
``E layers.{i}.self_attn.{p}.bias``              ``layers.{i}.self_attn.{p}.encoder_bias``
``E <name>`` (other)                             tied copy of ``<name>``: must equal it if both given
``lm_head.weight``                               tied copy of ``embed_tokens.weight``: must equal it
``model.encoder.vision_tower.*``                 skipped (vision is out of scope), as ``model.encoder.embed_vision.*``
===============================================  ================================================================

transformers ties the encoder's weights to the decoder's (``DiffusionGemmaModel._tied_weights_keys``: every
``weight``, ``scale``, ``per_expert_scale``, ``gate_up_proj``, ``down_proj``) but not its buffers (``layer_scalar``)
nor the attention biases (``attention_bias=True``): those are separate tensors per mode, and a checkpoint must hold
both copies (transformers saves both; a missing one is a missing tensor, as transformers reports it).

A ``DiffusionGemmaModel`` state dict (keys starting ``encoder.`` / ``decoder.``) is accepted too.

Every bad checkpoint raises :class:`~blockdiff.model.errors.CheckpointError` (a ``ValueError``) naming the file and
tensor; a missing file :class:`~blockdiff.model.errors.CheckpointFileNotFoundError` (also a ``FileNotFoundError``).
"""
from __future__ import annotations

import os

import torch
from safetensors import SafetensorError, safe_open

from .config import read_json_object
from .errors import CheckpointError, CheckpointFileNotFoundError

SKIPPED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
_DEC = "model.decoder."
_ENC = "model.encoder.language_model."
_MAX_LIST = 20
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
#: The dtypes the model computes in (its parameters, activations and KV caches; the attention backends take these
#: too). float8 and complex dtypes are refused by name: a float8 model loaded its weights rounded to 2-3 mantissa
#: bits and failed only at its first forward pass, inside a torch kernel ("not implemented for 'Float8_e5m2'").
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_dtype(dtype, name: str = "dtype") -> torch.dtype | None:
    """``dtype`` (None passes) if it is one of :data:`MODEL_DTYPES`.

    Raises:
        TypeError: anything else (a str, an integer / complex / float8 dtype); the message names ``name``.
    """
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or dtype not in MODEL_DTYPES:
        raise TypeError(f"{name} must be a floating torch.dtype the model computes in "
                        f"({', '.join(map(str, MODEL_DTYPES))}) or None, got {dtype!r}")
    return dtype


def hf_name(name: str) -> str:
    """transformers' checkpoint name of our parameter / buffer ``name`` (the table in the module docstring):
    ``layers.{i}.encoder_layer_scalar`` and ``*.encoder_bias`` are the encoder's own tensors, the rest the
    decoder's."""
    if name.endswith("encoder_layer_scalar"):
        return _ENC + name[: -len("encoder_layer_scalar")] + "layer_scalar"
    if name.endswith(".encoder_bias"):
        return _ENC + name[: -len("encoder_bias")] + "bias"
    return _DEC + name


def check_device(device, name: str = "device") -> torch.device:
    """``device`` (None: cpu; a ``torch.device``, its string, or a CUDA index) as a ``torch.device``. A CPU device is
    returned as plain ``cpu`` (``cpu:0``, ``cpu:1`` included), where torch puts every CPU tensor.

    Raises:
        TypeError: not a str / int / torch.device / None.
        ValueError: a string torch cannot parse (e.g. ``"bogus"``), or a CUDA device that is not there (no CUDA,
            or an index >= the device count); the message names ``name``.
    """
    if device is None:
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"{name} must be a torch.device, a device string or a CUDA index, got "
                        f"{type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{name} {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:0'): {e}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {device!r}: CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if dev.type == "cpu":
        return torch.device("cpu")  # (the harness refused "cpu:1" as another device than its model's "cpu")
    return dev


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
        CheckpointError: one message listing every missing, unexpected, mis-shaped, wrongly typed (an integer
            tensor for a float parameter, a value that is not a tensor) or tied-but-different tensor.
    """
    out: dict[str, torch.Tensor] = {}
    tied: dict[str, list[tuple[str, torch.Tensor]]] = {}
    unexpected, skipped, not_tensor, bad_dtype, twice = [], [], [], [], []
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
            if ours in expected and hf_name(ours) == k:  # not our encoder-only names under model.decoder.
                if ours in out:
                    twice.append(key)
                out[ours] = t
                continue
        elif k.startswith(_ENC):
            name = k[len(_ENC):]
            if name.endswith(".layer_scalar"):
                ours = name[: -len("layer_scalar")] + "encoder_layer_scalar"
                if ours in expected:
                    if ours in out:
                        twice.append(key)
                    out[ours] = t
                    continue
            elif name.endswith(".bias") and name[: -len("bias")] + "encoder_bias" in expected:
                ours = name[: -len("bias")] + "encoder_bias"  # untied in transformers: the encoder's own
                if ours in out:
                    twice.append(key)
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
                missing.append(hf_name(name))
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
        why = (" (transformers keeps the encoder's attention biases apart from the decoder's, and saves both)"
               if any(m.startswith(_ENC) and m.endswith(".bias") for m in missing) else "")
        errors.append(f"missing tensors ({len(missing)}){why}: {_fmt(missing)}")
    if unexpected:
        errors.append(f"unexpected tensors ({len(unexpected)}): {_fmt(unexpected)}")
    if bad_shape:
        errors.append(f"mis-shaped tensors ({len(bad_shape)}): {_fmt(bad_shape)}")
    if bad_dtype:
        errors.append(f"tensors of the wrong kind of dtype ({len(bad_dtype)}): {_fmt(bad_dtype)}")
    if twice:
        errors.append(f"tensors given twice (as model.* and as encoder. / decoder.) ({len(twice)}): {_fmt(twice)}")
    if not_tensor:
        errors.append(f"values that are not tensors ({len(not_tensor)}): {_fmt(not_tensor)}")
    if differ:
        errors.append(f"tied tensors that differ from the decoder's copy ({len(differ)}; transformers ties these "
                      f"encoder weights and lm_head to the decoder's): {_fmt(differ)}")
    if errors:
        raise CheckpointError("cannot load DiffusionGemma state dict: " + "; ".join(errors))
    return out, sorted(skipped)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied into its own (allocator-aligned) storage when it is a CPU tensor that does not start on a
    64-byte boundary: safetensors hands out views into the file's buffer at any offset, and CPU BLAS picks
    alignment-dependent kernels, so a model assigned such views computed logits 1 ulp away from the same weights
    in ordinary tensors."""
    if t.device.type == "cpu" and t.numel() and t.data_ptr() % 64:
        return t.clone()
    return t


def load_hf_state_dict(model, state_dict, *, device=None, dtype=None) -> list[str]:
    """Load a transformers DiffusionGemma state dict into ``model`` (which may live on the meta device).

    Tensors are cast to ``dtype`` (default: the model's parameter dtype, or the checkpoint's when the model
    is on the meta device and no dtype is given) and placed on ``device`` (default: the model's device, cpu
    for meta). Returns the skipped (vision) names.

    Raises:
        CheckpointError: see :func:`convert_hf_state_dict`; also a ``dtype`` that cannot hold a weight (a finite
            value that would overflow to inf, e.g. above 65504 in float16), or, without ``dtype`` (a meta model),
            an embedding stored in a dtype outside :data:`MODEL_DTYPES` (float8).
        TypeError: ``dtype`` is not one of :data:`MODEL_DTYPES` (or None).
        ValueError: a bad ``device`` (see :func:`check_device`).
    """
    check_dtype(dtype)
    if device is not None:
        device = check_device(device)
    expected = {n: (p.shape, p.dtype) for n, p in model.state_dict().items()}
    tensors, skipped = convert_hf_state_dict(state_dict, expected)
    ref = model.embed_tokens.weight
    if device is None:
        device = torch.device("cpu") if ref.is_meta else ref.device
    if dtype is None and not ref.is_meta:
        dtype = ref.dtype
    if dtype is None:
        dtype = tensors["embed_tokens.weight"].dtype
        if dtype not in MODEL_DTYPES:  # (the checkpoint's dtype becomes the model's)
            raise CheckpointError(f"{hf_name('embed_tokens.weight')} is stored as {dtype}, which the model does not "
                                  f"compute in: pass dtype= one of {', '.join(map(str, MODEL_DTYPES))}")
    final = {n: _own_storage(_cast(n, t, device, dtype)) for n, t in tensors.items()}
    model.load_state_dict(final, strict=True, assign=True)
    return skipped


def _cast(name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` on ``device``, in ``dtype`` if it is floating point; a narrowing cast (float32 / bf16 -> float16) that
    turns a finite weight into inf raises (as :func:`blockdiff.model.export_hf` refuses to write one)."""
    if not t.is_floating_point():
        return t.to(device=device)
    c = t.to(device=device, dtype=dtype)
    if c.numel() and torch.finfo(dtype).max < torch.finfo(t.dtype).max:
        lost = torch.isfinite(t).to(c.device) & ~torch.isfinite(c)
        if bool(lost.any()):
            v = float(t[lost.to(t.device)].flatten()[0])
            raise CheckpointError(f"dtype {dtype} cannot hold the weights: {hf_name(name)} ({t.dtype}) has "
                                  f"{int(lost.sum())} finite value(s) that overflow it (e.g. {v:.4g}); load in a "
                                  "wider dtype (float32 or bfloat16)")
    return c


def read_safetensors(path, device=None) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint: a file, or a folder with ``model.safetensors`` or
    ``model.safetensors.index.json`` (+ shards), read onto ``device`` (default cpu). Vision-tower tensors are not
    read (an empty placeholder keeps their names for the skipped list).

    The index must be a JSON object whose ``weight_map`` maps tensor names (str) to shard file names (str) inside
    the folder: relative names whose folder, after symlinks (``os.path.realpath``), is the checkpoint folder or
    under it (``../x`` and absolute names are refused before anything is opened; the shard entry itself may be a
    symlink, as in the Hugging Face cache). Every tensor it names must be in its shard, and no tensor may be in two
    files. A folder holding both ``model.safetensors`` and an index whose shards are other files is refused:
    transformers reads the former, vLLM the latter.

    Raises:
        TypeError: ``path`` is not a str / os.PathLike.
        ValueError: a bad ``device`` (see :func:`check_device`).
        CheckpointFileNotFoundError: nothing at ``path``, no ``model.safetensors`` / index in the folder, or a
            shard the index names is missing.
        CheckpointError: an index that is not JSON / not that layout / names a shard outside the folder; a file
            that is not a readable safetensors file (truncated, not safetensors, a folder); a tensor in two files
            or missing from its shard; ``model.safetensors`` beside an index of other shards. The message names the
            file (and tensor).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (a .safetensors file or a checkpoint folder), got "
                        f"{type(path).__name__}")
    dev = check_device(device)
    path = os.fspath(path)
    expected_in: dict[str, str] = {}  # tensor -> shard (index only)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_FILE)
        single = os.path.join(path, WEIGHTS_FILE)
        if os.path.exists(index):
            files, expected_in = _index_shards(path, index)
            names = sorted(os.path.relpath(f, os.path.realpath(path)) for f in files)
            if os.path.lexists(single) and names != [WEIGHTS_FILE]:
                # transformers' from_pretrained reads model.safetensors and ignores the index; vLLM (and this loader)
                # follow the index: the folder's weights would depend on who reads it
                raise CheckpointError(f"{path} holds both {WEIGHTS_FILE} and {INDEX_FILE}, whose shards are other "
                                      f"files ({_fmt(names)}): transformers loads {WEIGHTS_FILE}, vLLM and blockdiff "
                                      "the index's shards; remove one of the two")
        elif os.path.exists(single):
            files = [single]
        else:
            raise CheckpointFileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {path}")
    elif os.path.exists(path):
        files = [path]
    else:
        raise CheckpointFileNotFoundError(f"no safetensors checkpoint at {path}")
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for fn in files:
        if os.path.isdir(fn):
            raise CheckpointError(f"{fn} is a folder, not a safetensors file")
        try:
            with safe_open(fn, framework="pt", device="cpu") as f:
                for k in f.keys():
                    if k in where:
                        raise CheckpointError(f"tensor {k!r} is in two files: {where[k]} and {fn}")
                    where[k] = fn
                    if k.startswith(SKIPPED_PREFIXES):
                        out[k] = torch.empty(0)  # listed as skipped, never read
                    else:
                        t = f.get_tensor(k)
                        out[k] = t if dev.type == "cpu" else t.to(dev)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{fn} is not a readable safetensors file "
                                  f"(truncated, not safetensors, or unreadable): {e}") from e
    absent = sorted(f"{k} (in {os.path.basename(shard)})" for k, shard in expected_in.items() if where.get(k) != shard)
    if absent:
        raise CheckpointError(f"{INDEX_FILE} in {path} maps tensors to shard files that do not hold them "
                              f"({len(absent)}): {_fmt(absent)}")
    return out


def _index_shards(folder: str, index: str) -> tuple[list[str], dict[str, str]]:
    """Shard paths (sorted, each inside ``folder``) and tensor -> shard of a ``model.safetensors.index.json``."""
    d = read_json_object(index, INDEX_FILE)
    wm = d.get("weight_map")
    if not isinstance(wm, dict):
        raise CheckpointError(f"{INDEX_FILE} ({index}): weight_map must be a JSON object (tensor name -> shard file), "
                              f"got {type(wm).__name__ if 'weight_map' in d else 'no weight_map'}")
    bad = [f"{k!r}: {v!r}" for k, v in wm.items() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointError(f"{INDEX_FILE} ({index}): weight_map values must be shard file names (str), got "
                              f"{_fmt(bad)}")
    root = os.path.realpath(folder)
    files, full = [], {}
    for shard in sorted(set(wm.values())):
        # containment of the shard's folder after symlinks (realpath); the shard entry itself may be a symlink, as
        # in the Hugging Face cache, whose snapshot folders hold symlinks to ../../blobs/<sha256>
        name = os.path.basename(shard)
        parent = os.path.realpath(os.path.join(root, os.path.dirname(shard)))
        if os.path.isabs(shard) or name in ("", ".", "..") or os.path.commonpath([root, parent]) != root:
            raise CheckpointError(f"{INDEX_FILE} ({index}): shard {shard!r} resolves outside the checkpoint folder "
                                  f"{root}; shard names must be relative paths inside it")
        full[shard] = os.path.join(parent, name)
        if not os.path.exists(full[shard]):
            raise CheckpointFileNotFoundError(f"{INDEX_FILE} ({index}) names shard {shard!r}, which is missing "
                                              f"({full[shard]})")
        files.append(full[shard])
    return files, {k: full[v] for k, v in wm.items()}
