"""The process llama.cpp runs in (``python -m tasks.models.llama_cpp_worker``), started by ``tasks.models.llama_cpp``.

llama.cpp is native code: a bad quant type's kernel or a damaged file can kill the process it runs in (a
segmentation fault or an abort is not a Python exception). Run here, it kills this process alone, and the audit
fails that variant with one line and scores the others. The process dies with its parent (``PR_SET_PDEATHSIG``):
however the audit stops, nothing of llama.cpp is left running.

Requests and replies are frames on stdin/stdout: a JSON header and a binary payload, typed messages both sides read
(``tasks.models.llama_cpp_said``). ``open`` loads a file (its vocabulary only, or the model with a context);
``tokenize`` gives llama.cpp's token ids of a text and each token's bytes; ``score`` evaluates windows, each a fresh
sequence (the context's memory cleared), and gives back the logits of the positions asked for, as float32.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
from dataclasses import replace

import numpy as np

from tasks.models.llama_cpp_said import (Close, Detokenize, Done, Failed, Loaded, Open, Opened, Ran, Score, Tokenize,
                                       Tokenized, receive, request_of, send)


def _die_with_parent() -> None:
    """Ask Linux to send SIGKILL to this process when its parent ends (a parent killed by SIGKILL included)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the parent's own clean-up still ends it
        pass


# what llama.cpp's context says when it makes its flash-attention choice: with flash_attn auto, its probe of the
# fused op ("resolve_fused_ops: Flash Attention enabled", or "... not supported, set to disabled"); else the setting
# it took, once it has forced it where a model or a quantized V cache needs ("llama_context: flash_attn = enabled").
# llama.h has no getter of the mode chosen (cparams.flash_attn): its log is the only place it is said.
FLASH_PROBE = re.compile(r"Flash Attention (enabled|not supported, set to disabled)")
FLASH_SETTING = re.compile(r"flash_attn\s+=\s+(enabled|disabled|auto)")


def flash_attention_ran(said: str) -> str | None:
    """``on`` or ``off``: the flash attention a context ran with, from what llama.cpp logged while making it; None
    where it said neither."""
    probe = FLASH_PROBE.search(said)
    if probe:
        return "on" if probe.group(1) == "enabled" else "off"
    setting = FLASH_SETTING.search(said)
    return {"enabled": "on", "disabled": "off"}.get(setting.group(1)) if setting else None


