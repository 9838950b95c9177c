"""Run a prompt on a running ComfyUI server: POST /prompt, follow /history, fetch the outputs.

Only the standard library is used (urllib). Progress is followed by polling
``/history/<prompt id>`` (and ``/queue`` for the position), which works through proxies that
do not pass websockets.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Optional

from .errors import WorkflowError, WorkflowInterrupted


class ComfyServer:
    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout  # per HTTP request
        self.client_id = uuid.uuid4().hex

    def _request(self, path: str, data: Optional[dict] = None):
        body = json.dumps(data).encode() if data is not None else None
        request = urllib.request.Request(self.url + path, data=body,
                                         headers={"Content-Type": "application/json"} if body else {})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            raise _HTTPError(e.code, e.read()) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise WorkflowError(f"cannot reach the ComfyUI server at {self.url}: {reason}") from None

    def get_json(self, path: str):
        return json.loads(self._request(path))

    def object_info(self) -> dict:
        return self.get_json("/object_info")

    def submit(self, prompt: dict) -> str:
        try:
            reply = json.loads(self._request("/prompt", {"prompt": prompt,
                                                         "client_id": self.client_id}))
        except _HTTPError as e:
            raise prompt_error(e.body) from None
        return reply["prompt_id"]

    def wait(self, prompt_id: str, timeout: Optional[float] = None,
             on_status: Optional[Callable[[str], None]] = None, poll: float = 0.25) -> dict:
        """The history entry of the finished prompt; raises with the node's error on failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            history = self.get_json(f"/history/{prompt_id}")
            entry = history.get(prompt_id)
            if entry is not None:  # ComfyUI records a prompt in its history once it has ended
                return check_history(entry)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkflowError(f"the server did not finish prompt {prompt_id} within "
                                    f"{timeout:.0f} s")
            if on_status is not None:
                on_status("running")
            time.sleep(poll)

    def interrupt(self) -> None:
        self._request("/interrupt", {})

    def free(self, unload_models: bool = True, free_memory: bool = False) -> None:
        """What the editor's "Unload models" / "Free memory" buttons ask (done between prompts)."""
        self._request("/free", {"unload_models": unload_models, "free_memory": free_memory})

    def download(self, entry: dict, folder: Path) -> list[Path]:
        """Every saved output file of a finished prompt, copied into ``folder``."""
        files = []
        for node_output in entry.get("outputs", {}).values():
            for items in node_output.values():
                for item in items if isinstance(items, list) else []:
                    if not isinstance(item, dict) or item.get("type") != "output" \
                            or "filename" not in item:
                        continue
                    query = urllib.parse.urlencode({"filename": item["filename"], "type": "output",
                                                    "subfolder": item.get("subfolder", "")})
                    target = folder / item.get("subfolder", "") / item["filename"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(self._request(f"/view?{query}"))
                    files.append(target)
        return files


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
