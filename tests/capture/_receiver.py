"""A tiny ingest endpoint for tests: HTTP/1.1 keep-alive, Bearer token check, frames kept in
memory; it can go away (cutting open connections, like a process exit) and come back on the
same port."""

import http.server
import socket
import threading

from tensorverse.capture.frames import parse_frames


class Recorder:
    """A tiny ingest endpoint (HTTP/1.1 keep-alive) that can go away and come back on one port."""

    def __init__(self, port=0, status=200, token="s3cret"):
        self.bodies, self.headers, self.conns = [], [], []
        self._parsed: list = []  # frames of bodies[:self._n_parsed]
        self._n_parsed = 0
        self.status = status
        self.token = token
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                rec.conns.append(self.connection)

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                rec.headers.append(dict(self.headers))
                ok = self.headers.get("Authorization") == f"Bearer {rec.token}"
                status = rec.status if ok else 401
                if status == 200:
                    rec.bodies.append(body)
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/ingest"

    def frames(self):
        """Every frame received so far, in arrival order (each body parsed once)."""
        bodies = self.bodies[self._n_parsed:]
        for b in bodies:
            self._parsed.extend(parse_frames(b))
        self._n_parsed += len(bodies)
        return list(self._parsed)

    def stop(self):
        """Like a process exit: stop listening and cut the open keep-alive connections."""
        self.server.shutdown()
        self.server.server_close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