class Worker:
    def __init__(self):
        import llama_cpp

        self.ll = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = self.ctx = self.vocab = None
        self.n_vocab = 0
        self.said: list[str] | None = None  # what llama.cpp logs, kept while a context is made
        self._log = llama_cpp.llama_log_callback(self._logged)  # held: ctypes frees a callback nothing holds
        llama_cpp.llama_log_set(self._log, ctypes.c_void_p(0))

    def _logged(self, level: int, text: bytes, user_data) -> None:
        """llama.cpp's log line, to stderr (this worker's log, whose last line names a crash) as the binding's own
        logger sends it, and kept while ``said`` is a list."""
        line = text.decode("utf-8", "replace")
        sys.stderr.write(line)
        sys.stderr.flush()
        if self.said is not None:
            self.said.append(line)

    def open(self, request: Open) -> tuple[Opened, bytes]:
        ll = self.ll
        params = ll.llama_model_default_params()
        params.n_gpu_layers = request.gpu_layers
        params.vocab_only = request.vocab_only
        self.model = ll.llama_model_load_from_file(request.path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {request.path}")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        opened = Opened(n_vocab=self.n_vocab, add_bos=bool(ll.llama_vocab_get_add_bos(self.vocab)),
                        bos=int(ll.llama_vocab_bos(self.vocab)), system_info=ll.llama_print_system_info().decode())
        if params.vocab_only:
            return opened, b""
        ctx = ll.llama_context_default_params()
        ctx.n_ctx = request.n_ctx
        ctx.n_batch = ctx.n_ubatch = request.n_batch
        ctx.n_seq_max = 1
        # llama.cpp's context default is 4 threads whatever the machine: on 2 cores that oversubscribes them;
        # llama-perplexity's default is the cores this process may use, as here
        ctx.n_threads = ctx.n_threads_batch = request.threads or len(os.sched_getaffinity(0))
        ctx.type_k = getattr(ll, f"GGML_TYPE_{request.type_k.upper()}")
        ctx.type_v = getattr(ll, f"GGML_TYPE_{request.type_v.upper()}")
        ctx.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[request.flash_attn]
        self.said = []
        try:
            self.ctx = ll.llama_init_from_model(self.model, ctx)
        finally:
            said, self.said = "".join(self.said), None
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context with these settings (n_ctx "
                               f"{request.n_ctx}, type_k {request.type_k}, type_v {request.type_v}, "
                               f"flash_attn {request.flash_attn})")
        buffer = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.model, buffer, 256)
        # what ran, as the context took it (llama.h: "the requested values ... may differ")
        ran = Ran(flash_attn=flash_attention_ran(said), n_ctx=int(ll.llama_n_ctx(self.ctx)),
                  n_batch=int(ll.llama_n_batch(self.ctx)), n_ubatch=int(ll.llama_n_ubatch(self.ctx)),
                  threads=int(ll.llama_n_threads(self.ctx)), threads_batch=int(ll.llama_n_threads_batch(self.ctx)),
                  gpu_layers=params.n_gpu_layers if ll.llama_supports_gpu_offload() else 0)
        loaded = Loaded(desc=buffer.value.decode(), size=int(ll.llama_model_size(self.model)), ran=ran)
        return replace(opened, loaded=loaded), b""

    def tokenize(self, request: Tokenize, payload: bytes) -> tuple[Tokenized, bytes]:
        ll = self.ll
        n = len(payload) + 8
        tokens = (ll.llama_token * n)()
        count = ll.llama_tokenize(self.vocab, payload, len(payload), tokens, n, request.add_special, False)
        if count < 0:
            raise RuntimeError(f"llama.cpp's tokenizer gave {-count} tokens for {len(payload)} bytes")
        ids = np.ctypeslib.as_array(tokens)[:count].astype(np.int32)
        buffer = ctypes.create_string_buffer(256)
        lengths = np.empty(count, dtype=np.int32)
        for i, token in enumerate(ids.tolist()):
            written = ll.llama_token_to_piece(self.vocab, token, buffer, 256, 0, False)
            lengths[i] = max(written, 0)
        return Tokenized(count=count), ids.tobytes() + lengths.tobytes()

    def detokenize(self, request: Detokenize, payload: bytes) -> tuple[Done, bytes]:
        """The bytes of the tokens ``payload`` (int32 ids), each token's piece in turn, as the text they stand for."""
        buffer = ctypes.create_string_buffer(256)
        pieces = []
        for token in np.frombuffer(payload, dtype=np.int32).tolist():
            written = self.ll.llama_token_to_piece(self.vocab, token, buffer, 256, 0, False)
            pieces.append(buffer.raw[: max(written, 0)])
        return Done(), b"".join(pieces)

    def score(self, request: Score, payload: bytes) -> tuple[Done, bytes]:
        ll = self.ll
        tokens = np.frombuffer(payload, dtype=np.int32)
        n_batch = request.n_batch
        out, at = [], 0
        batch = ll.llama_batch_init(n_batch, 0, 1)
        try:
            for length, first, count in request.rows:
                row = tokens[at : at + length]
                at += length
                wanted = set(range(first, first + count))
                ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
                logits = []
                for start in range(0, length, n_batch):
                    stop = min(start + n_batch, length)
                    batch.n_tokens = stop - start
                    outputs = 0
                    for i, pos in enumerate(range(start, stop)):
                        batch.token[i] = int(row[pos])
                        batch.pos[i] = pos
                        batch.n_seq_id[i] = 1
                        batch.seq_id[i][0] = 0
                        batch.logits[i] = pos in wanted
                        outputs += pos in wanted
                    code = ll.llama_decode(self.ctx, batch)
                    if code != 0:
                        raise RuntimeError(f"llama_decode returned {code}")
                    if outputs:
                        pointer = ll.llama_get_logits(self.ctx)
                        logits.append(np.ctypeslib.as_array(pointer, shape=(outputs, self.n_vocab)).copy())
                out.append(np.concatenate(logits) if logits else np.empty((0, self.n_vocab), np.float32))
        finally:
            ll.llama_batch_free(batch)
        return Done(), np.concatenate(out).astype(np.float32).tobytes()

    def answer(self, request: Open | Tokenize | Detokenize | Score,
               payload: bytes) -> tuple[Opened | Tokenized | Done, bytes]:
        """The reply to ``request`` and its payload."""
        if isinstance(request, Open):
            return self.open(request)
        if isinstance(request, Tokenize):
            return self.tokenize(request, payload)
        if isinstance(request, Detokenize):
            return self.detokenize(request, payload)
        return self.score(request, payload)


def main() -> int:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent decides what a Ctrl-C means; this process just ends
    source = sys.stdin.buffer
    # replies go to a copy of stdout; whatever Python or llama.cpp itself prints on fd 1 goes to the log (stderr),
    # never into the replies
    sink = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    worker = Worker()
    while True:
        try:
            header, payload = receive(source)
        except EOFError:
            return 0
        try:
            request = request_of(header)
            if isinstance(request, Close):
                return 0
            reply, data = worker.answer(request, payload)
            send(sink, reply, data)
        except Exception as error:  # a Python-level failure is answered; a native crash ends the process
            send(sink, Failed(error=f"{type(error).__name__}: {error}"))


if __name__ == "__main__":
    # run as a script, its own folder comes first on the path, where tasks/models/llama_cpp.py would shadow the
    # binding's package of the same name
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main())
