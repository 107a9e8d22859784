"""llama.cpp through llama-cpp-python (an optional extra): the peer a CPU user would
otherwise run, decoding the very GGUF file our target is converted from.

Install with ``make llamacpp`` (``pip install -e '.[llamacpp]'``; llama.cpp is compiled from
source for this CPU once, 10-20 minutes on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

from . import registry

INSTALL = ("make llamacpp  (runs pip install -e '.[llamacpp]': llama-cpp-python==0.3.36, "
           "compiled from source once, 10-20 minutes)")
N_CTX = 8192  # tokens of llama.cpp's KV cache: prompt + new tokens of every bench prompt


class MissingExtraError(RuntimeError):
    """An optional dependency is not installed; the message says the one command to run."""


def llama_cpp():
    """The ``llama_cpp`` module. Raises MissingExtraError naming the install command."""
    try:
        import llama_cpp
    except ImportError as e:
        raise MissingExtraError(f"llama.cpp needs the llama-cpp-python extra, which is not "
                                f"installed ({e}); install it with: {INSTALL}") from None
    return llama_cpp


def gguf_file(name_or_path: str | Path) -> Path:
    """The GGUF file of a known model name (fetched on first use) or a ``.gguf`` path.

    Raises ValueError for anything else (llama.cpp reads GGUF files only), ModelFetchError
    when a known model cannot be fetched."""
    s = str(name_or_path)
    if s in registry.KNOWN_MODELS:
        registry.fetch(s)
        return registry.gguf_path(s)
    p = Path(s).expanduser()
    if p.suffix.lower() == ".gguf" and p.is_file():
        return p
    raise ValueError(f"llama.cpp runs GGUF files: {s!r} is neither a known model "
                     f"({', '.join(registry.KNOWN_MODELS)}) nor a .gguf file")


def load(name_or_path: str | Path, threads: int, prompt_lookup: int = 0):
    """A ``llama_cpp.Llama`` of the model's GGUF file with ``threads`` threads (decode and
    batch), an N_CTX-token context, no output on stderr. ``prompt_lookup`` > 0 attaches its
    prompt-lookup decoding (``LlamaPromptLookupDecoding``, that many draft tokens), which
    needs the logits of every row. Raises MissingExtraError, ValueError (see gguf_file)."""
    lc = llama_cpp()
    path = gguf_file(name_or_path)
    kwargs = {}
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup),
                  "logits_all": True}
    return lc.Llama(model_path=str(path), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                    verbose=False, **kwargs)


def generate_greedy(llm, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_ids: tuple[int, ...]) -> list[int]:
    """Greedy decoding (temperature 0: llama.cpp's greedy sampler) of up to
    ``max_new_tokens`` tokens after ``prompt_ids``, stopping after an EOS id (kept, as our
    engine keeps it). The KV cache starts empty (no prefix reuse across calls)."""
    llm.reset()
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    for tok in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                            repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok in eos_token_ids or len(out) >= max_new_tokens:
            break
    return out
