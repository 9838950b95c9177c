"""Hostile or malformed input: a ComfyUI server that names files outside the output folder,
workflows that name the user's private files, damaged weight headers, workflows and option
values that used to end in tracebacks. Each case: one clear line, nothing written or sent
outside where it belongs."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from seedvr2.cli import main

# ---------------------------------------------------------------------------------------------
# A fake ComfyUI on 127.0.0.1: /object_info, /upload/image, /prompt, /history, /view; no /ws
# (404), so runs are followed by polling /history.

LOAD_IMAGE_INFO = {"LoadImage": {"input": {"required": {"image": [["theirs.png"],
                                                                  {"image_upload": True}]}}},
                   "SaveImage": {"input": {"required": {"images": ["IMAGE"]}}}}


class FakeComfy:
    def __init__(self, outputs: list):
        self.outputs = outputs  # the history's saved-file items
        self.requests: list = []  # (method, path)
        self.uploads: list = []  # request bodies of /upload/image
        self.prompts: list = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body, status=200, kind="application/json"):
                data = json.dumps(body).encode() if kind == "application/json" else body
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append(("GET", self.path))
                parts = urlsplit(self.path)
                if parts.path == "/object_info":
                    self._reply(LOAD_IMAGE_INFO)
                elif parts.path == "/history/p1":
                    self._reply({"p1": {"status": {"status_str": "success", "messages": []},
                                        "outputs": {"2": {"images": fake.outputs}}}})
                elif parts.path == "/view":
                    query = parse_qs(parts.query)
                    self._reply(f"bytes of {query['filename'][0]}".encode(), kind="image/png")
                else:
                    self._reply({"error": "not found"}, 404)

            def do_POST(self):
                fake.requests.append(("POST", self.path))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/upload/image":
                    fake.uploads.append(body)
                    self._reply({"name": "uploaded.png", "subfolder": "", "type": "input"})
                elif self.path == "/prompt":
                    fake.prompts.append(json.loads(body))
                    self._reply({"prompt_id": "p1", "number": 0, "node_errors": {}})
                else:
                    self._reply({}, 200)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _workflow(tmp_path, image: str) -> Path:
    path = tmp_path / "wf.json"
    path.write_text(json.dumps({"1": {"class_type": "LoadImage", "inputs": {"image": image}},
                                "2": {"class_type": "SaveImage",
                                      "inputs": {"images": ["1", 0]}}}))
    return path


def _run_on(fake, tmp_path, image="theirs.png", input_dir=None):
    return main(["run-workflow", str(_workflow(tmp_path, image)), "--server", fake.url, "-q",
                 "--input-dir", str(input_dir or tmp_path / "in"),
                 "--output-dir", str(tmp_path / "work" / "out")])


def test_server_outputs_inside_the_output_folder_are_downloaded(tmp_path, capsys):
    items = [{"filename": "a.png", "subfolder": "", "type": "output"},
             {"filename": "b.png", "subfolder": "sub/deeper", "type": "output"},
             {"filename": "temp.png", "subfolder": "", "type": "temp"}]
    with FakeComfy(items) as fake:
        assert _run_on(fake, tmp_path) == 0
    out = tmp_path / "work" / "out"
    assert (out / "a.png").read_bytes() == b"bytes of a.png"
    assert (out / "sub" / "deeper" / "b.png").read_bytes() == b"bytes of b.png"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == \
        ["a.png", "sub", "sub/deeper", "sub/deeper/b.png"]


@pytest.mark.parametrize("subfolder, filename, shown", [
    ("", "../../evil.txt", "'../../evil.txt'"),
    ("../../..", "evil.txt", "'../../../evil.txt'"),
    ("sub/../..", "evil.txt", "'sub/../../evil.txt'"),
    ("/ABS", "evil.txt", "'/ABS/evil.txt'"),
    ("", "/ABS/evil.txt", "'/ABS/evil.txt'"),
    ("", "..", "'..'"),
    ("", "", "''"),
    ("link", "evil.txt", "'link/evil.txt'"),
])
def test_server_outputs_outside_the_output_folder_are_refused(tmp_path, capsys, subfolder,
                                                               filename, shown):
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    (out / "link").symlink_to(victim)  # a link inside the folder that leads out of it
    subfolder, filename, shown = (x.replace("/ABS", str(victim)) for x in (subfolder, filename,
                                                                            shown))
    items = [{"filename": "fine.png", "subfolder": "", "type": "output"},
             {"filename": filename, "subfolder": subfolder, "type": "output"}]
    with FakeComfy(items) as fake:
        assert _run_on(fake, tmp_path) == 1
        assert not [p for p in fake.requests if p[1].startswith("/view")]
    err = capsys.readouterr().err
    assert err == (f"error: the server at {fake.url} listed output files outside the output "
                   f"folder {out}: {shown}; nothing was downloaded\n")
    assert list(victim.iterdir()) == [] and list(out.iterdir()) == [out / "link"]
    assert not list(tmp_path.rglob("evil.txt")) and not (tmp_path.parent / "evil.txt").exists()


@pytest.mark.parametrize("name", ["SECRET", "../secret.txt", "../../secret.txt", "~/secret.txt",
                                  "link/secret.txt", "sub/../../secret.txt"])
def test_workflows_cannot_upload_files_outside_the_input_folder(tmp_path, capsys, name):
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    inputs = tmp_path / "a" / "in"
    (inputs / "sub").mkdir(parents=True)
    (tmp_path / "a" / "secret.txt").write_text("private")
    (inputs / "link").symlink_to(tmp_path)
    name = name.replace("SECRET", str(secret))
    with FakeComfy([]) as fake:
        assert _run_on(fake, tmp_path, image=name, input_dir=inputs) == 1
        assert fake.uploads == [] and fake.prompts == []
        assert [r for r in fake.requests if r[0] == "POST"] == []
    assert capsys.readouterr().err == (
        f"error: node 1 (LoadImage): image = {name!r} is not a file inside the input folder "
        f"{inputs}: only files inside --input-dir are uploaded to the server (copy the file "
        f"there and name it relative to that folder); nothing was sent\n")


def test_workflows_upload_files_of_the_input_folder(tmp_path, capsys):
    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    (inputs / "sub" / "mine.png").write_bytes(b"PNGDATA")
    with FakeComfy([]) as fake:
        assert _run_on(fake, tmp_path, image="sub/mine.png", input_dir=inputs) == 0
        assert len(fake.uploads) == 1 and b"PNGDATA" in fake.uploads[0]
        assert b'name="subfolder"\r\n\r\nsub\r\n' in fake.uploads[0]
        assert fake.prompts[0]["prompt"]["1"]["inputs"]["image"] == "uploaded.png"


def test_server_mode_without_websocket_client_names_the_package(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "websocket", None)  # import websocket -> ImportError
    with FakeComfy([]) as fake:
        assert _run_on(fake, tmp_path) == 1
        assert fake.prompts == []
    assert capsys.readouterr().err == (
        "error: following a run on a ComfyUI server needs the websocket-client package: "
        "pip install websocket-client\n")


def test_server_runs_are_followed_by_polling_when_there_is_no_websocket(tmp_path):
    from seedvr2.workflow.server import ComfyServer

    events = []
    with FakeComfy([]) as fake:
        client = ComfyServer(fake.url, timeout=10)
        assert client.events() is None  # /ws answers 404: no upgrade
        entry = client.run({"1": {"class_type": "SaveImage", "inputs": {}}}, timeout=30,
                           on_event=lambda kind, data: events.append(kind))
    assert entry["status"]["status_str"] == "success" and events == []
    assert ("GET", "/history/p1") in fake.requests


# ---------------------------------------------------------------------------------------------
# Damaged safetensors headers: `seedvr2 inspect F` and `upscale --dit F` say what is wrong in
# one line (the safetensors library would raise KeyError, TypeError, RecursionError or its own
# error without naming the file).

def _tensor(shape=(1,), offsets=(0, 4), dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


DEEP = b'{"a":' * 200_000 + b"1" + b"}" * 200_000
HEADERS = {  # case -> (header, tensor data bytes, the problem as reported)
    "no data_offsets": ({"w": {"dtype": "F32", "shape": [1]}}, 4,
                        "corrupt safetensors header (tensor 'w': no data_offsets)"),
    "string offsets": ({"w": _tensor(offsets=("0", "4"))}, 4,
                       "corrupt safetensors header (tensor 'w': data_offsets must be two whole "
                       "numbers of at least 0 (begin, end))"),
    "entry not an object": ({"w": 5}, 0,
                            "corrupt safetensors header (tensor 'w': an object with dtype, shape "
                            "and data_offsets was expected, not int)"),
    "nested 200,000 deep": (DEEP, 0,
                            "corrupt safetensors header (JSON nested too deeply)"),
    "reversed offsets": ({"w": _tensor(offsets=(4, 0))}, 4,
                         "corrupt safetensors header (tensor 'w': data_offsets end before they "
                         "begin (4, 0))"),
    "negative offsets": ({"w": _tensor(offsets=(-4, 0))}, 4,
                         "corrupt safetensors header (tensor 'w': data_offsets must be two whole "
                         "numbers of at least 0 (begin, end))"),
    "negative shape": ({"w": _tensor(shape=(-1,))}, 4,
                       "corrupt safetensors header (tensor 'w': shape must be a list of whole "
                       "numbers of at least 0)"),
    "10^6 x 10^6 over 16 bytes": ({"w": _tensor(shape=(10**6, 10**6), offsets=(0, 16))}, 16,
                                  "corrupt safetensors header (tensor 'w': shape [1000000, "
                                  "1000000] of F32 needs 4000000000000 bytes, its data_offsets "
                                  "span 16)"),
    "non-string metadata": ({"__metadata__": {"format": 1}, "w": _tensor()}, 4,
                            "corrupt safetensors header (__metadata__ must map names to "
                            "strings)"),
    "gap between tensors": ({"a": _tensor(), "b": _tensor(offsets=(8, 12))}, 12,
                            "corrupt safetensors header (tensor 'b': data starts at byte 8, the "
                            "previous tensor ends at 4; tensors must follow each other)"),
    "bytes after the tensors": ({"w": _tensor()}, 8,
                                "corrupt safetensors file (4 bytes after the last tensor)"),
    # A header of 62 bytes: 8 + 62 + 16 bytes needed, 8 + 62 + 8 there.
    "tensors past the end": ({"w": _tensor(shape=(4,), offsets=(0, 16))}, 8,
                             "truncated safetensors file (tensors need 86 bytes, file has 78)"),
    "unknown dtype": ({"w": _tensor(dtype="Q9")}, 4,
                      "corrupt safetensors header (tensor 'w': unsupported dtype 'Q9')"),
    "not UTF-8": (b'{"w\xff": 1}', 0, "corrupt safetensors header (not UTF-8 text)"),
    "not JSON": (b'{"w": [1, }', 0,
                 "corrupt safetensors header (not valid JSON: Expecting value at byte 10)"),
}


def _damaged(tmp_path, case) -> Path:
    import struct

    header, data, _ = HEADERS[case]
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return path


@pytest.mark.parametrize("case", list(HEADERS))
def test_inspect_names_what_is_wrong_with_a_damaged_header(tmp_path, capsys, case):
    path = _damaged(tmp_path, case)
    assert main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err == f"error: {path}: {HEADERS[case][2]}\n"


@pytest.mark.parametrize("case", ["no data_offsets", "entry not an object", "nested 200,000 deep",
                                  "10^6 x 10^6 over 16 bytes", "non-string metadata"])
def test_upscale_names_what_is_wrong_with_a_damaged_dit(tiny_options, tmp_path, capsys, case):
    from PIL import Image

    image = tmp_path / "in.png"
    Image.new("RGB", (32, 24)).save(image)
    path = _damaged(tmp_path, case)
    assert main(["upscale", str(image), "-o", str(tmp_path / "out.png"), "--dit", str(path),
                 "--vae", tiny_options["vae"], "--model-dir", str(tiny_options["model_dir"]),
                 "--device", "cpu", "--dtype", "fp32", "--resolution", "32", "--quiet"]) == 1
    assert capsys.readouterr().err == f"error: {path}: {HEADERS[case][2]}\n"
    assert not (tmp_path / "out.png").exists()


# ---------------------------------------------------------------------------------------------
# Names from workflows stay inside the model folder, and no error quotes a file's bytes.

SECRET = "root:x:0:0:root:/root:/bin/bash\n"


def _run_with_text_embeddings(tmp_path, tiny_model_dir, value):
    from test_workflows import API_DIR, make_inputs, tiny_sets

    prompt = json.loads((API_DIR / "image_upscale.json").read_text())
    return main(["run-workflow", str(API_DIR / "image_upscale.json"), "-q",
                 *(f"--set={s}" for s in tiny_sets(prompt)), f"--set=2.text_embeddings={value}",
                 "--model-dir", str(tiny_model_dir),
                 "--input-dir", str(make_inputs(tmp_path / "in")),
                 "--output-dir", str(tmp_path / "out")])


@pytest.mark.parametrize("value", ["SECRET", "../secret.txt", "~/secret.txt", "sub/../../x.pt"])
def test_workflow_text_embeddings_stay_inside_the_model_folder(tmp_path, capsys, tiny_model_dir,
                                                               value):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    value = value.replace("SECRET", str(secret))
    assert _run_with_text_embeddings(tmp_path, tiny_model_dir, value) == 1
    err = capsys.readouterr().err
    assert err == (f"error: node 2 (SeedVR2LoadDiTModel): text_embeddings = {value!r}: model "
                   f"name {value!r} is not a file name inside the model folder {tiny_model_dir} "
                   f"(names may not be absolute or contain '..')\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["passwd.safetensors", "passwd.pt", "passwd"])
def test_errors_never_quote_a_files_bytes(tmp_path, capsys, tiny_model_dir, name):
    """A text file where weights are expected: the error names the file, not its contents."""
    path = tiny_model_dir / name
    path.write_text(SECRET)
    try:
        assert _run_with_text_embeddings(tmp_path, tiny_model_dir, name) == 1
        assert main(["inspect", str(path)]) == 1
    finally:
        path.unlink()
    err = capsys.readouterr().err
    assert err == (f"error: node 4 (SeedVR2VideoUpscaler): {path}: unrecognised weight file "
                   f"(expected safetensors, a torch .pth/.pt state dict, or GGUF)\n"
                   f"error: {path}: unrecognised weight file (expected safetensors, a torch "
                   f".pth/.pt state dict, or GGUF)\n")


def test_a_damaged_pickle_is_one_line(tmp_path, capsys):
    path = tmp_path / "damaged.pt"
    path.write_bytes(b"\x80\x02" + SECRET.encode())  # a pickle header, then garbage
    assert main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err == \
        f"error: {path}: unreadable torch checkpoint (damaged data: IndexError)\n"


# ---------------------------------------------------------------------------------------------
# Workflows and option values that used to end in tracebacks.

@pytest.mark.parametrize("content, problem", [
    (b'{"1": {"class_type": "caf\xe9"}}', "not a workflow: not UTF-8 text (byte 25); a workflow "
                                          "is JSON as the editor saves it"),
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "not a workflow: JSON nested too deeply"),
    (b'{"1": {"class_type": "SaveImage", "inputs": {"images": ' + b"[" * 500 + b"]" * 500
     + b"}}}", None),
])
def test_unreadable_workflows_are_one_line(tmp_path, capsys, content, problem):
    path = tmp_path / "wf.json"
    path.write_bytes(content)
    assert main(["run-workflow", str(path), "--model-dir", str(tmp_path),
                 "--output-dir", str(tmp_path / "out")]) == 1
    if problem is None:  # parsed; nested past what a workflow holds (shape.MAX_DEPTH)
        problem = ("node 1 (SaveImage): input 'images' nests values more than 100 levels deep: "
                   "not something a workflow holds")
    else:
        problem = f"{path}: {problem}"
    assert capsys.readouterr().err == f"error: {problem}\n"


@pytest.mark.parametrize("fps", ["inf", "1e400", "-inf", "nan"])
def test_infinite_frame_rates_are_refused_like_other_bad_values(tmp_path, capsys, fps):
    assert main(["upscale", str(tmp_path / "in.png"), f"--fps={fps}"]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: --fps {fps}: expected auto, or a positive rate such as 24, 29.97 or "
        f"30000/1001\n")


# ---------------------------------------------------------------------------------------------
# Resolution: odd values are refused (outputs have even sizes); a size past the host's RAM is
# refused by the memory check before any work, on the CPU too.

def test_odd_resolutions_are_refused(tmp_path, capsys):
    assert main(["upscale", str(tmp_path / "in.png"), "--resolution", "17"]) == 2
    assert capsys.readouterr().err.endswith(
        "error: --resolution 17: must be even (outputs have even sizes); nearest valid values: "
        "16 or 18\n")


def test_a_resolution_past_the_hosts_ram_is_refused_before_any_work(tiny_options, tmp_path,
                                                                    capsys, monkeypatch):
    from PIL import Image

    from seedvr2.memory import budget as mem
    from seedvr2.api import MEMORY_CHECK_ENV
    from seedvr2.pipeline.runner import Upscaler

    def no_work(*args, **kwargs):
        raise AssertionError("the work began before the memory check")
    monkeypatch.setattr(Upscaler, "_encode", no_work)
    monkeypatch.delenv(MEMORY_CHECK_ENV, raising=False)
    monkeypatch.setattr(mem, "host_available", lambda: 16 * 2**30)  # a 16 GiB machine's RAM
    image = tmp_path / "in.png"
    Image.new("RGB", (32, 24)).save(image)
    assert main(["upscale", str(image), "-o", str(tmp_path / "out.png"), "--dit",
                 tiny_options["dit"], "--vae", tiny_options["vae"], "--model-dir",
                 str(tiny_options["model_dir"]), "--device", "cpu", "--dtype", "fp32",
                 "--resolution", "16384", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        "error: not enough memory on cpu for 21846x16384 frames at --batch-size 5: the encode "
        "phase needs about 563.7 GiB (VAE weights 5 MiB, DiT weights 7 MiB, activations "
        "469.8 GiB, margin 47.2 GiB, waiting tensors 46.7 GiB) but 16.0 GiB is available. "
        "Nothing fits at this resolution, even with the smallest batch, VAE tiles of 128 "
        "pixels: lower --resolution or use a device with more memory (to try anyway, set "
        "SEEDVR2_MEMORY_CHECK=warn)\n")
    assert list(tmp_path.iterdir()) == [image]


# ---------------------------------------------------------------------------------------------
# Launch folders (/tmp/seedvr2-ranks-*) of killed --devices launchers are removed by the next
# launch; a live launcher's never are.

def _aged(folder: Path) -> Path:
    import os
    import time

    old = time.time() - 3600
    os.utime(folder, (old, old))
    return folder


def test_next_launch_removes_the_folders_of_killed_launchers(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    from seedvr2.distributed import launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = {name: Path(tempfile.mkdtemp(prefix=launch.LAUNCH_PREFIX)) for name in
            ("stale", "live", "killed", "fresh")}
    for name in ("stale", "live", "killed"):
        (made[name] / "rank0").write_text("")
        _aged(made[name])
    not_a_folder = tmp_path / f"{launch.LAUNCH_PREFIX}file"
    not_a_folder.write_text("")
    _aged(not_a_folder)
    holders = {name: subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from seedvr2.io.temporaries import hold; "
         "held = hold(__import__('pathlib').Path(sys.argv[1])); print(held is not None, "
         "flush=True); time.sleep(600)", str(made[name])], stdout=subprocess.PIPE, text=True)
        for name in ("live", "killed")}  # launchers: each holds its folder while it lives
    try:
        assert [holders[n].stdout.readline() for n in holders] == ["True\n", "True\n"]
        holders["killed"].kill()  # kill -9: its `with` never cleans up
        holders["killed"].wait(30)
        assert sorted(launch.remove_stale_launch_folders()) == \
            sorted([made["stale"], made["killed"]])
    finally:
        for process in holders.values():
            process.kill()
            process.wait(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [made["live"].name, made["fresh"].name, not_a_folder.name])


def test_a_launch_holds_its_folder_and_clears_stale_ones(tmp_path, monkeypatch):
    import tempfile
    import types

    import torch.multiprocessing

    from seedvr2.distributed import launch
    from seedvr2.io.temporaries import hold

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = _aged(Path(tempfile.mkdtemp(prefix=launch.LAUNCH_PREFIX)))
    monkeypatch.setattr(torch.multiprocessing, "start_processes",
                        lambda *args, **kwargs: types.SimpleNamespace(processes=[]))
    with launch._launched(launch._file_worker, ["cpu", "cpu"], 30, ()) as (_, started):
        assert not stale.exists() and started.is_dir()
        _aged(started)
        assert hold(started) is None  # locked: another launch would leave it alone
        assert launch.remove_stale_launch_folders() == [] and started.is_dir()
    assert list(tmp_path.iterdir()) == []


def test_event_stream_skips_previews_resumes_cut_messages_and_reports_a_close():
    """Our use of websocket-client: binary messages (previews) are skipped, a message cut by
    the timeout is completed by the next call, a close ends the stream."""
    import base64
    import hashlib
    import socket
    import threading
    import time

    from websocket import ABNF

    from seedvr2.workflow.server import EventsFailed, EventStream

    def frame(opcode, payload: bytes) -> bytes:  # server frames are not masked
        return ABNF(1, 0, 0, 0, opcode, 0, payload).format()

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    cut = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn, listener:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096)
            key = next(line.split(b":", 1)[1].strip() for line in request.split(b"\r\n")
                       if line.lower().startswith(b"sec-websocket-key:"))
            accept = base64.b64encode(hashlib.sha1(
                key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()).decode()
            conn.sendall(f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                         f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n".encode())
            conn.sendall(frame(ABNF.OPCODE_BINARY, b"\x00\x00\x00\x01preview"))
            text = frame(ABNF.OPCODE_TEXT, b'{"type": "progress"}')
            conn.sendall(text[:6])
            cut.wait(10)
            conn.sendall(text[6:] + frame(ABNF.OPCODE_CLOSE, b"\x03\xe8"))
            time.sleep(0.5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    stream = EventStream(f"ws://127.0.0.1:{listener.getsockname()[1]}/ws?clientId=x", timeout=10)
    try:
        assert stream.recv(timeout=0.3) is None  # the preview skipped, the event cut short
        cut.set()
        assert stream.recv(timeout=10) == '{"type": "progress"}'
        with pytest.raises(EventsFailed, match="^the server closed the websocket$"):
            stream.recv(timeout=10)
    finally:
        stream.close()
    thread.join(10)


def test_workflow_text_embeddings_name_a_file_of_the_model_folder(tmp_path, capsys,
                                                                  tiny_model_dir):
    assert _run_with_text_embeddings(tmp_path, tiny_model_dir, "nothing.pt") == 1
    assert capsys.readouterr().err == (
        f"error: node 2 (SeedVR2LoadDiTModel): text_embeddings 'nothing.pt': no such file in the "
        f"model folder {tiny_model_dir} (use auto, or the name of a file there)\n")
    assert _run_with_text_embeddings(tmp_path, tiny_model_dir, "text_64.safetensors") == 0
    assert [p.suffix for p in (tmp_path / "out" / "SeedVR2").iterdir()] == [".png"]


@pytest.mark.parametrize("flag", ["--input-noise-scale", "--latent-noise-scale", "--dist-timeout"])
def test_nan_is_refused_by_every_number_option(tmp_path, capsys, flag):
    """NaN passes every range comparison: a noise scale of nan would make every frame NaN."""
    assert main(["upscale", str(tmp_path / "in.png"), f"{flag}=nan"]) == 2
    assert capsys.readouterr().err.endswith(f"error: {flag} nan: expected a number\n")
