"""The llama.cpp peer of ``bench offline --peer llama.cpp``, and greedy decoding through it for ``bench agree``.

llama-cpp-python's ``Llama`` runs one sequence at a time, so the peer is always batch 1: the first prompt
of the batch ours ran, whatever its ``--batch-size`` (the report says so). It loads the GGUF file ours
loaded, on the host, with the same number of threads for the prompt and for decoding, and computes on
the file's own quantized blocks (``weights`` in the result, in llama.cpp's words), where
ours holds what its backend made of the file (the report's ``quantization``). It gets our token ids as they
are (the GGUF's vocabulary is ours) and decodes greedily, the argmax of the last logits, exactly
``output_len`` tokens whatever EOS. Timing, per run: the prefill is the eval of the prompt and the
first token's argmax; the decode is the other O - 1 tokens, each an eval of one token and an argmax,
and its rate (O - 1) tokens over that time. One warm-up run of 4 tokens, then the median of ``runs``.
A build with AMX loads the weights into plain CPU buffers, not AMX ones (``AMX_OFF`` says why, and so
does ``weights``).

llama-cpp-python is a bench extra (``pip install 'chitu-core[bench-llamacpp]'``), never a dependency of
the core: without it there is no peer, and ``missing()`` says how to install it.
"""

import ctypes
import statistics
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

NAME = "llama.cpp"
INSTALL_HINT = ("llama-cpp-python is not installed: pip install 'chitu-core[bench-llamacpp]' "
                "(it builds llama.cpp from source, about 14 minutes)")
GGUF_MAGIC = b"GGUF"


def missing() -> str | None:
    """Why the peer cannot run here (the install hint, or the import's error), or None: it can."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # ImportError; OSError where the build cannot load its shared library
        if isinstance(exc, ImportError) and exc.name == "llama_cpp":
            return INSTALL_HINT
        # Installed, but a dependency of its own is missing (diskcache after `pip install --no-deps`), say.
        return f"llama-cpp-python failed to import: {type(exc).__name__}: {exc}"
    return None


def is_gguf(path: str | Path) -> bool:
    """Whether llama.cpp can be given ``path``: a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:  # a directory, or nothing there
        return False


def not_gguf_reason(model: str) -> str:
    return f"llama.cpp runs GGUF files, and {model} is not one: pass --model FILE.gguf (or no --model: the embedded default)"


def amx_built_in() -> bool:
    """Whether this llama.cpp build has its AMX matmul (built with GGML_NATIVE on an AMX host, say)."""
    import llama_cpp

    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


AMX_OFF = ("AMX and repacked weight buffers off: llama.cpp's AMX matmul segfaults on some AMX hosts "
           "(ggml-org/llama.cpp#20824)")


@contextmanager
def _no_extra_buffer_types():
    """Models loaded inside get ``use_extra_bufts = False`` (llama-server's --no-repack): weights stay in
    plain CPU buffers, never in AMX or repacked ones. ``Llama`` has no argument for it and builds its
    model parameters from ``llama_model_default_params`` of the ctypes bindings, so that is wrapped."""
    from llama_cpp import llama_cpp as bindings

    defaults = bindings.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    bindings.llama_model_default_params = params
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


def load(gguf_path: str | Path, n_ctx: int, threads: int, float32_kv: bool = False):
    """A ``llama_cpp.Llama`` on ``gguf_path`` with room for ``n_ctx`` tokens, ``threads`` threads for both
    the prompt and the decode, and logits kept for the last token of each eval only. Where the build has
    AMX, without extra buffer types (``AMX_OFF`` says why). ``float32_kv``: its KV cache in float32
    instead of its default float16 (one rounding of llama.cpp's own changed, for ``bench agree``'s control)."""
    import llama_cpp

    kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if float32_kv else {}
    with _no_extra_buffer_types() if amx_built_in() else nullcontext():
        return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                               n_batch=512, verbose=False, **kv)


def weights(llm) -> str:
    """What llama.cpp computes on: its own words for what it loaded (e.g. "llama 256M Q4_1"), and where
    the AMX buffers are off, that."""
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm.model, buf, len(buf))
    return f"the GGUF file's own blocks ({buf.value.decode('utf-8', 'replace')})" + (
        f"; {AMX_OFF}" if amx_built_in() else "")


def last_logits(llm) -> np.ndarray:
    """The logits after the last eval'd token: a float32 view of llama.cpp's buffer, valid until the next eval."""
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def top2_gap(logits: np.ndarray) -> float:
    """The largest logit less the second largest: how far greedy decoding was from a tie."""
    second, first = np.partition(logits, -2)[-2:]
    return float(first - second)


def greedy(llm, prompt: list[int], n: int, gaps: list[float] | None = None) -> tuple[list[int], float, float]:
    """Exactly ``n`` greedy tokens after ``prompt`` (EOS ignored), from an empty context. Returns the tokens,
    the prefill seconds (the prompt's eval and the first token) and the decode seconds (the rest). With
    ``gaps``, each step's ``top2_gap`` is appended to it."""
    llm.reset()  # the next eval drops the cache from position 0

    def next_token() -> int:
        logits = last_logits(llm)
        if gaps is not None:
            gaps.append(top2_gap(logits))
        return int(logits.argmax())

    start = time.perf_counter()
    llm.eval(prompt)
    tokens = [next_token()]
    first = time.perf_counter()
    for _ in range(n - 1):
        llm.eval(tokens[-1:])
        tokens.append(next_token())
    return tokens, first - start, time.perf_counter() - first


def run_llamacpp(gguf_path: str | Path, prompts: list[list[int]], output_len: int, threads: int,
                 runs: int) -> dict[str, Any]:
    """llama.cpp at batch 1 on ``prompts[0]``: the keys ``offline.render`` reads from a peer (name, mode,
    output_tok_per_s, prefill_s, decode_tok_per_s), and the threads and llama-cpp-python version."""
    import llama_cpp

    prompt = prompts[0]
    llm = load(gguf_path, len(prompt) + output_len + 8, threads)
    try:
        greedy(llm, prompt, min(output_len, 4))  # warm-up: the weights paged in, the threads started
        timed = [greedy(llm, prompt, output_len)[1:] for _ in range(runs)]
        held = weights(llm)
    finally:
        llm.close()
    prefill_s = statistics.median(p for p, _ in timed)
    decode_s = statistics.median(d for _, d in timed)
    total_s = statistics.median(p + d for p, d in timed)
    return {
        "name": NAME,
        "mode": f"llama.cpp batch 1, {threads} thread{'s' if threads != 1 else ''}",
        "weights": held,
        "threads": threads,
        "llama_cpp_version": llama_cpp.__version__,
        "batch_size": 1,
        "total_s": round(total_s, 6),
        "output_tok_per_s": round(output_len / total_s, 3),
        "prefill_s": round(prefill_s, 6),
        "prefill_tok_per_s": round(len(prompt) / prefill_s, 3),
        "decode_s": round(decode_s, 6),
        "decode_tok_per_s": round((output_len - 1) / decode_s, 3) if output_len > 1 and decode_s > 0 else None,
        "runs_decode_tok_per_s": [round((output_len - 1) / d, 3) if output_len > 1 and d > 0 else None for _, d in timed],
    }
