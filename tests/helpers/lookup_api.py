"""A stand-in Kubernetes API server for helm's ``lookup`` (``helm template --dry-run=server``): API discovery
and GETs of the objects it is given, 404 for everything else. Plain HTTP on loopback, no authentication."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from tests.helpers.ports import free_port

# (apiVersion, kind) -> resource name, for the kinds the chart looks up.
RESOURCES = {("v1", "Secret"): "secrets", ("apps/v1", "DaemonSet"): "daemonsets"}


def _base(api_version: str) -> str:
    return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"


class LookupApi:
    """Serves ``objects`` (namespaced, of the kinds in ``RESOURCES``) until the ``with`` block ends.

    Args:
      objects: the cluster's objects, each with apiVersion, kind, metadata.name and metadata.namespace.
      directory: where ``kubeconfig`` is written.
    """

    def __init__(self, objects: list[dict], directory: Path):
        self._paths = {
            f"{_base(o['apiVersion'])}/namespaces/{o['metadata']['namespace']}/"
            f"{RESOURCES[(o['apiVersion'], o['kind'])]}/{o['metadata']['name']}": o
            for o in objects
        }
        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.kubeconfig = directory / "kubeconfig"
        self.requests: list[str] = []

    def _discovery(self, path: str) -> dict | None:
        """What client-go's discovery asks before a GET: the resources of one group version."""
        resources = [
            {"name": plural, "singularName": kind.lower(), "namespaced": True, "kind": kind, "verbs": ["get"]}
            for (api_version, kind), plural in RESOURCES.items()
            if _base(api_version) == path
        ]
        if not resources:
            return None
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": path.split("/", 2)[2],
            "resources": resources,
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                api.requests.append(path)
                body = api._paths.get(path) or api._discovery(path)
                status = 200 if body else 404
                if body is None:
                    body = {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": "NotFound",
                        "code": 404,
                    }
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # quiet: ``requests`` records them
                pass

        return Handler

    def __enter__(self) -> "LookupApi":
        host, port = self._server.server_address[:2]
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "lookup", "cluster": {"server": f"http://{host}:{port}"}}],
            "users": [{"name": "lookup", "user": {}}],
            "contexts": [{"name": "lookup", "context": {"cluster": "lookup", "user": "lookup"}}],
            "current-context": "lookup",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
