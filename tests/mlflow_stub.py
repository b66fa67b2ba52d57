"""A small MLflow-compatible tracking server for the tracker tests (standard library only).

``python -m tests.mlflow_stub DIR [HOLD_AT]`` binds 127.0.0.1 on a free port, writes the port to
``DIR/port``, and answers the REST calls ``MlflowClient`` makes to create an experiment and a
run, log batches and end the run. Every metrics batch it takes is appended to
``DIR/batches.jsonl`` as ``{"step": [...], "metrics": {key: value}}``. With ``HOLD_AT`` = N it
writes ``DIR/held`` when the N-th metrics batch arrives and never answers it: the test then kills
the server in the middle of that request, as a server that dies under a run.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

API = "/api/2.0/mlflow/"


class Store:
    def __init__(self, folder: Path, hold_at: int) -> None:
        self.folder, self.hold_at = folder, hold_at
        self.experiments: dict[str, str] = {}
        self.runs: dict[str, dict] = {}
        self.batches = 0

    def run_info(self, run_id: str) -> dict:
        run = self.runs[run_id]
        return {"run_id": run_id, "run_uuid": run_id, "experiment_id": run["experiment_id"],
                "run_name": run["name"], "status": run["status"], "lifecycle_stage": "active",
                "start_time": run["start_time"], "artifact_uri": ""}

    def run(self, run_id: str) -> dict:
        params = [{"key": k, "value": v} for k, v in self.runs[run_id]["params"].items()]
        return {"info": self.run_info(run_id), "data": {"params": params}}


def make_handler(store: Store) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, body: dict, code: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _missing(self, what: str) -> None:
            self._reply({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": what}, 404)

        def do_GET(self) -> None:
            url = urllib.parse.urlparse(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            route = url.path.removeprefix(API)
            if route == "experiments/get-by-name":
                name = query.get("experiment_name", "")
                if name not in store.experiments:
                    return self._missing(f"no experiment {name}")
                return self._reply({"experiment": {
                    "experiment_id": store.experiments[name], "name": name,
                    "lifecycle_stage": "active", "artifact_location": ""}})
            if route == "runs/get":
                run_id = query.get("run_id", "")
                if run_id not in store.runs:
                    return self._missing(f"no run {run_id}")
                return self._reply({"run": store.run(run_id)})
            return self._missing(f"no route {url.path}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            route = urllib.parse.urlparse(self.path).path.removeprefix(API)
            if route == "experiments/create":
                store.experiments[body["name"]] = str(len(store.experiments) + 1)
                return self._reply({"experiment_id": store.experiments[body["name"]]})
            if route == "runs/create":
                run_id = f"run{len(store.runs) + 1}"
                store.runs[run_id] = {"experiment_id": body.get("experiment_id", ""),
                                      "name": body.get("run_name", ""), "status": "RUNNING",
                                      "start_time": body.get("start_time", 0), "params": {}}
                return self._reply({"run": store.run(run_id)})
            if route == "runs/log-batch":
                run = store.runs[body["run_id"]]
                run["params"].update({p["key"]: p["value"] for p in body.get("params", [])})
                metrics = body.get("metrics", [])
                if metrics:
                    store.batches += 1
                    line = {"step": sorted({int(m.get("step", 0)) for m in metrics}),
                            "metrics": {m["key"]: m["value"] for m in metrics}}
                    with open(store.folder / "batches.jsonl", "a") as f:
                        f.write(json.dumps(line) + "\n")
                    if store.batches == store.hold_at:
                        (store.folder / "held").write_text(str(store.batches))
                        while True:  # never answer: the test kills the server here
                            time.sleep(60)
                return self._reply({})
            if route == "runs/update":
                store.runs[body["run_id"]]["status"] = body.get("status", "RUNNING")
                return self._reply({"run_info": store.run_info(body["run_id"])})
            return self._missing(f"no route {self.path}")

    return Handler


def main() -> None:
    folder = Path(sys.argv[1])
    hold_at = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    server = HTTPServer(("127.0.0.1", 0), make_handler(Store(folder, hold_at)))
    tmp = folder / "port.tmp"
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(folder / "port")
    server.serve_forever()


if __name__ == "__main__":
    main()
