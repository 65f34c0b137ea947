"""Export a blockdiff DiffusionGemma as a Hugging Face DiffusionGemma folder that transformers and vLLM load by path.

``blockdiff export OUT`` (:mod:`blockdiff.integration.cli`) runs :func:`export_hf` on the shipped ``stdlib-byte``
checkpoint. The folder holds:

=============================  =======================================================================================
``config.json``                transformers ``DiffusionGemmaConfig``: ``architectures``
                               ``["DiffusionGemmaForBlockDiffusion"]`` (the name vLLM's model registry and
                               transformers' auto classes map), ``model_type`` ``diffusion_gemma``, ``canvas_length``,
                               ``vision_config: null`` and a ``text_config`` (``diffusion_gemma_text``) with every
                               :class:`~blockdiff.model.DiffusionGemmaConfig` field.
                               The full-attention geometry is written as ``global_head_dim`` /
                               ``num_global_key_value_heads`` (what vLLM's Gemma 4 layers read; transformers folds
                               them into ``per_layer_config``), and ``final_logit_softcapping`` explicitly (vLLM reads
                               it from the file; transformers' class default is 30.0). blockdiff's own
                               ``bidirectional_window`` stays in ``text_config`` (transformers and vLLM ignore it:
                               transformers' decoder uses the ``"prefix"`` window; vLLM 0.26's Triton attention
                               a symmetric one, ``|q - k| < sliding_window``, on bidirectional rows).
``model.safetensors``          the weights under transformers' names (what ``DiffusionGemmaForBlockDiffusion
                               .save_pretrained`` writes: ``model.decoder.*``, the encoder's
                               ``model.encoder.language_model.layers.{i}.layer_scalar``; tied copies left out).
``generation_config.json``     transformers ``DiffusionGemmaGenerationConfig``: ``max_denoising_steps``, ``t_min``,
                               ``t_max``, ``sampler_config`` (``EntropyBoundSamplerConfig`` with ``entropy_bound``),
                               ``confidence_threshold``, ``stability_threshold``, the special ids; vLLM 0.26 reads
                               these keys at sampler-build time.
``tokenizer.json``             a Hugging Face ``tokenizers`` byte-level tokenizer with
                               :class:`~blockdiff.model.tokenizer.ByteTokenizer`'s ids: ``<pad>`` 0, ``<eos>`` 1,
                               ``<bos>`` 2 (special), byte ``b`` -> ``3 + b`` (GPT-2 byte-to-unicode alphabet, a BPE
                               without merges); ids past 258 up to ``vocab_size`` are ``<unused_{id}>`` tokens.
``tokenizer_config.json``      ``PreTrainedTokenizerFast`` with those special tokens and ``split_special_tokens``
                               (the text ``"<eos>"`` encodes as its five bytes, as ByteTokenizer does); no BOS is
                               added, so ``AutoTokenizer(...).encode(text) == ByteTokenizer().encode(text)``.
=============================  =======================================================================================

Serving the folder with vLLM 0.26: ``vllm serve OUT --language-model-only`` (the architecture is registered as
multimodal; the folder has no vision tower and no image processor), plus blockdiff's plugin flags
(``VLLM_PLUGINS=blockdiff``, ``--attention-backend CUSTOM``, its ``--scheduler-cls``: integration/README.md) or, for
stock vLLM where blockdiff is installed, ``VLLM_PLUGINS=none`` (``blockdiff export`` prints both,
:func:`blockdiff.integration.cli.serve_commands`). The canvas length comes from ``config.json`` unless
``--diffusion-config`` gives one.

Sources: transformers 5.24 ``models/diffusion_gemma`` (``configuration_diffusion_gemma.py``,
``generation_diffusion_gemma.py``: ``DiffusionGemmaGenerationConfig`` and its ``_get_default_generation_params``);
vLLM 0.26.0 ``model_executor/models/diffusion_gemma.py`` (``DiffusionGemmaModelState`` / ``custom_sampler``),
``models/gemma4.py``, ``transformers_utils/configs/diffusion_gemma.py``; GPT-2's ``bytes_to_unicode``
(``tokenizers``' ``ByteLevel`` alphabet).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil

import torch
from safetensors.torch import save_file

from .config import DiffusionGemmaConfig, finite_real, show_real
from .generation import parse_generation_config
from .loading import INDEX_FILE, WEIGHTS_FILE, hf_name
from .modeling import DiffusionGemma
from .pretrained import load_pretrained
from .tokenizer import ByteTokenizer, bytes_to_unicode
from .train import hf_state_dict

__all__ = ["ARCHITECTURE", "EXPORT_FILES", "GENERATION_DEFAULTS", "export_hf", "hf_config_dict",
           "hf_generation_config_dict", "hf_tokenizer_json", "hf_tokenizer_config_dict"]

#: ``config.json`` ``architectures[0]``: transformers' class and the key of vLLM's model registry.
ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
MODEL_TYPE, TEXT_MODEL_TYPE = "diffusion_gemma", "diffusion_gemma_text"
#: Files :func:`export_hf` writes (``model.safetensors`` only for a checkpoint or model source, the tokenizer files
#: only with ``write_tokenizer``).
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json")
#: transformers' ``DiffusionGemmaGenerationConfig._get_default_generation_params()`` (the values
#: ``generate()`` falls back to), also :class:`blockdiff.sampler.SamplingParams`' defaults.
GENERATION_DEFAULTS = {"max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1,
                       "confidence_threshold": 0.005, "stability_threshold": 1}
SPECIAL_TOKENS = {ByteTokenizer.pad_token_id: "<pad>", ByteTokenizer.eos_token_id: "<eos>",
                  ByteTokenizer.bos_token_id: "<bos>"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------------- config
def hf_config_dict(config: DiffusionGemmaConfig, *, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The ``config.json`` of ``config`` (see the module docstring), ``dtype`` recorded as the weights' dtype.

    Raises:
        TypeError: ``config`` is not a :class:`DiffusionGemmaConfig`.
        ValueError: ``final_logit_softcapping`` is None (transformers' DiffusionGemma always applies the
            softcap, so the file could not describe the model), or ``dtype`` is not float32 / bfloat16 / float16.
    """
    if not isinstance(config, DiffusionGemmaConfig):
        raise TypeError(f"config must be a DiffusionGemmaConfig, got {type(config).__name__}")
    if config.final_logit_softcapping is None:
        raise ValueError("final_logit_softcapping=None cannot be exported: transformers' "
                         "DiffusionGemmaForBlockDiffusion always softcaps the logits")
    text = config.to_dict()
    canvas_length = text.pop("canvas_length")
    text.update(model_type=TEXT_MODEL_TYPE, dtype=_dtype_name(dtype))
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "canvas_length": canvas_length,
        "tie_word_embeddings": config.tie_word_embeddings,
        "dtype": _dtype_name(dtype),
        "text_config": text,
        "vision_config": None,
    }


