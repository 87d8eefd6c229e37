"""A service with side effects, for the multi-turn kill tests: its own process on loopback.

`python keyed_service.py LOG PORTFILE SEED` answers POST /step {"key", "prompt"} with the table
value of the prompt's key (`tool_tasks.lookup_value`) and `=`, and appends every request it
answers to LOG as a JSON line {"key", "observation"} (flushed before the answer is sent), so a
test sees exactly which steps the world was asked for, and how often.
"""
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from async_rl.data.tool_tasks import lookup_value

LOCK = threading.Lock()


def main() -> None:
    log_path, port_file, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    log = open(log_path, "a")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            value = lookup_value(seed, body["prompt"].rstrip("="))
            obs = f"{value}=" if value is not None else "-="
            with LOCK:
                log.write(json.dumps({"key": body["key"], "observation": obs}) + "\n")
                log.flush()
            out = json.dumps({"observation": obs}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # the run's env steps connect at once (rollout.env_max_concurrent)

    server = Server(("127.0.0.1", 0), Handler)
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
