"""``batch_size: auto``: the batch size to score with, found once per model, window and device.

On CUDA it is the largest power of two (up to ``cap``) whose batch of the longest windows runs without
running out of memory. On CPU memory is rarely the limit and larger batches stop paying early, so it
is the smallest power of two past which tokens per second stop improving by 5%. Either way the search
is bounded, its result is cached in ``$PPL_AUDIT_CACHE/batch_sizes.json``, and the perplexity does not
depend on it; an out-of-memory error later still halves the batch size instead of failing.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from tasks.core import sealed
from tasks.core.files import write_atomically
from tasks.core.places import cache_dir
from tasks.engine.batch_sizes_said import BatchSizes
from tasks.engine.kv_cache import KVCacheFormat
from tasks.engine.model_facts import input_device
from tasks.engine.perplexity import score_windows
from tasks.engine.scoring_options import Feed, ScoreOptions
from tasks.engine.stream import TokenStream
from tasks.engine.windows import plan


def _cache_key(model, window: int, mode: str) -> str:
    """What a batch size is found for: the model (its name, and the digest of its config: another model saved at the
    same path is searched again), its dtype and device, the window and mode."""
    config = model.config.to_json_string() if hasattr(model, "config") else ""
    return json.dumps([str(model.name_or_path), hashlib.sha256(config.encode()).hexdigest()[:16], str(model.dtype),
                       str(input_device(model)), window, mode])


def _known(file: Path) -> dict[str, int]:
    """The batch sizes found before, when the file holds what was written (its digest, each a positive whole number);
    else none, with one line: a wrong size would make scoring slow or run out of memory."""
    if not file.is_file():
        return {}
    entry = sealed.read_entry(file)
    problem = sealed.damage(entry, "its content")
    found = None if problem else BatchSizes.of_json(entry)
    if found is None:
        sealed.warn_remade("batch size cache", file, problem or "it holds a batch size that is not a positive whole "
                           "number", "the sizes are searched again")
        return {}
    return found.sizes


def auto_batch_size(model, stream: TokenStream, window: int, stride: int, mode: str = "sliding", cap: int = 64,
                    kv_cache: KVCacheFormat | None = None) -> int:
    """Search (or recall) the batch size for ``model`` at this window on this device, each batch tried as it will be
    scored: through ``kv_cache``'s format, where it has one (a residual's second copy of keys and values takes
    memory)."""
    file = cache_dir() / "batch_sizes.json"
    known = _known(file)
    key = _cache_key(model, window, mode)
    if key in known:
        return known[key]
    windows = sorted(plan(stream, window, stride, mode), key=lambda w: w.end - w.start, reverse=True)
    device = input_device(model)
    cuda = device.type == "cuda"
    best, best_speed, size = 1, 0.0, 1
    while size <= min(cap, len(windows)):
        try:
            started = time.perf_counter()
            score_windows(model, Feed(stream.ids, stream.prefix, batch_size=size), windows[:size],
                          ScoreOptions(kv_cache=kv_cache))
            if cuda:
                torch.cuda.synchronize(device)
            speed = sum(w.n_scored for w in windows[:size]) / (time.perf_counter() - started)
        except torch.OutOfMemoryError:
            break
        if not cuda and speed < best_speed * 1.05:
            break
        best, best_speed, size = size, max(speed, best_speed), size * 2
    if cuda:  # out of the handler, where the failed batch's tensors (held by the error's frames) are free again
        torch.cuda.empty_cache()
    known[key] = best
    file.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(file, json.dumps(sealed.seal(BatchSizes(known).to_json()), indent=1))
    return best
