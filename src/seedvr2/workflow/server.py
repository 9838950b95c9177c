"""Run a prompt on a ComfyUI server (``run-workflow --server``; docs/comfyui.md): upload its inputs,
POST /prompt, follow it on the websocket (opened before queueing, so no event is missed; if it
fails, by polling ``/history/<prompt id>``, whose entry is the result either way), fetch outputs."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Optional

from .errors import WorkflowError, WorkflowInterrupted
from .numz import widget_inputs

log = logging.getLogger("seedvr2")
Events = Callable[[str, dict], None]  # on_event(type, data) with ComfyUI's event names
# Inputs whose value is a file in the server's input folder, for servers whose /object_info
# shows no upload button on them (inputs with one are found there).
FILE_INPUTS = {"SeedVR2UpscaleVideoFile": "video_path"}
UPLOAD_FLAGS = ("image_upload", "video_upload", "animated_image_upload", "audio_upload")


class ComfyServer:
    def __init__(self, url: str, timeout: float = 30.0, websocket: bool = True):
        self.url = url.rstrip("/")
        self.timeout = timeout  # per HTTP request
        self.client_id = uuid.uuid4().hex
        self.websocket = websocket  # follow runs on /ws (else: poll /history)

    def request(self, path: str, data: Optional[dict] = None, body=None,
                 headers: Optional[dict] = None):
        if data is not None:
            body, headers = json.dumps(data).encode(), {"Content-Type": "application/json"}
        request = urllib.request.Request(self.url + path, data=body, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            raise _HTTPError(e.code, e.read()) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise WorkflowError(f"cannot reach the ComfyUI server at {self.url}: {reason}") from None

    def get_json(self, path: str):
        return json.loads(self.request(path))

    def object_info(self) -> dict:
        return self.get_json("/object_info")

    def submit(self, prompt: dict) -> str:
        try:
            reply = json.loads(self.request("/prompt", {"prompt": prompt,
                                                         "client_id": self.client_id}))
        except _HTTPError as e:
            raise prompt_error(e.body) from None
        return reply["prompt_id"]

    def events(self) -> Optional["EventStream"]:
        """The websocket of this client's events, or None when it cannot be opened."""
        if not self.websocket:
            return None
        parts = urllib.parse.urlsplit(self.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        url = urllib.parse.urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/ws",
                                       urllib.parse.urlencode({"clientId": self.client_id}), ""))
        try:
            return EventStream(url, timeout=self.timeout)
        except EventsFailed as e:
            log.info(f"{e}; following the run by polling /history")
            return None

    def run(self, prompt: dict, timeout: Optional[float] = None,
            on_event: Optional[Events] = None) -> dict:
        """Queue ``prompt`` and wait for its history entry (raises with the node's error)."""
        events = self.events()
        try:
            prompt_id = self.submit(prompt)
            try:
                return self.wait(prompt_id, timeout=timeout, on_event=on_event, events=events)
            except KeyboardInterrupt:
                self.cancel(prompt_id)
                raise
        finally:
            if events is not None:
                events.close()

    def _history(self, prompt_id: str) -> Optional[dict]:
        return self.get_json(f"/history/{prompt_id}").get(prompt_id)

    def wait(self, prompt_id: str, timeout: Optional[float] = None,
             on_event: Optional[Events] = None, poll: float = 0.25,
             events: Optional["EventStream"] = None) -> dict:
        """The finished prompt's history entry, on ``events``, else (or on failing) polled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if events is not None:
            try:
                entry = self._follow(events, prompt_id, deadline, timeout, on_event)
            except EventsFailed as e:
                if on_event is not None:
                    on_event("seedvr2_fallback", {"reason": str(e)})
                log.info(f"websocket: {e}; following the run by polling /history")
            else:
                return check_history(entry)
        return check_history(self._poll(prompt_id, deadline, timeout, poll))

    def _poll(self, prompt_id: str, deadline, timeout, interval: float) -> dict:
        while True:
            entry = self._history(prompt_id)
            if entry is not None:  # ComfyUI records a prompt in its history once it has ended
                return entry
            self._check_deadline(deadline, prompt_id, timeout)
            time.sleep(interval)

    @staticmethod
    def _check_deadline(deadline, prompt_id, timeout):
        if deadline is not None and time.monotonic() > deadline:
            raise WorkflowError(f"the server did not finish prompt {prompt_id} within "
                                f"{timeout:.0f} s")

    def _follow(self, events: "EventStream", prompt_id: str, deadline, timeout, on_event) -> dict:
        """Read events until ComfyUI says the prompt ended; then its history entry."""
        last_check = time.monotonic()
        while True:
            self._check_deadline(deadline, prompt_id, timeout)
            left = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            text = events.recv(timeout=left)
            if time.monotonic() - last_check > 5.0:  # did it end unheard (a lost event)?
                last_check = time.monotonic()
                entry = self._history(prompt_id)
                if entry is not None:
                    return entry
            if text is None:
                continue
            try:
                event = json.loads(text)
                kind, body = event["type"], event.get("data") or {}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if not isinstance(body, dict) or body.get("prompt_id") != prompt_id:
                continue  # queue status, other clients' prompts
            if kind == "executing" and body.get("node") is None:
                break  # ComfyUI sends this once the prompt is done and in the history
            if on_event is not None:
                on_event(kind, body)
        return self._poll(prompt_id, deadline, timeout, 0.1)

    def cancel(self, prompt_id: str) -> None:
        """Take ``prompt_id`` off the queue, or interrupt it if it runs (best effort)."""
        for path, data in (("/queue", {"delete": [prompt_id]}),
                           ("/interrupt", {"prompt_id": prompt_id})):
            try:
                self.request(path, data)
            except (WorkflowError, _HTTPError):
                pass

    def upload(self, path: Path, subfolder: str = "") -> str:
        """POST /upload/image into the server's input folder, never overwriting (an identical
        file keeps its name, another gets a new one); returns the name for the input value."""
        boundary = uuid.uuid4().hex
        path = Path(path)
        fields = b"".join(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n"
                          f"\r\n{value}\r\n".encode() for name, value in
                          (("type", "input"), ("subfolder", subfolder)))
        filename = path.name.replace('"', "%22").replace("\r", "").replace("\n", "")
        head = fields + (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; "
                         f"filename=\"{filename}\"\r\nContent-Type: application/octet-stream"
                         f"\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        try:
            size = path.stat().st_size
        except OSError as e:
            raise WorkflowError(f"{path}: cannot read the input file: {e.strerror or e}") from None

        def body():
            yield head
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    yield chunk
            yield tail
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}",
                   "Content-Length": str(len(head) + size + len(tail))}
        try:
            reply = json.loads(self.request("/upload/image", body=body(), headers=headers))
        except _HTTPError as e:
            raise WorkflowError(f"uploading {path} to {self.url} failed: HTTP {e.code} "
                                f"{e.body[:200]!r}") from None
        name = reply["name"]
        return f"{reply['subfolder']}/{name}" if reply.get("subfolder") else name

    def download(self, entry: dict, folder: Path) -> list[Path]:
        """A finished prompt's saved outputs, copied into ``folder`` (each renamed once complete).
        Paths the server gives that lead outside ``folder`` refuse it before any is fetched."""
        from ..io.temporaries import temporary_path

        folder = Path(folder)
        wanted, refused = [], []
        for item in _saved_files(entry):
            subfolder, filename = item.get("subfolder") or "", item["filename"]
            target = output_path_in(folder, subfolder, filename)
            if target is None:
                refused.append(f"{'/'.join(filter(None, (subfolder, filename)))!r}")
            else:
                wanted.append((target, urllib.parse.urlencode(
                    {"filename": filename, "type": "output", "subfolder": subfolder})))
        if refused:
            raise WorkflowError(f"the server at {self.url} listed output files outside the output "
                                f"folder {folder}: {', '.join(refused)}; nothing was downloaded")
        files = []
        for target, query in wanted:
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = temporary_path(target, keep_suffix=False)
            try:
                partial.write_bytes(self.request(f"/view?{query}"))
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
            files.append(target)
        return files


def _saved_files(entry: dict) -> list[dict]:
    """The ``{"filename", "subfolder", "type": "output"}`` items of a history entry."""
    return [item for node_output in (entry.get("outputs") or {}).values()
            if isinstance(node_output, dict)
            for items in node_output.values() if isinstance(items, list)
            for item in items
            if isinstance(item, dict) and item.get("type") == "output"
            and isinstance(item.get("filename"), str)
            and isinstance(item.get("subfolder", ""), (str, type(None)))]


def output_path_in(folder: Path, subfolder: str, filename: str) -> Optional[Path]:
    """``folder / subfolder / filename`` when inside ``folder`` (after following ``..`` and links;
    absolute parts, which would replace ``folder``, are outside), else None."""
    if not filename or os.path.isabs(subfolder) or os.path.isabs(filename) or \
            "\0" in subfolder + filename:
        return None
    target = folder / subfolder / filename
    root = folder.resolve()
    resolved = target.resolve()
    if resolved == root or not resolved.is_relative_to(root):
        return None
    return target


class EventsFailed(OSError):
    """The websocket could not be opened, or broke: follow the run on /history instead."""


class EventStream:
    """ComfyUI's events for one client: ``recv(timeout)`` is the next text message (JSON) or None
    in time; previews (binary) are skipped. ``websocket-client`` itself answers pings."""

    def __init__(self, url: str, timeout: float = 30.0):
        try:
            import websocket
        except ImportError:
            websocket = None
        if not hasattr(websocket, "WebSocket"):  # absent, or the unrelated "websocket" package
            raise WorkflowError("following a run on a ComfyUI server needs the websocket-client "
                                "package: pip install websocket-client")
        self._lib = websocket
        self.ws = websocket.WebSocket()
        try:
            self.ws.connect(url, timeout=timeout)
        except (websocket.WebSocketException, OSError) as e:
            self.close()
            raise EventsFailed(f"cannot open the websocket {url}: {e}") from None

    def recv(self, timeout: Optional[float] = None) -> Optional[str]:
        lib = self._lib
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                self.ws.settimeout(left)
                opcode, data = self.ws.recv_data()
            except lib.WebSocketTimeoutException:
                return None  # a message cut by the timeout is completed by the next call
            except (lib.WebSocketException, OSError) as e:
                raise EventsFailed(f"the websocket broke: {e or type(e).__name__}") from None
            if opcode == lib.ABNF.OPCODE_CLOSE:
                raise EventsFailed("the server closed the websocket")
            if opcode == lib.ABNF.OPCODE_TEXT:
                try:
                    return data.decode("utf-8")
                except UnicodeDecodeError:
                    raise EventsFailed("the websocket sent text that is not UTF-8") from None

    def close(self) -> None:
        try:
            self.ws.close(timeout=1)
        except (self._lib.WebSocketException, OSError):
            pass


class _HTTPError(Exception):
    def __init__(self, code: int, body: bytes):
        self.code, self.body = code, body


def prompt_error(body: bytes) -> WorkflowError:
    """The message of a rejected prompt (HTTP 400): the first node error, else the error."""
    try:
        reply = json.loads(body)
    except ValueError:
        return WorkflowError(f"the server rejected the prompt: {body[:300]!r}")
    for node_id, info in (reply.get("node_errors") or {}).items():
        for error in info.get("errors", []):
            text = error.get("details") or error.get("message", "invalid input")
            if error.get("message") and error["message"] not in text:
                text = f"{error['message']}: {text}"
            return WorkflowError(text, str(node_id), info.get("class_type"))
    error = reply.get("error") or {}
    text = error.get("message", "invalid prompt")
    if error.get("details"):
        text += f": {error['details']}"
    return WorkflowError(text)


def check_history(entry: dict) -> dict:
    for event, data in entry.get("status", {}).get("messages", []):
        if event == "execution_error":
            raise WorkflowError(data.get("exception_message", "failed").strip(),
                                str(data.get("node_id")), data.get("node_type"))
        if event == "execution_interrupted":
            raise WorkflowInterrupted("interrupted", str(data.get("node_id")), data.get("node_type"))
    return entry


def _server_files(object_info: dict) -> tuple[dict, set]:
    """(node type -> inputs whose value is a server input file, the files its input folder has)."""
    file_inputs: dict = {kind: {name} for kind, name in FILE_INPUTS.items()}
    listed: set = set()
    for kind, info in object_info.items():
        for widget in widget_inputs(info):
            if any(widget.extra.get(flag) for flag in UPLOAD_FLAGS):
                file_inputs.setdefault(kind, set()).add(widget.name)
                options = widget.choices or widget.extra.get("options", [])
                listed.update(o for o in options if isinstance(o, str))
    return file_inputs, listed


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name this file system cannot hold (too long): no file here
        return False


def upload_inputs(client: ComfyServer, prompt: dict, object_info: dict, input_dir,
                  on_upload: Optional[Callable[[Path, str], None]] = None) -> dict:
    """``prompt`` with the files of ``input_dir`` the server lacks uploaded and renamed; a name
    leading outside ``input_dir`` refuses the run before the first upload."""
    file_inputs, listed = _server_files(object_info)
    prompt = json.loads(json.dumps(prompt))
    root = Path(input_dir).resolve()
    planned: list = []  # (inputs, input name, file as named, its real path, subfolder)
    for node_id, node in prompt.items():
        inputs = node.get("inputs") or {}
        for name in file_inputs.get(node.get("class_type"), ()):
            value = inputs.get(name)
            if not isinstance(value, str) or not value.strip() or value in listed:
                continue
            raw = value.strip()
            # The server resolves names inside its input folder only (absolute ones refused), so
            # an absolute name is a local file inside input_dir or refused. (No name holds NUL.)
            local = (root / raw.replace("\x00", "")).resolve()
            if raw.startswith("~") or "\x00" in raw or not local.is_relative_to(root):
                raise WorkflowError(
                    f"{name} = {value!r} is not a file inside the input folder {root}: only "
                    f"files inside --input-dir are uploaded to the server (copy the file there "
                    f"and name it relative to that folder); nothing was sent",
                    str(node_id), node.get("class_type"))
            if not _is_file(local):
                continue  # the server reports the missing file
            subfolder = local.parent.relative_to(root).as_posix().removeprefix(".")
            planned.append((inputs, name, Path(input_dir) / raw, local, subfolder))
    uploaded: dict = {}
    for inputs, name, named, local, subfolder in planned:
        if local not in uploaded:
            uploaded[local] = client.upload(local, subfolder)
            if on_upload is not None:
                on_upload(named, uploaded[local])
        inputs[name] = uploaded[local]
    return prompt


class ProgressPrinter:
    """``on_event`` of ComfyServer.run: on stderr a line per node run or cached, progress bars."""

    def __init__(self, prompt: dict, stream=None):
        self.prompt = prompt
        self.stream = stream if stream is not None else sys.stderr
        self._bars: dict = {}

    def label(self, node_id) -> str:
        node = self.prompt.get(str(node_id)) or {}
        return f"node {node_id} ({node.get('class_type', '?')})"

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def __call__(self, kind: str, data: dict) -> None:
        if kind == "execution_cached":
            for node_id in data.get("nodes") or []:
                self._say(f"{self.label(node_id)}: cached")
        elif kind == "executing":
            self.close()
            self._say(f"{self.label(data.get('node'))}: running")
        elif kind == "progress":
            self._progress(str(data.get("node")), data.get("value", 0), data.get("max", 0))
        elif kind in ("executed", "execution_success", "execution_error",
                      "execution_interrupted"):
            self.close()
        elif kind == "seedvr2_fallback":
            self.close()
            self._say(f"websocket: {data.get('reason')}; following the run by polling /history")

    def _progress(self, node_id: str, value, total) -> None:
        from tqdm import tqdm

        bar = self._bars.get(node_id)
        if bar is None or bar.total != total:
            if bar is not None:
                bar.close()
            bar = self._bars[node_id] = tqdm(total=total, desc=self.label(node_id),
                                             unit="step", file=self.stream, leave=True)
        bar.update(value - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
