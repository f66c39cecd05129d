"""A stand-in for the CSI livenessprobe sidecar (kubernetes-csi/livenessprobe), for ``make e2e-deploy`` only: no
registry here serves its image and the Go module proxy refuses its module.

The same flags (``--csi-address``, ``--health-port``, ``--probe-timeout``) and contract: ``GET /healthz`` answers
200 when the driver's CSI ``Probe`` on the socket answers ready within the timeout, else 500 with the reason.
"""

import argparse
import http.server

import grpc

from protos import csi_pb2, csi_pb2_grpc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csi-address", required=True, help="the driver's socket path")
    parser.add_argument("--health-port", type=int, default=9808)
    parser.add_argument("--probe-timeout", type=float, default=1.0, help="seconds")
    args = parser.parse_args()
    channel = grpc.insecure_channel(f"unix://{args.csi_address}")
    identity = csi_pb2_grpc.IdentityStub(channel)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/healthz":
                self.send_error(404)
                return
            try:
                probed = identity.Probe(csi_pb2.ProbeRequest(), timeout=args.probe_timeout)
                # An unset `ready` means ready (CSI spec: "the plugin is ready unless it says otherwise").
                ok, reason = (not probed.HasField("ready") or probed.ready.value), "driver not ready"
            except grpc.RpcError as error:
                ok, reason = False, f"Probe: {error.code().name}: {error.details()}"
            body = b"ok" if ok else reason.encode()
            self.send_response(200 if ok else 500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    http.server.ThreadingHTTPServer(("", args.health_port), Health).serve_forever()


if __name__ == "__main__":
    main()