def hf_generation_config_dict(config: DiffusionGemmaConfig, *, max_denoising_steps: int | None = None,
                              t_min: float | None = None, t_max: float | None = None,
                              entropy_bound: float | None = None, confidence_threshold: float | None = None,
                              stability_threshold: int | None = None, max_new_tokens: int | None = None) -> dict:
    """The ``generation_config.json`` (transformers' ``DiffusionGemmaGenerationConfig`` fields).

    Args:
        config: gives the special ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``).
        max_denoising_steps: step cap per canvas (int >= 1). t_min, t_max: temperatures of the last / first
            denoising step, ``0 <= t_min < t_max`` (transformers requires ``t_max > t_min``; greedy is a request
            option, not a default). entropy_bound: acceptance budget in nats (> 0). confidence_threshold:
            mean-entropy convergence threshold in nats (> 0). These are transformers' rules for the file, stricter
            than :class:`blockdiff.sampler.SamplingParams`' per-request ones (t_min == t_max, 0 bounds):
            docs/ARCHITECTURE.md section 7, "Exported sampling defaults". stability_threshold: int >= 0. None takes
            :data:`GENERATION_DEFAULTS`. max_new_tokens: default output cap (int >= 1) or None (not written;
            vLLM 0.26 drops it for DiffusionGemma anyway).

    Raises:
        TypeError: a value of the wrong type (named). ValueError: a value breaking its rule (named), or one
            blockdiff's loader refuses (:func:`blockdiff.model.generation.parse_generation_config`: e.g.
            ``max_denoising_steps`` >= 2**14, ``stability_threshold`` >= 2**31, a float beyond float32, a float32
            schedule with a temperature below 2**-126 or overflowing float32, which the sampler refuses).
    """
    p = dict(GENERATION_DEFAULTS)
    given = dict(max_denoising_steps=max_denoising_steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                 confidence_threshold=confidence_threshold, stability_threshold=stability_threshold)
    p.update({k: v for k, v in given.items() if v is not None})
    for name in ("max_denoising_steps", "stability_threshold"):
        if not _is_int(p[name]):
            raise TypeError(f"{name} must be an int, got {type(p[name]).__name__}")
    if p["max_denoising_steps"] < 1:
        raise ValueError(f"max_denoising_steps must be >= 1, got {p['max_denoising_steps']}")
    if p["stability_threshold"] < 0:
        raise ValueError(f"stability_threshold must be >= 0, got {p['stability_threshold']}")
    for name in ("t_min", "t_max", "entropy_bound", "confidence_threshold"):
        v = p[name]
        if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
        if not finite_real(v):
            raise ValueError(f"{name} must be finite, got {show_real(v)}")
        p[name] = float(v)  # transformers checks isinstance(..., float) on entropy_bound / confidence_threshold
    if p["t_min"] < 0:
        raise ValueError(f"t_min must be >= 0, got {p['t_min']}")
    if not p["t_max"] > p["t_min"]:
        raise ValueError(f"t_max must be > t_min (transformers' rule), got t_max={p['t_max']}, t_min={p['t_min']}")
    for name in ("entropy_bound", "confidence_threshold"):
        if not p[name] > 0:
            raise ValueError(f"{name} must be > 0 nats, got {p[name]}")
    out = {
        "max_denoising_steps": p["max_denoising_steps"],
        "t_min": p["t_min"],
        "t_max": p["t_max"],
        "sampler_config": {"entropy_bound": p["entropy_bound"], "_cls_name": "EntropyBoundSamplerConfig"},
        "confidence_threshold": p["confidence_threshold"],
        "stability_threshold": p["stability_threshold"],
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    if max_new_tokens is not None:
        if not _is_int(max_new_tokens):  # a TypeError as the other ints here (a str / float / bool was ValueError)
            raise TypeError(f"max_new_tokens must be an int >= 1 or None, got {type(max_new_tokens).__name__} "
                            f"({max_new_tokens!r})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1 or None, got {max_new_tokens!r}")
        out["max_new_tokens"] = max_new_tokens
    # what blockdiff's loader reads back (the sampler's ranges too: max_denoising_steps < 2**14, stability_threshold
    # < 2**31, floats finite in float32): never write a file blockdiff refuses to load
    parse_generation_config(out, config)
    return out


# ------------------------------------------------------------------------------------------------- tokenizer
def hf_tokenizer_json(vocab_size: int = ByteTokenizer.vocab_size) -> dict:
    """``tokenizer.json`` (Hugging Face ``tokenizers`` format) of :class:`ByteTokenizer`'s ids, padded with
    ``<unused_{id}>`` tokens (never produced by encoding) up to ``vocab_size``.

    Raises:
        ValueError: ``vocab_size`` < 259 (the byte tokenizer's ids do not fit).
    """
    if not _is_int(vocab_size) or vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(f"vocab_size must be an int >= {ByteTokenizer.vocab_size} (the byte tokenizer's ids), got "
                         f"{vocab_size!r}")
    vocab = {content: i for i, content in SPECIAL_TOKENS.items()}
    for b, ch in bytes_to_unicode().items():
        vocab[ch] = ByteTokenizer.byte_offset + b
    for i in range(ByteTokenizer.vocab_size, vocab_size):
        vocab[f"<unused_{i}>"] = i
    added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, c in sorted(SPECIAL_TOKENS.items())]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def hf_tokenizer_config_dict(model_max_length: int) -> dict:
    """``tokenizer_config.json`` for :func:`hf_tokenizer_json` (``AutoTokenizer`` resolves it offline)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL_TOKENS[ByteTokenizer.pad_token_id],
        "eos_token": SPECIAL_TOKENS[ByteTokenizer.eos_token_id],
        "bos_token": SPECIAL_TOKENS[ByteTokenizer.bos_token_id],
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
    }


# ---------------------------------------------------------------------------------------------------- export
def export_hf(source, out_dir, *, dtype: torch.dtype | str | None = None, overwrite: bool = False,
              write_tokenizer: bool = True, check_vllm: bool = True, **generation) -> dict[str, str]:
    """Write ``source`` as a Hugging Face DiffusionGemma folder (files in the module docstring).

    Args:
        source: a trained checkpoint folder (``model.safetensors``, ``config.json``, ``tokenizer.json`` as
            ``python3 -m blockdiff.model.train --out`` writes it; loaded and checked by
            :func:`blockdiff.model.pretrained.load_pretrained`), a :class:`DiffusionGemma`, or a
            :class:`DiffusionGemmaConfig` alone (no ``model.safetensors``: for ``vllm serve --load-format dummy``).
        out_dir: folder to write (created if missing). Must not be the source folder. The files are written in
            full into a hidden staging folder first, then moved in (a missing ``out_dir`` appears complete or not at
            all; an existing one gets its ``config.json`` last, so an interrupted export leaves no ``config.json``
            beside the files it replaced); a failed write leaves ``out_dir`` as it was, and a symlink named as an
            export file is replaced, never written through.
        dtype: dtype of the written weights (``torch.float32`` / ``bfloat16`` / ``float16`` or its name); default
            the source's parameter dtype (bf16 for the shipped checkpoint), bfloat16 for a config alone.
        overwrite: replace files of :data:`EXPORT_FILES` already in ``out_dir``, and remove those this export does
            not write (default: refuse if any is there). Other weight files (``model.safetensors.index.json``,
            another ``*.safetensors``) are refused either way: loaders read them beside or instead of
            ``model.safetensors``.
        write_tokenizer: write ``tokenizer.json`` / ``tokenizer_config.json`` (the byte tokenizer, padded to
            ``vocab_size``; needs ``vocab_size >= 259`` and the config's special ids equal to ByteTokenizer's).
        check_vllm: refuse what vLLM 0.26's DiffusionGemma would load into a different model: encoder and decoder
            ``layer_scalar`` that differ (vLLM keeps one per layer) or a ``hidden_activation`` other than
            ``gelu_pytorch_tanh`` (vLLM's self-conditioning MLP and MoE hard-code tanh GELU).
        **generation: ``max_denoising_steps``, ``t_min``, ``t_max``, ``entropy_bound``, ``confidence_threshold``,
            ``stability_threshold``, ``max_new_tokens`` of ``generation_config.json``
            (see :func:`hf_generation_config_dict`).

    Returns:
        file name -> path of every file written.

    Raises:
        TypeError: ``source`` of another type, ``out_dir`` not a str / os.PathLike, an unknown ``generation`` keyword,
            a value of the wrong type.
        FileNotFoundError: a source folder that is missing or lacks a checkpoint file (from ``load_pretrained``).
        FileExistsError: ``out_dir`` already holds an export file (a dangling symlink of that name included) and
            ``overwrite`` is False (all are named), ``out_dir`` is a file or a dangling symlink, or it holds other
            weight files (named; ``overwrite`` or not).
        IsADirectoryError: ``out_dir`` holds a folder named as an export file (nothing is written).
        ValueError: ``out_dir`` is empty or the source folder; a DiffusionGemma with any tensor on the meta device (no
            weights); without ``dtype``, a source whose weights mix dtypes or are in one an export does not write
            (float64); a source the files cannot describe (see
            ``check_vllm``, :func:`hf_config_dict`, :func:`hf_tokenizer_json`); a bad generation value; weights that
            do not match the source's config (from the loader); a ``dtype`` that cannot hold the weights (a finite
            weight that would overflow to inf, e.g. above 65504 in float16; checked before anything is written).
    """
    unknown = sorted(set(generation) - {*GENERATION_DEFAULTS, "max_new_tokens"})
    if unknown:
        raise TypeError(f"export_hf() got unknown generation keywords {unknown}; known: "
                        f"{sorted({*GENERATION_DEFAULTS, 'max_new_tokens'})}")
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir must be a str or os.PathLike (the folder to write), got {type(out_dir).__name__}")
    out_dir = os.fspath(out_dir)
    model = None
    if isinstance(source, (str, os.PathLike)):
        src_dir = os.fspath(source)
        if os.path.isdir(src_dir) and os.path.realpath(src_dir) == os.path.realpath(out_dir):
            raise ValueError(f"out_dir {out_dir!r} is the source checkpoint folder: export to another folder")
        model, _ = load_pretrained(src_dir)  # checks files, tokenizer, weights against config.json
        config = model.config
    elif isinstance(source, DiffusionGemma):
        model, config = source, source.config
        meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if meta:  # shapes only: torch's "Cannot copy out of meta tensor" at save
            raise ValueError(f"source is a DiffusionGemma with {len(meta)} tensors on the meta device (no weights to "
                             f"write; first: {meta[0]}): load or initialise its weights, or pass its "
                             "DiffusionGemmaConfig to export the config alone")
    elif isinstance(source, DiffusionGemmaConfig):
        config = source
    else:
        raise TypeError(f"source must be a checkpoint folder, a DiffusionGemma or a DiffusionGemmaConfig, got "
                        f"{type(source).__name__}")
    if dtype is None and model is not None:
        found = {}  # the weights' dtypes, each with its first parameter's name
        for n, t in model.named_parameters():
            found.setdefault(t.dtype, n)
        if len(found) > 1:
            raise ValueError(f"dtype: the source's weights mix {', '.join(f'{d} ({n})' for d, n in found.items())}; "
                             f"pass dtype= one of {list(_DTYPES)} to write them in one")
        if model.embed_tokens.weight.dtype not in _DTYPES.values():
            raise ValueError(f"dtype: the source's weights are {model.embed_tokens.weight.dtype}, which an export "
                             f"does not write; pass dtype= one of {list(_DTYPES)}")
    if dtype is None:
        dtype = model.embed_tokens.weight.dtype if model is not None else torch.bfloat16
    dtype = _resolve_dtype(dtype)

    if check_vllm:
        _check_vllm(config, model)
    files = {"config.json": hf_config_dict(config, dtype=dtype),
             "generation_config.json": hf_generation_config_dict(config, **generation)}
    if write_tokenizer:
        special = {"pad_token_id": config.pad_token_id, "eos_token_id": config.eos_token_id,
                   "bos_token_id": config.bos_token_id}
        want = {k: getattr(ByteTokenizer, k) for k in special}
        if special != want:
            raise ValueError(f"the byte tokenizer's special ids are {want}, the config's {special}; pass "
                             "write_tokenizer=False to export without a tokenizer")
        files["tokenizer.json"] = hf_tokenizer_json(config.vocab_size)
        files["tokenizer_config.json"] = hf_tokenizer_config_dict(config.max_position_embeddings)

    if not out_dir:
        raise ValueError("out_dir must not be empty (the folder to write)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"out_dir {out_dir!r} is a file, not a folder")
    if os.path.islink(out_dir) and not os.path.exists(out_dir):
        raise FileExistsError(f"out_dir {out_dir!r} is a symlink to {os.readlink(out_dir)!r}, which does not exist: "
                              "create that folder or export to another path")
    # lexists: a dangling symlink counts (it was followed, writing the file wherever it pointed)
    present = [n for n in EXPORT_FILES if os.path.lexists(os.path.join(out_dir, n))]
    if present and not overwrite:
        raise FileExistsError(f"out_dir {out_dir!r} already holds {', '.join(present)} (pass overwrite=True to "
                              "replace them)")
    folders = [n for n in present if os.path.isdir(os.path.join(out_dir, n))
               and not os.path.islink(os.path.join(out_dir, n))]
    if folders:
        raise IsADirectoryError(f"out_dir {out_dir!r} holds folders named {', '.join(folders)}, which an export "
                                "cannot replace with its files: remove them or export to another folder")
    other = _other_weights(out_dir)
    if other:  # read beside or in place of model.safetensors: the folder would load weights this export did not write
        raise FileExistsError(f"out_dir {out_dir!r} holds other weight files ({', '.join(other)}), which loaders "
                              f"read beside or instead of {WEIGHTS_FILE} (blockdiff and vLLM follow an "
                              f"{INDEX_FILE} first); an export does not remove them, even with overwrite: remove them "
                              "or export to another folder")
    tensors = None
    if model is not None:  # converted before anything is written: a dtype that cannot hold the weights is refused
        tensors = hf_state_dict(model, dtype)
        _check_representable(model, tensors, dtype)
    return _write_folder(out_dir, tensors, files, present)


# ---------------------------------------------------------------------------------------------------- helpers
def _other_weights(out_dir: str) -> list[str]:
    """Weight files in ``out_dir`` other than ``model.safetensors``: an ``model.safetensors.index.json`` (which
    blockdiff's loader, transformers and vLLM follow to its shards) and any other ``*.safetensors`` (vLLM reads every
    one in the folder when there is no index)."""
    if not os.path.isdir(out_dir):
        return []
    return sorted(n for n in os.listdir(out_dir)
                  if n == INDEX_FILE or (n.endswith(".safetensors") and n != WEIGHTS_FILE))


def _write_folder(out_dir: str, tensors: dict[str, torch.Tensor] | None, files: dict[str, dict],
                  present: list[str]) -> dict[str, str]:
    """Write the export's files into ``out_dir`` so that no failure leaves a folder that loads as a wrong model.

    Every file is first written in full into a hidden staging folder on the same file system (a write that fails,
    e.g. a full disk, removes it and leaves ``out_dir`` as it was). A missing ``out_dir`` is then the staging folder
    renamed (it appears complete or not at all); an existing one gets each file by ``os.replace`` (a symlink of that
    name is replaced, never written through), its earlier ``config.json`` removed first and the new one placed last,
    so a folder interrupted between two renames has no ``config.json`` (every loader needs it), never an earlier
    export's files beside this one's."""
    fresh = not os.path.isdir(out_dir)
    # a missing OUT: staged in its parent as written (the kernel resolves it as it resolves OUT: 'a/b/../c' stages
    # in 'a/b/..', creating 'a/b' as os.makedirs(OUT) did; a lexical os.path.abspath parent 'a' left the rename to
    # 'a/b/../c' without its 'a/b', a FileNotFoundError naming the staging folder)
    where = (os.path.dirname(out_dir.rstrip(os.sep)) or os.curdir) if fresh else out_dir
    os.makedirs(where, exist_ok=True)
    stage = os.path.join(where, f".blockdiff-export-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(stage)  # (the mode os.makedirs gives a folder: the umask's)
    names = []
    try:
        if tensors is not None:
            save_file(tensors, os.path.join(stage, WEIGHTS_FILE),
                      metadata={"format": "pt", "source": "blockdiff.model.export"})
            names.append(WEIGHTS_FILE)
        for name, content in files.items():
            with open(os.path.join(stage, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2, ensure_ascii=False)
                f.write("\n")
            names.append(name)
        if WEIGHTS_FILE in names:  # safetensors writes 0600; give it the JSON files' (umask) mode
            os.chmod(os.path.join(stage, WEIGHTS_FILE), os.stat(os.path.join(stage, "config.json")).st_mode & 0o777)
        if fresh:
            os.rename(stage, out_dir)
        else:
            config = os.path.join(out_dir, "config.json")
            if os.path.lexists(config):
                os.remove(config)
            for name in names:
                if name != "config.json":  # (placed last, below)
                    os.replace(os.path.join(stage, name), os.path.join(out_dir, name))
            for name in present:  # overwrite: an earlier export's file this one does not write must not pair with it
                if name not in names and os.path.lexists(os.path.join(out_dir, name)):
                    os.remove(os.path.join(out_dir, name))
            os.replace(os.path.join(stage, "config.json"), config)
            os.rmdir(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return {name: os.path.join(out_dir, name) for name in names}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _dtype_name(dtype) -> str:
    dtype = _resolve_dtype(dtype)
    return next(k for k, v in _DTYPES.items() if v == dtype)


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {list(_DTYPES)} (or the torch dtype), got {dtype!r}")


def _check_representable(model: DiffusionGemma, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Raise unless every finite weight of ``model`` stays finite in ``tensors`` (its ``hf_state_dict`` in
    ``dtype``): e.g. a weight above 65504 would be written as inf in float16."""
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            continue
        conv = tensors[hf_name(name)]
        lost = torch.isfinite(t.detach().cpu()) & ~torch.isfinite(conv)
        if bool(lost.any()):
            v = float(t.detach().cpu()[lost].flatten()[0])
            raise ValueError(f"dtype {_dtype_name(dtype)} cannot hold the weights: {hf_name(name)} has "
                             f"{int(lost.sum())} finite value(s) that overflow it (e.g. {v:.4g}); export in a wider "
                             "dtype (float32 or bfloat16)")


def _check_vllm(config: DiffusionGemmaConfig, model: DiffusionGemma | None) -> None:
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {config.hidden_activation!r}: vLLM 0.26's DiffusionGemma hard-codes "
                         "tanh GELU (gelu_pytorch_tanh) in its self-conditioning MLP and MoE; pass check_vllm=False "
                         "for a transformers-only export")
    if model is None:
        return
    differ = [i for i, layer in enumerate(model.layers)
              if not torch.equal(layer.layer_scalar.detach().cpu(), layer.encoder_layer_scalar.detach().cpu())]
    if differ:
        raise ValueError(f"layers {differ} have encoder and decoder layer_scalar that differ: vLLM 0.26's "
                         "DiffusionGemma keeps one layer_scalar per layer for both modes; pass check_vllm=False for "
                         "a transformers-only export")
