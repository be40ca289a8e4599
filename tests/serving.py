"""A test server: an `SFIServer` on a free loopback port, in a thread, closed with its model."""
import threading
from contextlib import contextmanager

from sfi_gguf.serve.server import SFIServer


@contextmanager
def running_server(llm, model_name: str):
    srv = SFIServer(llm, "127.0.0.1", 0, model_name=model_name)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        llm.close()
