"""Runs Miles' own session server for `session_load.rs`, in front of an SGLang-compatible backend.

Usage: python miles_session_server.py BACKEND_URL TOKENIZER_DIR LOG_FILE

The server is `miles.rollout.session.server.run_session_server`, the process Miles starts for
`--use-session-server` (FastAPI + uvicorn, one httpx client to the backend, TITO with the
family's fixed template), called in this process with the arguments its own overhead harness
(`tests/manual/session/bench_session_server_overhead.py`) gives it, without routing replay
(the bench's turns carry no routed experts): `--tito-model qwen3`, the strict message matcher,
the linear (v1) session server. Miles must be importable: its source tree and its Python
dependencies on PYTHONPATH (the bench passes `MILES_SESSION_PYTHONPATH`).

Picks a free port on 127.0.0.1, sends the server's logs (uvicorn's access log included, as
Miles runs it) to LOG_FILE, and prints `listening on http://127.0.0.1:PORT` on stdout once
`/health` answers, the line the bench waits for. Runs until killed.
"""

import os
import socket
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def announce_when_ready(out, url: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    out.write(f"listening on {url}\n")
                    out.flush()
                    return
        except OSError:
            pass
        time.sleep(0.1)
    out.write("miles_session_server: /health never answered\n")
    out.flush()
    os._exit(1)


def main() -> None:
    backend_url, tokenizer_dir, log_file = sys.argv[1:4]
    # stdout carries only the announcement; everything the server logs goes to the file.
    announce = os.fdopen(os.dup(1), "w")
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)

    from miles.rollout.session.server import run_session_server
    from miles.utils.chat_template_utils.tito_tokenizer import resolve_fixed_chat_template

    tito_model = "qwen3"
    chat_template_path, chat_template_kwargs = resolve_fixed_chat_template(tito_model)
    port = free_port()
    args = SimpleNamespace(
        hf_checkpoint=tokenizer_dir,
        chat_template_path=chat_template_path,
        apply_chat_template_kwargs=chat_template_kwargs,
        tito_model=tito_model,
        use_rollout_routing_replay=False,
        use_rollout_indexer_replay=False,
        pause_generation_mode="retract",
        miles_router_timeout=600.0,
        session_server_ip="127.0.0.1",
        session_server_port=port,
        session_server_instance_id="session-load-bench",
    )
    threading.Thread(
        target=announce_when_ready, args=(announce, f"http://127.0.0.1:{port}"), daemon=True
    ).start()
    run_session_server(args, backend_url)


if __name__ == "__main__":
    main()
