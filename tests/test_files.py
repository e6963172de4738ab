"""Files later runs read back (spool record, manifest, batch sizes, token cache): never left half written,
and a damaged one is set aside with one line and made again."""

from __future__ import annotations

import errno
import json
import os
import platform
import sys

import pytest

from tasks.core.files import read_json, write_atomically


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_litter(tmp_path, monkeypatch):
    target = tmp_path / "record.json"
    write_atomically(target, json.dumps({"kept": True}))

    def disk_full(_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, json.dumps({"kept": False, "padding": "x" * 100_000}))
    assert json.loads(target.read_text()) == {"kept": True}
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_damaged_manifest_is_ignored_with_one_line(tmp_path, capsys):
    from tasks.models.quantize import MANIFEST, read_manifest

    damaged = tmp_path / MANIFEST
    damaged.write_text('{"method": "gptq", "bi')  # as a crash mid-write left it before
    assert read_manifest(str(tmp_path)) is None  # so an audit's cached checkpoint is quantized again
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"quantization manifest {damaged} is damaged" in err
    assert read_json(tmp_path / "absent.json", "anything") is None and capsys.readouterr().err == ""


def test_a_damaged_token_cache_is_made_again(tokenizer, tmp_path, monkeypatch, capsys):
    from helpers import make_text

    from tasks.data.corpus import cached_tokenize, tokenize

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    text = make_text(500)
    first = cached_tokenize(text, tokenizer, bos="none")
    [entry] = (tmp_path / "tokens").iterdir()
    entry.write_bytes(entry.read_bytes()[:100])
    again = cached_tokenize(text, tokenizer, bos="none")
    assert f"token cache {entry} is damaged: it cannot be read" in capsys.readouterr().err
    assert again.ids.tolist() == first.ids.tolist() == tokenize(text, tokenizer, bos="none").ids.tolist()
    assert cached_tokenize(text, tokenizer, bos="none").ids.tolist() == first.ids.tolist()  # rebuilt whole
    assert capsys.readouterr().err == ""


def test_a_damaged_batch_size_cache_is_searched_again(tiny_model64, tokenizer, tmp_path, monkeypatch, capsys):
    from helpers import make_text

    from tasks.data.corpus import tokenize
    from tasks.engine.batching import auto_batch_size

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    (tmp_path / "batch_sizes.json").write_text('{"[\\"tiny')
    stream = tokenize(make_text(800), tokenizer, bos="none")
    size = auto_batch_size(tiny_model64, stream, 64, 32)
    assert size >= 1 and "batch size cache" in capsys.readouterr().err
    assert list(json.loads((tmp_path / "batch_sizes.json").read_text())["sizes"].values()) == [size]


def test_scratch_folders_of_processes_that_died_are_removed_next_time(tmp_path):
    from helpers import dead_pid

    from tasks.core.files import scratch

    left = tmp_path / f"{dead_pid()}@{platform.node()}~x1"  # as a killed process leaves it
    alive = tmp_path / f"1@{platform.node()}~x2"  # pid 1 lives as long as the machine
    for folder in (left, alive):
        folder.mkdir()
    with scratch(tmp_path) as mine:
        assert mine.is_dir() and not left.exists() and alive.is_dir()
    assert not mine.exists()


def test_a_stop_inside_a_scratch_folder_that_another_thread_still_writes_stays_a_stop(tmp_path):
    """Ctrl-C during quantizing, while gptqmodel's threads still wrote its offload folder: removing the scratch
    folder failed ("OSError: Directory not empty: 'offload'") and that error took the KeyboardInterrupt's place, so
    an audit scored on (its supervisor killed it 6 s later) and recorded the variant as failed with it."""
    import threading

    from tasks.core.files import scratch

    stop = threading.Event()

    def write(folder) -> None:
        n = 0
        while not stop.is_set():
            try:
                (folder / "offload" / str(n)).mkdir(parents=True)
            except OSError:
                pass
            n += 1

    with pytest.raises(KeyboardInterrupt):
        with scratch(tmp_path) as folder:
            writer = threading.Thread(target=write, args=(folder,))
            writer.start()
            try:
                while len(list((folder / "offload").glob("*"))) < 2000:
                    pass
                raise KeyboardInterrupt
            finally:
                threading.Timer(0.5, stop.set).start()  # it writes on while the folder is removed
    writer.join()


def test_a_killed_quantization_leaves_nothing_in_tmp_and_its_scratch_goes_next_time(tmp_path, trained_model_dir):
    """gptqmodel offloads finished layers to disk: into our scratch folder, not a /tmp folder of its own."""
    import signal
    import subprocess
    import time

    from tasks.core.files import scratch

    tmp, cache = tmp_path / "tmp", tmp_path / "cache"
    tmp.mkdir()
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from tasks.models.quantize import Scheme, draw_calibration, quantize\n"
        "from tasks.models.resolve import load_tokenizer, locate_model\n"
        "ids = torch.randint(0, 300, (64 * 256,))\n"
        "drawn = draw_calibration(ids, 64, 256, 0, 'random', 'none')\n"
        "quantize(locate_model(sys.argv[1]), Scheme('gptq', 4, 32, True), drawn, Path(sys.argv[2]), "
        "load_tokenizer(sys.argv[1]))\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp), "PPL_AUDIT_CACHE": str(cache)}
    process = subprocess.Popen([sys.executable, "-c", script, str(trained_model_dir), str(tmp_path / "out")], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not list((cache / "scratch").glob("*/offload/*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, f"quantization ended before it offloaded a layer: {process.stderr.read()[-2000:]}"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert list(tmp.iterdir()) == []
    assert not (tmp_path / "out").exists(), "no half-made checkpoint where the finished one goes"
    for root in (cache / "scratch", tmp_path / ".out.partial"):  # the latter: the checkpoint, made beside `out`
        (left,) = root.iterdir()
        with scratch(root):
            assert not left.exists()


def test_a_folder_is_published_whole_or_not_at_all(tmp_path):
    from tasks.core.files import publish

    made = tmp_path / "made"
    made.mkdir()
    (made / "weights").write_text("w")
    (tmp_path / "empty").mkdir()
    publish(made, tmp_path / "empty")
    assert (tmp_path / "empty" / "weights").read_text() == "w" and not made.exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "weights").write_text("v")
    with pytest.raises(FileExistsError, match="empty is not empty"):
        publish(other, tmp_path / "empty")
    assert (tmp_path / "empty" / "weights").read_text() == "w" and (other / "weights").read_text() == "v"
