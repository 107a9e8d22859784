"""Fill-in-the-middle (FIM): the target's FIM tokens, and the prompt of a FIM request.

A FIM request gives the text before a gap (prefix) and after it (suffix); the model writes
the middle. Its prompt is laid out as llama.cpp's server lays out ``/infill``'s (the layout
the editor plugins llama.vscode and llama.vim are tuned to): optional repository-level
context first (``<|repo_name|>`` and ``<|file_sep|>`` chunks, Qwen2.5-Coder's format), then
``<FIM_PRE>prefix prompt <FIM_SUF>suffix <FIM_MID>`` (or suffix first, ``spm``). The prefix
and suffix are also part of the prompt the lookup proposers search, so identifiers and
closing code there are proposed for free. Speculation changes nothing else: the middle is
the target's own decoding of that prompt.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from .models import gguf_file
from .models.loading import LoadedModel

# llama.cpp's token texts of each FIM role (llama-vocab.cpp), for files without the GGUF keys
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<file_sep>", "<fim-sep>"),
    # end of text: llama.cpp ends any generation there (its end-of-generation tokens); a
    # chat model's GGUF names only its end of turn as EOS, yet ends a middle with this
    "eot": ("<|endoftext|>", "<EOT>", "▁<EOT>", "<|eot_id|>", "<｜end▁of▁sentence｜>"),
}
# the GGUF key of each role, where it is not tokenizer.ggml.fim_<role>_token_id
GGUF_KEYS = {"eot": "tokenizer.ggml.eot_token_id"}
# how much of the prefix and suffix a prompt keeps (llama.cpp's server: 3/4 and 1/4 of its
# batch of 2,048 tokens)
BATCH = 2048


class FIMError(ValueError):
    """A fill-in-the-middle request this target cannot serve (no FIM tokens), or bad FIM
    input; the message says which and what to do."""


@dataclass(frozen=True)
class FIMTokens:
    """A tokenizer's FIM token ids: ``pre``, ``suf``, ``mid`` always; ``pad`` (ends a
    middle), ``rep`` (starts the repository name), ``sep`` (starts a file) and ``eot`` (end
    of text) where it has them."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None
    eot: int | None = None

    @property
    def stops(self) -> tuple[int, ...]:
        """Tokens after which a middle is done (llama.cpp counts them as end of generation):
        the model closing the gap, ending the text, or starting another file."""
        return tuple(t for t in (self.pad, self.rep, self.sep, self.eot) if t is not None)


_found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fim_tokens(target: LoadedModel) -> FIMTokens | None:
    """The target's FIM tokens: from its GGUF file's metadata where it has them
    (``tokenizer.ggml.fim_pre_token_id`` ...), else found by their text in its vocabulary as
    llama.cpp finds them (:data:`FIM_TEXTS`); None when it lacks any of the three a prompt
    needs. Found once per loaded model."""
    if target in _found:
        return _found[target]
    ids: dict[str, int | None] = dict.fromkeys(FIM_TEXTS)
    source = gguf_file.source_of(target.path) if target.path is not None else None
    if source is not None and source.is_file():
        f = gguf_file.of_directory(target.path)
        for role in ids:
            value = f.field(GGUF_KEYS.get(role, f"tokenizer.ggml.fim_{role}_token_id"))
            ids[role] = int(value) if isinstance(value, int) else None
    tok = target.tokenizer
    vocab = tok.get_vocab() if tok is not None else {}
    for role, texts in FIM_TEXTS.items():
        if ids[role] is None:
            ids[role] = next((vocab[t] for t in texts if t in vocab), None)
    found = FIMTokens(**ids) if None not in (ids["pre"], ids["suf"], ids["mid"]) else None
    _found[target] = found
    return found


def require_fim(target: LoadedModel) -> FIMTokens:
    """:func:`fim_tokens`, or FIMError naming the model and what to use instead."""
    found = fim_tokens(target)
    if found is None:
        raise FIMError(f"model {target.name!r} has no fill-in-the-middle tokens (none of "
                       f"{', '.join(FIM_TEXTS['pre'][:3])}... in its vocabulary or its GGUF "
                       "metadata): use a code model trained for FIM (Qwen2.5-Coder, "
                       "StarCoder2, CodeLlama, DeepSeek-Coder), or send the prefix alone")
    return found


def infill_ids(target: LoadedModel, prefix: str, suffix: str, *, prompt: str = "",
               extra: list[dict] | tuple = (), n_ctx: int | None = None, n_predict: int = 0,
               spm: bool = False, repo: bool = False) -> list[int]:
    """The token ids of a FIM request's prompt, as llama.cpp's server builds ``/infill``'s.

    Args:
        target: the model (its tokenizer and :func:`fim_tokens`).
        prefix, suffix: the text before and after the gap.
        prompt: text that continues the prefix (llama.cpp's ``prompt``: the part of the
            current line the cursor is in).
        extra: repository-level context, chunks ``{"filename": str, "text": str}`` put
            before the prefix, newest last: as many of the last ones as fit
            ``n_ctx - 2048 - 2 * n_predict`` tokens.
        repo: lay out the repository context even without ``extra`` (llama.cpp's /infill:
            ``<|repo_name|>myproject``, the chunks, ``<|file_sep|>filename``); else only
            with ``extra`` (a single file's FIM, as OpenAI's ``suffix``).
        n_ctx: the context the request runs in (default: the model's).
        n_predict: tokens the middle may take.
        spm: suffix first (``--spm-infill``), for models trained that way.
    Returns:
        token ids: [context] [BOS if the tokenizer adds one] PRE prefix[-1536:] prompt SUF
        suffix[:510 - len(prompt)] MID (PSM order).
    Raises:
        FIMError: the model has no FIM tokens, or ``extra`` is not a list of such chunks.
    """
    fim = require_fim(target)
    tok = target.tokenizer

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    if not isinstance(extra, (list, tuple)) or not all(
            isinstance(c, dict) and isinstance(c.get("text", ""), str)
            and isinstance(c.get("filename", ""), str) for c in extra):
        raise FIMError("input_extra must be a list of {\"filename\": str, \"text\": str} chunks")
    context: list[int] = []
    if repo or extra:
        if fim.rep is not None:  # llama.cpp names the repository "myproject"
            context += [fim.rep] + enc("myproject\n")
        for chunk in extra:
            if fim.sep is not None:
                context += [fim.sep] + enc(chunk.get("filename", "tmp") + "\n")
            else:
                context += enc("\n\n--- snippet ---\n\n")
            context += enc(chunk.get("text", ""))
        if fim.sep is not None:
            context += [fim.sep] + enc("filename\n")
    pre, suf, cont = enc(prefix), enc(suffix), enc(prompt)
    pre = pre[len(pre) - min(len(pre), 3 * (BATCH // 4)):]
    suf = suf[:max(0, BATCH // 4 - (2 + len(cont)))]
    n_ctx = n_ctx or target.lm.max_context
    take = min(max(0, n_ctx - BATCH - 2 * n_predict), len(context))
    head = [fim.pre] + pre + cont
    tail = [fim.suf] + suf
    first, second = (tail, head) if spm else (head, tail)
    bos = getattr(tok, "bos_token_id", None)
    if bos is not None and getattr(tok, "add_bos_token", False):
        first = [bos] + first
    return context[len(context) - take:] + first + second + [fim.mid]
